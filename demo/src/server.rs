//! The payments API: axum behind the idempotency layer, one redb file for
//! the engine, the simulated provider beside it, and a resolver that asks
//! the provider what happened to an UNKNOWN payment.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path as UrlPath, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use idempotency::http::{ClaimInfo, Disposition, IdempotencyLayer, Route};
use idempotency::{Engine, Envelope, Pending, Resolution};
use serde::Deserialize;

use crate::provider::{Charge, ChargeError, Fault, Provider};

/// Request header for the demo's fault injection: `provider-timeout` makes
/// the provider charge and then time out.
pub const FAULT_HEADER: &str = "x-simulate-fault";

/// How `serve` runs.
pub struct ServeOptions {
    /// Where to listen.
    pub addr: SocketAddr,
    /// The engine's redb file.
    pub db: PathBuf,
    /// The claim lease: how long a payment may take before a retry treats
    /// it as UNKNOWN. It must outlast the provider call (here ~0.3 s).
    pub lease: Duration,
    /// Abort the process right after the provider charged, before the
    /// outcome is recorded (fault injection for the demo).
    pub crash_after_charge: bool,
    /// Shut down when standard input closes (how the demo stops its child
    /// servers gracefully).
    pub exit_on_stdin_eof: bool,
}

/// The provider's ledger file for an engine file: `payments.redb` →
/// `payments.provider.jsonl`.
pub fn provider_path(db: &Path) -> PathBuf {
    db.with_extension("provider.jsonl")
}

#[derive(Clone)]
struct AppState {
    provider: Arc<Provider>,
    crash_after_charge: bool,
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
pub async fn serve(opts: ServeOptions) -> Result<(), Box<dyn std::error::Error>> {
    let provider = Arc::new(Provider::open(&provider_path(&opts.db))?);
    let for_resolver = provider.clone();
    let engine = Engine::builder()
        .lease(opts.lease)
        .resolver(move |pending: &Pending| resolve(&for_resolver, pending))
        .open(&opts.db)?;
    let engine = Arc::new(engine);

    let layer = IdempotencyLayer::new(engine.clone())
        .route(Route::new("/payments").require_key().json_pointers([
            "/amount",
            "/currency",
            "/customer",
        ]))
        .tenant_header(header::HeaderName::from_static("x-merchant-id"))
        .max_body_bytes(16 * 1024);
    let state = AppState {
        provider: provider.clone(),
        crash_after_charge: opts.crash_after_charge,
    };
    let app = Router::new()
        .route("/payments", post(create_payment))
        .route("/payments/{id}", get(get_payment))
        .layer(layer)
        .with_state(state);

    let listener = tokio::net::TcpListener::bind(opts.addr).await?;
    // The demo reads this line to learn the port.
    println!("listening on http://{}", listener.local_addr()?);
    eprintln!(
        "engine {}, provider ledger {}, lease {} ms{}",
        opts.db.display(),
        provider.path().display(),
        opts.lease.as_millis(),
        if opts.crash_after_charge {
            ", will abort after the first charge"
        } else {
            ""
        }
    );
    let exit_on_eof = opts.exit_on_stdin_eof;
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            if exit_on_eof {
                stdin_closed().await;
            } else {
                let _ = tokio::signal::ctrl_c().await;
            }
        })
        .await?;
    // Dropping the last engine handle commits what is queued and closes the
    // file.
    drop(engine);
    Ok(())
}

/// Resolves when standard input reaches end of file.
async fn stdin_closed() {
    let _ = tokio::task::spawn_blocking(|| {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
    })
    .await;
}

/// The resolver: the provider is asked by the claim's reference. Charged →
/// the response the handler would have sent; unknown to the provider → the
/// payment never happened, so a retry may run it afresh; the provider
/// cannot tell (its ledger is broken) → still unknown, never "not executed".
fn resolve(provider: &Provider, pending: &Pending) -> Resolution {
    match provider.status(&pending.reference) {
        Ok(Some(charge)) => Resolution::Completed(payment_envelope(&charge)),
        Ok(None) => Resolution::NotExecuted,
        Err(e) => {
            eprintln!("resolver: {}: {e}", pending.reference);
            Resolution::StillUnknown
        }
    }
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

fn problem(status: StatusCode, title: &str, detail: &str) -> Response {
    let body = serde_json::json!({
        "type": "about:blank",
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
    Extension(claim): Extension<ClaimInfo>,
    headers: HeaderMap,
    Json(req): Json<CreatePayment>,
) -> Response {
    if req.amount == 0 || req.currency.len() != 3 || req.customer.is_empty() {
        return problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid payment",
            "amount must be positive, currency a 3-letter code, customer non-empty",
        );
    }
    let fault = match headers.get(FAULT_HEADER).map(HeaderValue::as_bytes) {
        Some(b"provider-timeout") => Fault::TimeoutAfterCharge,
        _ => Fault::None,
    };
    let provider = app.provider.clone();
    let client_key = claim.key.key().to_owned();
    // The provider call blocks (latency, fsync): keep it off the runtime's
    // worker threads. The claim's reference is the provider's dedupe key.
    let charged = tokio::task::spawn_blocking(move || {
        provider.charge(
            &claim.reference,
            req.amount,
            &req.currency,
            &client_key,
            fault,
        )
    })
    .await;
    match charged {
        Ok(Ok(charge)) => {
            if app.crash_after_charge {
                // Charged at the provider, outcome not recorded: exactly
                // the window the resolver exists for.
                eprintln!("fault injection: aborting after charge {}", charge.id);
                std::process::abort();
            }
            let envelope = payment_envelope(&charge);
            let mut response = (StatusCode::CREATED, envelope.body).into_response();
            for (name, value) in envelope.headers {
                if let (Ok(name), Ok(value)) = (
                    header::HeaderName::from_bytes(name.as_bytes()),
                    HeaderValue::from_bytes(&value),
                ) {
                    response.headers_mut().insert(name, value);
                }
            }
            response
        }
        Ok(Err(ChargeError::Declined)) => problem(
            StatusCode::PAYMENT_REQUIRED,
            "Card declined",
            "the provider declined the charge",
        ),
        Ok(Err(ChargeError::Timeout)) => {
            // The provider may have charged: never retry blindly. The
            // layer marks the key UNKNOWN; a retry asks the resolver.
            let mut response = problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "Payment provider timed out",
                "the payment's outcome is being checked with the provider; retry later with \
                 the same Idempotency-Key",
            );
            response.extensions_mut().insert(Disposition::Unknown);
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            response
        }
        Ok(Err(ChargeError::Io(e))) => {
            // The ledger write failed: the charge may or may not be durable.
            let mut response = problem(
                StatusCode::BAD_GATEWAY,
                "Payment provider failed",
                &e.to_string(),
            );
            response.extensions_mut().insert(Disposition::Unknown);
            response
        }
        Err(join) => {
            let mut response = problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Payment failed",
                &join.to_string(),
            );
            response.extensions_mut().insert(Disposition::Unknown);
            response
        }
    }
}

async fn get_payment(State(app): State<AppState>, UrlPath(id): UrlPath<String>) -> Response {
    match app.provider.by_id(&id) {
        Some(charge) => Json(payment_json(&charge)).into_response(),
        None => problem(StatusCode::NOT_FOUND, "No such payment", &id),
    }
}
