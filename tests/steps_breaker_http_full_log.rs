//! Breaker finding on a key whose evidence log is full (issue 22; the
//! design: such a key "answers `begin` with that error until an operator
//! purges it"), behind the HTTP layer: every attempt of the handler
//! reserves 16 steps and dies in doubt, a resolver answers "not executed",
//! and the key resumes, until the log reaches 256 entries. From then on
//! only an operator can help, yet the answer is 503 `engine-error` with
//! `Retry-After: 1` and "retry with the same Idempotency-Key": clients
//! retry forever. Guards against an answer that promises a retry helps
//! when it cannot (the damaged-record case answers a 500 that says an
//! operator must act).

use std::error::Error;
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::post;
use axum::{Extension, Router};
use idempotency::http::{Disposition, IdempotencyLayer};
use idempotency::{
    Effects, Engine, InDoubt, InDoubtStep, Resolution, Resolver, StepResolution, MAX_STEPS_PER_KEY,
};

type TestResult = Result<(), Box<dyn Error>>;

const TYPE_PREFIX: &str = "tag:idempotency.invalid,2026:http-problems#";

struct NeverHappened;

impl Resolver for NeverHappened {
    fn resolve(&self, _: &InDoubt) -> Resolution {
        Resolution::NotExecuted
    }
    fn resolve_step(&self, _: &InDoubtStep) -> StepResolution {
        StepResolution::NotExecuted
    }
}

/// Reserves every step it may, then its provider times out.
async fn flaky(Extension(effects): Extension<Effects>) -> (StatusCode, Extension<Disposition>) {
    for n in 0..MAX_STEPS_PER_KEY {
        if effects.effect_async(&format!("s{n}")).await.is_err() {
            break;
        }
    }
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Extension(Disposition::InDoubt),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_log_is_not_answered_as_retry_later() -> TestResult {
    let dir = tempfile::tempdir()?;
    let engine = Arc::new(
        Engine::builder()
            .sweep_interval(None)
            .resolver(NeverHappened)
            .open(dir.path().join("full.redb"))?,
    );
    let app = Router::new()
        .route("/pay", post(flaky))
        .layer(IdempotencyLayer::new(engine.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()?;
    let mut seen = Vec::new();
    for _ in 0..30 {
        let r = client
            .post(format!("{base}/pay"))
            .header("idempotency-key", "order-full-log")
            .header("content-type", "application/json")
            .body(r#"{"amount": 10}"#)
            .send()
            .await?;
        let status = r.status();
        let body: serde_json::Value = serde_json::from_str(&r.text().await?).unwrap_or_default();
        let kind = body["type"]
            .as_str()
            .unwrap_or("")
            .trim_start_matches(TYPE_PREFIX)
            .to_owned();
        seen.push((status.as_u16(), kind.clone()));
        if kind == "engine-error" {
            let logs: Vec<(String, usize)> = engine
                .in_doubt(10)?
                .into_iter()
                .map(|d| {
                    let n = engine.history(&d.key).map_or(0, |h| h.len());
                    (d.key.to_string(), n)
                })
                .collect();
            return Err(format!(
                "a key whose log is full (an operator must purge it) is answered 503 \
                 engine-error 'retry with the same Idempotency-Key' with Retry-After; \
                 answers so far {seen:?}; body {body}; keys in doubt and their log \
                 sizes {logs:?}"
            )
            .into());
        }
    }
    eprintln!("answers: {seen:?}");
    Ok(())
}
