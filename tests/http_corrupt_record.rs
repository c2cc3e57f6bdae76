//! A damaged stored record under the HTTP layer (issue 14 item 1).
//!
//! - On PostgreSQL (no page checksums of ours): a changed byte in a stored
//!   record is met at request time: the retry is answered 500
//!   `stored-record-corrupt`, the handler is not run again, and other keys
//!   keep working.
//! - On redb: a writable open verifies every page first, so a server never
//!   starts on a damaged file (`OpenError::Corrupt`); it cannot answer
//!   anything wrong from it.
//!
//! The PostgreSQL test needs `IDEMPOTENCY_TEST_PG` (see
//! `scripts/with-postgres`); without it it is skipped, or fails under
//! `CI=true`.

use std::error::Error;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idempotency::http::IdempotencyLayer;
use idempotency::{Corrupted, Engine, OpenError};

// Declared once at the test binary's root (tests/services/main.rs): its
// table and key prefixes are unique through one counter per process.
use crate::harness;

type TestResult = Result<(), Box<dyn Error>>;

/// A marker inside the stored response, to find the record's bytes.
const MARKER: &str = "receipt-0123456789-marker";

async fn serve(engine: Engine) -> Result<(String, Arc<AtomicUsize>), Box<dyn Error>> {
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
        .layer(IdempotencyLayer::new(Arc::new(engine)));
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

#[tokio::test(flavor = "multi_thread")]
async fn a_damaged_record_is_a_500_and_never_runs_again() -> TestResult {
    let Some(url) = harness::pg_url() else {
        return Ok(());
    };
    static N: AtomicU64 = AtomicU64::new(0);
    let prefix = format!(
        "hc_{}_{}_",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    let open = || {
        Engine::builder()
            .table_prefix(prefix.clone())
            .sweep_interval(None)
            .open_postgres(&url)
    };
    let (base, runs) = serve(tokio::task::block_in_place(open)?).await?;
    let r = charge(&base, "pay-1").await?;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // Change one byte of the stored response ('r' of the marker to 'R').
    let url2 = url.clone();
    let records = format!("{prefix}records");
    let changed = tokio::task::spawn_blocking(move || {
        let mut client =
            idempotency::postgres::Client::connect(&url2, idempotency::postgres::NoTls)?;
        client.execute(
            &format!(
                "UPDATE {records} SET record = overlay(record placing '\\x52'::bytea
                     from position('\\x72656365697074'::bytea in record) for 1)
                 WHERE position('\\x72656365697074'::bytea in record) > 0"
            ),
            &[],
        )
    })
    .await??;
    assert_eq!(changed, 1, "the stored response was not found");
    let r = charge(&base, "pay-1").await?;
    assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(!r.headers().contains_key("retry-after"));
    let body = r.text().await?;
    assert!(body.contains("stored-record-corrupt"), "{body}");
    assert!(!body.contains("marker"), "damaged bytes replayed: {body}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran again");
    // Other keys keep working.
    let r = charge(&base, "pay-2").await?;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    Ok(())
}

#[test]
fn a_server_never_starts_on_a_damaged_redb_file() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.redb");
    {
        let rt = tokio::runtime::Runtime::new()?;
        rt.block_on(async {
            let (base, _) = serve(Engine::builder().open(&path)?).await?;
            assert_eq!(charge(&base, "pay-1").await?.status(), StatusCode::CREATED);
            Ok::<_, Box<dyn Error>>(())
        })?;
    }
    let mut bytes = std::fs::read(&path)?;
    let at = bytes
        .windows(MARKER.len())
        .position(|w| w == MARKER.as_bytes())
        .ok_or("the stored response is not in the file")?;
    bytes[at + 3] ^= 0x20;
    std::fs::write(&path, &bytes)?;
    match Engine::builder().open(&path) {
        Err(OpenError::Corrupt {
            what: Corrupted::File,
            reason,
            ..
        }) => {
            assert!(!reason.is_empty());
        }
        Err(other) => return Err(format!("expected OpenError::Corrupt, got {other}").into()),
        Ok(_) => return Err("an engine opened a damaged file".into()),
    }
    Ok(())
}
