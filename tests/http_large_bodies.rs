//! Large, deeply nested JSON bodies under the HTTP layer (issue 14.10).
//! Guards against fingerprinting on the async workers (a 1 MiB body of
//! nested arrays takes a third of a second to canonicalize) and against
//! such bodies being refused or fingerprinted unstably. Fingerprinting runs
//! on the blocking pool, at most one large body per CPU at once.

use std::error::Error;
use std::sync::Arc;

use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::Router;
use idempotency::http::{IdempotencyLayer, Route};
use idempotency::Engine;

type TestResult = Result<(), Box<dyn Error>>;

/// Thousands of 60-deep `[[…]]` in one array of just under 1 MiB.
fn nested_body() -> String {
    let unit = format!("{}{}", "[".repeat(60), "]".repeat(60));
    let mut body = String::from("[");
    while body.len() + unit.len() + 2 < (1 << 20) {
        if body.len() > 1 {
            body.push(',');
        }
        body.push_str(&unit);
    }
    body.push(']');
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_megabyte_bodies_are_fingerprinted_off_the_workers() -> TestResult {
    let dir = tempfile::tempdir()?;
    let engine = Arc::new(Engine::builder().open(dir.path().join("large.redb"))?);
    let app = Router::new()
        .route("/docs", post(|| async { (StatusCode::CREATED, "stored") }))
        .route("/health", get(|| async { "ok" }))
        .layer(
            IdempotencyLayer::new(engine)
                .route(Route::new("/docs").json())
                .max_body_bytes(2 << 20),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = reqwest::Client::new();
    let body = nested_body();

    let mut tasks = Vec::new();
    for i in 0..4 {
        let (client, url, body) = (client.clone(), format!("{base}/docs"), body.clone());
        tasks.push(tokio::spawn(async move {
            client
                .post(url)
                .header("idempotency-key", format!("doc-{i}"))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .map(|r| r.status())
        }));
    }
    // Unrelated requests are served meanwhile.
    let health = client.get(format!("{base}/health")).send().await?;
    assert_eq!(health.text().await?, "ok");
    for task in tasks {
        assert_eq!(task.await??, StatusCode::CREATED);
    }
    // The fingerprint is stable: the retry replays.
    let retry = client
        .post(format!("{base}/docs"))
        .header("idempotency-key", "doc-0")
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await?;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    Ok(())
}
