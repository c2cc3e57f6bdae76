//! The layer's settings as its services use them, and the defaults and
//! header rules they start from.

use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderName;
use http::request::Parts;
use http::{Method, StatusCode};

use super::runtime::Runtime;
use super::unmatched::Unmatched;
use super::{Caller, Disposition, Route};
use crate::Engine;

pub(crate) type ScopeFn = Arc<dyn Fn(&Parts, &str) -> String + Send + Sync>;

/// Which response headers are stored for replay.
#[derive(Clone, Debug)]
pub(crate) enum HeaderPolicy {
    /// All but [`UNSTORABLE`], [`CREDENTIALS`] and these.
    AllExcept(Vec<HeaderName>),
    /// Only these (never one of [`UNSTORABLE`]; a credential only when
    /// named here).
    Only(Vec<HeaderName>),
}

impl HeaderPolicy {
    /// Whether a response header of this name is stored (headers named by
    /// the response's `Connection` header and the layer's reserved names
    /// are skipped by the caller).
    pub(crate) fn stores(&self, name: &HeaderName) -> bool {
        if UNSTORABLE.contains(name) {
            return false;
        }
        match self {
            HeaderPolicy::AllExcept(excluded) => {
                !excluded.contains(name) && !CREDENTIALS.contains(name)
            }
            HeaderPolicy::Only(names) => names.contains(name),
        }
    }
}

/// Response headers that cannot be replayed, whatever the configuration:
/// hop-by-hop headers (RFC 9110 section 7.6.1, plus the obsolete
/// `Keep-Alive` and `Proxy-Connection`), which describe one connection;
/// `Date`, which must describe the replay; and `Content-Length`, which the
/// server computes for the body actually sent. Headers named by the
/// response's `Connection` header are hop-by-hop too and skipped.
pub(crate) const UNSTORABLE: [HeaderName; 11] = [
    http::header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    http::header::PROXY_AUTHENTICATE,
    http::header::TE,
    http::header::TRAILER,
    http::header::TRANSFER_ENCODING,
    http::header::UPGRADE,
    http::header::DATE,
    http::header::CONTENT_LENGTH,
    // The layer's own replay marker, added to every replay.
    super::IDEMPOTENT_REPLAYED,
];

/// Credentials (`Set-Cookie`, `Set-Cookie2`, `Authorization`,
/// `Proxy-Authorization`): not stored unless named in
/// `IdempotencyLayer::stored_headers`, since a stored one is handed to
/// whoever retries with the key next.
pub(crate) const CREDENTIALS: [HeaderName; 4] = [
    http::header::SET_COOKIE,
    HeaderName::from_static("set-cookie2"),
    http::header::AUTHORIZATION,
    http::header::PROXY_AUTHORIZATION,
];

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) engine: Arc<Engine>,
    pub(crate) methods: Vec<Method>,
    pub(crate) routes: Vec<Route>,
    pub(crate) require_key: bool,
    pub(crate) tenant_header: Option<HeaderName>,
    pub(crate) caller: Caller,
    /// Key of the caller digest, derived from the app's secret.
    pub(crate) caller_key: Option<[u8; 32]>,
    pub(crate) scope: Option<ScopeFn>,
    pub(crate) max_body_bytes: usize,
    /// Longest wait for a request body, from its first poll to its end.
    pub(crate) body_read_timeout: std::time::Duration,
    pub(crate) mismatch_status: StatusCode,
    /// Status of the `key-expired` answer (409 or 410).
    pub(crate) expired_status: StatusCode,
    pub(crate) headers: HeaderPolicy,
    pub(crate) client_errors: Disposition,
    pub(crate) server_errors: Disposition,
    /// Per-status overrides of the class defaults.
    pub(crate) by_status: Vec<(StatusCode, Disposition)>,
    pub(crate) panics: Disposition,
    pub(crate) in_doubt_retry_after: Duration,
    pub(crate) schema_version: u32,
    /// `Some(retry_after)`: refuse at capacity instead of waiting.
    pub(crate) shed: Option<Duration>,
    pub(crate) runtime: Arc<Runtime>,
    /// Paths warned about for matching no route (shared by clones).
    pub(crate) unmatched: Arc<Unmatched>,
}

/// Statuses that refuse a request before any work, released by default:
/// axum's extractors answer malformed syntax 400, a missing length 411, an
/// oversized body 413, a wrong media type 415 and a wrongly shaped body 422;
/// 408 (the request was not received in time), 425 (too early) and 429
/// (rate limited) say "not processed, try again".
pub(crate) const RELEASED: [StatusCode; 8] = [
    StatusCode::BAD_REQUEST,
    StatusCode::REQUEST_TIMEOUT,
    StatusCode::LENGTH_REQUIRED,
    StatusCode::PAYLOAD_TOO_LARGE,
    StatusCode::UNSUPPORTED_MEDIA_TYPE,
    StatusCode::UNPROCESSABLE_ENTITY,
    StatusCode::TOO_EARLY,
    StatusCode::TOO_MANY_REQUESTS,
];

/// Default for [`IdempotencyLayer::max_in_flight`]: tokio's default limit
/// of blocking threads, so that every admitted request can have its engine
/// call running at once.
pub(crate) const DEFAULT_MAX_IN_FLIGHT: usize = 512;
