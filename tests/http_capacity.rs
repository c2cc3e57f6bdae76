//! Backpressure of the HTTP layer (issue 13.9): 1,000 concurrent
//! connections with distinct keys over loopback. Guards against every
//! request occupying a blocking thread and queueing without bound: at most
//! `max_in_flight` claimed requests run at once, and every request gets an
//! answer (the handler's, or 503 `overloaded` with `Retry-After` when the
//! layer sheds load).

use std::error::Error;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idempotency::http::IdempotencyLayer;
use idempotency::{Engine, IdempotencyKey};
use tokio::sync::Semaphore;

type TestResult = Result<(), Box<dyn Error>>;

const CONNECTIONS: usize = 1000;
const LIMIT: usize = 8;
const BOUND: Duration = Duration::from_secs(60);

struct Gauge {
    now: AtomicUsize,
    max: AtomicUsize,
}

/// Handlers that block on `gate` and record how many run at once.
async fn start(
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
    gate: Arc<Semaphore>,
    gauge: Arc<Gauge>,
) -> Result<(String, Arc<Engine>, tempfile::TempDir), Box<dyn Error>> {
    let dir = tempfile::tempdir()?;
    let engine = Arc::new(Engine::builder().open(dir.path().join("capacity.redb"))?);
    let app = Router::new()
        .route(
            "/payments",
            post(move || {
                let (gate, gauge) = (gate.clone(), gauge.clone());
                async move {
                    let now = gauge.now.fetch_add(1, Ordering::SeqCst) + 1;
                    gauge.max.fetch_max(now, Ordering::SeqCst);
                    if let Ok(permit) = gate.acquire().await {
                        permit.forget();
                    }
                    gauge.now.fetch_sub(1, Ordering::SeqCst);
                    (StatusCode::CREATED, "ok")
                }
            }),
        )
        .layer(configure(
            IdempotencyLayer::new(engine.clone()).max_in_flight(LIMIT),
        ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok((base, engine, dir))
}

fn new_gauge() -> Arc<Gauge> {
    Arc::new(Gauge {
        now: AtomicUsize::new(0),
        max: AtomicUsize::new(0),
    })
}

/// Sends `CONNECTIONS` requests at once, each on its own connection;
/// returns their (status, Retry-After) as they complete, through a channel.
fn fire(base: &str) -> tokio::sync::mpsc::UnboundedReceiver<Result<(u16, bool), String>> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..CONNECTIONS {
        let tx = tx.clone();
        let url = format!("{base}/payments");
        tokio::spawn(async move {
            // One client per request: one connection each.
            let answer = async {
                let client = reqwest::Client::builder()
                    .pool_max_idle_per_host(0)
                    .build()?;
                let r = client
                    .post(url)
                    .header("idempotency-key", format!("cap-{i}"))
                    .body("{}")
                    .send()
                    .await?;
                Ok::<_, reqwest::Error>((
                    r.status().as_u16(),
                    r.headers().contains_key("retry-after"),
                ))
            }
            .await
            .map_err(|e| e.to_string());
            let _ = tx.send(answer);
        });
    }
    rx
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousand_connections_wait_for_capacity() -> TestResult {
    let (gate, gauge) = (Arc::new(Semaphore::new(0)), new_gauge());
    let (base, _engine, _dir) = start(|l| l, gate.clone(), gauge.clone()).await?;
    let mut answers = fire(&base);
    // With the gate shut, exactly LIMIT handlers get to run; the rest wait
    // in poll_ready, holding no blocking thread.
    let deadline = tokio::time::Instant::now() + BOUND;
    while gauge.now.load(Ordering::SeqCst) < LIMIT {
        assert!(
            tokio::time::Instant::now() < deadline,
            "handlers never started"
        );
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    gate.add_permits(CONNECTIONS);
    let mut created = 0;
    for _ in 0..CONNECTIONS {
        let (status, _) = tokio::time::timeout(BOUND, answers.recv())
            .await?
            .ok_or("an answer went missing")??;
        assert_eq!(status, 201);
        created += 1;
    }
    assert_eq!(created, CONNECTIONS, "every request answered");
    assert!(
        gauge.max.load(Ordering::SeqCst) <= LIMIT,
        "{} handlers ran at once; the limit is {LIMIT}",
        gauge.max.load(Ordering::SeqCst)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousand_connections_are_shed_with_retry_after() -> TestResult {
    let (gate, gauge) = (Arc::new(Semaphore::new(0)), new_gauge());
    let (base, engine, _dir) = start(
        |l| l.load_shed(Duration::from_secs(2)),
        gate.clone(),
        gauge.clone(),
    )
    .await?;
    let mut answers = fire(&base);
    // The gate stays shut until every shed request is answered, so exactly
    // LIMIT requests run and the others are refused at once.
    let mut shed = 0;
    while shed < CONNECTIONS - LIMIT {
        let (status, retry_after) = tokio::time::timeout(BOUND, answers.recv())
            .await?
            .ok_or("an answer went missing")??;
        assert_eq!(status, 503);
        assert!(retry_after, "503 without Retry-After");
        shed += 1;
    }
    gate.add_permits(CONNECTIONS);
    for _ in 0..LIMIT {
        let (status, _) = tokio::time::timeout(BOUND, answers.recv())
            .await?
            .ok_or("an answer went missing")??;
        assert_eq!(status, 201);
    }
    // A shed request left no record behind: its retry runs.
    let mut records = 0;
    for i in 0..CONNECTIONS {
        let key = IdempotencyKey::new("POST /payments", format!("cap-{i}"))?;
        records += usize::from(engine.record(&key)?.is_some());
    }
    assert_eq!(records, LIMIT);
    assert!(gauge.max.load(Ordering::SeqCst) <= LIMIT);
    Ok(())
}
