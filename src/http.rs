//! A [`tower::Layer`] for the `Idempotency-Key` HTTP request header
//! (cargo feature `http`).
//!
//! It implements the IETF httpapi draft
//! [draft-ietf-httpapi-idempotency-key-header](https://datatracker.ietf.org/doc/draft-ietf-httpapi-idempotency-key-header/)
//! on top of an [`Engine`]: the first request with a key runs the handler
//! once and its response is stored; a retry with the same key and the same
//! request gets the stored response back, marked `Idempotent-Replayed: true`.
//!
//! ```
//! use std::sync::Arc;
//!
//! use axum::{routing::post, Router};
//! use idempotency::http::{IdempotencyLayer, Route};
//! use idempotency::Engine;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let engine = Arc::new(Engine::builder().open(dir.path().join("idem.redb"))?);
//! let layer = IdempotencyLayer::new(engine)
//!     .route(Route::new("/payments").require_key().json_pointers(["/amount", "/currency"]));
//! let app: Router = Router::new()
//!     .route("/payments", post(|| async { (axum::http::StatusCode::CREATED, "{}") }))
//!     .layer(layer);
//! // axum::serve(listener, app).await?;
//! # let _ = app;
//! # Ok(())
//! # }
//! ```
//!
//! # What a request gets
//!
//! Only requests with a configured method (POST and PATCH by default) are
//! considered; all others pass through untouched, as do requests without a
//! key on routes that do not require one.
//!
//! | situation | response |
//! |---|---|
//! | first request with a key | the handler's response; it is stored (see below) |
//! | retry, same request, stored | the stored status, stored headers and body, plus `Idempotent-Replayed: true` |
//! | retry while the first still runs | 409, `Retry-After`, problem type [`in-progress`](#in-progress) |
//! | same key, different request | 409 (or 422, see [`IdempotencyLayer::mismatch_status`]), [`key-mismatch`](#key-mismatch) |
//! | earlier attempt's outcome unknown | 503, `Retry-After`, [`outcome-unknown`](#outcome-unknown), unless the engine's [`crate::Resolver`] settles it during `begin` (then a replay, or a fresh run if the work never happened) |
//! | key expired and tombstoned | 409, [`key-expired`](#key-expired) |
//! | missing key where required | 400, [`missing-key`](#missing-key) |
//! | malformed key | 400, [`malformed-key`](#malformed-key) |
//! | body not JSON on a JSON route | 400, [`invalid-body`](#invalid-body); nothing is stored |
//! | body above [`IdempotencyLayer::max_body_bytes`] | 413, [`body-too-large`](#body-too-large); nothing is stored |
//!
//! Every refusal above happens *before* any claim: nothing is stored and
//! the handler does not run. Error responses of the layer itself are
//! RFC 9457 `application/problem+json`.
//!
//! The key is read as an RFC 8941 structured-field String (`"abc"`), as the
//! draft specifies, or, for Stripe-style clients, as a bare token (`abc`):
//! printable ASCII without whitespace, quotes, backslashes, commas or
//! semicolons. It is at most 255 bytes. A repeated header is malformed.
//!
//! # Scope and fingerprint
//!
//! The key is scoped (see [`crate::IdempotencyKey`]) by default to
//! `"{method} {route}"`, where `route` is the pattern of the matching
//! [`Route`] or else the request path, followed by ` tenant={value}` when
//! the [`tenant header`](IdempotencyLayer::tenant_header) is present; or by
//! your own function ([`IdempotencyLayer::scope`]).
//!
//! The fingerprint covers the method, the path, the query string and the
//! body: canonical JSON (whole document or the route's JSON Pointers) when
//! the route is JSON, or when the content type is `application/json` or
//! `*/*+json`; the raw bytes otherwise.
//!
//! # What is stored
//!
//! After the handler answers, its whole response body is read and, by
//! status:
//!
//! | status | default | setting |
//! |---|---|---|
//! | 1xx–3xx | stored ([`crate::Engine::complete`]) | a [`Disposition`] response extension |
//! | 400, 411, 413, 415, 422 | not stored, key released: these reject a request before the handler acts (axum's extractors), so a corrected retry runs | [`IdempotencyLayer::on_status`] |
//! | other 4xx | stored as a final failure ([`crate::Failure::Final`]) | [`IdempotencyLayer::on_client_error`] |
//! | 5xx | not stored; the key is released and a retry runs the handler again ([`crate::Failure::Retryable`]) | [`IdempotencyLayer::on_server_error`] |
//!
//! A handler overrides this for one response by inserting a [`Disposition`]
//! into the response extensions: `Disposition::Unknown` when a downstream
//! call timed out after it may have had effects (the record becomes
//! UNKNOWN; retries get 503 until a resolver settles it). A 5xx left
//! retryable must therefore mean "nothing happened".
//!
//! The stored envelope keeps the status, the [`stored
//! headers`](IdempotencyLayer::stored_headers) (by default `Content-Type`
//! and `Location`) and the body. The outcome is durable before the response
//! is sent, so a retry that follows the response always replays. A response
//! larger than the engine's `max_response_bytes` is still sent, but cannot
//! be stored: the record becomes UNKNOWN (see [`crate::Engine::complete`]).
//! A replay sends the envelope after the engine's upcasters ran on it (see
//! [`crate::EngineBuilder::upcaster`]); one older than the current schema
//! and not covered by an upcaster is sent as stored.
//!
//! # Failures, panics and cancellation
//!
//! - **The inner service returns an error**, or its response body fails
//!   while being read: the work may have happened, so the claim is failed
//!   as UNKNOWN (never re-executed); the error is passed on (for a body
//!   error, a 500 [`response-error`](#response-error)).
//! - **The handler panics**: the claim is settled as
//!   [`IdempotencyLayer::on_panic`] says (UNKNOWN by default, or released),
//!   then the panic continues to unwind.
//! - **The response future is dropped** while the handler runs (the client
//!   went away and the server cancelled the request, or a timeout layer
//!   fired): the [`crate::Claim`] drops with it and the record becomes
//!   UNKNOWN, never re-executed. If it is dropped before the claim was
//!   handed to the handler, the claim is released instead, since nothing
//!   ran. Once the handler has answered, storing the outcome runs to
//!   completion even if the future is dropped.
//!
//! The engine's calls block (they wait for an fsync); the layer runs them
//! with [`tokio::task::spawn_blocking`], so the service must be polled
//! inside a tokio runtime.
//!
//! # Problem types
//!
//! Each refusal's `type` is this page's URL with one of these fragments.
//!
//! ### malformed-key
//! 400: the `Idempotency-Key` header is not one structured-field string or
//! bare token of 1 to 255 bytes.
//! ### missing-key
//! 400: the route requires an `Idempotency-Key` header and there is none.
//! ### invalid-scope
//! 400: the scope built from the request (e.g. a tenant header) is not a
//! valid scope.
//! ### unreadable-body
//! 400: the request body could not be read.
//! ### invalid-body
//! 400: the route expects JSON and the body is not strict JSON.
//! ### body-too-large
//! 413: the body is larger than the layer accepts.
//! ### in-progress
//! 409: a request with this key is still being processed; retry after
//! `Retry-After` seconds.
//! ### key-mismatch
//! 409 or 422: the key was used before for a different request.
//! ### key-expired
//! 409: the key's record expired and the key may not be reused yet.
//! ### outcome-unknown
//! 503: an earlier attempt with this key may have had effects that were
//! never recorded; it is being recovered. Retry after `Retry-After` seconds.
//! ### response-error
//! 500: the handler's response body failed while being read.
//! ### engine-error
//! 500: the idempotency store failed.

mod header;
mod problem;
mod route;

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE, LOCATION};
use http::request::Parts;
use http::{Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited};
use parking_lot::Mutex;

use crate::{Begin, BoxError, Claim, Engine, Envelope, Failure, Fingerprint, IdempotencyKey};
use problem::Problem;
use route::BodyMode;
pub use route::Route;

/// The request header: `Idempotency-Key`.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The header on replayed responses: `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The request body the inner service receives: the original body for
/// requests passed through, the buffered body for claimed ones.
pub type RequestBody<B> = Either<B, Full<Bytes>>;

/// The response body the layer returns: the inner service's body when
/// passed through, a buffered body otherwise.
pub type ResponseBody<B> = Either<B, Full<Bytes>>;

/// The future returned by [`IdempotencyService`].
pub type ResponseFuture<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send + 'static>>;

type ScopeFn = Arc<dyn Fn(&Parts, &str) -> String + Send + Sync>;

/// What to do with a claimed request's response.
///
/// Configured per status class ([`IdempotencyLayer::on_client_error`],
/// [`IdempotencyLayer::on_server_error`]), or set for one response by a
/// handler that inserts it into the response extensions (with axum: return
/// `(StatusCode::SERVICE_UNAVAILABLE, Extension(Disposition::Unknown), ..)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Disposition {
    /// Store the response and replay it to every retry (as a success below
    /// 400, as a [`crate::Failure::Final`] from 400).
    Store,
    /// Store nothing and release the key: the next request with it runs the
    /// handler again ([`crate::Failure::Retryable`]). Only correct if the
    /// handler had no effects.
    Retry,
    /// The handler's effects are unknown (e.g. a provider call timed out):
    /// the record becomes UNKNOWN, is never re-executed, and retries get 503
    /// until a [`crate::Resolver`] settles it.
    Unknown,
}

/// The claim a request runs under, inserted into the request extensions
/// before the handler is called (with axum: `Extension<ClaimInfo>`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimInfo {
    /// The scoped key.
    pub key: IdempotencyKey,
    /// The claim's provider reference ([`Claim::reference`]): pass it to a
    /// payment provider as its idempotency key, so a resolver can later ask
    /// the provider about it.
    pub reference: String,
    /// The claim's fencing token ([`Claim::fencing_token`]).
    pub fencing_token: u64,
}

#[derive(Clone)]
struct Config {
    engine: Arc<Engine>,
    methods: Vec<Method>,
    routes: Vec<Route>,
    require_key: bool,
    tenant_header: Option<HeaderName>,
    scope: Option<ScopeFn>,
    max_body_bytes: usize,
    mismatch_status: StatusCode,
    stored_headers: Vec<HeaderName>,
    client_errors: Disposition,
    server_errors: Disposition,
    /// Per-status overrides of the class defaults.
    by_status: Vec<(StatusCode, Disposition)>,
    panics: Disposition,
    unknown_retry_after: Duration,
    schema_version: u32,
}

/// Statuses with which a request is rejected before the handler could act
/// (axum's extractors answer malformed syntax 400, a missing length 411, an
/// oversized body 413, a wrong media type 415 and a wrongly shaped body
/// 422). Nothing happened, so by default they are not stored: the corrected
/// retry runs, as Stripe does for validation failures.
const REJECTIONS: [StatusCode; 5] = [
    StatusCode::BAD_REQUEST,
    StatusCode::LENGTH_REQUIRED,
    StatusCode::PAYLOAD_TOO_LARGE,
    StatusCode::UNSUPPORTED_MEDIA_TYPE,
    StatusCode::UNPROCESSABLE_ENTITY,
];

/// A [`tower::Layer`] implementing the `Idempotency-Key` header on an
/// [`Engine`]; see the [module docs](self) for what requests get.
///
/// ## Defaults
///
/// | setting | default |
/// |---|---|
/// | [`methods`](Self::methods) | POST, PATCH |
/// | [`require_key`](Self::require_key) | `false` (a request without a key passes through) |
/// | [`route`](Self::route) | none: body fingerprint by content type |
/// | [`scope`](Self::scope) | `"{method} {route}"` plus ` tenant={value}` |
/// | [`tenant_header`](Self::tenant_header) | none |
/// | [`max_body_bytes`](Self::max_body_bytes) | 1 MiB (1,048,576 bytes) |
/// | [`mismatch_status`](Self::mismatch_status) | 409 Conflict |
/// | [`stored_headers`](Self::stored_headers) | `Content-Type`, `Location` |
/// | [`on_client_error`](Self::on_client_error) | [`Disposition::Store`] |
/// | [`on_status`](Self::on_status) | 400, 411, 413, 415, 422: [`Disposition::Retry`] |
/// | [`on_server_error`](Self::on_server_error) | [`Disposition::Retry`] |
/// | [`on_panic`](Self::on_panic) | [`Disposition::Unknown`] |
/// | [`unknown_retry_after`](Self::unknown_retry_after) | 1 s |
/// | [`response_schema_version`](Self::response_schema_version) | 1 |
#[derive(Clone)]
#[must_use]
pub struct IdempotencyLayer {
    cfg: Arc<Config>,
}

impl IdempotencyLayer {
    /// A layer on `engine` with the documented defaults.
    pub fn new(engine: Arc<Engine>) -> IdempotencyLayer {
        IdempotencyLayer {
            cfg: Arc::new(Config {
                engine,
                methods: vec![Method::POST, Method::PATCH],
                routes: Vec::new(),
                require_key: false,
                tenant_header: None,
                scope: None,
                max_body_bytes: 1 << 20,
                mismatch_status: StatusCode::CONFLICT,
                stored_headers: vec![CONTENT_TYPE, LOCATION],
                client_errors: Disposition::Store,
                by_status: REJECTIONS
                    .iter()
                    .map(|&s| (s, Disposition::Retry))
                    .collect(),
                server_errors: Disposition::Retry,
                panics: Disposition::Unknown,
                unknown_retry_after: Duration::from_secs(1),
                schema_version: 1,
            }),
        }
    }

    fn cfg(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.cfg)
    }

    /// The methods the layer applies to; requests with other methods pass
    /// through untouched, key or not.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.cfg().methods = methods.into_iter().collect();
        self
    }

    /// Whether requests on routes without their own setting must carry a
    /// key (400 `missing-key` if not). When `false`, they pass through.
    pub fn require_key(mut self, required: bool) -> Self {
        self.cfg().require_key = required;
        self
    }

    /// Adds per-route settings. Routes are tried in the order added; the
    /// first whose pattern matches the request path applies.
    pub fn route(mut self, route: Route) -> Self {
        self.cfg().routes.push(route);
        self
    }

    /// A request header naming the tenant (e.g. `x-tenant-id`), appended to
    /// the default scope so two tenants' keys never collide. Ignored when
    /// [`IdempotencyLayer::scope`] is set. A value that is not visible ASCII
    /// is refused with 400 `invalid-scope`.
    pub fn tenant_header(mut self, name: HeaderName) -> Self {
        self.cfg().tenant_header = Some(name);
        self
    }

    /// Computes the scope from the request head and the matched route
    /// pattern (or the path if no route matched), instead of the default
    /// `"{method} {route}"`. The scope must be 1..=255 bytes without control
    /// characters; otherwise the request is refused with 400
    /// `invalid-scope`.
    pub fn scope(mut self, scope: impl Fn(&Parts, &str) -> String + Send + Sync + 'static) -> Self {
        self.cfg().scope = Some(Arc::new(scope));
        self
    }

    /// Largest request body read, in bytes. A larger body is refused with
    /// 413 before any claim (a `Content-Length` above the limit is refused
    /// before the body is read).
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.cfg().max_body_bytes = bytes;
        self
    }

    /// Status for a key reused with a different request: 409 Conflict (the
    /// default, as Stripe does) or 422 Unprocessable Content (the IETF
    /// draft's choice, section 2.7).
    pub fn mismatch_status(mut self, status: StatusCode) -> Self {
        self.cfg().mismatch_status = status;
        self
    }

    /// The response headers stored with the body and sent on replay (every
    /// value of each, in order). Other headers are sent only with the
    /// original response.
    pub fn stored_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.cfg().stored_headers = names.into_iter().collect();
        self
    }

    /// What happens to a 4xx response of the handler (except the statuses
    /// set by [`on_status`](Self::on_status)).
    pub fn on_client_error(mut self, disposition: Disposition) -> Self {
        self.cfg().client_errors = disposition;
        self
    }

    /// What happens to responses with this exact status, over the class
    /// default. By default 400, 411, 413, 415 and 422 are
    /// [`Disposition::Retry`]: those are how a request is rejected before the
    /// handler acts (axum's extractors), so a corrected retry must run. A
    /// handler that answers one of them *after* a side effect inserts
    /// [`Disposition::Store`] into its response extensions.
    pub fn on_status(mut self, status: StatusCode, disposition: Disposition) -> Self {
        let by_status = &mut self.cfg().by_status;
        by_status.retain(|(s, _)| *s != status);
        by_status.push((status, disposition));
        self
    }

    /// What happens to a 5xx response of the handler.
    pub fn on_server_error(mut self, disposition: Disposition) -> Self {
        self.cfg().server_errors = disposition;
        self
    }

    /// What happens to the claim when the handler panics:
    /// [`Disposition::Retry`] releases the key, anything else makes the
    /// record UNKNOWN (there is no response to store). The panic then
    /// continues to unwind.
    pub fn on_panic(mut self, disposition: Disposition) -> Self {
        self.cfg().panics = disposition;
        self
    }

    /// The `Retry-After` sent with 503 `outcome-unknown`, rounded up to whole
    /// seconds (at least 1).
    pub fn unknown_retry_after(mut self, after: Duration) -> Self {
        self.cfg().unknown_retry_after = after;
        self
    }

    /// The schema version stored in envelopes (see [`Envelope`]); bump it
    /// when the handler's responses change shape, and register upcasters on
    /// the engine.
    pub fn response_schema_version(mut self, version: u32) -> Self {
        self.cfg().schema_version = version;
        self
    }
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.cfg;
        f.debug_struct("IdempotencyLayer")
            .field("methods", &c.methods)
            .field("routes", &c.routes)
            .field("require_key", &c.require_key)
            .field("tenant_header", &c.tenant_header)
            .field("custom_scope", &c.scope.is_some())
            .field("max_body_bytes", &c.max_body_bytes)
            .field("mismatch_status", &c.mismatch_status)
            .field("stored_headers", &c.stored_headers)
            .field("client_errors", &c.client_errors)
            .field("by_status", &c.by_status)
            .field("server_errors", &c.server_errors)
            .field("panics", &c.panics)
            .finish_non_exhaustive()
    }
}

impl<S> tower::Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> IdempotencyService<S> {
        IdempotencyService {
            inner,
            cfg: self.cfg.clone(),
        }
    }
}

/// The service made by [`IdempotencyLayer`].
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    cfg: Arc<Config>,
}

impl<S: fmt::Debug> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> tower::Service<Request<ReqBody>> for IdempotencyService<S>
where
    S: tower::Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // The service that was polled ready goes into the future; a fresh
        // clone stays behind for the next call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(handle(self.cfg.clone(), inner, req))
    }
}

/// What the checks before `begin` decided.
enum Admission<B> {
    /// Not ours: call the inner service with the request as it came.
    Pass(B),
    /// Claim this key for this request.
    Begin {
        key: IdempotencyKey,
        fingerprint: Fingerprint,
        lease: Option<Duration>,
        body: Bytes,
    },
}

async fn handle<S, ReqBody, ResBody>(
    cfg: Arc<Config>,
    mut inner: S,
    req: Request<ReqBody>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: tower::Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    let (parts, body) = req.into_parts();
    let (key, fingerprint, lease, body) = match admit(&cfg, &parts, body).await {
        Ok(Admission::Pass(body)) => {
            let response = inner
                .call(Request::from_parts(parts, Either::Left(body)))
                .await?;
            return Ok(response.map(Either::Left));
        }
        Ok(Admission::Begin {
            key,
            fingerprint,
            lease,
            body,
        }) => (key, fingerprint, lease, body),
        Err(problem) => return Ok(answer(problem)),
    };
    let begin = match begin_blocking(cfg.engine.clone(), key, fingerprint, lease).await {
        Ok(begin) => begin,
        Err(problem) => return Ok(answer(problem)),
    };
    let problem = match begin {
        Begin::Claimed(claim) => return run_claimed(&cfg, inner, parts, body, claim).await,
        Begin::Replay(replay) => return Ok(replay_response(replay.envelope).map(Either::Right)),
        Begin::Processing { retry_after } => Problem::new(
            StatusCode::CONFLICT,
            "in-progress",
            "Request in progress",
            "a request with this Idempotency-Key is still being processed",
        )
        .retry_after(ceil_secs(retry_after)),
        Begin::Mismatch => Problem::new(
            cfg.mismatch_status,
            "key-mismatch",
            "Idempotency-Key reused",
            "this Idempotency-Key was already used for a different request",
        ),
        Begin::Unknown(pending) => {
            tracing::info!(key = %pending.key, reference = %pending.reference, "outcome unknown");
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "outcome-unknown",
                "Outcome being recovered",
                "an earlier request with this Idempotency-Key may have had effects that were \
                 not recorded; it is being recovered and will not be executed again",
            )
            .retry_after(ceil_secs(cfg.unknown_retry_after))
        }
        Begin::Tombstoned { reusable_at_ms, .. } => Problem::new(
            StatusCode::CONFLICT,
            "key-expired",
            "Idempotency-Key expired",
            format!(
                "this Idempotency-Key expired; it may not be reused before {reusable_at_ms} ms \
                 since the Unix epoch; use a new key"
            ),
        ),
    };
    Ok(answer(problem))
}

/// Decides whether a request is ours, and if so reads and fingerprints it.
async fn admit<B>(cfg: &Config, parts: &Parts, body: B) -> Result<Admission<B>, Problem>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    if !cfg.methods.contains(&parts.method) {
        return Ok(Admission::Pass(body));
    }
    let path = parts.uri.path();
    let route = cfg.routes.iter().find(|r| r.matches(path));
    let required = route.and_then(|r| r.require_key).unwrap_or(cfg.require_key);
    let client_key = match header::parse_key(parts.headers.get_all(&IDEMPOTENCY_KEY)) {
        Ok(Some(key)) => key,
        Ok(None) if !required => return Ok(Admission::Pass(body)),
        Ok(None) => {
            return Err(Problem::new(
                StatusCode::BAD_REQUEST,
                "missing-key",
                "Idempotency-Key required",
                format!("{} {path} requires an Idempotency-Key header", parts.method),
            ))
        }
        Err(detail) => {
            return Err(Problem::new(
                StatusCode::BAD_REQUEST,
                "malformed-key",
                "Malformed Idempotency-Key",
                detail,
            ))
        }
    };
    let route_path = route.map_or(path, Route::pattern);
    let scope = match &cfg.scope {
        Some(scope) => scope(parts, route_path),
        None => default_scope(cfg, parts, route_path)?,
    };
    let key = IdempotencyKey::new(scope, client_key).map_err(|e| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "invalid-scope",
            "Invalid idempotency scope",
            e.to_string(),
        )
    })?;
    let body = read_body(&parts.headers, body, cfg.max_body_bytes).await?;
    let mode = route.map_or(&BodyMode::Auto, |r| &r.body);
    let fingerprint = fingerprint(parts, mode, &body)?;
    Ok(Admission::Begin {
        key,
        fingerprint,
        lease: route.and_then(|r| r.lease),
        body,
    })
}

fn default_scope(cfg: &Config, parts: &Parts, route: &str) -> Result<String, Problem> {
    let mut scope = format!("{} {route}", parts.method);
    if let Some(name) = &cfg.tenant_header {
        if let Some(value) = parts.headers.get(name) {
            let tenant = value.to_str().map_err(|_| {
                Problem::new(
                    StatusCode::BAD_REQUEST,
                    "invalid-scope",
                    "Invalid idempotency scope",
                    format!("the {name} header must be visible ASCII"),
                )
            })?;
            // The route is a URI path and has no spaces, so this cannot be
            // confused with another route's scope.
            scope.push_str(" tenant=");
            scope.push_str(tenant);
        }
    }
    Ok(scope)
}

async fn read_body<B>(headers: &http::HeaderMap, body: B, limit: usize) -> Result<Bytes, Problem>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let too_large = |what: String| {
        Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body-too-large",
            "Request body too large",
            format!("{what}; at most {limit} bytes are accepted"),
        )
    };
    let declared = headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(len) = declared {
        if len > limit as u64 {
            return Err(too_large(format!("the body is {len} bytes")));
        }
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(too_large("the body is larger".into()))
        }
        Err(e) => Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "unreadable-body",
            "Unreadable request body",
            format!("the request body could not be read: {e}"),
        )),
    }
}

fn fingerprint(parts: &Parts, mode: &BodyMode, body: &[u8]) -> Result<Fingerprint, Problem> {
    let builder = Fingerprint::builder()
        .part("method", parts.method.as_str().as_bytes())
        .part("path", parts.uri.path().as_bytes())
        .part("query", parts.uri.query().unwrap_or("").as_bytes());
    let pointers = match mode {
        BodyMode::Json(pointers) => pointers.as_slice(),
        BodyMode::Auto if is_json(&parts.headers) => &[],
        BodyMode::Auto | BodyMode::Raw => return Ok(builder.part("body", body).finish()),
    };
    let pointers: Vec<&str> = pointers.iter().map(String::as_str).collect();
    match builder.json("body", body, &pointers) {
        Ok(builder) => Ok(builder.finish()),
        Err(e) => Err(Problem::new(
            StatusCode::BAD_REQUEST,
            "invalid-body",
            "Request body is not valid JSON",
            format!("the request body is not valid JSON: {e}"),
        )),
    }
}

/// `application/json` or any `*/*+json` media type.
fn is_json(headers: &http::HeaderMap) -> bool {
    let Some(value) = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("application/json")
        || essence
            .get(essence.len().saturating_sub(5)..)
            .is_some_and(|tail| tail.eq_ignore_ascii_case("+json"))
}

fn ceil_secs(d: Duration) -> u64 {
    u64::try_from(d.as_millis().div_ceil(1000))
        .unwrap_or(u64::MAX)
        .max(1)
}

fn answer<B>(problem: Problem) -> Response<Either<B, Full<Bytes>>> {
    problem.into_response().map(Either::Right)
}

fn engine_problem(e: &crate::Error) -> Problem {
    tracing::error!(error = %e, "idempotency engine failed");
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "engine-error",
        "Idempotency store failed",
        e.to_string(),
    )
}

/// Where a blocking `begin` leaves its answer. If the request future is
/// dropped before taking it, a won claim is released (the handler never
/// ran), by whichever side comes second.
enum Slot {
    Waiting,
    Ready(crate::Result<Begin>),
    Taken,
    Abandoned,
}

struct Handoff {
    engine: Arc<Engine>,
    slot: Mutex<Slot>,
}

/// Marks the handoff abandoned when the request future is dropped.
struct AbandonOnDrop(Arc<Handoff>);

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        let previous = std::mem::replace(&mut *self.0.slot.lock(), Slot::Abandoned);
        if let Slot::Ready(Ok(Begin::Claimed(claim))) = previous {
            let engine = self.0.engine.clone();
            let release = move || release(&engine, claim);
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => drop(runtime.spawn_blocking(release)),
                Err(_) => release(),
            }
        }
    }
}

fn release(engine: &Engine, claim: Claim) {
    let key = claim.key().clone();
    if let Err(e) = engine.fail(claim, Failure::Retryable) {
        tracing::warn!(%key, error = %e, "could not release an abandoned claim");
    }
}

/// Runs `begin` on the blocking pool.
async fn begin_blocking(
    engine: Arc<Engine>,
    key: IdempotencyKey,
    fingerprint: Fingerprint,
    lease: Option<Duration>,
) -> Result<Begin, Problem> {
    let handoff = Arc::new(Handoff {
        engine,
        slot: Mutex::new(Slot::Waiting),
    });
    let guard = AbandonOnDrop(handoff.clone());
    let worker = handoff.clone();
    let joined = tokio::task::spawn_blocking(move || {
        let engine = &worker.engine;
        let result = match lease {
            Some(lease) => engine.begin_with_lease(&key, fingerprint, lease),
            None => engine.begin(&key, fingerprint),
        };
        let mut slot = worker.slot.lock();
        if matches!(*slot, Slot::Abandoned) {
            drop(slot);
            if let Ok(Begin::Claimed(claim)) = result {
                release(engine, claim);
            }
        } else {
            *slot = Slot::Ready(result);
        }
    })
    .await;
    let taken = std::mem::replace(&mut *handoff.slot.lock(), Slot::Taken);
    drop(guard);
    match (taken, joined) {
        (Slot::Ready(Ok(begin)), _) => Ok(begin),
        (Slot::Ready(Err(e)), _) => Err(engine_problem(&e)),
        (_, Err(e)) => Err(Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "engine-error",
            "Idempotency store failed",
            format!("the engine call did not finish: {e}"),
        )),
        (_, Ok(())) => Err(Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "engine-error",
            "Idempotency store failed",
            "the engine call left no answer",
        )),
    }
}

/// How a finished claim is reported to the engine.
enum Outcome {
    Complete(Envelope),
    Fail(Failure),
}

/// Reports a claim's outcome on the blocking pool and waits for it to be
/// durable. Runs to completion even if the request future is dropped.
async fn settle(engine: Arc<Engine>, claim: Claim, outcome: Outcome) {
    let key = claim.key().clone();
    let done = tokio::task::spawn_blocking(move || match outcome {
        Outcome::Complete(envelope) => engine.complete(claim, envelope),
        Outcome::Fail(failure) => engine.fail(claim, failure),
    })
    .await;
    match done {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::error!(%key, error = %e, "could not record the outcome"),
        Err(e) => tracing::error!(%key, error = %e, "recording the outcome did not finish"),
    }
}

async fn run_claimed<S, ReqBody, ResBody>(
    cfg: &Config,
    mut inner: S,
    parts: Parts,
    body: Bytes,
    claim: Claim,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: tower::Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    let engine = cfg.engine.clone();
    let mut req = Request::from_parts(parts, Either::Right(Full::new(body)));
    req.extensions_mut().insert(ClaimInfo {
        key: claim.key().clone(),
        reference: claim.reference().to_owned(),
        fencing_token: claim.fencing_token(),
    });
    let called = match std::panic::catch_unwind(AssertUnwindSafe(|| inner.call(req))) {
        Ok(future) => CatchUnwind(Box::pin(future)).await,
        Err(panic) => Err(panic),
    };
    let response = match called {
        Ok(Ok(response)) => response,
        Ok(Err(e)) => {
            let reason = "the inner service returned an error".to_string();
            settle(engine, claim, Outcome::Fail(Failure::Unknown { reason })).await;
            return Err(e);
        }
        Err(panic) => {
            let failure = match cfg.panics {
                Disposition::Retry => Failure::Retryable,
                Disposition::Store | Disposition::Unknown => Failure::Unknown {
                    reason: "the handler panicked".into(),
                },
            };
            settle(engine, claim, Outcome::Fail(failure)).await;
            std::panic::resume_unwind(panic);
        }
    };
    let (mut head, body) = response.into_parts();
    // Converted at once: the body's own error type need not be `Send`.
    let collected: Result<_, BoxError> = body.collect().await.map_err(Into::into);
    let body = match collected {
        Ok(collected) => collected.to_bytes(),
        Err(e) => {
            let reason = format!("the response body failed: {e}");
            settle(engine, claim, Outcome::Fail(Failure::Unknown { reason })).await;
            return Ok(answer(Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "response-error",
                "Response failed",
                "the response body failed while being read; the request's outcome is being \
                 recovered",
            )));
        }
    };
    let status = head.status;
    let disposition = head
        .extensions
        .remove::<Disposition>()
        .or_else(|| {
            cfg.by_status
                .iter()
                .find(|(s, _)| *s == status)
                .map(|&(_, d)| d)
        })
        .unwrap_or(if status.is_server_error() {
            cfg.server_errors
        } else if status.is_client_error() {
            cfg.client_errors
        } else {
            Disposition::Store
        });
    let outcome = match disposition {
        Disposition::Store => {
            let mut envelope = Envelope::new(cfg.schema_version, status.as_u16(), body.to_vec());
            for name in &cfg.stored_headers {
                for value in head.headers.get_all(name) {
                    envelope
                        .headers
                        .push((name.as_str().to_owned(), value.as_bytes().to_vec()));
                }
            }
            if status.as_u16() < 400 {
                Outcome::Complete(envelope)
            } else {
                Outcome::Fail(Failure::Final(envelope))
            }
        }
        Disposition::Retry => Outcome::Fail(Failure::Retryable),
        Disposition::Unknown => Outcome::Fail(Failure::Unknown {
            reason: format!("the handler answered {status} with its outcome unknown"),
        }),
    };
    settle(engine, claim, outcome).await;
    Ok(Response::from_parts(head, Either::Right(Full::new(body))))
}

fn replay_response(envelope: Envelope) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(envelope.body)));
    *response.status_mut() =
        StatusCode::from_u16(envelope.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    for (name, value) in envelope.headers {
        // Stored from a valid response, so these parse; skip one that does
        // not rather than fail the replay.
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) {
            headers.append(name, value);
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

/// Polls a future, turning a panic into an `Err` with its payload.
struct CatchUnwind<F>(Pin<Box<F>>);

impl<F: Future> Future for CatchUnwind<F> {
    type Output = Result<F::Output, Box<dyn std::any::Any + Send>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let future = self.0.as_mut();
        match std::panic::catch_unwind(AssertUnwindSafe(|| future.poll(cx))) {
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_content_types() {
        let mut h = http::HeaderMap::new();
        assert!(!is_json(&h));
        for (ct, want) in [
            ("application/json", true),
            ("Application/JSON; charset=utf-8", true),
            ("application/merge-patch+json", true),
            ("text/plain", false),
            ("json", false),
        ] {
            h.insert(CONTENT_TYPE, HeaderValue::from_static(ct));
            assert_eq!(is_json(&h), want, "{ct}");
        }
    }

    #[test]
    fn retry_after_rounds_up() {
        assert_eq!(ceil_secs(Duration::ZERO), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1001)), 2);
        assert_eq!(ceil_secs(Duration::from_secs(3)), 3);
    }
}
