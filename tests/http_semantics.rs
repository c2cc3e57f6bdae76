//! The layer's answers as the IETF Idempotency-Key draft's newer revisions
//! and a first axum user meet them (issues 25 and 27), over loopback with a
//! real client. Guards against: a handler running twice because a retry's
//! cookie jar gained a cookie; an expired key answered like a new one when
//! the app asked for 410; problem bodies without `retryable`, or without
//! the lease end a client needs to time its retry; problem types pointing
//! at pages that do not exist; a `Set-Cookie` the app asked to store being
//! dropped silently, and an unreplayable header accepted into the list.

use std::error::Error;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::header::{CONTENT_TYPE, SET_COOKIE, TRANSFER_ENCODING};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Extension, Router};
use idempotency::http::{Caller, Disposition, IdempotencyLayer, Route};
use idempotency::{Engine, EngineBuilder, ExpiryPolicy, ManualClock};
use tokio::sync::Semaphore;

type TestResult = Result<(), Box<dyn Error>>;

/// 2026-12-01T15:04:05.000Z in milliseconds since the Unix epoch.
const T0_MS: u64 = 1_796_137_445_000;
/// The problem type prefix the layer documents (a tag URI, RFC 4151).
const TYPE_PREFIX: &str = "tag:idempotency.invalid,2026:http-problems#";
const PAYMENT: &str = r#"{"amount": 1000, "currency": "EUR"}"#;

struct App {
    base: String,
    runs: Arc<AtomicUsize>,
    /// `/slow` waits for a permit here before answering.
    gate: Arc<Semaphore>,
    client: reqwest::Client,
    _dir: tempfile::TempDir,
}

/// The layer (configured by `configure`) in front of counting handlers:
/// `/payments` answers 201 with a `Set-Cookie`, `/slow` waits for the
/// gate, `/unknown` advances the clock 2 s and answers 503 marked
/// [`Disposition::InDoubt`], `/decline` answers 402.
async fn start(
    builder: EngineBuilder,
    clock: ManualClock,
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> Result<App, Box<dyn Error>> {
    let dir = tempfile::tempdir()?;
    let engine = Arc::new(builder.open(dir.path().join("semantics.redb"))?);
    let runs = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(Semaphore::new(0));
    let counter = |runs: &Arc<AtomicUsize>| {
        let runs = runs.clone();
        move || runs.fetch_add(1, Ordering::SeqCst) + 1
    };
    let (pay, slow, unknown, decline) = (
        counter(&runs),
        counter(&runs),
        counter(&runs),
        counter(&runs),
    );
    let slow_gate = gate.clone();
    let app = Router::new()
        .route(
            "/payments",
            post(move || {
                let run = pay();
                async move {
                    (
                        StatusCode::CREATED,
                        [(CONTENT_TYPE, "application/json"), (SET_COOKIE, "seen=1")],
                        format!(r#"{{"run":{run}}}"#),
                    )
                }
            }),
        )
        .route(
            "/slow",
            post(move || {
                slow();
                let gate = slow_gate.clone();
                async move {
                    let _permit = gate.acquire().await;
                    StatusCode::CREATED
                }
            }),
        )
        .route(
            "/unknown",
            post(move || {
                unknown();
                clock.advance(Duration::from_secs(2));
                async {
                    (
                        StatusCode::SERVICE_UNAVAILABLE,
                        Extension(Disposition::InDoubt),
                    )
                }
            }),
        )
        .route(
            "/decline",
            post(move || {
                decline();
                async { StatusCode::PAYMENT_REQUIRED }
            }),
        )
        .layer(configure(
            IdempotencyLayer::new(engine).route(Route::new("/payments").json()),
        ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(App {
        base,
        runs,
        gate,
        client: reqwest::Client::builder()
            .timeout(Duration::from_secs(20))
            .build()?,
        _dir: dir,
    })
}

fn manual() -> (ManualClock, EngineBuilder) {
    let clock = ManualClock::new(T0_MS);
    let builder = Engine::builder()
        .clock(clock.clone())
        .lease(Duration::from_secs(10))
        .sweep_interval(None);
    (clock, builder)
}

impl App {
    fn post(&self, path: &str, key: &str) -> reqwest::RequestBuilder {
        self.client
            .post(format!("{}{path}", self.base))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(PAYMENT)
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

fn replayed(r: &reqwest::Response) -> bool {
    r.headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

/// Checks a problem answer's status, content type and `type` prefix;
/// returns its name (the fragment) and the body.
async fn problem(
    r: reqwest::Response,
    status: u16,
) -> Result<(String, serde_json::Value), Box<dyn Error>> {
    assert_eq!(r.status().as_u16(), status);
    assert_eq!(r.headers()[CONTENT_TYPE], "application/problem+json");
    let body: serde_json::Value = r.json().await?;
    let kind = body["type"].as_str().ok_or("no type")?;
    let name = kind
        .strip_prefix(TYPE_PREFIX)
        .ok_or_else(|| format!("type {kind:?} is not under {TYPE_PREFIX}"))?;
    assert!(body["retryable"].is_boolean(), "{body}");
    Ok((name.to_owned(), body))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_changed_cookie_jar_is_the_same_caller() -> TestResult {
    let (clock, builder) = manual();
    let app = start(builder, clock, |l| l).await?;
    let first = app
        .post("/payments", "order-1")
        .header("authorization", "Bearer alice")
        .header("cookie", "session=s1")
        .send()
        .await?;
    assert_eq!(first.status(), StatusCode::CREATED);
    // The retry's jar gained a load balancer's cookie and the one the
    // first response set: same key, same Authorization, so a replay.
    let retry = app
        .post("/payments", "order-1")
        .header("authorization", "Bearer alice")
        .header("cookie", "session=s1; lb=xyz; seen=1")
        .send()
        .await?;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(replayed(&retry), "the retry ran the handler again");
    assert_eq!(app.runs(), 1);
    // Another credential is still another caller.
    let bob = app
        .post("/payments", "order-1")
        .header("authorization", "Bearer bob")
        .send()
        .await?;
    assert!(!replayed(&bob), "bob got alice's stored response");
    assert_eq!(app.runs(), 2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn cookie_sessions_count_by_name_only() -> TestResult {
    let (clock, builder) = manual();
    let app = start(builder, clock, |l| l.caller(Caller::cookies(["session"]))).await?;
    let send = |jar: &'static str| app.post("/payments", "k").header("cookie", jar).send();
    assert!(!replayed(&send("session=s1").await?));
    assert!(replayed(&send("lb=xyz; session=s1").await?), "extra cookie");
    assert!(!replayed(&send("session=s2").await?), "another session");
    assert_eq!(app.runs(), 2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn expired_key_is_410_gone_when_asked_and_tombstoned() -> TestResult {
    let (clock, builder) = manual();
    let builder = builder
        .ttl(Duration::from_secs(60))
        .expiry_policy(ExpiryPolicy::Tombstone {
            keep: Duration::from_secs(3600),
        });
    let app = start(builder, clock.clone(), |l| {
        l.expired_status(StatusCode::GONE)
    })
    .await?;
    let r = app.post("/decline", "x-1").send().await?;
    assert_eq!(r.status(), StatusCode::PAYMENT_REQUIRED);
    clock.advance(Duration::from_secs(120));
    let (name, body) = problem(app.post("/decline", "x-1").send().await?, 410).await?;
    assert_eq!(name, "key-expired");
    assert_eq!(body["retryable"], false);
    // Expired at T0 + 60 s; reusable an hour later.
    assert_eq!(body["reusable_at"], "2026-12-01T16:05:05.000Z");
    assert_eq!(app.runs(), 1, "an expired key never runs again");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn without_tombstones_an_expired_key_is_new_again() -> TestResult {
    let (clock, builder) = manual();
    let builder = builder
        .ttl(Duration::from_secs(60))
        .expiry_policy(ExpiryPolicy::Forget);
    let app = start(builder, clock.clone(), |l| {
        l.expired_status(StatusCode::GONE)
    })
    .await?;
    app.post("/decline", "x-1").send().await?;
    clock.advance(Duration::from_secs(120));
    // Forgotten: the engine cannot tell it from a new key, so no 410.
    let r = app.post("/decline", "x-1").send().await?;
    assert_eq!(r.status(), StatusCode::PAYMENT_REQUIRED);
    assert!(!replayed(&r));
    assert_eq!(app.runs(), 2);
    Ok(())
}

#[test]
fn expired_status_is_409_or_410() -> TestResult {
    let dir = tempfile::tempdir()?;
    let engine = Arc::new(Engine::builder().open(dir.path().join("e.redb"))?);
    let layer = IdempotencyLayer::new(engine);
    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        layer.clone().expired_status(StatusCode::NOT_FOUND)
    }));
    assert!(refused.is_err(), "404 accepted as the expired status");
    let _ = layer.expired_status(StatusCode::CONFLICT);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn in_flight_and_in_doubt_answers_carry_the_lease_end() -> TestResult {
    let (clock, builder) = manual();
    let app = start(builder, clock.clone(), |l| l).await?;
    let first = tokio::spawn(app.post("/slow", "s-1").send());
    // The claim is taken once the handler runs.
    tokio::time::timeout(Duration::from_secs(20), async {
        while app.runs() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await?;
    let (name, body) = problem(app.post("/slow", "s-1").send().await?, 409).await?;
    assert_eq!(name, "processing");
    assert_eq!(body["retryable"], true);
    // Claimed at T0 with a 10 s lease.
    assert_eq!(body["lease_ends_at"], "2026-12-01T15:04:15.000Z");
    app.gate.add_permits(1);
    assert_eq!(first.await??.status(), StatusCode::CREATED);

    // The handler failed at T0 + 2 s with its outcome unknown: that is
    // where its lease ended.
    let r = app.post("/unknown", "u-1").send().await?;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    let (name, body) = problem(app.post("/unknown", "u-1").send().await?, 503).await?;
    assert_eq!(name, "outcome-unknown");
    assert_eq!(body["retryable"], true);
    assert_eq!(body["lease_ends_at"], "2026-12-01T15:04:07.000Z");
    assert_eq!(app.runs(), 2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn refusals_say_whether_to_retry() -> TestResult {
    let (clock, builder) = manual();
    let app = start(builder, clock, |l| l.require_key(true)).await?;
    let bare = app
        .client
        .post(format!("{}/decline", app.base))
        .send()
        .await?;
    let (name, body) = problem(bare, 400).await?;
    assert_eq!(
        (name.as_str(), &body["retryable"]),
        ("missing-key", &false.into())
    );
    app.post("/payments", "m-1").send().await?;
    let changed = app
        .post("/payments", "m-1")
        .body(r#"{"amount": 2}"#)
        .send()
        .await?;
    let (name, body) = problem(changed, 409).await?;
    assert_eq!(
        (name.as_str(), &body["retryable"]),
        ("key-mismatch", &false.into())
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_set_cookie_named_in_stored_headers_is_replayed() -> TestResult {
    let (clock, builder) = manual();
    let named = start(builder, clock, |l| {
        l.stored_headers([CONTENT_TYPE, SET_COOKIE])
    })
    .await?;
    named.post("/payments", "c-1").send().await?;
    let replay = named.post("/payments", "c-1").send().await?;
    assert!(replayed(&replay));
    assert_eq!(replay.headers()[SET_COOKIE], "seen=1");

    // By default it is not stored.
    let (clock, builder) = manual();
    let default = start(builder, clock, |l| l).await?;
    default.post("/payments", "c-1").send().await?;
    let replay = default.post("/payments", "c-1").send().await?;
    assert!(replayed(&replay));
    assert!(replay.headers().get(SET_COOKIE).is_none());
    assert_eq!(replay.headers()[CONTENT_TYPE], "application/json");
    Ok(())
}

#[test]
fn unreplayable_stored_headers_are_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let engine = Arc::new(Engine::builder().open(dir.path().join("h.redb"))?);
    let layer = IdempotencyLayer::new(engine);
    for name in [TRANSFER_ENCODING, axum::http::header::DATE] {
        let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            layer.clone().stored_headers([CONTENT_TYPE, name.clone()])
        }));
        assert!(refused.is_err(), "{name} accepted into stored_headers");
    }
    Ok(())
}
