//! The layer's own answers: RFC 9457 problem details (`application/problem+json`).

use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};

use super::body::ResponseBody;
use crate::timestamp;

/// The `type` of every problem is this prefix and the problem's name (the
/// module docs' headings), e.g.
/// `tag:idempotency.invalid,2026:http-problems#missing-key`.
///
/// A tag URI (RFC 4151) is an identifier, not a locator: nothing is
/// published at it, and RFC 9457 (section 3.1.1) has consumers compare it,
/// never fetch it. The tagging authority is under `.invalid`, a name
/// reserved never to resolve (RFC 6761), so the URI cannot be taken for a
/// page. The fragment is the anchor of the problem's documentation in the
/// crate's `http` module.
pub(crate) const TYPE_PREFIX: &str = "tag:idempotency.invalid,2026:http-problems#";

/// Every problem the layer answers and whether a retry of the same request
/// with the same key can succeed without changing anything (the body's
/// `retryable` member). The module docs list the same names, each under its
/// own heading (a unit test checks both ways).
pub(crate) const KINDS: [(&str, bool); 18] = [
    ("malformed-key", false),
    ("missing-key", false),
    ("invalid-scope", false),
    ("unreadable-body", true),
    ("body-timeout", true),
    ("invalid-body", false),
    ("body-too-large", false),
    ("processing", true),
    ("key-mismatch", false),
    ("key-expired", false),
    ("response-not-retained", false),
    ("outcome-unknown", true),
    ("outcome-not-recorded", true),
    ("overloaded", true),
    ("response-error", true),
    ("engine-error", true),
    ("stored-record-corrupt", false),
    ("evidence-log-full", false),
];

/// Whether a retry with the same key and request can succeed; `false` for
/// a name not in [`KINDS`] (a retry is then the client's own risk).
pub(crate) fn retryable(kind: &str) -> bool {
    KINDS
        .iter()
        .find(|(k, _)| *k == kind)
        .is_some_and(|&(_, r)| r)
}

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

    /// Adds `name` as an RFC 3339 UTC timestamp of `ms` (milliseconds since
    /// the Unix epoch), e.g. `2026-12-01T15:04:05.678Z`.
    pub(crate) fn instant(self, name: &'static str, ms: u64) -> ProblemDetails {
        self.member(name, timestamp::rfc3339(ms).into())
    }

    /// Adds `lease_ends_at`: when the lease of the claim holding the key
    /// ends (for `processing` and `outcome-unknown`). Until then the earlier
    /// request may still be running; after it, a retry finds its outcome or
    /// the record in doubt.
    pub(crate) fn lease_ends_at(self, ms: u64) -> ProblemDetails {
        self.instant("lease_ends_at", ms)
    }

    /// The RFC 9457 body: `type`, `title`, `status`, `detail`, the
    /// extension member `retryable`, then the problem's own members.
    fn into_json(self) -> (StatusCode, Option<u64>, serde_json::Value) {
        let mut body = serde_json::Map::new();
        body.insert("type".into(), format!("{TYPE_PREFIX}{}", self.kind).into());
        body.insert("title".into(), self.title.into());
        body.insert("status".into(), self.status.as_u16().into());
        body.insert("detail".into(), self.detail.into());
        body.insert("retryable".into(), retryable(self.kind).into());
        for (name, value) in self.members {
            body.insert(name.into(), value);
        }
        (
            self.status,
            self.retry_after_secs,
            serde_json::Value::Object(body),
        )
    }

    pub(crate) fn into_response<B>(self) -> Response<ResponseBody<B>> {
        let (status, retry_after_secs, body) = self.into_json();
        let mut response = Response::new(ResponseBody::full(body.to_string()));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(secs) = retry_after_secs {
            headers.insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names under "# Problem types" in the module docs (`### name`).
    fn documented() -> Vec<&'static str> {
        include_str!("../http.rs")
            .lines()
            .filter_map(|l| l.strip_prefix("//! ### "))
            .map(str::trim)
            .collect()
    }

    #[test]
    fn every_documented_problem_has_a_retryable_flag_and_back() {
        let documented = documented();
        assert!(documented.len() > 10, "{documented:?}");
        for name in &documented {
            assert!(
                KINDS.iter().any(|(k, _)| k == name),
                "{name} is documented but has no retryable flag"
            );
        }
        for (kind, _) in KINDS {
            assert!(
                documented.contains(&kind),
                "{kind} has a flag but no heading in the module docs"
            );
        }
    }

    #[test]
    fn body_carries_type_retryable_and_members() {
        let (status, _, json) = ProblemDetails::new(StatusCode::CONFLICT, "processing", "t", "d")
            .lease_ends_at(1_000)
            .into_json();
        assert_eq!(status, StatusCode::CONFLICT);
        assert_eq!(
            json["type"],
            "tag:idempotency.invalid,2026:http-problems#processing"
        );
        assert_eq!(json["retryable"], true);
        assert_eq!(json["lease_ends_at"], "1970-01-01T00:00:01.000Z");
        assert!(!retryable("key-mismatch"));
        assert!(!retryable("no-such-kind"));
    }
}
