//! SIGKILL a server child serving requests through the layer's async path
//! (redb, journaled), reopen, and check: every response a client saw is
//! what a retry replays, and no handler ran twice for a key.
#![cfg(unix)]

use std::collections::HashMap;
use std::error::Error;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::Router;
use http_body_util::BodyExt;
use idempotency::http::IdempotencyLayer;
use idempotency::Engine;
use tower::ServiceExt;

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const ROLE: &str = "BREAKER_KILL_HTTP_ROLE";
const LEASE: Duration = Duration::from_millis(500);

fn app(engine: Arc<Engine>, log: std::path::PathBuf) -> Router {
    Router::new()
        .route(
            "/pay",
            post(move |headers: axum::http::HeaderMap| {
                let log = log.clone();
                async move {
                    let key = headers["idempotency-key"].to_str().unwrap_or("").to_owned();
                    let mut f = std::fs::OpenOptions::new()
                        .append(true)
                        .create(true)
                        .open(&log)
                        .expect("run log");
                    f.write_all(format!("{key}\n").as_bytes()).expect("run log");
                    tokio::time::sleep(Duration::from_millis(3)).await;
                    (StatusCode::CREATED, format!("{key} {}", std::process::id()))
                }
            }),
        )
        .layer(IdempotencyLayer::new(engine))
}

#[test]
fn child_entry() -> TestResult {
    let Some(db) = std::env::var_os(ROLE) else {
        return Ok(());
    };
    let db = Path::new(&db);
    let engine = Arc::new(Engine::builder().lease(LEASE).open(db)?);
    let app = app(engine, db.with_extension("runs"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        println!("{}", listener.local_addr()?);
        std::io::stdout().flush()?;
        axum::serve(listener, app).await?;
        Ok(())
    })
}

#[test]
fn sigkill_mid_traffic_loses_no_told_answer_and_runs_nothing_twice() -> TestResult {
    if std::env::var_os(ROLE).is_some() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("kill.redb");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut told: HashMap<String, String> = HashMap::new();
    let mut sent = Vec::new();
    for round in 0..4u64 {
        let mut child = Command::new(std::env::current_exe()?)
            .args([
                "--exact",
                // `<file>::child_entry` where this file is a module of a test binary.
                concat!(module_path!(), "::child_entry")
                    .split_once("::")
                    .map_or("child_entry", |(_, t)| t),
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(ROLE, &db)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let mut line = String::new();
        let stdout = child.stdout.take().ok_or("stdout")?;
        let mut reader = BufReader::new(stdout);
        // The test harness prints its own lines first.
        loop {
            line.clear();
            if reader.read_line(&mut line)? == 0 {
                return Err("child exited".into());
            }
            // libtest prints `test child_entry ... ` before it.
            if let Some(at) = line.find("127.0.0.1:") {
                line = line.split_off(at);
                break;
            }
        }
        let url = format!("http://{}/pay", line.trim());
        let kill_after = Duration::from_millis(80 + round * 70);
        let answers = rt.block_on(async {
            let client = reqwest::Client::new();
            let mut tasks = Vec::new();
            for i in 0..3000 {
                let (client, url) = (client.clone(), url.clone());
                let key = format!("r{round}-k{i}");
                tasks.push(tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_micros(i * 100)).await;
                    let r = client
                        .post(&url)
                        .header("idempotency-key", &key)
                        .body("{}")
                        .send()
                        .await;
                    let got = match r {
                        Ok(r) if r.status() == 201 => r.text().await.ok(),
                        _ => None,
                    };
                    (key, got)
                }));
            }
            tokio::time::sleep(kill_after).await;
            let _ = child.kill();
            let _ = child.wait();
            let mut out = Vec::new();
            for t in tasks {
                if let Ok(a) = t.await {
                    out.push(a);
                }
            }
            out
        });
        for (key, got) in answers {
            if let Some(body) = got {
                told.insert(key.clone(), body);
            }
            sent.push(key);
        }
    }
    eprintln!("{} sent, {} told 201", sent.len(), told.len());
    std::thread::sleep(LEASE + Duration::from_millis(200));
    let engine = Arc::new(Engine::builder().lease(LEASE).open(&db)?);
    let app = app(engine, db.with_extension("runs"));
    let mut statuses: HashMap<u16, usize> = HashMap::new();
    let mut problems = Vec::new();
    rt.block_on(async {
        for key in &sent {
            let req = Request::post("/pay")
                .header("idempotency-key", key)
                .body(Body::from("{}"))?;
            let response = app.clone().oneshot(req).await?;
            let status = response.status().as_u16();
            let body = String::from_utf8_lossy(&response.into_body().collect().await?.to_bytes())
                .into_owned();
            *statuses.entry(status).or_default() += 1;
            if let Some(t) = told.get(key) {
                if (status, &body) != (201, t) {
                    problems.push(format!("{key}: told {t:?}, retry {status} {body:?}"));
                }
            }
            if status == 409 {
                problems.push(format!("{key}: 409 after every lease ended: {body}"));
            }
        }
        Ok::<(), Box<dyn Error + Send + Sync>>(())
    })?;
    let mut runs: HashMap<String, u32> = HashMap::new();
    for line in std::fs::read_to_string(db.with_extension("runs"))?.lines() {
        *runs.entry(line.to_owned()).or_default() += 1;
    }
    for (key, n) in &runs {
        if *n > 1 {
            problems.push(format!("{key}: handler ran {n} times"));
        }
    }
    eprintln!("retry statuses {statuses:?}");
    assert!(
        problems.is_empty(),
        "{} problems: {:#?}",
        problems.len(),
        &problems[..problems.len().min(10)]
    );
    Ok(())
}
