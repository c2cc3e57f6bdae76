//! Storage failing under the HTTP layer (issue 14.3 and 13.3): when the
//! outcome of a request cannot be recorded (disk full), the client must not
//! get the handler's 2xx as if it were durable; and no answer of the layer
//! carries internal error text (storage errors, keys).

#[path = "common/faulty_backend.rs"]
mod faulty_backend;

use std::error::Error;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use faulty_backend::{Faults, FaultyBackend};
use idempotency::http::IdempotencyLayer;
use idempotency::Engine;

type TestResult = Result<(), Box<dyn Error>>;

/// A server whose `/charge` handler fills the disk after it has acted.
async fn start() -> Result<(String, Faults, Arc<AtomicUsize>), Box<dyn Error>> {
    let (backend, faults) = FaultyBackend::new();
    let engine = Arc::new(Engine::builder().open_with_backend(backend)?);
    let runs = Arc::new(AtomicUsize::new(0));
    let (counter, switch) = (runs.clone(), faults.clone());
    let app = Router::new()
        .route(
            "/charge",
            post(move || {
                let (runs, faults) = (counter.clone(), switch.clone());
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    faults.fail_writes();
                    (StatusCode::CREATED, r#"{"charged":true}"#)
                }
            }),
        )
        .route("/ok", post(|| async { (StatusCode::CREATED, "fine") }))
        .layer(IdempotencyLayer::new(engine));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok((base, faults, runs))
}

fn assert_no_internals(body: &str) {
    for leak in [
        "injected", "no space", "storage", "POST /", "caller=", "poison",
    ] {
        assert!(!body.contains(leak), "internal text {leak:?} in {body}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn failed_complete_is_never_a_2xx() -> TestResult {
    let (base, _faults, runs) = start().await?;
    let client = reqwest::Client::new();
    let r = client
        .post(format!("{base}/charge"))
        .header("idempotency-key", "disk-full-1")
        .body("{}")
        .send()
        .await?;
    assert_eq!(
        r.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "a 2xx whose outcome was not recorded"
    );
    assert!(r.headers().contains_key("retry-after"));
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let body = r.text().await?;
    assert!(body.contains("outcome-not-recorded"), "{body}");
    assert!(
        !body.contains("charged"),
        "the handler's answer leaked: {body}"
    );
    assert_no_internals(&body);

    // The retry never runs the handler again.
    let retry = client
        .post(format!("{base}/charge"))
        .header("idempotency-key", "disk-full-1")
        .body("{}")
        .send()
        .await?;
    assert!(!retry.status().is_success());
    assert_no_internals(&retry.text().await?);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn layer_500_carries_no_internals() -> TestResult {
    let (base, faults, _runs) = start().await?;
    faults.fail_writes();
    let r = reqwest::Client::new()
        .post(format!("{base}/ok"))
        .header("idempotency-key", "secret-key-123")
        .body("{}")
        .send()
        .await?;
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let body = r.text().await?;
    assert!(body.contains("engine-error"), "{body}");
    assert!(!body.contains("secret-key-123"), "{body}");
    assert_no_internals(&body);
    Ok(())
}
