//! Per-route settings and the path patterns that select them.

use std::time::Duration;

use crate::canonical;

/// Settings for the requests whose path matches one pattern.
///
/// A pattern is a path whose segments are literal, `{name}` (any one
/// non-empty segment) or, as the last segment, `{*name}` (the rest of the
/// path), as in axum 0.8. The first registered route that matches a request
/// decides; a request matching none uses the layer's defaults.
///
/// ## Defaults
///
/// | setting | default |
/// |---|---|
/// | key required | the layer's [`require_key`](super::IdempotencyLayer::require_key) (itself `false`) |
/// | body fingerprint | by content type: canonical JSON for `application/json` and `*/*+json`, raw bytes otherwise |
/// | lease | the engine's |
/// | wait for outcome | none: a duplicate of a running request gets 409 at once |
///
/// ```
/// use idempotency::http::Route;
///
/// let route = Route::new("/payments")
///     .require_key()
///     .json_pointers(["/amount", "/currency"]);
/// let refunds = Route::new("/payments/{id}/refunds").json();
/// # let _ = (route, refunds);
/// ```
#[derive(Clone, Debug)]
#[must_use]
pub struct Route {
    pub(crate) pattern: String,
    segments: Vec<Segment>,
    pub(crate) require_key: Option<bool>,
    pub(crate) body: BodyMode,
    pub(crate) lease: Option<Duration>,
    pub(crate) wait: Option<Duration>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Param,
    Rest,
}

/// How a route's request body enters the fingerprint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum BodyMode {
    /// JSON if the content type says so, raw bytes otherwise.
    Auto,
    /// Always JSON: the whole document, or only these pointers.
    Json(Vec<String>),
    /// Raw bytes, whatever the content type.
    Raw,
}

impl Route {
    /// Settings for requests whose path matches `pattern`.
    ///
    /// # Panics
    ///
    /// If `pattern` does not start with `/`, has an empty `{}` segment, or
    /// has a `{*rest}` segment that is not the last (a configuration error,
    /// caught when the layer is built, as axum does for its routes).
    pub fn new(pattern: impl Into<String>) -> Route {
        let pattern = pattern.into();
        assert!(
            pattern.starts_with('/'),
            "route pattern {pattern:?} must start with '/'"
        );
        let parts: Vec<&str> = pattern[1..].split('/').collect();
        let mut segments = Vec::with_capacity(parts.len());
        for (i, part) in parts.iter().enumerate() {
            let segment = match part.strip_prefix('{').and_then(|p| p.strip_suffix('}')) {
                Some(name) if name.starts_with('*') => {
                    assert!(
                        i + 1 == parts.len() && name.len() > 1,
                        "route pattern {pattern:?}: a {{*rest}} segment must be named and last"
                    );
                    Segment::Rest
                }
                Some(name) => {
                    assert!(
                        !name.is_empty(),
                        "route pattern {pattern:?} has an unnamed {{}} segment"
                    );
                    Segment::Param
                }
                None => Segment::Literal((*part).to_string()),
            };
            segments.push(segment);
        }
        Route {
            pattern,
            segments,
            require_key: None,
            body: BodyMode::Auto,
            lease: None,
            wait: None,
        }
    }

    /// Requests on this route without an `Idempotency-Key` are refused with
    /// 400 (problem type `missing-key`).
    pub fn require_key(mut self) -> Route {
        self.require_key = Some(true);
        self
    }

    /// Requests on this route without a key pass through untouched, whatever
    /// the layer's default.
    pub fn optional_key(mut self) -> Route {
        self.require_key = Some(false);
        self
    }

    /// The body must be JSON, whatever its content type; the fingerprint
    /// covers the whole document in canonical form (RFC 8785 structure,
    /// exact decimal numbers, see [`crate::canonical`]). A body that is not
    /// strict JSON is refused with 400 before any claim. An empty body is
    /// an absent body: fingerprinted as such, never refused.
    pub fn json(mut self) -> Route {
        self.body = BodyMode::Json(Vec::new());
        self
    }

    /// Like [`Route::json`], but only the values at these RFC 6901 JSON
    /// Pointers enter the fingerprint (an absent field differs from `null`),
    /// so a retry may change other fields, like a client trace id. An empty
    /// list is the same as [`Route::json`].
    ///
    /// # Panics
    ///
    /// If a pointer is not a valid RFC 6901 JSON Pointer (it must be empty or
    /// start with `/`, and `~` must be followed by `0` or `1`).
    pub fn json_pointers<I, P>(mut self, pointers: I) -> Route
    where
        I: IntoIterator<Item = P>,
        P: Into<String>,
    {
        let pointers: Vec<String> = pointers.into_iter().map(Into::into).collect();
        for p in &pointers {
            if let Err(e) = canonical::validate_pointer(p) {
                panic!("route {:?}: invalid JSON Pointer {p:?}: {e}", self.pattern);
            }
        }
        self.body = BodyMode::Json(pointers);
        self
    }

    /// The body enters the fingerprint as raw bytes, whatever its content
    /// type.
    pub fn raw_body(mut self) -> Route {
        self.body = BodyMode::Raw;
        self
    }

    /// The claim lease for this route (see
    /// [`crate::Engine::begin_with_lease`]): how long the handler may run
    /// before a retry sees the record as UNKNOWN.
    pub fn lease(mut self, lease: Duration) -> Route {
        self.lease = Some(lease);
        self
    }

    /// A duplicate that arrives while the first request with its key runs
    /// waits up to `wait` for that request's outcome and then gets its
    /// replay (or, if the first request's key was released, runs itself),
    /// instead of 409 `processing` at once; if the time runs out, it gets
    /// the 409. For clients that cannot retry. The wait holds one of the
    /// layer's in-flight permits (see
    /// [`IdempotencyLayer::max_in_flight`](super::IdempotencyLayer::max_in_flight)).
    /// A claim held by this process wakes its waiters as soon as its
    /// outcome is recorded; one held by another process is polled every
    /// 50 ms.
    pub fn wait_for_outcome(mut self, wait: Duration) -> Route {
        self.wait = Some(wait);
        self
    }

    /// The pattern this route was built with.
    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    /// Whether `path` (a URI path, without query) matches the pattern.
    pub fn matches(&self, path: &str) -> bool {
        let Some(path) = path.strip_prefix('/') else {
            return false;
        };
        let mut parts = path.split('/');
        for segment in &self.segments {
            match segment {
                Segment::Rest => return true,
                Segment::Param => match parts.next() {
                    Some(p) if !p.is_empty() => {}
                    _ => return false,
                },
                Segment::Literal(lit) => {
                    if parts.next() != Some(lit.as_str()) {
                        return false;
                    }
                }
            }
        }
        parts.next().is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_like_axum() {
        let r = Route::new("/payments/{id}/refunds");
        assert!(r.matches("/payments/p1/refunds"));
        assert!(!r.matches("/payments//refunds"));
        assert!(!r.matches("/payments/p1/refunds/"));
        assert!(!r.matches("/payments/p1"));
        let root = Route::new("/");
        assert!(root.matches("/"));
        assert!(!root.matches("/x"));
        let rest = Route::new("/files/{*path}");
        assert!(rest.matches("/files/a/b/c"));
        assert!(!rest.matches("/other/a"));
        assert!(Route::new("/payments").matches("/payments"));
        assert!(!Route::new("/payments").matches("/payments/x"));
    }

    #[test]
    #[should_panic(expected = "invalid JSON Pointer")]
    fn bad_pointer_panics_at_configuration() {
        let _ = Route::new("/p").json_pointers(["amount"]);
    }
}
