//! A [`tower::Layer`] for the `Idempotency-Key` HTTP request header
//! (cargo feature `http`).
//!
//! It implements the IETF httpapi draft
//! [draft-ietf-httpapi-idempotency-key-header](https://datatracker.ietf.org/doc/draft-ietf-httpapi-idempotency-key-header/)
//! on top of an [`Engine`](crate::Engine): the first request with a key runs
//! the handler once and its response is stored; a retry with the same key
//! and the same request gets the stored response back, marked
//! `Idempotent-Replayed: true`.
//!
//! ```
//! use std::sync::Arc;
//!
//! use axum::extract::Extension;
//! use axum::http::StatusCode;
//! use axum::routing::{get, post};
//! use axum::Router;
//! use idempotency::http::{ClaimInfo, IdempotencyLayer, Route};
//! use idempotency::Engine;
//!
//! // `Option`: the layer inserts `ClaimInfo` only into requests it claims
//! // a key for. A request it passes through (a GET here, or a POST without
//! // a key on a route whose key is optional) has none, and a plain
//! // `Extension<ClaimInfo>` would answer those with 500.
//! async fn create_payment(claim: Option<Extension<ClaimInfo>>) -> (StatusCode, String) {
//!     match claim {
//!         // Pass `reference` to the payment provider as its idempotency key.
//!         Some(Extension(claim)) => (StatusCode::CREATED, claim.reference),
//!         None => (StatusCode::CREATED, "not claimed".into()),
//!     }
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let engine = Arc::new(Engine::builder().open(dir.path().join("idem.redb"))?);
//! let layer = IdempotencyLayer::new(engine)
//!     // Every POST and PATCH needs a key, including on paths no `Route`
//!     // matches: a mistyped pattern cannot make the key optional.
//!     .require_key(true)
//!     .route(Route::new("/payments").json_pointers(["/amount", "/currency"]));
//! let app: Router = Router::new()
//!     .route("/payments", post(create_payment))
//!     .route("/health", get(|| async { "ok" }))
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
//! | first request with a key | the handler's response; its outcome is recorded (see [`IdempotencyLayer`]) |
//! | retry, same request, stored | the stored status, stored headers and body, plus `Idempotent-Replayed: true` |
//! | retry, same request, completed but its body was too large to keep | 409 [`response-not-retained`](#response-not-retained), plus `Idempotent-Replayed: true` |
//! | retry while the first still runs | 409, `Retry-After`, [`processing`](#processing) (or, on a route with [`Route::wait_for_outcome`], the outcome once it is there) |
//! | same key, different request | 409 (or 422, see [`IdempotencyLayer::mismatch_status`]), [`key-mismatch`](#key-mismatch) |
//! | earlier attempt's outcome unknown | 503, `Retry-After`, [`outcome-unknown`](#outcome-unknown), unless the engine's [`crate::Resolver`] settles it during `begin` (then a replay, or a fresh run if the work never happened, or for a key with effect steps a resumed run that skips the confirmed calls) |
//! | key expired and tombstoned | 409 (or 410, see [`IdempotencyLayer::expired_status`]), [`key-expired`](#key-expired) |
//! | missing key where required | 400, [`missing-key`](#missing-key) |
//! | malformed (or blank) key | 400, [`malformed-key`](#malformed-key) |
//! | body not JSON on a JSON route | 400, [`invalid-body`](#invalid-body); nothing is stored |
//! | body above [`IdempotencyLayer::max_body_bytes`] | 413, [`body-too-large`](#body-too-large); nothing is stored |
//! | body not fully received within [`IdempotencyLayer::body_read_timeout`] | 408, [`body-timeout`](#body-timeout); nothing is stored |
//! | the layer is at capacity and sheds load ([`IdempotencyLayer::load_shed`]) | 503, `Retry-After`, [`overloaded`](#overloaded); nothing is stored |
//!
//! Every refusal above happens *before* any claim: nothing is stored and
//! the handler does not run. Error responses of the layer itself are
//! RFC 9457 `application/problem+json` and never carry internal error text
//! (storage errors, keys): that goes to the log (`tracing`).
//!
//! The key is read as an RFC 8941 structured-field String (`"abc"`), as the
//! draft specifies (parsed with the `sfv` crate), or, for Stripe-style
//! clients, as a bare token (`abc`): printable ASCII without whitespace,
//! quotes, backslashes, commas or semicolons. It is at most 255 bytes and
//! not blank (a quoted key of only whitespace is malformed). A repeated
//! header is malformed.
//!
//! # Scope: whose key is it
//!
//! Keys are chosen by clients, so two callers can pick the same one. The
//! key is scoped (see [`crate::IdempotencyKey`]) by default to
//! `"{method} {route}"` (`route` is the pattern of the matching [`Route`],
//! or else the request path), then ` tenant={value}` when the [`tenant
//! header`](IdempotencyLayer::tenant_header) is present, then
//! ` caller={digest}` identifying the caller (see [`Caller`]): by default a
//! keyed blake3 digest of the request's `Authorization` header, never
//! stored in clear. Two callers with different credentials therefore never
//! share a record. Cookies count only by name ([`Caller::cookies`]): a
//! whole `Cookie` header changes between a request and its retry (a load
//! balancer's cookie, one set by the first response), which would make the
//! retry a new caller and run the handler twice. Requests that carry no
//! credentials are one anonymous caller, so **apps whose users are told
//! apart by a session cookie must name it** ([`Caller::cookies`]) or
//! return the user from [`Caller::from_fn`]. Sharing keys between all
//! callers is an explicit opt-in ([`Caller::shared`]);
//! [`IdempotencyLayer::scope`] replaces the whole computation. A scope
//! longer than a key's scope may be (255 bytes: a long path on a route no
//! [`Route`] matches, a long tenant value) is replaced by
//! `"{method} #{digest}"`, a digest of the whole scope, so such a request
//! is served under a scope of its own rather than refused.
//!
//! # Routes
//!
//! A [`Route`] sets a path's key requirement, body fingerprint, lease and
//! wait. A request that matches no route gets the layer's defaults, so a
//! route whose pattern never matches (a typo, or a pattern written with an
//! axum `nest` prefix while the layer sits inside the nest, which strips
//! it) silently falls back to them. Two guards: require keys at the layer
//! ([`IdempotencyLayer::require_key`]) and mark the exceptions
//! ([`Route::optional_key`]), and watch the log: while any route is
//! configured, the layer warns (`tracing`, once per path, for at most 64
//! distinct paths) about each POST or PATCH path that matched none.
//!
//! # The claim in the handler
//!
//! A claimed request reaches the handler with a [`ClaimInfo`] in its
//! extensions. Requests the layer passes through carry none: other
//! methods (a GET), and requests without a key where the key is optional.
//! Extract it as `Option<Extension<ClaimInfo>>` (axum answers a missing
//! plain `Extension<ClaimInfo>` with 500), or require keys so that every
//! POST and PATCH reaching the handler is claimed.
//!
//! The fingerprint covers the method, the path, the query string and the
//! body: canonical JSON (whole document or the route's JSON Pointers) when
//! the route is JSON, or when the content type is `application/json` or
//! `*/*+json`; the raw bytes otherwise. An empty body is an absent body,
//! whatever the content type or route. A body under 64 KiB is
//! fingerprinted on the async worker that read it; a larger one on tokio's
//! blocking pool (a large JSON body behind one of a permit per CPU).
//!
//! A claimed request also carries the claim's [`crate::Effects`] handle:
//! extract `Extension<Effects>` and reserve each external call as an
//! effect step before making it (`effects.effect_async("charge").await`),
//! then confirm or reject it with the provider's answer. When an attempt
//! dies between calls, its steps are settled by asking their providers and
//! the retry resumes: it runs the handler again, and the steps already
//! confirmed answer [`crate::EffectStep::Confirmed`] so their calls are
//! skipped (see `docs/recovery.md`).
//!
//! Engine calls on redb go through the engine's async entry points
//! ([`Engine::begin_async`](crate::Engine::begin_async),
//! [`Engine::complete_async`](crate::Engine::complete_async),
//! [`Engine::fail_async`](crate::Engine::fail_async)): writes are queued to
//! the engine's writer thread and the request's task is woken by the
//! durable reply; repeats are answered from a snapshot read on the worker.
//! No thread waits per request. On PostgreSQL (a synchronous client), and
//! while the engine is poisoned (its next write tries a reopen, which
//! blocks), they run on tokio's blocking pool instead.
//!
//! # Problem types
//!
//! Each refusal's `type` is the tag URI (RFC 4151)
//! `tag:idempotency.invalid,2026:http-problems#` followed by one of the
//! names below, e.g. `tag:idempotency.invalid,2026:http-problems#processing`.
//! It identifies the problem and is not a page to fetch (RFC 9457 section
//! 3.1.1 has clients compare it, never dereference it); its tagging
//! authority is under `.invalid` (RFC 6761), a name that never resolves.
//! The fragment is the heading here.
//!
//! Besides RFC 9457's `type`, `title`, `status` and `detail`, every body has
//! the member `retryable`: `true` when sending the same request with the
//! same key again can succeed (after `Retry-After`, if given), `false` when
//! the request or the key must change first. The `processing` and
//! `outcome-unknown` bodies carry `lease_ends_at`, an RFC 3339 UTC
//! timestamp: when the lease of the claim that holds the key ends. Until
//! then the earlier request may still be running; a retry after it finds
//! that request's outcome, or a record in doubt that the engine recovers.
//!
//! ### malformed-key
//! 400: the `Idempotency-Key` header is not one structured-field string or
//! bare token of 1 to 255 bytes, or it is blank.
//! ### missing-key
//! 400: the route requires an `Idempotency-Key` header and there is none.
//! ### invalid-scope
//! 400: the scope built from the request (e.g. a tenant header) is not a
//! valid scope.
//! ### unreadable-body
//! 400: the request body could not be read.
//! ### body-timeout
//! 408 (RFC 9110 section 15.5.9): the request body did not fully arrive
//! within [`IdempotencyLayer::body_read_timeout`]. Retryable: nothing was
//! claimed, so sending the whole request again with the same key runs it.
//! ### invalid-body
//! 400: the route expects JSON and the body is not strict JSON.
//! ### body-too-large
//! 413: the body is larger than the layer accepts.
//! ### processing
//! 409: a request with this key is still being processed; retry after
//! `Retry-After` seconds (an estimate of when it finishes, see
//! [`IdempotencyLayer`]). Retryable; carries `lease_ends_at`.
//! ### key-mismatch
//! 409 or 422: the key was used before for a different request. On a route
//! that fingerprints JSON Pointers, the member `pointers` lists the
//! pointers whose values differ from the stored request's (names only,
//! never values), when the first request's outcome is stored.
//! ### key-expired
//! 409, or 410 Gone with [`IdempotencyLayer::expired_status`]: the key's
//! record expired (its response is no longer kept) and the key may not be
//! reused before `reusable_at` (an RFC 3339 timestamp member). Only engines
//! that keep tombstones ([`crate::ExpiryPolicy::Tombstone`]) can tell an
//! expired key from a new one. Not retryable: look the operation up, or
//! use a new key.
//! ### response-not-retained
//! 409: the request with this key completed, but its response was larger
//! than the store keeps (the engine's `max_response_bytes`), so it cannot
//! be replayed. It will not run again. The member `original_status` holds
//! the original status, and a stored `Location` header is sent along: read
//! the resource instead.
//! ### outcome-unknown
//! 503: an earlier attempt with this key may have had effects that were
//! never recorded; it is being recovered. Retry after `Retry-After` seconds.
//! Carries `lease_ends_at` (the earlier attempt's lease end: before it,
//! that attempt may still be running), `reference` (the earlier attempt's
//! claim reference), `steps` (each effect step's `name` and `state`:
//! `reserved`, `confirmed`, `failed`, `unknown`, `not_executed`; never its
//! evidence) and `retry_can_help`: `true` when the engine has someone to
//! ask, so a later retry is answered (a replay, or a resumed run that skips
//! the confirmed steps); `false` when only an operator can settle it
//! (`idem resolve`). For a key without steps it is `true` when the engine
//! has a [`crate::Resolver`]. For a key with steps, when every step not yet
//! settled (`reserved` or `unknown`) has a per-step resolver for its name
//! ([`crate::EngineBuilder::step_resolver`]) or the engine has a
//! `Resolver`; the engine cannot tell whether that `Resolver` implements
//! [`crate::Resolver::resolve_step`], so it counts as covering every step
//! (register per-step resolvers if yours does not). The `detail` of a key
//! with steps says that the retry runs the request again, making only the
//! calls not already confirmed.
//! ### outcome-not-recorded
//! 503: the handler answered, but its outcome could not be recorded (the
//! store failed, e.g. the disk is full), so its answer is withheld. Retry
//! with the same key after `Retry-After` seconds: the request is never run
//! a second time; the retry is answered once the outcome is recovered.
//! ### overloaded
//! 503: the layer is at capacity; retry after `Retry-After` seconds.
//! Nothing was stored.
//! ### response-error
//! 500: the handler's response body failed while being read.
//! ### engine-error
//! 503 with `Retry-After`: the idempotency store failed (storage error,
//! engine poisoned or closed); the request was not run and a retry with the
//! same key is safe. The cause goes to the log, never into the body.
//! ### stored-record-corrupt
//! 500: the stored record for this key is damaged; the request was not
//! run. Not retryable until an operator repairs the record (`idem verify`
//! lists it).
//! ### evidence-log-full
//! 500: this key's evidence log holds [`crate::MAX_HISTORY_ENTRIES`]
//! entries (its attempts died in doubt again and again), and the engine
//! refuses every further transition of it; the request was not run. Not
//! retryable: an operator must look at the key (`idem show`) and settle or
//! purge it. No `Retry-After`.

mod admit;
mod body;
mod config;
mod flow;
mod future;
mod header;
mod layer;
mod problem;
mod replay;
mod route;
mod runtime;
mod service;
mod store;
mod unmatched;

use std::fmt;
use std::sync::Arc;

use http::header::HeaderName;
use http::request::Parts;

use crate::IdempotencyKey;

pub use body::{RequestBody, ResponseBody};
pub use future::ResponseFuture;
pub use layer::IdempotencyLayer;
pub use route::Route;
pub use service::IdempotencyService;
pub use store::CompletionMessages;

/// The request header: `Idempotency-Key`.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The header on replayed responses: `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// What to do with a claimed request's response.
///
/// Set per status ([`IdempotencyLayer::on_status`]) or class
/// ([`IdempotencyLayer::on_client_error`],
/// [`IdempotencyLayer::on_server_error`]), or for one response by a handler
/// that inserts it into the response extensions (with axum: return
/// `(StatusCode::SERVICE_UNAVAILABLE, Extension(Disposition::Retry), ..)`).
/// The handler's word wins over every default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Disposition {
    /// *Final*: store the response and replay it to every retry (as a
    /// success below 400, as a [`crate::Failure::Final`] from 400).
    Store,
    /// *Retryable*: store nothing and release the key; the next request
    /// with it runs the handler again ([`crate::Failure::Retryable`]). Only
    /// correct if nothing happened.
    Retry,
    /// *In doubt*: the work may have happened (e.g. a provider call timed
    /// out, or the handler failed after acting): the record becomes UNKNOWN,
    /// is never re-executed, and retries get 503 until a
    /// [`crate::Resolver`] settles it.
    InDoubt,
}

/// Who a request comes from, for scoping keys (see the [module
/// docs](self#scope-whose-key-is-it)).
///
/// Identities are hashed (keyed blake3, 128 bits, hex) before they enter
/// the scope, so credentials never reach the database or the logs.
///
/// The default is the `Authorization` header alone. A retry must be the
/// same caller as its first request, or it runs again: so only what
/// identifies the caller may count, never what changes between a request
/// and its retry. A whole `Cookie` header is such a thing (a load balancer
/// or an analytics script adds a cookie, the first response sets one), so
/// cookies count only by name ([`Caller::cookies`]).
///
/// **Cookie-session apps must say which cookie holds the session**
/// ([`Caller::cookies`], or [`Caller::from_fn`] returning the session's
/// user): under the default, their requests carry no `Authorization`, are
/// all the one anonymous caller, and share keys. The layer logs a warning
/// (once per process) when a request carries cookies but none of the
/// caller's credentials.
///
/// Changing the caller changes scopes. Before this default, the whole
/// `Cookie` header counted too: a request that carried cookies and was
/// first sent before an upgrade is a new request when retried after it.
///
/// ## How this maps to Stripe
///
/// Stripe scopes idempotency keys per account: the same key sent by two
/// accounts names two requests. [`Caller::headers`] with `Authorization`
/// (the default) does this for bearer-token APIs when each account has one
/// credential; if an account can hold several (rotated keys, several
/// users), use [`Caller::from_fn`] to return the *account* id, so that a
/// retry with a rotated credential still finds its record.
#[derive(Clone)]
pub struct Caller(CallerKind);

#[derive(Clone)]
pub(crate) enum CallerKind {
    /// The values of these headers and of these cookies (by name).
    Credentials {
        headers: Vec<HeaderName>,
        cookies: Vec<String>,
    },
    Custom(Arc<CallerFn>),
    Shared,
}

type CallerFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

impl Caller {
    /// The values of these request headers identify the caller (all of the
    /// present ones, in this order). A request with none of them is the
    /// anonymous caller. The default is `Authorization` alone.
    ///
    /// The whole header value counts. Naming `Cookie` here makes the whole
    /// cookie jar the identity: a retry whose jar gained or changed a cookie
    /// (one set by the first response, or by a load balancer) is then a
    /// different caller and runs again; name the session cookie with
    /// [`Caller::cookies`] instead.
    pub fn headers(names: impl IntoIterator<Item = HeaderName>) -> Caller {
        Caller::headers_and_cookies(names, Vec::<String>::new())
    }

    /// The values of these cookies (from the request's `Cookie` headers,
    /// RFC 6265 section 5.4: `name=value` pairs separated by `;`, names
    /// compared exactly) identify the caller; other cookies do not count.
    /// A request with none of them is the anonymous caller.
    pub fn cookies<N: Into<String>>(names: impl IntoIterator<Item = N>) -> Caller {
        Caller::headers_and_cookies(Vec::new(), names)
    }

    /// Both: these headers' values (as [`Caller::headers`]) and these
    /// cookies' values (as [`Caller::cookies`]), e.g. `Authorization` for
    /// API clients and the `session` cookie for browsers.
    pub fn headers_and_cookies<N: Into<String>>(
        headers: impl IntoIterator<Item = HeaderName>,
        cookies: impl IntoIterator<Item = N>,
    ) -> Caller {
        Caller(CallerKind::Credentials {
            headers: headers.into_iter().collect(),
            cookies: cookies.into_iter().map(Into::into).collect(),
        })
    }

    /// The app's own identity, from the request head (e.g. the account id
    /// an authentication layer put into the extensions). `None` is the
    /// anonymous caller.
    pub fn from_fn(f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Caller {
        Caller(CallerKind::Custom(Arc::new(f)))
    }

    /// Every caller shares every key: the scope has no caller part. Only
    /// for APIs with a single client, or whose keys are unguessable *and*
    /// whose responses hold nothing private.
    pub fn shared() -> Caller {
        Caller(CallerKind::Shared)
    }
}

impl Default for Caller {
    fn default() -> Caller {
        Caller::headers([http::header::AUTHORIZATION])
    }
}

impl fmt::Debug for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            CallerKind::Credentials { headers, cookies } => f
                .debug_struct("Caller::headers_and_cookies")
                .field("headers", headers)
                .field("cookies", cookies)
                .finish(),
            CallerKind::Custom(_) => f.write_str("Caller::from_fn(..)"),
            CallerKind::Shared => f.write_str("Caller::shared()"),
        }
    }
}

/// The claim a request runs under, inserted into the request extensions
/// before the handler is called (beside the claim's [`crate::Effects`]).
///
/// Only claimed requests carry it. Requests the layer passes through have
/// none: a method the layer does not apply to (GET, by default), or a
/// request without an `Idempotency-Key` on a route where the key is
/// optional (the layer's default). With axum, extract
/// `Option<Extension<ClaimInfo>>`: a plain `Extension<ClaimInfo>` answers
/// such requests 500. It is always there when the handler's route requires
/// a key ([`Route::require_key`], [`IdempotencyLayer::require_key`]) and
/// the method is one the layer applies to. See the [module
/// docs](self#the-claim-in-the-handler).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimInfo {
    /// The scoped key.
    pub key: IdempotencyKey,
    /// The claim's provider reference ([`crate::Claim::reference`]): pass it
    /// to a payment provider as its idempotency key, so a resolver can later
    /// ask the provider about it.
    pub reference: String,
    /// The claim's fencing token ([`crate::Claim::fencing_token`]).
    pub fencing_token: u64,
}
