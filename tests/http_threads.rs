//! The layer's thread count stays flat under many concurrent requests
//! (issue 27). 400 requests with distinct keys are in flight at once on a
//! durable engine; the process's threads (counted in /proc/self/task, not
//! timed) may grow by a few at most. Guards against the engine calls going
//! back to tokio's blocking pool, where every waiting request held a thread
//! of its own (~100 threads at 64 connections, ~500 at 1,000).

use std::error::Error;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::Router;
use idempotency::http::IdempotencyLayer;
use idempotency::Engine;
use tower::ServiceExt;

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const REQUESTS: usize = 400;
/// Threads the process may add while the requests run: none are needed
/// (the runtime's workers, the engine's writer, syncer and sweeper exist
/// before), a few for slack (a `spawn_blocking` elsewhere, the runtime's
/// own timer or I/O helpers).
const SLACK: usize = 8;

fn threads() -> std::io::Result<usize> {
    Ok(std::fs::read_dir("/proc/self/task")?.count())
}

#[test]
fn thread_count_stays_flat_under_concurrent_requests() -> TestResult {
    if !std::path::Path::new("/proc/self/task").exists() {
        eprintln!("no /proc/self/task here; skipped");
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let dir = tempfile::tempdir()?;
    let engine = Arc::new(Engine::builder().open(dir.path().join("threads.redb"))?);
    let app = Router::new()
        .route(
            "/pay",
            post(|| async {
                // Long enough for every request to be in flight at once.
                tokio::time::sleep(Duration::from_millis(100)).await;
                (StatusCode::CREATED, "{\"ok\":true}")
            }),
        )
        .layer(IdempotencyLayer::new(engine.clone()));

    // Warm up: one request, so lazily started threads exist before the
    // baseline is taken.
    let warm = runtime.block_on(app.clone().oneshot(request("warm-up")?))?;
    assert_eq!(warm.status(), StatusCode::CREATED);

    let peak = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, stop) = (peak.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                if let Ok(n) = threads() {
                    peak.fetch_max(n, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    let baseline = threads()?;
    let statuses = runtime.block_on(async {
        let mut tasks = Vec::with_capacity(REQUESTS);
        for i in 0..REQUESTS {
            let app = app.clone();
            let req = request(&format!("key-{i}"))?;
            tasks.push(tokio::spawn(async move { app.oneshot(req).await }));
        }
        let mut statuses = Vec::with_capacity(REQUESTS);
        for task in tasks {
            statuses.push(task.await??.status());
        }
        Ok::<_, Box<dyn Error + Send + Sync>>(statuses)
    })?;
    stop.store(true, Ordering::SeqCst);
    sampler.join().map_err(|_| "sampler panicked")?;

    let created = statuses
        .iter()
        .filter(|s| **s == StatusCode::CREATED)
        .count();
    assert_eq!(created, REQUESTS, "every request ran once: {statuses:?}");
    let peak = peak.load(Ordering::SeqCst);
    assert!(
        peak <= baseline + SLACK,
        "threads grew from {baseline} to {peak} under {REQUESTS} concurrent requests"
    );
    Ok(())
}

fn request(key: &str) -> Result<Request<Body>, axum::http::Error> {
    Request::post("/pay")
        .header("idempotency-key", format!("\"{key}\""))
        .header("content-type", "application/json")
        .body(Body::from(r#"{"amount":100}"#))
}
