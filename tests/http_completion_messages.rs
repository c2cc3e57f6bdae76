//! Outbox messages a handler hands to the HTTP layer
//! (`http::CompletionMessages` in its response extensions). Guards against
//! an event stored for a request that did not succeed (a retryable
//! refusal, an in-doubt 500, a final 402), stored twice when a retry
//! replays, or stored under an id that is not the claim's reference.

use std::error::Error;
use std::sync::Arc;

use axum::http::{HeaderValue, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Extension, Router};
use idempotency::http::{ClaimInfo, CompletionMessages, IdempotencyLayer};
use idempotency::{Engine, OutgoingMessage};

type TestResult = Result<(), Box<dyn Error>>;

/// The event every route hands to the layer.
fn event() -> Extension<CompletionMessages> {
    Extension(CompletionMessages(vec![OutgoingMessage::new(
        "payment.succeeded",
        "paid",
    )]))
}

async fn serve(engine: Arc<Engine>) -> Result<String, Box<dyn Error>> {
    let router = Router::new()
        .route(
            "/ok",
            post(|Extension(claim): Extension<ClaimInfo>| async move {
                (StatusCode::CREATED, event(), claim.reference)
            }),
        )
        .route(
            "/busy",
            post(|| async {
                let mut r = (StatusCode::SERVICE_UNAVAILABLE, event(), "busy").into_response();
                r.headers_mut()
                    .insert("retry-after", HeaderValue::from_static("1"));
                r
            }),
        )
        .route(
            "/failed",
            post(|| async { (StatusCode::INTERNAL_SERVER_ERROR, event(), "unknown") }),
        )
        .route(
            "/declined",
            post(|| async { (StatusCode::PAYMENT_REQUIRED, event(), "declined") }),
        )
        .layer(IdempotencyLayer::new(engine));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(base)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_success_stores_its_messages_once_with_the_completion() -> TestResult {
    let dir = tempfile::tempdir()?;
    let engine = Arc::new(Engine::builder().open(dir.path().join("messages.redb"))?);
    let base = serve(engine.clone()).await?;
    let client = reqwest::Client::new();
    let post = |path: &str, key: &str| {
        client
            .post(format!("{base}{path}"))
            .header("idempotency-key", format!("\"{key}\""))
            .send()
    };

    // Not a success: nothing goes to the outbox.
    assert_eq!(post("/busy", "k-busy").await?.status(), 503);
    assert_eq!(post("/failed", "k-failed").await?.status(), 500);
    assert_eq!(post("/declined", "k-declined").await?.status(), 402);
    assert_eq!(engine.outbox().len()?, 0);

    // A success: one message, under the claim's reference, stored before
    // the answer was sent; the retry replays and stores nothing more.
    let first = post("/ok", "k-ok").await?;
    assert_eq!(first.status(), 201);
    let reference = first.text().await?;
    let retry = post("/ok", "k-ok").await?;
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let pending = engine.outbox().take(10)?;
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!(pending[0].id, format!("{reference}/0"));
    assert_eq!(pending[0].topic, "payment.succeeded");
    assert_eq!(pending[0].payload, b"paid");
    Ok(())
}
