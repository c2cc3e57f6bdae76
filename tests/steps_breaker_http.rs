//! Breaker finding on the HTTP in-doubt problem body (issue 22): its
//! `retry_can_help` member must say whether a retry can settle the key
//! without an operator. Guards against a body that promises a retry will
//! help when the one unsettled step has no resolver at all (the engine has
//! a per-step resolver for ANOTHER step name only, and no whole-key
//! resolver): clients then retry forever on a key only an operator can
//! settle.

use std::error::Error;
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::post;
use axum::{Extension, Router};
use idempotency::http::{Disposition, IdempotencyLayer};
use idempotency::{EffectStep, Effects, Engine, InDoubtStep, StepResolution};

type TestResult = Result<(), Box<dyn Error>>;

/// Charges (confirmed), reserves the receipt, then the mailer times out:
/// the receipt's outcome is unknown.
async fn pay(
    Extension(effects): Extension<Effects>,
) -> Result<(StatusCode, String), (StatusCode, Extension<Disposition>)> {
    let in_doubt = || {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Extension(Disposition::InDoubt),
        )
    };
    if let EffectStep::Run { .. } = effects
        .effect_async("charge")
        .await
        .map_err(|_| in_doubt())?
    {
        effects
            .confirm_async("charge", b"ch_1")
            .await
            .map_err(|_| in_doubt())?;
    }
    // Reserved; the mailer's call then times out.
    let _receipt = effects
        .effect_async("receipt")
        .await
        .map_err(|_| in_doubt())?;
    Err(in_doubt())
}

#[tokio::test(flavor = "multi_thread")]
async fn retry_can_help_is_false_when_no_resolver_covers_the_unsettled_step() -> TestResult {
    let dir = tempfile::tempdir()?;
    // A resolver for the card provider only; nobody can ask the mailer.
    let engine = Arc::new(
        Engine::builder()
            .sweep_interval(None)
            .step_resolver("charge", |_: &InDoubtStep| StepResolution::StillUnknown)
            .open(dir.path().join("steps.redb"))?,
    );
    let app = Router::new()
        .route("/pay", post(pay))
        .layer(IdempotencyLayer::new(engine.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()?;
    let post = || {
        client
            .post(format!("{base}/pay"))
            .header("idempotency-key", "order-no-mailer-resolver")
            .header("content-type", "application/json")
            .body(r#"{"amount": 10}"#)
    };
    let first = post().send().await?;
    assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE);
    let retry = post().send().await?;
    assert_eq!(retry.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: serde_json::Value = serde_json::from_str(&retry.text().await?)?;
    let unsettled: Vec<&str> = body["steps"]
        .as_array()
        .ok_or("no steps")?
        .iter()
        .filter(|s| s["state"] != "confirmed")
        .filter_map(|s| s["name"].as_str())
        .collect();
    assert_eq!(unsettled, ["receipt"], "{body}");
    assert_eq!(
        body["retry_can_help"], false,
        "the only unsettled step ('receipt') has no resolver and the engine has no \
         whole-key resolver, yet the body tells the client a retry can help: {body}"
    );
    Ok(())
}
