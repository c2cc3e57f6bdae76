//! The layer's own answers: RFC 9457 problem details (`application/problem+json`).

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};
use http_body_util::Full;

/// Where the problem types are documented (the module docs' headings).
const TYPE_BASE: &str = "https://docs.rs/idempotency/latest/idempotency/http/index.html#";

/// One problem answer, before it becomes a response.
#[derive(Debug)]
pub(crate) struct Problem {
    pub(crate) status: StatusCode,
    /// The anchor of its documentation, e.g. `missing-key`.
    pub(crate) kind: &'static str,
    pub(crate) title: &'static str,
    pub(crate) detail: String,
    pub(crate) retry_after_secs: Option<u64>,
}

impl Problem {
    pub(crate) fn new(
        status: StatusCode,
        kind: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Problem {
        Problem {
            status,
            kind,
            title,
            detail: detail.into(),
            retry_after_secs: None,
        }
    }

    pub(crate) fn retry_after(mut self, secs: u64) -> Problem {
        self.retry_after_secs = Some(secs.max(1));
        self
    }

    pub(crate) fn into_response(self) -> Response<Full<Bytes>> {
        let body = serde_json::json!({
            "type": format!("{TYPE_BASE}{}", self.kind),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(secs) = self.retry_after_secs {
            headers.insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}
