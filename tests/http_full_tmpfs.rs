//! A real full disk under the layer's async path on a journaled file: a
//! 10 MiB tmpfs (tests/space_reserve.rs covers smaller ones and the
//! recovery reserve) fills while requests arrive; answers are 201 or 503, never a
//! wrong one, and service comes back when space does. Also: 1,000
//! concurrent loopback connections keep the thread count flat. Needs root
//! for `mount`: skipped otherwise, but a failure under `CI=true` (CI runs
//! as root, so a skip there would hide the test).

use std::collections::HashMap;
use std::error::Error;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::Router;
use http_body_util::BodyExt;
use idempotency::http::IdempotencyLayer;
use idempotency::Engine;
use parking_lot::Mutex;
use tower::ServiceExt;

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

fn app(engine: Arc<Engine>, runs: Arc<Mutex<HashMap<String, u32>>>) -> Router {
    Router::new()
        .route(
            "/pay",
            post(move |headers: axum::http::HeaderMap| {
                let runs = runs.clone();
                async move {
                    let key = headers["idempotency-key"].to_str().unwrap_or("").to_owned();
                    let n = {
                        let mut runs = runs.lock();
                        let n = runs.entry(key.clone()).or_default();
                        *n += 1;
                        *n
                    };
                    (
                        StatusCode::CREATED,
                        format!("{key} run {n} {}", "x".repeat(6000)),
                    )
                }
            }),
        )
        .layer(IdempotencyLayer::new(engine))
}

async fn send(app: &Router, key: &str) -> Result<(u16, String), Box<dyn Error + Send + Sync>> {
    let req = Request::post("/pay")
        .header("idempotency-key", key)
        .body(Body::from("{}"))?;
    let response = app.clone().oneshot(req).await?;
    let status = response.status().as_u16();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// The thread count is the whole process's: the two tests of this file
/// run one at a time, or the full-tmpfs test's engine and runtime threads
/// count against the other's budget (the README run saw 13 -> 25).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

#[test]
fn a_full_tmpfs_gives_503s_never_a_wrong_answer_and_recovers() -> TestResult {
    let _one = ONE_AT_A_TIME.lock();
    let dir = tempfile::tempdir()?;
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt)?;
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=10m", "tmpfs"])
        .arg(&mnt)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "cannot mount a tmpfs, and CI=true: the full-disk test must run in CI"
        );
        eprintln!("cannot mount a tmpfs here; skipped");
        return Ok(());
    }
    // Unmounted even when an assertion panics.
    struct Unmount<'a>(&'a std::path::Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(self.0).status();
        }
    }
    let _unmount = Unmount(&mnt);
    full_disk(&mnt)
}

fn full_disk(mnt: &std::path::Path) -> TestResult {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let engine = Arc::new(Engine::builder().open(mnt.join("db.redb"))?);
    let runs = Arc::new(Mutex::new(HashMap::new()));
    let app = app(engine.clone(), runs.clone());
    let mut answers: Vec<(String, u16, String)> = Vec::new();
    let mut i = 0;
    // Fill the disk through requests: bounded.
    let filled = runtime.block_on(async {
        while i < 3000 {
            let key = format!("k{i}");
            i += 1;
            let (status, body) = send(&app, &key).await?;
            answers.push((key, status, body));
            if status == 503 && answers.iter().filter(|a| a.1 == 503).count() >= 20 {
                return Ok::<bool, Box<dyn Error + Send + Sync>>(true);
            }
        }
        Ok(false)
    })?;
    assert!(filled, "the disk never filled: {} requests", answers.len());
    assert!(
        engine.poisoned().is_some(),
        "503s without a poisoned engine"
    );
    let mut statuses: HashMap<u16, usize> = HashMap::new();
    for (_, s, body) in &answers {
        *statuses.entry(*s).or_default() += 1;
        assert!(matches!(s, 201 | 503), "{s}: {body}");
    }
    eprintln!("while filling: {statuses:?}");
    for (key, s, body) in answers.iter().filter(|a| a.1 == 503).take(3) {
        eprintln!(
            "{key}: {s} {body} runs={:?} record={:?}",
            runs.lock().get(key),
            engine.record(&idempotency::IdempotencyKey::new(
                "POST /pay",
                key.as_str()
            )?)
        );
    }
    // Free space: remove what is not the database (nothing here), so grow
    // the tmpfs instead.
    let ok = std::process::Command::new("mount")
        .args(["-o", "remount,size=64m"])
        .arg(mnt)
        .status()?
        .success();
    assert!(ok, "remount");
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.poisoned().is_some() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(engine.poisoned(), None, "the engine did not recover");
    runtime.block_on(async {
        for (key, status, body) in &answers {
            let (s, b) = send(&app, key).await?;
            match status {
                201 => assert_eq!((s, &b), (201, body), "{key}: told 201, retry differs"),
                _ if body.contains("outcome-not-recorded") => {
                    // The failed completion consumed the claim: the record
                    // stays PROCESSING until its lease ends (409), then
                    // UNKNOWN (503); never a second run.
                    assert!(
                        (s == 503 && b.contains("outcome-unknown"))
                            || (s == 409 && b.contains("processing")),
                        "{key}: {s} {b}"
                    );
                }
                _ => assert_eq!(s, 201, "{key}: {b}"),
            }
        }
        Ok::<(), Box<dyn Error + Send + Sync>>(())
    })?;
    for (key, n) in runs.lock().iter() {
        assert!(*n <= 1, "{key} ran {n} times");
    }
    Ok(())
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, Iterator::count)
}

#[test]
fn a_thousand_loopback_connections_keep_threads_flat() -> TestResult {
    let _one = ONE_AT_A_TIME.lock();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let dir = tempfile::tempdir()?;
    let engine = Arc::new(Engine::builder().open(dir.path().join("t.redb"))?);
    let app = Router::new()
        .route(
            "/pay",
            post(|| async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                (StatusCode::CREATED, "ok")
            }),
        )
        .layer(IdempotencyLayer::new(engine).max_in_flight(2000));
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move { axum::serve(listener, app).await });
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()?;
        let url = format!("http://{addr}/pay");
        client
            .post(&url)
            .header("idempotency-key", "warm")
            .send()
            .await?;
        let before = threads();
        let peak = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let sampler = {
            let peak = peak.clone();
            tokio::spawn(async move {
                for _ in 0..300 {
                    peak.fetch_max(threads(), std::sync::atomic::Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        };
        let mut tasks = Vec::new();
        for i in 0..1000 {
            let (client, url) = (client.clone(), url.clone());
            tasks.push(tokio::spawn(async move {
                client
                    .post(&url)
                    .header("idempotency-key", format!("k{i}"))
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
            }));
        }
        let mut ok = 0;
        for t in tasks {
            if matches!(t.await?, Ok(201)) {
                ok += 1;
            }
        }
        sampler.abort();
        let peak = peak.load(std::sync::atomic::Ordering::SeqCst);
        eprintln!("threads before {before}, peak {peak}, 201s {ok}");
        assert_eq!(ok, 1000);
        assert!(peak <= before + 8, "threads grew from {before} to {peak}");
        Ok::<(), Box<dyn Error + Send + Sync>>(())
    })
}
