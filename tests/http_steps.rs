//! Effect steps behind the HTTP layer, over loopback with a real client: a
//! handler takes the claim's `Effects` from the request extensions, and an
//! attempt that dies between its two provider calls is answered 503
//! `outcome-unknown` naming the operation's reference and each step's name
//! and state (never the evidence), with whether a retry can help; once the
//! provider answers, the retry resumes and skips the call already made.
//! Guards against a second charge on the retry, evidence leaking into a
//! problem body, and a handler that cannot reach the steps at all.

use std::error::Error;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::http::header::{CONTENT_TYPE, RETRY_AFTER};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Extension, Router};
use idempotency::http::{ClaimInfo, Disposition, IdempotencyLayer};
use idempotency::{EffectStep, Effects, Engine, InDoubtStep, StepResolution};

type TestResult = Result<(), Box<dyn Error>>;

const TYPE_PREFIX: &str = "tag:idempotency.invalid,2026:http-problems#";

#[derive(Default)]
struct Providers {
    charges: AtomicUsize,
    receipts: AtomicUsize,
    /// The next attempt dies after reserving the receipt.
    die: AtomicBool,
}

async fn pay(
    Extension(effects): Extension<Effects>,
    Extension(info): Extension<ClaimInfo>,
    Extension(providers): Extension<Arc<Providers>>,
) -> Result<(StatusCode, String), (StatusCode, Extension<Disposition>)> {
    let in_doubt = || {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Extension(Disposition::InDoubt),
        )
    };
    assert_eq!(effects.fencing_token(), info.fencing_token);
    match effects
        .effect_async("charge")
        .await
        .map_err(|_| in_doubt())?
    {
        EffectStep::Run { .. } => {
            providers.charges.fetch_add(1, Ordering::SeqCst);
            effects
                .confirm_async("charge", b"ch_secret_evidence")
                .await
                .map_err(|_| in_doubt())?;
        }
        EffectStep::Confirmed { .. } => {}
        EffectStep::Failed { .. } => return Ok((StatusCode::PAYMENT_REQUIRED, "declined".into())),
    }
    let EffectStep::Run { .. } = effects
        .effect_async("receipt")
        .await
        .map_err(|_| in_doubt())?
    else {
        return Ok((StatusCode::CREATED, "paid".into()));
    };
    if providers.die.swap(false, Ordering::SeqCst) {
        // The mailer timed out: its outcome is unknown.
        return Err(in_doubt());
    }
    providers.receipts.fetch_add(1, Ordering::SeqCst);
    effects
        .confirm_async("receipt", b"mail-1")
        .await
        .map_err(|_| in_doubt())?;
    Ok((StatusCode::CREATED, "paid".into()))
}

#[tokio::test(flavor = "multi_thread")]
async fn in_doubt_body_names_steps_and_the_retry_resumes() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mailer_answer = Arc::new(Mutex::new(StepResolution::StillUnknown));
    let answer = mailer_answer.clone();
    let engine = Arc::new(
        Engine::builder()
            .sweep_interval(None)
            .step_resolver("receipt", move |_: &InDoubtStep| {
                answer
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone()
            })
            .open(dir.path().join("steps.redb"))?,
    );
    let providers = Arc::new(Providers::default());
    providers.die.store(true, Ordering::SeqCst);
    let app = Router::new()
        .route("/pay", post(pay))
        .layer(IdempotencyLayer::new(engine.clone()))
        .layer(Extension(providers.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()?;
    let post = || {
        client
            .post(format!("{base}/pay"))
            .header("idempotency-key", "order-7")
            .header("content-type", "application/json")
            .body(r#"{"amount": 10}"#)
    };

    let first = post().send().await?;
    assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE);
    // The retry meets the key in doubt: the mailer cannot tell yet.
    let retry = post().send().await?;
    assert_eq!(retry.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(retry.headers().contains_key(RETRY_AFTER));
    assert_eq!(retry.headers()[CONTENT_TYPE], "application/problem+json");
    let text = retry.text().await?;
    assert!(
        !text.contains("ch_secret_evidence"),
        "evidence leaked: {text}"
    );
    let body: serde_json::Value = serde_json::from_str(&text)?;
    assert_eq!(body["type"], format!("{TYPE_PREFIX}outcome-unknown"));
    assert_eq!(body["retry_can_help"], true, "{body}");
    let reference = body["reference"].as_str().ok_or("no reference")?;
    assert!(!reference.is_empty());
    let steps = body["steps"].as_array().ok_or("no steps")?;
    let named: Vec<(&str, &str)> = steps
        .iter()
        .filter_map(|s| Some((s["name"].as_str()?, s["state"].as_str()?)))
        .collect();
    assert_eq!(
        named,
        [("charge", "confirmed"), ("receipt", "unknown")],
        "{body}"
    );
    assert!(steps.iter().all(|s| s.get("evidence").is_none()), "{body}");

    // The mailer never got the call: the retry resumes, skips the charge.
    *mailer_answer.lock().unwrap_or_else(PoisonError::into_inner) = StepResolution::NotExecuted;
    let resumed = post().send().await?;
    assert_eq!(resumed.status(), StatusCode::CREATED);
    assert_eq!(providers.charges.load(Ordering::SeqCst), 1, "charged twice");
    assert_eq!(providers.receipts.load(Ordering::SeqCst), 1);
    let replayed = post().send().await?;
    assert_eq!(replayed.status(), StatusCode::CREATED);
    assert_eq!(providers.charges.load(Ordering::SeqCst), 1);
    Ok(())
}
