//! The layer's settings as its services use them, and the defaults and
//! header rules they start from.

use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderName;
use http::request::Parts;
use http::{Method, StatusCode};

use super::runtime::Runtime;
use super::{Caller, Disposition, Route};
use crate::Engine;

pub(crate) type ScopeFn = Arc<dyn Fn(&Parts, &str) -> String + Send + Sync>;

/// Which response headers are stored for replay.
#[derive(Clone, Debug)]
pub(crate) enum HeaderPolicy {
    /// All but [`NEVER_STORED`] and these.
    AllExcept(Vec<HeaderName>),
    /// Only these (still never one of [`NEVER_STORED`]).
    Only(Vec<HeaderName>),
}

/// Response headers never stored: hop-by-hop headers (RFC 9110 section
/// 7.6.1, plus the obsolete `Keep-Alive` and `Proxy-Connection`), which
/// describe one connection; credentials (`Set-Cookie`, `Authorization`,
/// `Proxy-Authorization`), which must not be handed to whoever sends the
/// key next; `Date`, which must describe the replay; and `Content-Length`,
/// which the server computes for the body actually sent. Headers named by
/// the response's `Connection` header are hop-by-hop too and skipped.
pub(crate) const NEVER_STORED: [HeaderName; 12] = [
    http::header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    http::header::PROXY_AUTHENTICATE,
    http::header::PROXY_AUTHORIZATION,
    http::header::TE,
    http::header::TRAILER,
    http::header::TRANSFER_ENCODING,
    http::header::UPGRADE,
    http::header::SET_COOKIE,
    http::header::DATE,
    http::header::CONTENT_LENGTH,
];

/// Also never stored, kept apart because `http` has no constants for them.
pub(crate) const NEVER_STORED_EXTRA: [HeaderName; 2] = [
    http::header::AUTHORIZATION,
    HeaderName::from_static("set-cookie2"),
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
    pub(crate) mismatch_status: StatusCode,
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
