//! The payments API: axum behind the idempotency layer, the engine on a
//! redb file or a PostgreSQL database, two simulated providers with a
//! ledger file each (the card provider, then the receipt provider), and a
//! resolver that asks them what happened to an UNKNOWN payment's calls.
//!
//! A payment makes two external calls, each an effect step of its claim:
//! `effect("charge")` durably reserves the step and hands out its
//! reference, the card provider is called with that reference as its
//! idempotency key, and `confirm("charge", charge)` records the answer;
//! then the same for `"receipt"`. A retry after a crash resumes: a step
//! confirmed before the crash is skipped (its evidence is the provider's
//! answer), and only the calls that did not happen are made.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use idempotency::http::{ClaimInfo, CompletionMessages, Disposition, IdempotencyLayer, Route};
use idempotency::{
    EffectStep, Effects, Engine, EngineBuilder, Envelope, ExpiryPolicy, InDoubt, InDoubtStep,
    Resolution, Resolver, StepInfo, StepResolution,
};
use serde::Deserialize;
use tracing_subscriber::filter::LevelFilter;

use crate::event::PaymentSucceeded;
use crate::provider::{Charge, ChargeError, Fault, Provider};
use crate::receipts::{receipts_path, Receipt, Receipts};
use crate::store::Store;

/// The payment's first effect step: the card charge.
pub const CHARGE_STEP: &str = "charge";

/// The payment's second effect step: the receipt sent to the customer.
pub const RECEIPT_STEP: &str = "receipt";

/// Response header naming what each step did in this run, e.g.
/// `charge=confirmed-earlier, receipt=sent`: `made` (called now),
/// `confirmed-earlier` (an earlier attempt's call, skipped now).
pub const STEPS_HEADER: &str = "x-payment-steps";

/// What `serve --crash-between-steps` prints on stdout once a payment's
/// charge is confirmed and before its receipt is sent; the server then
/// holds the request until it is killed (the demo sends SIGKILL).
pub const BETWEEN_STEPS_LINE: &str = "between steps: charge confirmed, receipt not sent";

/// Request header for the demo's fault injection: `provider-timeout` makes
/// the provider charge and then time out; `slow` charges, then holds the
/// answer for [`SLOW`] (a request in flight, for the conformance kit).
pub const FAULT_HEADER: &str = "x-simulate-fault";

/// What `serve` answers a key reused with a different request, unless
/// `--mismatch-status` says otherwise: 422, the IETF draft's status.
pub const DEFAULT_MISMATCH_STATUS: StatusCode = StatusCode::UNPROCESSABLE_ENTITY;

/// Request header for the conformance kit (conformance/README.md): a status
/// from 400 to 599 that the payment answers at once, before charging (a 503
/// with `Retry-After: 1`). Not fingerprinted, so a retry without it is the
/// same request.
pub const STATUS_HEADER: &str = "x-simulate-status";

/// How long `x-simulate-fault: slow` holds a charged payment's answer.
pub const SLOW: Duration = Duration::from_secs(1);

/// How `serve` runs.
pub struct ServeOptions {
    /// Where to listen.
    pub addr: SocketAddr,
    /// Where the engine keeps its records.
    pub store: Store,
    /// The provider's ledger file.
    pub ledger: PathBuf,
    /// The claim lease: how long a payment may take before a retry treats
    /// it as UNKNOWN. It must outlast the provider call (here ~0.3 s).
    pub lease: Duration,
    /// How long a completed payment is replayed.
    pub ttl: Duration,
    /// What a key gets after its TTL: a tombstone (never a second charge)
    /// or nothing (a very late retry is a new payment).
    pub expiry: ExpiryPolicy,
    /// A connection that has not sent a whole request head within this
    /// time is closed, so slow clients cannot hold connections open.
    pub header_read_timeout: Duration,
    /// The status for a key reused with a different request (the layer's
    /// `mismatch_status`): 422, 409 or 400.
    pub mismatch_status: StatusCode,
    /// Abort the process right after the provider charged, before the
    /// outcome is recorded (fault injection for the demo).
    pub crash_after_charge: bool,
    /// Once a payment's charge is confirmed, print [`BETWEEN_STEPS_LINE`]
    /// and hold the request (before the receipt is sent) until the process
    /// is killed (fault injection for the demo's SIGKILL between the two
    /// calls).
    pub pause_between_steps: bool,
    /// Shut down when standard input closes (how the demo stops its child
    /// servers gracefully).
    pub exit_on_stdin_eof: bool,
    /// A NATS server URL: relay the outbox (each payment's
    /// `payment.succeeded` event) to its JetStream stream `PAYMENTS`
    /// (needs the `nats` feature; `main` refuses it otherwise).
    pub nats: Option<String>,
}

/// The provider's ledger file for an engine file: `payments.redb` →
/// `payments.provider.jsonl` (the receipt provider's is beside it,
/// `payments.receipts.jsonl`, see [`receipts_path`]).
pub fn provider_path(db: &Path) -> PathBuf {
    db.with_extension("provider.jsonl")
}

/// The two simulated providers a payment calls.
#[derive(Clone)]
pub struct Providers {
    /// The card provider: charges.
    pub cards: Arc<Provider>,
    /// The receipt provider: sends the receipt after the charge.
    pub receipts: Arc<Receipts>,
}

impl Providers {
    /// Opens the card provider's ledger at `ledger` and the receipt
    /// provider's beside it ([`receipts_path`]).
    ///
    /// # Errors
    /// Either ledger cannot be opened (I/O, a corrupt line).
    pub fn open(ledger: &Path) -> std::io::Result<Providers> {
        Ok(Providers {
            cards: Arc::new(Provider::open(ledger)?),
            receipts: Arc::new(Receipts::open(&receipts_path(ledger))?),
        })
    }
}

/// The faults `serve` injects on purpose (the demo's crash phases).
#[derive(Clone, Copy, Debug, Default)]
pub struct Faults {
    /// Abort right after the provider charged, before the charge step is
    /// confirmed.
    pub crash_after_charge: bool,
    /// Hold each payment between its two calls (charge confirmed, receipt
    /// not sent) after printing [`BETWEEN_STEPS_LINE`].
    pub pause_between_steps: bool,
}

#[derive(Clone)]
struct AppState {
    providers: Providers,
    faults: Faults,
}

/// A payment request. The fingerprint covers `amount`, `currency` and
/// `customer`; `description` may change between retries.
#[derive(Debug, Deserialize)]
struct CreatePayment {
    amount: u64,
    currency: String,
    customer: String,
    #[allow(dead_code)]
    #[serde(default)]
    description: Option<String>,
}

/// Runs the API until Ctrl-C (or standard input closes, if asked).
///
/// A start that fails (address in use, unusable database path, unreachable
/// PostgreSQL) leaves no new files behind: the address is bound first, and
/// a redb or ledger file this call created is removed again if the engine
/// or the ledger cannot be opened.
pub async fn serve(opts: ServeOptions) -> Result<(), Box<dyn std::error::Error>> {
    // Warnings and errors from the engine and the layer (a full disk, a
    // poisoned engine, a stale claim) reach the operator on stderr.
    init_logging(LevelFilter::WARN);
    let listener = tokio::net::TcpListener::bind(opts.addr)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", opts.addr))?;
    let receipts = receipts_path(&opts.ledger);
    let (providers, engine) = {
        let mut files = vec![opts.ledger.as_path(), receipts.as_path()];
        files.extend(opts.store.redb_path());
        let cleanup = RemoveOnFailure::new(&files);
        let providers = Providers::open(&opts.ledger)
            .map_err(|e| format!("cannot open the providers' ledgers: {e}"))?;
        let builder = with_resolver(
            Engine::builder()
                .lease(opts.lease)
                .ttl(opts.ttl)
                .expiry_policy(opts.expiry),
            providers.clone(),
        );
        // Engine calls block the calling thread; on PostgreSQL, opening
        // (and closing) one on a runtime thread even panics, because the
        // synchronous client runs a runtime of its own. So both happen on
        // the blocking pool.
        let store = opts.store.clone();
        let engine = tokio::task::spawn_blocking(move || store.open(builder))
            .await
            .map_err(|e| format!("opening the engine failed: {e}"))?
            .map_err(|e| -> Box<dyn std::error::Error> { e })?;
        cleanup.disarm();
        (providers, Arc::new(engine))
    };

    #[cfg(feature = "nats")]
    let relay = match &opts.nats {
        Some(url) => Some(
            crate::broker::RelayTask::start(engine.clone(), url)
                .await
                .map_err(|e| format!("the outbox relay cannot start: {e}"))?,
        ),
        None => None,
    };
    #[cfg(not(feature = "nats"))]
    if let Some(url) = &opts.nats {
        return Err(format!("--nats {url}: {}", crate::store::NEEDS_NATS).into());
    }

    let faults = Faults {
        crash_after_charge: opts.crash_after_charge,
        pause_between_steps: opts.pause_between_steps,
    };
    let app = app(
        engine.clone(),
        providers.clone(),
        faults,
        opts.mismatch_status,
    );

    eprintln!(
        "engine {}, provider ledger {}, receipt ledger {}, lease {} ms, ttl {} s, expiry {:?}{}{}{}",
        opts.store,
        providers.cards.path().display(),
        providers.receipts.path().display(),
        opts.lease.as_millis(),
        opts.ttl.as_secs(),
        opts.expiry,
        if opts.crash_after_charge {
            ", will abort after the first charge"
        } else {
            ""
        },
        if opts.pause_between_steps {
            ", will hold each payment between its charge and its receipt"
        } else {
            ""
        },
        match &opts.nats {
            Some(url) => format!(", outbox relayed to NATS JetStream at {url}"),
            None => String::new(),
        }
    );
    // The demo reads this line to learn the port (and waits for the line
    // above on stderr, so it is printed before the demo goes on).
    println!("listening on http://{}", listener.local_addr()?);
    let exit_on_eof = opts.exit_on_stdin_eof;
    // A poisoned engine (redb: a full disk, an I/O error; PostgreSQL never
    // poisons) refuses writes and keeps serving replays; it reopens the
    // database by itself once storage works again, and asking `poisoned()`
    // is one of the moments it checks. Tell the operator when writes stop
    // and when they are back.
    let watched = engine.clone();
    let watcher = tokio::spawn(async move {
        let mut was_poisoned = false;
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            match watched.poisoned() {
                Some(cause) if !was_poisoned => {
                    eprintln!("payments: writes refused until storage works again: {cause}");
                    was_poisoned = true;
                }
                None if was_poisoned => {
                    eprintln!("payments: storage works again; the database was reopened");
                    was_poisoned = false;
                }
                _ => {}
            }
        }
    });
    let shutdown = async move {
        if exit_on_eof {
            stdin_closed().await;
        } else {
            // Ctrl-C or SIGTERM (`kill`, a service manager) both stop the
            // server cleanly, so the file needs no recovery afterwards and
            // the read-only `idem` commands can open it.
            let terminate = async {
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(mut term) => {
                        term.recv().await;
                    }
                    Err(_) => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                () = terminate => {}
            }
        }
    };
    serve_http1(listener, app, opts.header_read_timeout, shutdown).await;
    // Dropping the last engine handle commits what is queued and closes the
    // file or the PostgreSQL connections, off the runtime's threads (see
    // the open above). Every connection task has finished; with the
    // watcher stopped too, this is the last handle.
    watcher.abort();
    let _ = watcher.await;
    // A last relay pass: a server stopped cleanly leaves no event behind
    // (one killed leaves them to the next server's relay).
    #[cfg(feature = "nats")]
    if let Some(relay) = relay {
        if let Err(e) = relay.stop().await {
            eprintln!("payments: the outbox relay's last pass failed: {e}");
        }
    }
    let _ = tokio::task::spawn_blocking(move || drop(engine)).await;
    Ok(())
}

/// Sends the engine's and the layer's `tracing` events to stderr, at the
/// level `RUST_LOG` names (`off`, `error`, `warn`, `info`, `debug`,
/// `trace`), else at `default`. A `RUST_LOG` that is not one of those
/// (a per-module filter) is reported and `default` is used.
pub fn init_logging(default: LevelFilter) {
    let level = match std::env::var("RUST_LOG") {
        Err(_) => default,
        Ok(value) => value.trim().parse().unwrap_or_else(|_| {
            eprintln!(
                "payments: RUST_LOG={value:?} is not a level (off, error, warn, info, debug, \
                 trace); logging at {default}"
            );
            default
        }),
    };
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(level)
        .try_init();
}

/// The engine settings of `builder`, plus the resolver that asks the
/// providers what happened to an UNKNOWN payment's calls.
pub fn with_resolver(builder: EngineBuilder, providers: Providers) -> EngineBuilder {
    builder.resolver(PaymentResolver { providers })
}

/// The API: `POST /payments` behind the idempotency layer (a key required
/// on every POST and PATCH, so that a route pattern that does not match
/// cannot make it optional; amount, currency and customer fingerprinted;
/// the tenant from `X-Merchant-Id`; a reused key with a different request
/// answered `mismatch_status`), `GET /payments/{id}` and
/// `GET /charges?key=KEY` (the charges made for a client's key: the
/// conformance kit's execution count), charging through `provider`.
/// `faults` injects the demo's crashes.
pub fn app(
    engine: Arc<Engine>,
    providers: Providers,
    faults: Faults,
    mismatch_status: StatusCode,
) -> Router {
    let layer = IdempotencyLayer::new(engine)
        .require_key(true)
        .route(Route::new("/payments").json_pointers(["/amount", "/currency", "/customer"]))
        .tenant_header(header::HeaderName::from_static("x-merchant-id"))
        .mismatch_status(mismatch_status)
        .max_body_bytes(16 * 1024)
        // Every POST carries a key (`require_key`), so the layer reads
        // every body: a client that sends half of one gets 408 after 10 s
        // instead of holding its slot and connection (the head of a
        // request is bounded by `--header-read-timeout`).
        .body_read_timeout(Duration::from_secs(10));
    let state = AppState { providers, faults };
    Router::new()
        .route("/payments", post(create_payment))
        .route("/payments/{id}", get(get_payment))
        .route("/charges", get(charges_for_key))
        .layer(layer)
        .with_state(state)
}

/// The API served inside this process, on a loopback port (the demo's
/// phases that need to hold the engine: its clock, its disk).
pub struct InProcess {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl InProcess {
    /// Serves [`app`] on an ephemeral loopback port until [`Self::stop`].
    ///
    /// # Errors
    ///
    /// When no loopback port can be bound.
    pub async fn start(engine: Arc<Engine>, providers: Providers) -> std::io::Result<InProcess> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let base = format!("http://{}", listener.local_addr()?);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            let _ = stopped.await;
        };
        let app = app(
            engine,
            providers,
            Faults::default(),
            DEFAULT_MISMATCH_STATUS,
        );
        let task = tokio::spawn(serve_http1(
            listener,
            app,
            Duration::from_secs(10),
            shutdown,
        ));
        Ok(InProcess { base, stop, task })
    }

    /// Stops accepting, lets in-flight requests finish, and waits for the
    /// connections to close (so the engine's handles in the API are gone).
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

/// Serves HTTP/1.1 connections until `shutdown` resolves, then lets
/// in-flight requests finish. By hand rather than with `axum::serve`,
/// which has no header-read timeout: hyper enforces one only when it is
/// given a timer.
async fn serve_http1(
    listener: tokio::net::TcpListener,
    app: Router,
    header_read_timeout: Duration,
    shutdown: impl std::future::Future<Output = ()>,
) {
    // Each connection task holds a receiver; a send asks them to finish
    // their request and close, and `closed()` waits until they all have.
    let (close, close_rx) = tokio::sync::watch::channel(());
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _peer)) => stream,
                    Err(e) => {
                        // Out of file descriptors and the like: back off
                        // instead of spinning.
                        eprintln!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let conn = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(header_read_timeout)
                    .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
                let mut close_rx = close_rx.clone();
                tokio::spawn(async move {
                    let mut conn = std::pin::pin!(conn);
                    // Errors are clients that hung up or were too slow:
                    // nothing to do.
                    tokio::select! {
                        _ = conn.as_mut() => return,
                        _ = close_rx.changed() => {}
                    }
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    drop(close_rx);
    let _ = close.send(());
    close.closed().await;
}

/// Removes the files among `paths` that did not exist when it was made,
/// unless disarmed: a failed start must not leave a half-made database.
struct RemoveOnFailure {
    created: Vec<PathBuf>,
}

impl RemoveOnFailure {
    fn new(paths: &[&Path]) -> RemoveOnFailure {
        RemoveOnFailure {
            created: paths
                .iter()
                .filter(|p| !p.exists())
                .map(|p| p.to_path_buf())
                .collect(),
        }
    }

    fn disarm(mut self) {
        self.created.clear();
    }
}

impl Drop for RemoveOnFailure {
    fn drop(&mut self) {
        for path in &self.created {
            if path.is_file() {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

/// Resolves when standard input reaches end of file.
async fn stdin_closed() {
    let _ = tokio::task::spawn_blocking(|| {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
    })
    .await;
}

/// The resolver: each call is settled by asking its own provider by the
/// step's reference, never by calling again.
struct PaymentResolver {
    providers: Providers,
}

impl Resolver for PaymentResolver {
    /// A key without effect steps never reserved a call (a step is durable
    /// before its call is made), unless it was charged by a server older
    /// than steps, which charged by the claim's reference: asked by that.
    /// Charged → the response the handler would have sent; unknown to the
    /// provider → never happened, a retry may run it afresh; the provider
    /// cannot tell (its ledger is broken) → still unknown, never "not
    /// executed".
    fn resolve(&self, pending: &InDoubt) -> Resolution {
        match self.providers.cards.status(&pending.reference) {
            Ok(Some(charge)) => Resolution::Completed(payment_envelope(&charge)),
            Ok(None) => Resolution::NotExecuted,
            Err(e) => {
                eprintln!("resolver: {}: {e}", pending.reference);
                Resolution::StillInDoubt
            }
        }
    }

    /// A step whose call may have happened: its provider's ledger has the
    /// answer under the step's reference (the evidence is that entry, as
    /// the handler would have confirmed it), or has nothing (not executed:
    /// the next attempt calls under the same reference), or cannot tell.
    fn resolve_step(&self, step: &InDoubtStep) -> StepResolution {
        let found = match step.name.as_str() {
            CHARGE_STEP => self
                .providers
                .cards
                .status(&step.reference)
                .map(|c| c.map(|c| charge_evidence(&c))),
            RECEIPT_STEP => self
                .providers
                .receipts
                .status(&step.reference)
                .map(|r| r.map(|r| receipt_evidence(&r))),
            other => {
                eprintln!("resolver: no provider for step {other:?}");
                return StepResolution::StillUnknown;
            }
        };
        match found {
            Ok(Some(evidence)) => StepResolution::Executed(evidence),
            Ok(None) => StepResolution::NotExecuted,
            Err(e) => {
                eprintln!("resolver: {} step {}: {e}", step.key, step.reference);
                StepResolution::StillUnknown
            }
        }
    }

    /// Never completes from the steps alone, even when both calls
    /// happened: the completion must carry the payment's
    /// `payment.succeeded` event (the handler hands it to the layer), and
    /// a completion written here would have none. So the next attempt
    /// resumes: it skips the confirmed calls and completes with the event.
    fn complete_from_steps(&self, _in_doubt: &InDoubt, _steps: &[StepInfo]) -> Option<Envelope> {
        None
    }
}

/// The charge step's evidence: the provider's charge as JSON (about 200
/// bytes, well under the engine's evidence bound).
fn charge_evidence(charge: &Charge) -> Vec<u8> {
    serde_json::to_vec(charge).unwrap_or_default()
}

/// The receipt step's evidence: the provider's receipt as JSON.
fn receipt_evidence(receipt: &Receipt) -> Vec<u8> {
    serde_json::to_vec(receipt).unwrap_or_default()
}

/// The JSON body of a payment.
fn payment_json(charge: &Charge) -> serde_json::Value {
    serde_json::json!({
        "id": charge.id,
        "status": "succeeded",
        "amount": charge.amount,
        "currency": charge.currency,
        "reference": charge.reference,
    })
}

/// The 201 response for a charge, as the layer stores it (status, the
/// stored headers, body): the resolver builds the same.
fn payment_envelope(charge: &Charge) -> Envelope {
    Envelope::new(1, 201, payment_json(charge).to_string())
        .with_header("content-type", "application/json")
        .with_header("location", format!("/payments/{}", charge.id))
}

/// A failure after which the charge may or may not have happened: the
/// layer marks the key UNKNOWN (never re-executed; a retry asks the
/// resolver). The body carries no internals.
fn outcome_in_doubt(status: StatusCode, title: &str) -> Response {
    let mut response = problem(
        status,
        title,
        "the payment's outcome is being checked with the provider; retry later with the same \
         Idempotency-Key",
    );
    response.extensions_mut().insert(Disposition::InDoubt);
    response
}

fn problem(status: StatusCode, title: &str, detail: &str) -> Response {
    problem_with_type(status, "about:blank", title, detail)
}

/// The demo's own problem types: `tag:payments-demo.invalid,2026:problems#NAME`
/// (a tag URI, never fetched, as the layer's are).
fn problem_of_type(status: StatusCode, name: &str, title: &str, detail: &str) -> Response {
    let type_uri = format!("tag:payments-demo.invalid,2026:problems#{name}");
    problem_with_type(status, &type_uri, title, detail)
}

fn problem_with_type(status: StatusCode, type_uri: &str, title: &str, detail: &str) -> Response {
    let body = serde_json::json!({
        "type": type_uri,
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

async fn create_payment(
    State(app): State<AppState>,
    // Always there: the layer requires a key on every POST, so each one
    // that reaches this handler is claimed, and the layer puts the claim's
    // `Effects` beside its `ClaimInfo`. `Option` all the same, so that a
    // change to the layer's settings is a 500 problem, not axum's 500.
    claim: Option<Extension<ClaimInfo>>,
    effects: Option<Extension<Effects>>,
    headers: HeaderMap,
    Json(req): Json<CreatePayment>,
) -> Response {
    let (Some(Extension(claim)), Some(Extension(effects))) = (claim, effects) else {
        eprintln!("payments: a POST /payments reached the handler without a claim");
        return problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "Not claimed",
            "the payment was not run: the idempotency layer did not claim this request",
        );
    };
    if let Some(value) = headers.get(STATUS_HEADER) {
        return simulated_status(value);
    }
    if req.amount == 0 || req.currency.len() != 3 || req.customer.is_empty() {
        return problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid payment",
            "amount must be positive, currency a 3-letter code, customer non-empty",
        );
    }
    let (fault, slow) = match headers.get(FAULT_HEADER).map(HeaderValue::as_bytes) {
        Some(b"provider-timeout") => (Fault::TimeoutAfterCharge, false),
        Some(b"slow") => (Fault::None, true),
        _ => (Fault::None, false),
    };
    let client_key = claim.key.key().to_owned();

    // Step 1, the charge: reserved durably before the call, made with the
    // step's reference as the provider's idempotency key, confirmed with
    // the provider's answer. An earlier attempt's confirmed charge is
    // skipped.
    let (charge, charge_done) = match effects.effect_async(CHARGE_STEP).await {
        Ok(EffectStep::Run { reference }) => {
            let cards = app.providers.cards.clone();
            let (amount, currency, key) = (req.amount, req.currency.clone(), client_key.clone());
            // The provider call blocks (latency, fsync): keep it off the
            // runtime's worker threads.
            let charged = tokio::task::spawn_blocking(move || {
                cards.charge(&reference, amount, &currency, &key, fault)
            })
            .await;
            match charged {
                Ok(Ok(charge)) => {
                    if app.faults.crash_after_charge {
                        // Charged at the provider, step not confirmed:
                        // exactly the window the step resolver exists for.
                        eprintln!("fault injection: aborting after charge {}", charge.id);
                        std::process::abort();
                    }
                    if let Err(e) = effects
                        .confirm_async(CHARGE_STEP, &charge_evidence(&charge))
                        .await
                    {
                        eprintln!("payments: charge {} made, not confirmed: {e}", charge.id);
                        return not_recorded();
                    }
                    (charge, "made")
                }
                Ok(Err(ChargeError::Declined)) => {
                    // The provider said no: nothing was charged, and the
                    // step records that answer.
                    if let Err(e) = effects.reject_async(CHARGE_STEP, b"declined").await {
                        eprintln!("payments: a declined charge not recorded: {e}");
                        return not_recorded();
                    }
                    return declined();
                }
                Ok(Err(ChargeError::Timeout)) => {
                    // The provider may have charged: never retry blindly.
                    // The layer marks the key UNKNOWN (the charge step with
                    // it); a retry asks the resolver about the step.
                    let mut response = outcome_in_doubt(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "Payment provider timed out",
                    );
                    response
                        .headers_mut()
                        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                    return response;
                }
                Ok(Err(ChargeError::Io(e))) => {
                    // The ledger write failed: the charge may or may not be
                    // durable. The cause (paths, OS errors) goes to the
                    // log, not to clients.
                    eprintln!("payments: the provider's ledger write failed: {e}");
                    return outcome_in_doubt(StatusCode::BAD_GATEWAY, "Payment provider failed");
                }
                Err(join) => {
                    eprintln!("payments: the charge task failed: {join}");
                    return outcome_in_doubt(StatusCode::INTERNAL_SERVER_ERROR, "Payment failed");
                }
            }
        }
        Ok(EffectStep::Confirmed { evidence, .. }) => {
            match serde_json::from_slice::<Charge>(&evidence) {
                Ok(charge) => (charge, "confirmed-earlier"),
                Err(e) => {
                    eprintln!("payments: a confirmed charge's evidence does not parse: {e}");
                    return outcome_in_doubt(StatusCode::INTERNAL_SERVER_ERROR, "Payment failed");
                }
            }
        }
        Ok(EffectStep::Failed { .. }) => return declined(),
        Err(e) => {
            // Nothing was called in this attempt (the reservation is
            // written before the call), but an earlier attempt may have
            // acted: in doubt, so the key is settled, never re-run blindly.
            eprintln!("payments: the charge step could not be reserved: {e}");
            return step_not_recorded();
        }
    };

    if app.faults.pause_between_steps && charge_done == "made" {
        // The demo kills the process here (SIGKILL): the charge is
        // confirmed, the receipt not sent.
        println!("{BETWEEN_STEPS_LINE}: {}", charge.id);
        std::future::pending::<()>().await;
    }

    // Step 2, the receipt: the same, with the receipt provider.
    let receipt_done = match effects.effect_async(RECEIPT_STEP).await {
        Ok(EffectStep::Run { reference }) => {
            let receipts = app.providers.receipts.clone();
            let (charge_id, customer, key) =
                (charge.id.clone(), req.customer.clone(), client_key.clone());
            let sent = tokio::task::spawn_blocking(move || {
                receipts.send(&reference, &charge_id, &customer, &key)
            })
            .await;
            match sent {
                Ok(Ok(receipt)) => {
                    if let Err(e) = effects
                        .confirm_async(RECEIPT_STEP, &receipt_evidence(&receipt))
                        .await
                    {
                        eprintln!("payments: receipt {} sent, not confirmed: {e}", receipt.id);
                        return not_recorded();
                    }
                    "sent"
                }
                Ok(Err(e)) => {
                    eprintln!("payments: the receipt provider's ledger write failed: {e}");
                    return outcome_in_doubt(StatusCode::BAD_GATEWAY, "Receipt provider failed");
                }
                Err(join) => {
                    eprintln!("payments: the receipt task failed: {join}");
                    return outcome_in_doubt(StatusCode::INTERNAL_SERVER_ERROR, "Payment failed");
                }
            }
        }
        Ok(EffectStep::Confirmed { .. }) => "confirmed-earlier",
        Ok(EffectStep::Failed { .. }) => {
            // This handler never rejects a receipt step.
            eprintln!("payments: a receipt step recorded as failed");
            return outcome_in_doubt(StatusCode::INTERNAL_SERVER_ERROR, "Payment failed");
        }
        Err(e) => {
            eprintln!("payments: the receipt step could not be reserved: {e}");
            return step_not_recorded();
        }
    };

    if slow {
        // Charged and receipted, outcome not yet recorded: the key is in
        // flight.
        tokio::time::sleep(SLOW).await;
    }
    let envelope = payment_envelope(&charge);
    // The event goes into the outbox in the same write as the completion.
    let event = CompletionMessages(vec![PaymentSucceeded::of(&charge).message()]);
    let mut response = (StatusCode::CREATED, Extension(event), envelope.body).into_response();
    for (name, value) in envelope.headers {
        if let (Ok(name), Ok(value)) = (
            header::HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) {
            response.headers_mut().insert(name, value);
        }
    }
    if let Ok(steps) = HeaderValue::from_str(&format!(
        "{CHARGE_STEP}={charge_done}, {RECEIPT_STEP}={receipt_done}"
    )) {
        response
            .headers_mut()
            .insert(header::HeaderName::from_static(STEPS_HEADER), steps);
    }
    response
}

fn declined() -> Response {
    problem(
        StatusCode::PAYMENT_REQUIRED,
        "Card declined",
        "the provider declined the charge",
    )
}

/// A provider answered but its step could not be recorded (storage
/// failing): in doubt, so a retry settles the step with the provider
/// instead of calling it again.
fn not_recorded() -> Response {
    let mut response = problem_of_type(
        StatusCode::SERVICE_UNAVAILABLE,
        "call-not-recorded",
        "Call not recorded",
        "the payment's outcome is being checked with the provider; retry later with the same \
         Idempotency-Key",
    );
    response.extensions_mut().insert(Disposition::InDoubt);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// A step could not be reserved (storage failing): its call was not made.
/// In doubt all the same, since an earlier step may have acted; a retry
/// settles the key (a key with no call made is released) and resumes.
fn step_not_recorded() -> Response {
    let mut response = problem_of_type(
        StatusCode::SERVICE_UNAVAILABLE,
        "step-not-recorded",
        "Step not recorded",
        "the payment's next call could not be recorded, so it was not made; retry later with \
         the same Idempotency-Key",
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response.extensions_mut().insert(Disposition::InDoubt);
    response
}

/// The answer `x-simulate-status: NNN` asks for (see [`STATUS_HEADER`]).
fn simulated_status(value: &HeaderValue) -> Response {
    let status = value
        .to_str()
        .ok()
        .and_then(|s| s.parse::<u16>().ok())
        .filter(|n| (400..=599).contains(n))
        .and_then(|n| StatusCode::from_u16(n).ok());
    let Some(status) = status else {
        return problem(
            StatusCode::BAD_REQUEST,
            "Invalid x-simulate-status",
            "x-simulate-status must be a status from 400 to 599",
        );
    };
    let mut response = problem(
        status,
        "Simulated failure",
        "x-simulate-status asked for this status; nothing was charged",
    );
    if status == StatusCode::SERVICE_UNAVAILABLE {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response
}

#[derive(Deserialize)]
struct ChargesQuery {
    key: String,
}

/// `GET /charges?key=KEY`: `{"key": KEY, "count": N, "ids": [...]}`, the
/// charges made under the client's `Idempotency-Key` KEY.
async fn charges_for_key(State(app): State<AppState>, Query(q): Query<ChargesQuery>) -> Response {
    let ids: Vec<String> = app
        .providers
        .cards
        .by_client_key(&q.key)
        .into_iter()
        .map(|c| c.id)
        .collect();
    Json(serde_json::json!({ "key": q.key, "count": ids.len(), "ids": ids })).into_response()
}

async fn get_payment(State(app): State<AppState>, UrlPath(id): UrlPath<String>) -> Response {
    match app.providers.cards.by_id(&id) {
        Some(charge) => Json(payment_json(&charge)).into_response(),
        None => problem(StatusCode::NOT_FOUND, "No such payment", &id),
    }
}
