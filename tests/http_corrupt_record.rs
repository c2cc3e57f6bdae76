//! A damaged stored record under the HTTP layer (issue 14 item 1): the
//! retry is answered 500 `stored-record-corrupt`, the handler is not run
//! again, and other keys keep working.

use std::error::Error;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idempotency::http::IdempotencyLayer;
use idempotency::Engine;

type TestResult = Result<(), Box<dyn Error>>;

/// A marker inside the stored response, to find the record's bytes.
const MARKER: &str = "receipt-0123456789-marker";

async fn serve(path: &std::path::Path) -> Result<(String, Arc<AtomicUsize>), Box<dyn Error>> {
    let engine = Arc::new(Engine::builder().open(path)?);
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let app = Router::new()
        .route(
            "/charge",
            post(move || {
                let runs = counter.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::CREATED, MARKER)
                }
            }),
        )
        .layer(IdempotencyLayer::new(engine));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok((base, runs))
}

async fn charge(base: &str, key: &str) -> Result<reqwest::Response, reqwest::Error> {
    reqwest::Client::new()
        .post(format!("{base}/charge"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(r#"{"amount":100}"#)
        .send()
        .await
}

#[test]
fn a_damaged_record_is_a_500_and_never_runs_again() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.redb");
    // First life: one charge, then a clean close (the runtime and the
    // engine are dropped), so the record is in the database file.
    {
        let rt = tokio::runtime::Runtime::new()?;
        rt.block_on(async {
            let (base, runs) = serve(&path).await?;
            let r = charge(&base, "pay-1").await?;
            assert_eq!(r.status(), StatusCode::CREATED);
            assert_eq!(runs.load(Ordering::SeqCst), 1);
            Ok::<_, Box<dyn Error>>(())
        })?;
    }
    // Damage one byte of the stored response.
    let mut bytes = std::fs::read(&path)?;
    let at = bytes
        .windows(MARKER.len())
        .position(|w| w == MARKER.as_bytes())
        .ok_or("the stored response is not in the file")?;
    bytes[at + 3] ^= 0x20;
    std::fs::write(&path, &bytes)?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let (base, runs) = serve(&path).await?;
        let r = charge(&base, "pay-1").await?;
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!r.headers().contains_key("retry-after"));
        let body = r.text().await?;
        assert!(body.contains("stored-record-corrupt"), "{body}");
        assert!(!body.contains("marker"), "damaged bytes replayed: {body}");
        assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler ran again");
        // Other keys keep working.
        let r = charge(&base, "pay-2").await?;
        assert_eq!(r.status(), StatusCode::CREATED);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        Ok(())
    })
}
