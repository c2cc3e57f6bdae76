//! The layer's own answers: RFC 9457 problem details (`application/problem+json`).

use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};

use super::body::ResponseBody;

/// Where the problem types are documented (the module docs' headings).
const TYPE_BASE: &str = "https://docs.rs/idempotency/latest/idempotency/http/index.html#";

/// One problem answer, before it becomes a response. Its text is meant for
/// clients: it never holds internal error text (that goes to the log).
#[derive(Debug)]
pub(crate) struct ProblemDetails {
    pub(crate) status: StatusCode,
    /// The anchor of its documentation, e.g. `missing-key`.
    pub(crate) kind: &'static str,
    pub(crate) title: &'static str,
    pub(crate) detail: String,
    pub(crate) retry_after_secs: Option<u64>,
    /// Extension members (RFC 9457 section 3.2).
    pub(crate) members: Vec<(&'static str, serde_json::Value)>,
}

impl ProblemDetails {
    pub(crate) fn new(
        status: StatusCode,
        kind: &'static str,
        title: &'static str,
        detail: impl Into<String>,
    ) -> ProblemDetails {
        ProblemDetails {
            status,
            kind,
            title,
            detail: detail.into(),
            retry_after_secs: None,
            members: Vec::new(),
        }
    }

    pub(crate) fn retry_after(mut self, secs: u64) -> ProblemDetails {
        self.retry_after_secs = Some(secs.max(1));
        self
    }

    pub(crate) fn member(mut self, name: &'static str, value: serde_json::Value) -> ProblemDetails {
        self.members.push((name, value));
        self
    }

    pub(crate) fn into_response<B>(self) -> Response<ResponseBody<B>> {
        let mut body = serde_json::Map::new();
        body.insert("type".into(), format!("{TYPE_BASE}{}", self.kind).into());
        body.insert("title".into(), self.title.into());
        body.insert("status".into(), self.status.as_u16().into());
        body.insert("detail".into(), self.detail.into());
        for (name, value) in self.members {
            body.insert(name.into(), value);
        }
        let body = serde_json::Value::Object(body).to_string();
        let mut response = Response::new(ResponseBody::full(body));
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
