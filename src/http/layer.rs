//! The [`IdempotencyLayer`]: configuration and its defaults.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderName;
use http::request::Parts;
use http::{Method, StatusCode};

use super::config::{Config, HeaderPolicy, DEFAULT_MAX_IN_FLIGHT, RELEASED, UNSTORABLE};
use super::runtime::Runtime;
use super::service::IdempotencyService;
use super::store::RESERVED_PREFIX;
use super::{Caller, Disposition, Route};
use crate::Engine;

/// Default of [`IdempotencyLayer::body_read_timeout`].
const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// A [`tower::Layer`] implementing the `Idempotency-Key` header on an
/// [`Engine`]; see the [module docs](super) for what requests get.
///
/// # What happens to the handler's response
///
/// Each response is classified by the taxonomy of [`Disposition`]:
/// *retryable* (nothing happened: the key is released, a retry runs),
/// *final* (stored and replayed to every retry) or *in doubt* (the work may
/// have happened: the record becomes UNKNOWN, is never re-executed, and
/// retries get 503 until a [`crate::Resolver`] settles it). By default:
///
/// | status | default | why |
/// |---|---|---|
/// | 1xx–3xx | final: stored | the work is done |
/// | 400, 411, 413, 415, 422 | retryable: released | how a request is rejected before the handler acts (axum's extractors); a corrected retry must run |
/// | 408, 425, 429 | retryable: released | "not processed, try again" (timeout reading the request, too early, rate limited); the retry after the advertised delay must run, not get the refusal back |
/// | other 4xx (402, 404, 409, …) | final: stored as a final failure | a business refusal: the same request gets the same answer |
/// | 503 with `Retry-After` | retryable: released | the conventional "overloaded, try later", sent before work starts |
/// | other 5xx (500, 502, 503 without `Retry-After`, 504, …) | in doubt | the handler may have acted before failing (charged a card, then failed to render); running it again could do it twice |
///
/// The handler's own word wins: a handler that failed before acting
/// inserts [`Disposition::Retry`] into its response extensions (and one
/// that answers 429 or 400 *after* acting inserts [`Disposition::Store`]).
/// [`on_status`](Self::on_status), [`on_client_error`](Self::on_client_error)
/// and [`on_server_error`](Self::on_server_error) change the defaults.
///
/// # Durability and streaming
///
/// A response is sent only once its outcome is recorded, or in a way that
/// cannot be mistaken for a success:
///
/// - **A body of known size within the engine's `max_response_bytes`**
///   (the usual JSON answer) is read, recorded, then sent. If recording
///   fails (e.g. the disk is full), the client gets 503
///   [`outcome-not-recorded`](super#outcome-not-recorded) instead of the
///   handler's answer.
/// - **A body of known size above the limit** has its completion recorded
///   without the body (status and headers kept, marked "not retained"),
///   then streams through. A retry gets 409
///   [`response-not-retained`](super#response-not-retained): a definite
///   "it completed", never a second run.
/// - **A body of unknown size** (a stream, `text/event-stream`, a
///   compression layer inside this one) streams through to the client as it
///   is produced while a copy is kept up to the limit; the outcome (with the
///   copy, or marked "not retained" if the body outgrew the limit) is
///   recorded when the stream ends, and the stream's end is held back until
///   it is durable. If recording fails, the stream ends with an error
///   instead of its end, so the client sees an incomplete response. If the
///   client goes away mid-stream, the completion is recorded as "not
///   retained".
///
/// Only *final* responses are stored; retryable and in-doubt ones are
/// recorded (released, or marked UNKNOWN) before their head is sent, and
/// their body streams through untouched.
///
/// Stored headers are all end-to-end response headers except the
/// hop-by-hop ones (`Connection` and those it names, `Keep-Alive`,
/// `Proxy-Connection`, `Proxy-Authenticate`, `TE`, `Trailer`,
/// `Transfer-Encoding`, `Upgrade`), credentials (`Set-Cookie`,
/// `Set-Cookie2`, `Authorization`, `Proxy-Authorization`; stored only when
/// named in [`stored_headers`](Self::stored_headers)), `Date` and
/// `Content-Length`; see also [`exclude_headers`](Self::exclude_headers).
/// So `Content-Encoding`,
/// `Content-Type`, `Location`, `ETag` and the like replay as sent.
///
/// # Retry-After for a request in progress
///
/// The 409 `processing` answer's `Retry-After` is when the running request
/// is likely to finish: a running average (exponentially weighted) of how
/// long the route's claimed requests took from claim to recorded outcome
/// (requests that match no [`Route`] share one estimate),
/// minus how long this one has run if this process holds it, capped by its
/// remaining lease, rounded up to whole seconds (at least 1). Until the
/// route has finished one request, it is the remaining lease capped at one
/// second.
///
/// # Capacity
///
/// Every claimed request holds one of [`max_in_flight`](Self::max_in_flight)
/// permits from before its `begin` until its outcome is recorded (the
/// pattern of tower's `ConcurrencyLimit`): `poll_ready` waits for a permit,
/// so overload turns into backpressure on the server's accept loop rather
/// than a growing queue of blocked threads. `poll_ready` cannot see the
/// request, so every request waits for a permit while the layer is full; one
/// that turns out not to be ours (another method, no key) gives it back at
/// once, before the inner service runs. Put routes that must stay
/// responsive under overload (health checks) outside the layer. With
/// [`load_shed`](Self::load_shed), `poll_ready` is always ready and a
/// request that finds no permit is answered 503
/// [`overloaded`](super#overloaded) with `Retry-After` instead.
///
/// # Failures, panics and cancellation
///
/// - **The inner service returns an error**, or its response body fails:
///   the work may have happened, so the claim is failed as UNKNOWN (never
///   re-executed); the error is passed on (for a body read before sending,
///   a 500 [`response-error`](super#response-error)).
/// - **The handler panics**: the claim is failed as
///   [`on_panic`](Self::on_panic) says (UNKNOWN by default, or released),
///   then the panic continues to unwind.
/// - **The response future is dropped** while the handler runs (the client
///   went away and the server cancelled the request, or a timeout layer
///   fired): the [`crate::Claim`] drops with it and the record becomes
///   UNKNOWN, never re-executed. If it is dropped before the claim was
///   handed to the handler, the claim is released instead, since nothing
///   ran. Once the handler has answered, recording the outcome runs to
///   completion even if the future is dropped.
///
/// On redb the layer awaits the engine's async calls (a durable write wakes
/// the request's task; no thread waits for the fsync); on PostgreSQL, while
/// the engine is poisoned, and for bodies of 64 KiB or more (fingerprinting)
/// it uses [`tokio::task::spawn_blocking`]. The service must be polled
/// inside a tokio runtime.
///
/// ## Defaults
///
/// | setting | default |
/// |---|---|
/// | [`methods`](Self::methods) | POST, PATCH |
/// | [`require_key`](Self::require_key) | `false` (a request without a key passes through) |
/// | [`route`](Self::route) | none: body fingerprint by content type |
/// | [`caller`](Self::caller) | [`Caller::headers`]: `Authorization` (hashed); cookies only by name ([`Caller::cookies`]) |
/// | [`caller_secret`](Self::caller_secret) | none: the digest is keyed by a fixed context string |
/// | [`scope`](Self::scope) | `"{method} {route}"` plus ` tenant={value}` plus ` caller={digest}` |
/// | [`tenant_header`](Self::tenant_header) | none |
/// | [`max_body_bytes`](Self::max_body_bytes) | 1 MiB (1,048,576 bytes) |
/// | [`body_read_timeout`](Self::body_read_timeout) | 30 s |
/// | [`mismatch_status`](Self::mismatch_status) | 409 Conflict |
/// | [`expired_status`](Self::expired_status) | 409 Conflict |
/// | [`stored_headers`](Self::stored_headers) | all end-to-end headers but the hop-by-hop ones, credentials, `Date` and `Content-Length` (see above) |
/// | [`on_status`](Self::on_status) | 400, 408, 411, 413, 415, 422, 425, 429: [`Disposition::Retry`] |
/// | [`on_client_error`](Self::on_client_error) | [`Disposition::Store`] |
/// | [`on_server_error`](Self::on_server_error) | [`Disposition::InDoubt`] (503 with `Retry-After`: [`Disposition::Retry`]) |
/// | [`on_panic`](Self::on_panic) | [`Disposition::InDoubt`] |
/// | [`in_doubt_retry_after`](Self::in_doubt_retry_after) | 1 s |
/// | [`response_schema_version`](Self::response_schema_version) | 1 |
/// | [`max_in_flight`](Self::max_in_flight) | 512 |
/// | [`load_shed`](Self::load_shed) | off: wait for capacity |
#[derive(Clone)]
#[must_use]
pub struct IdempotencyLayer {
    pub(crate) cfg: Arc<Config>,
}

impl IdempotencyLayer {
    /// A layer on `engine`, with the defaults above.
    pub fn new(engine: Arc<Engine>) -> IdempotencyLayer {
        IdempotencyLayer {
            cfg: Arc::new(Config {
                engine,
                methods: vec![Method::POST, Method::PATCH],
                routes: Vec::new(),
                require_key: false,
                tenant_header: None,
                caller: Caller::default(),
                caller_key: None,
                scope: None,
                max_body_bytes: 1 << 20,
                body_read_timeout: DEFAULT_BODY_READ_TIMEOUT,
                mismatch_status: StatusCode::CONFLICT,
                expired_status: StatusCode::CONFLICT,
                headers: HeaderPolicy::AllExcept(Vec::new()),
                client_errors: Disposition::Store,
                server_errors: Disposition::InDoubt,
                by_status: RELEASED.iter().map(|&s| (s, Disposition::Retry)).collect(),
                panics: Disposition::InDoubt,
                in_doubt_retry_after: Duration::from_secs(1),
                schema_version: 1,
                shed: None,
                runtime: Runtime::new(DEFAULT_MAX_IN_FLIGHT),
                unmatched: Arc::default(),
            }),
        }
    }

    fn cfg(&mut self) -> &mut Config {
        Arc::make_mut(&mut self.cfg)
    }

    /// The methods the layer applies to; other requests pass through.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.cfg().methods = methods.into_iter().collect();
        self
    }

    /// Adds per-route settings (see [`Route`]). The first matching route
    /// decides.
    pub fn route(mut self, route: Route) -> Self {
        self.cfg().routes.push(route);
        self
    }

    /// Whether a request without an `Idempotency-Key` is refused (400) on
    /// routes that do not say otherwise.
    pub fn require_key(mut self, required: bool) -> Self {
        self.cfg().require_key = required;
        self
    }

    /// A request header naming the tenant, appended to the default scope as
    /// ` tenant={value}`, so tenants never share keys. A value that is not
    /// visible ASCII is refused with 400 `invalid-scope`. Only meaningful if
    /// something upstream checks that the caller belongs to the tenant;
    /// the [`caller`](Self::caller) part of the scope stays in place.
    pub fn tenant_header(mut self, name: HeaderName) -> Self {
        self.cfg().tenant_header = Some(name);
        self
    }

    /// How the caller is identified for the default scope (see [`Caller`]);
    /// [`Caller::shared`] makes all callers share keys.
    pub fn caller(mut self, caller: Caller) -> Self {
        self.cfg().caller = caller;
        self
    }

    /// Keys the caller digest with a secret of the app's (any length; a
    /// 32-byte key is derived from it with blake3). Without one, the digest
    /// of a low-entropy credential (a Basic-auth password) could be found by
    /// trying candidates against a copy of the database. The secret must
    /// stay the same across restarts and servers: changing it changes every
    /// caller's scope, so records made before are no longer found and a
    /// retry across the change runs again.
    pub fn caller_secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.cfg().caller_key = Some(blake3::derive_key(
            "idempotency http caller secret v1",
            secret.as_ref(),
        ));
        self
    }

    /// Computes the scope from the request head and the matched route
    /// pattern (or the path if no route matched), instead of the default
    /// (method, route, tenant, caller): the function then decides alone who
    /// shares keys. The scope must be 1..=255 bytes without control
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

    /// Longest wait for a request body the layer reads (a request with a
    /// key, on a covered method), from the first read to the body's end.
    /// A body that has not fully arrived by then is answered 408 Request
    /// Timeout ([`body-timeout`](crate::http#body-timeout), RFC 9110
    /// section 15.5.9) before any claim, and its in-flight slot (see
    /// [`max_in_flight`](Self::max_in_flight)) is freed: without a bound,
    /// clients that send half a body hold their slots, and their
    /// connections, for ever. Default 30 s; clamped to at least 1 ms.
    ///
    /// Requests the layer passes through (no key, another method) are read
    /// by the app: the server should bound those itself (for example
    /// tower-http's `RequestBodyTimeoutLayer`), and hyper's
    /// `header_read_timeout` bounds the head of every request.
    pub fn body_read_timeout(mut self, timeout: Duration) -> Self {
        self.cfg().body_read_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Status for a key reused with a different request: 409 Conflict (the
    /// default; the `key-mismatch` problem type tells it apart from
    /// `processing`) or 422 Unprocessable Content (the IETF draft's
    /// choice, section 2.7). Stripe answers 400 in this case.
    pub fn mismatch_status(mut self, status: StatusCode) -> Self {
        self.cfg().mismatch_status = status;
        self
    }

    /// Status for a key used after its record expired, while the engine
    /// keeps its tombstone: 409 Conflict (the default) or 410 Gone. Either
    /// way the problem type is [`key-expired`](super#key-expired), with the
    /// member `reusable_at`, and the handler does not run.
    ///
    /// 410 tells a client that the key is known and gone, as opposed to
    /// never seen: one that derives keys from its own data (an order id)
    /// can then look the operation up before it mints a new key. It needs
    /// [`ExpiryPolicy::Tombstone`](crate::ExpiryPolicy::Tombstone) on the
    /// engine: under [`ExpiryPolicy::Forget`](crate::ExpiryPolicy::Forget)
    /// (the engine's default) an expired record is gone, the key is new
    /// again and the request runs; so does a request after the tombstone's
    /// own lifetime. A reused key with a *different* request is answered
    /// [`key-mismatch`](super#key-mismatch) while the tombstone lasts (the
    /// fingerprint is checked first).
    ///
    /// # Panics
    ///
    /// If `status` is neither 409 nor 410 (a configuration error).
    pub fn expired_status(mut self, status: StatusCode) -> Self {
        assert!(
            status == StatusCode::CONFLICT || status == StatusCode::GONE,
            "expired_status must be 409 Conflict or 410 Gone, not {status}"
        );
        self.cfg().expired_status = status;
        self
    }

    /// Stores only these response headers (every value of each, in order)
    /// instead of all end-to-end headers. Other headers are sent only with
    /// the original response, so a replay may then lack what is needed to
    /// read its body.
    ///
    /// A credential named here (`Set-Cookie`, `Set-Cookie2`,
    /// `Authorization`, `Proxy-Authorization`) **is** stored and replayed:
    /// an explicit opt-in, e.g. for a login endpoint whose retry must get
    /// the session cookie its lost response carried. The risk: the stored
    /// cookie is handed to whoever retries with the key and passes the
    /// [`caller`](Self::caller) scope, so keep a caller scope that
    /// identifies the client (never [`Caller::shared`] or anonymous
    /// callers on such a route), and know that the replay sends the cookie
    /// as it was set (an expiry date, a session since revoked).
    ///
    /// # Panics
    ///
    /// If a name is one that cannot be replayed (hop-by-hop headers,
    /// `Date`, `Content-Length`, `Idempotent-Replayed`) or one the layer
    /// reserves (prefix `idempotency-layer-`): a configuration error,
    /// refused rather than ignored.
    pub fn stored_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        let names: Vec<HeaderName> = names.into_iter().collect();
        for name in &names {
            assert!(
                !UNSTORABLE.contains(name),
                "stored_headers: {name} cannot be replayed (it describes one connection or \
                 one response: hop-by-hop, Date, Content-Length, Idempotent-Replayed)"
            );
            assert!(
                !name.as_str().starts_with(RESERVED_PREFIX),
                "stored_headers: {name} uses the layer's reserved prefix {RESERVED_PREFIX}"
            );
        }
        self.cfg().headers = HeaderPolicy::Only(names);
        self
    }

    /// Never stores these response headers either (on top of the
    /// hop-by-hop headers, credentials, `Date` and `Content-Length`), e.g.
    /// a per-response trace id. Replaces a
    /// [`stored_headers`](Self::stored_headers) list.
    pub fn exclude_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.cfg().headers = HeaderPolicy::AllExcept(names.into_iter().collect());
        self
    }

    /// What happens to a 4xx response of the handler (except the statuses
    /// set by [`on_status`](Self::on_status)).
    pub fn on_client_error(mut self, disposition: Disposition) -> Self {
        self.cfg().client_errors = disposition;
        self
    }

    /// What happens to responses with this exact status, over the class
    /// default (see the table above for the statuses set by default). A
    /// handler that answers one of them *after* a side effect inserts
    /// [`Disposition::Store`] into its response extensions.
    pub fn on_status(mut self, status: StatusCode, disposition: Disposition) -> Self {
        let by_status = &mut self.cfg().by_status;
        by_status.retain(|(s, _)| *s != status);
        by_status.push((status, disposition));
        self
    }

    /// What happens to a 5xx response of the handler; 503 with a
    /// `Retry-After` header is [`Disposition::Retry`] unless set by
    /// [`on_status`](Self::on_status). [`Disposition::Retry`] here runs a
    /// failed handler again on retry: only if no handler acts before it
    /// can fail.
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

    /// The `Retry-After` sent with 503 `outcome-unknown` and
    /// `outcome-not-recorded`, rounded up to whole seconds (at least 1).
    pub fn in_doubt_retry_after(mut self, after: Duration) -> Self {
        self.cfg().in_doubt_retry_after = after;
        self
    }

    /// The schema version stored in envelopes (see [`crate::Envelope`]);
    /// bump it when the handler's responses change shape, and register
    /// upcasters on the engine.
    pub fn response_schema_version(mut self, version: u32) -> Self {
        self.cfg().schema_version = version;
        self
    }

    /// Most claimed requests in flight at once, from `begin` to recorded
    /// outcome (clamped to at least 1). Keep it at or below the engine's
    /// [`queue_capacity`](crate::EngineBuilder::queue_capacity) and
    /// tokio's blocking-thread limit (512 by default). Services made before
    /// this call keep the old limit.
    pub fn max_in_flight(mut self, requests: usize) -> Self {
        self.cfg().runtime = Runtime::new(requests);
        self
    }

    /// At capacity, answer 503 `overloaded` with this `Retry-After`
    /// (rounded up to whole seconds, at least 1) instead of waiting for a
    /// permit in `poll_ready`.
    pub fn load_shed(mut self, retry_after: Duration) -> Self {
        self.cfg().shed = Some(retry_after);
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
            .field("caller", &c.caller)
            .field("custom_scope", &c.scope.is_some())
            .field("max_body_bytes", &c.max_body_bytes)
            .field("body_read_timeout", &c.body_read_timeout)
            .field("mismatch_status", &c.mismatch_status)
            .field("expired_status", &c.expired_status)
            .field("headers", &c.headers)
            .field("client_errors", &c.client_errors)
            .field("by_status", &c.by_status)
            .field("server_errors", &c.server_errors)
            .field("panics", &c.panics)
            .field("load_shed", &c.shed)
            .finish_non_exhaustive()
    }
}

impl<S> tower::Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> IdempotencyService<S> {
        IdempotencyService::new(inner, self.cfg.clone())
    }
}
