//! The `Idempotency-Key` HTTP layer, end to end over loopback: a real axum
//! server on an ephemeral port, real HTTP requests with reqwest, an engine on
//! a redb file. Guards against a handler running twice for one key
//! (concurrent duplicates, retries), against a changed request being
//! answered with another request's response, and against refusals (bad key,
//! bad body, oversize body) leaving records behind.

use std::error::Error;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Extension;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::Router;
use idempotency::http::{ClaimInfo, Disposition, IdempotencyLayer, Route};
use idempotency::{
    Engine, EngineBuilder, ExpiryPolicy, IdempotencyKey, InDoubt, ManualClock, Resolution, State,
};
use reqwest::Response;

type TestResult = Result<(), Box<dyn Error>>;

/// A server with the layer in front of counting handlers.
struct App {
    base: String,
    engine: Arc<Engine>,
    runs: Arc<AtomicUsize>,
    client: reqwest::Client,
    _dir: tempfile::TempDir,
}

async fn start(
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> Result<App, Box<dyn Error>> {
    start_with(Engine::builder(), configure).await
}

async fn start_with(
    builder: EngineBuilder,
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> Result<App, Box<dyn Error>> {
    let dir = tempfile::tempdir()?;
    let engine = Arc::new(builder.open(dir.path().join("http.redb"))?);
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = configure(
        IdempotencyLayer::new(engine.clone())
            .route(Route::new("/payments").require_key().json())
            .max_body_bytes(1024),
    );
    let counted = |status: StatusCode, delay_ms: u64| {
        let runs = runs.clone();
        move |Extension(claim): Extension<ClaimInfo>, body: String| {
            let runs = runs.clone();
            async move {
                let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                let mut headers = HeaderMap::new();
                headers.insert("content-type", "application/json".parse().unwrap());
                headers.insert("location", format!("/payments/{run}").parse().unwrap());
                headers.insert("x-not-stored", "1".parse().unwrap());
                let body = serde_json::json!({
                    "run": run,
                    "reference": claim.reference,
                    "request": body,
                });
                (status, headers, body.to_string())
            }
        }
    };
    let passthrough_runs = runs.clone();
    let unknown_runs = runs.clone();
    let panic_runs = runs.clone();
    let typed_runs = runs.clone();
    let app = Router::new()
        .route("/payments", post(counted(StatusCode::CREATED, 300)))
        .route(
            "/fail500",
            post(counted(StatusCode::INTERNAL_SERVER_ERROR, 0)),
        )
        .route("/decline", post(counted(StatusCode::PAYMENT_REQUIRED, 0)))
        .route(
            "/open",
            post(move || {
                let runs = passthrough_runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    "passed"
                }
            }),
        )
        .route(
            "/timeout",
            post(move || {
                let runs = unknown_runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    (
                        StatusCode::SERVICE_UNAVAILABLE,
                        Extension(Disposition::InDoubt),
                        "provider timed out",
                    )
                }
            }),
        )
        .route("/health", get(|| async { "ok" }))
        .route(
            "/typed",
            post(move |axum::Json(v): axum::Json<serde_json::Value>| {
                let runs = typed_runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::CREATED, v.to_string())
                }
            }),
        )
        .route(
            "/panic",
            post(move || {
                let runs = panic_runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    if runs.load(Ordering::SeqCst) < 1000 {
                        panic!("handler bug");
                    }
                    "unreachable"
                }
            }),
        )
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(App {
        base,
        engine,
        runs,
        client: reqwest::Client::new(),
        _dir: dir,
    })
}

impl App {
    async fn post(&self, path: &str, key: Option<&str>, body: &str) -> reqwest::Result<Response> {
        let mut req = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_string());
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        req.send().await
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

fn replayed(r: &Response) -> bool {
    r.headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

fn content_type(r: &Response) -> String {
    r.headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string()
}

/// Reads a problem+json answer and checks its shape; returns its type.
async fn problem(r: Response, status: u16) -> Result<String, Box<dyn Error>> {
    assert_eq!(r.status().as_u16(), status);
    assert_eq!(content_type(&r), "application/problem+json");
    let body: serde_json::Value = r.json().await?;
    assert_eq!(body["status"], status);
    assert!(
        body["title"].is_string() && body["detail"].is_string(),
        "{body}"
    );
    let kind = body["type"].as_str().unwrap_or("").to_string();
    Ok(kind.rsplit('#').next().unwrap_or("").to_string())
}

const PAYMENT: &str = r#"{"amount": 1000, "currency": "EUR"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_concurrent_duplicates_run_the_handler_once() -> TestResult {
    let app = Arc::new(start(|l| l).await?);
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            let r = app.post("/payments", Some("\"dup-1\""), PAYMENT).await?;
            let status = r.status().as_u16();
            let is_replay = replayed(&r);
            let retry_after = r.headers().get("retry-after").cloned();
            let body = r.text().await?;
            Ok::<_, reqwest::Error>((status, is_replay, retry_after, body))
        }));
    }
    let mut original = None;
    let (mut replays, mut in_progress) = (0, 0);
    let mut replay_bodies = Vec::new();
    for task in tasks {
        let (status, is_replay, retry_after, body) = task.await??;
        match (status, is_replay) {
            (201, false) => {
                assert!(original.is_none(), "two original responses");
                original = Some(body);
            }
            (201, true) => {
                replays += 1;
                replay_bodies.push(body);
            }
            (409, false) => {
                in_progress += 1;
                assert!(retry_after.is_some(), "409 processing without Retry-After");
                assert!(body.contains("processing"), "{body}");
            }
            other => panic!("unexpected answer {other:?}: {body}"),
        }
    }
    assert_eq!(app.runs(), 1, "the handler ran more than once");
    let original = original.ok_or("no request ran the handler")?;
    assert_eq!(replays + in_progress, 49);
    for body in replay_bodies {
        assert_eq!(body, original, "a replay differs from the original");
    }

    // A later retry replays the stored status, stored headers and body.
    let r = app.post("/payments", Some("\"dup-1\""), PAYMENT).await?;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert!(replayed(&r));
    assert_eq!(r.headers()["location"], "/payments/1");
    assert_eq!(content_type(&r), "application/json");
    // Every end-to-end header is stored, not only a short allowlist.
    assert_eq!(r.headers()["x-not-stored"], "1");
    assert_eq!(r.text().await?, original);
    assert_eq!(app.runs(), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn quoted_and_bare_keys_name_the_same_key() -> TestResult {
    let app = start(|l| l).await?;
    let first = app.post("/payments", Some("abc-123"), PAYMENT).await?;
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(!replayed(&first));
    // Member order and number spelling do not change the fingerprint.
    let same = r#"{"currency":"EUR","amount":1000.0}"#;
    let again = app.post("/payments", Some("\"abc-123\""), same).await?;
    assert_eq!(again.status(), StatusCode::CREATED);
    assert!(replayed(&again));
    assert_eq!(app.runs(), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn tampered_retry_is_a_conflict() -> TestResult {
    let app = start(|l| l).await?;
    let r = app.post("/payments", Some("t-1"), PAYMENT).await?;
    assert_eq!(r.status(), StatusCode::CREATED);
    let tampered = r#"{"amount": 100000, "currency": "EUR"}"#;
    let r = app.post("/payments", Some("t-1"), tampered).await?;
    assert_eq!(problem(r, 409).await?, "key-mismatch");
    assert_eq!(app.runs(), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn tampered_retry_is_422_when_configured() -> TestResult {
    let app = start(|l| l.mismatch_status(StatusCode::UNPROCESSABLE_ENTITY)).await?;
    let r = app.post("/payments", Some("t-2"), PAYMENT).await?;
    assert_eq!(r.status(), StatusCode::CREATED);
    let r = app
        .post(
            "/payments",
            Some("t-2"),
            r#"{"amount": 1, "currency": "EUR"}"#,
        )
        .await?;
    assert_eq!(problem(r, 422).await?, "key-mismatch");
    assert_eq!(app.runs(), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_key_is_400_where_required_and_passes_elsewhere() -> TestResult {
    let app = start(|l| l).await?;
    let r = app.post("/payments", None, PAYMENT).await?;
    assert_eq!(problem(r, 400).await?, "missing-key");
    assert_eq!(app.runs(), 0);

    // Not required: passed through untouched, every time.
    for _ in 0..2 {
        let r = app.post("/open", None, "not even json").await?;
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.text().await?, "passed");
    }
    // Methods not configured pass through even with a key.
    let r = app
        .client
        .get(format!("{}/health", app.base))
        .header("idempotency-key", "\"unterminated")
        .send()
        .await?;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(app.runs(), 2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_key_is_400_problem_json() -> TestResult {
    let app = start(|l| l).await?;
    let too_long = "k".repeat(256);
    for key in [
        "\"unterminated",
        "two words",
        "\"\"",
        "a,b",
        too_long.as_str(),
    ] {
        let r = app.post("/payments", Some(key), PAYMENT).await?;
        assert_eq!(problem(r, 400).await?, "malformed-key", "key {key:?}");
    }
    // Repeated header.
    let r = app
        .client
        .post(format!("{}/payments", app.base))
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .body(PAYMENT)
        .send()
        .await?;
    assert_eq!(problem(r, 400).await?, "malformed-key");
    assert_eq!(app.runs(), 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_json_is_400_and_stores_nothing() -> TestResult {
    let app = start(|l| l).await?;
    for body in [r#"{"amount": 10,"#, r#"{"amount": 1, "amount": 2}"#, "[1,"] {
        let r = app.post("/payments", Some("bad-json"), body).await?;
        assert_eq!(problem(r, 400).await?, "invalid-body", "body {body:?}");
    }
    let key = IdempotencyKey::new("POST /payments", "bad-json")?;
    assert!(
        app.engine.record(&key)?.is_none(),
        "a refused request left a record"
    );
    assert_eq!(app.runs(), 0);

    // The key is still free for a valid request.
    let r = app.post("/payments", Some("bad-json"), PAYMENT).await?;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert!(app.engine.record(&key)?.is_some());
    Ok(())
}

/// The server answers 413 and closes while the request body is still
/// arriving; a client that is still writing then sees a broken pipe (or a
/// reset) instead of the answer, depending on timing (issue 14.9). So these
/// requests go out over a raw socket in one write, before the server can
/// read any of it, and the answer is read afterwards: no race left.
#[tokio::test(flavor = "multi_thread")]
async fn oversize_body_is_413_before_any_claim() -> TestResult {
    let app = start(|l| l).await?;
    let big = format!(r#"{{"amount": 1, "pad": "{}"}}"#, "x".repeat(2000));
    let declared = format!(
        "POST /payments HTTP/1.1\r\nhost: x\r\nidempotency-key: big\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{big}",
        big.len()
    );
    let (status, body) = raw_exchange(&app.base, declared.as_bytes()).await?;
    assert_eq!(status, 413);
    assert!(body.contains("body-too-large"), "{body}");

    // Without Content-Length (chunked), the limit holds while reading.
    let mut chunked = b"POST /payments HTTP/1.1\r\nhost: x\r\nidempotency-key: big\r\n\
        content-type: application/json\r\ntransfer-encoding: chunked\r\n\
        connection: close\r\n\r\n"
        .to_vec();
    for _ in 0..40 {
        chunked.extend_from_slice(b"64\r\n");
        chunked.extend_from_slice(&[b'x'; 100]);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let (status, body) = raw_exchange(&app.base, &chunked).await?;
    assert_eq!(status, 413);
    assert!(body.contains("body-too-large"), "{body}");

    let key = IdempotencyKey::new("POST /payments", "big")?;
    assert!(app.engine.record(&key)?.is_none());
    assert_eq!(app.runs(), 0);
    Ok(())
}

/// Sends a whole HTTP/1.1 request in one write, then reads the answer
/// until the server closes. A reset after the answer arrived (the server
/// closed with unread request bytes) still returns what was read.
async fn raw_exchange(base: &str, request: &[u8]) -> Result<(u16, String), Box<dyn Error>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = base.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(request).await?;
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(e) if !answer.is_empty() => {
                eprintln!("read ended with {e} after the answer");
                break;
            }
            Err(e) => return Err(e.into()),
        }
    }
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status line in {text:?}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    Ok((status, body))
}

#[tokio::test(flavor = "multi_thread")]
async fn inner_500_is_never_run_again_and_402_is_replayed() -> TestResult {
    let app = start(|l| l).await?;
    let r = app.post("/fail500", Some("e-500"), PAYMENT).await?;
    assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(!replayed(&r));
    // The handler may have acted before failing: a retry must not run it.
    let r = app.post("/fail500", Some("e-500"), PAYMENT).await?;
    assert_eq!(problem(r, 503).await?, "outcome-unknown");
    assert_eq!(app.runs(), 1, "a 500 must not be executed again by default");

    let first = app.post("/decline", Some("e-402"), PAYMENT).await?;
    assert_eq!(first.status(), StatusCode::PAYMENT_REQUIRED);
    assert!(!replayed(&first));
    let first = first.text().await?;
    let again = app.post("/decline", Some("e-402"), PAYMENT).await?;
    assert_eq!(again.status(), StatusCode::PAYMENT_REQUIRED);
    assert!(replayed(&again));
    assert_eq!(again.text().await?, first);
    assert_eq!(app.runs(), 2, "a stored 4xx must not run again");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn dispositions_are_configurable() -> TestResult {
    let app = start(|l| {
        l.on_server_error(Disposition::Store)
            .on_client_error(Disposition::Retry)
    })
    .await?;
    for _ in 0..2 {
        let r = app.post("/fail500", Some("c-500"), PAYMENT).await?;
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
    for _ in 0..2 {
        let r = app.post("/decline", Some("c-402"), PAYMENT).await?;
        assert_eq!(r.status(), StatusCode::PAYMENT_REQUIRED);
        assert!(!replayed(&r));
    }
    assert_eq!(app.runs(), 3, "500 stored once, 402 run twice");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn handler_marked_unknown_is_503_with_retry_after() -> TestResult {
    let app = start(|l| l.in_doubt_retry_after(Duration::from_millis(1500))).await?;
    let r = app.post("/timeout", Some("u-1"), PAYMENT).await?;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.text().await?, "provider timed out");
    let r = app.post("/timeout", Some("u-1"), PAYMENT).await?;
    assert_eq!(r.headers()["retry-after"], "2");
    assert_eq!(problem(r, 503).await?, "outcome-unknown");
    assert_eq!(app.runs(), 1, "an unknown outcome must never run again");
    let key = IdempotencyKey::new("POST /timeout", "u-1")?;
    let record = app.engine.record(&key)?.ok_or("no record")?;
    assert_eq!(record.state, State::Unknown);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn resolver_settles_unknown_into_a_replay() -> TestResult {
    let builder = Engine::builder().resolver(|p: &InDoubt| {
        Resolution::Completed(
            idempotency::Envelope::new(1, 201, format!(r#"{{"settled":"{}"}}"#, p.reference))
                .with_header("content-type", "application/json"),
        )
    });
    let app = start_with(builder, |l| l).await?;
    let r = app.post("/timeout", Some("r-1"), PAYMENT).await?;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    let r = app.post("/timeout", Some("r-1"), PAYMENT).await?;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert!(replayed(&r));
    assert!(r.text().await?.contains("settled"));
    assert_eq!(app.runs(), 1, "settled by querying, never by running again");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn expired_key_under_tombstone_is_409() -> TestResult {
    let clock = ManualClock::new(1_000_000);
    let builder = Engine::builder()
        .clock(clock.clone())
        .ttl(Duration::from_secs(60))
        .expiry_policy(ExpiryPolicy::Tombstone {
            keep: std::time::Duration::from_millis(3_600_000),
        })
        .sweep_interval(None);
    let app = start_with(builder, |l| l).await?;
    let r = app.post("/decline", Some("x-1"), PAYMENT).await?;
    assert_eq!(r.status(), StatusCode::PAYMENT_REQUIRED);
    clock.advance(Duration::from_secs(120));
    let r = app.post("/decline", Some("x-1"), PAYMENT).await?;
    assert_eq!(problem(r, 409).await?, "key-expired");
    assert_eq!(app.runs(), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn tenants_do_not_share_keys() -> TestResult {
    let app = start(|l| l.tenant_header(axum::http::HeaderName::from_static("x-tenant"))).await?;
    for tenant in ["a", "b", "a"] {
        let r = app
            .client
            .post(format!("{}/decline", app.base))
            .header("idempotency-key", "same")
            .header("x-tenant", tenant)
            .header("content-type", "application/json")
            .body(PAYMENT)
            .send()
            .await?;
        assert_eq!(r.status(), StatusCode::PAYMENT_REQUIRED);
    }
    assert_eq!(app.runs(), 2, "tenant b's key is not tenant a's");
    let key = IdempotencyKey::new("POST /decline tenant=b", "same")?;
    assert!(app.engine.record(&key)?.is_some());
    Ok(())
}

/// A tenant header must not be able to spell another caller's scope: the
/// default scope is `METHOD route tenant=… caller=…`, and a tenant value
/// containing ` caller=<digest>` once reached the victim's records.
#[tokio::test(flavor = "multi_thread")]
async fn tenant_header_cannot_spell_another_callers_scope() -> TestResult {
    let app = start(|l| l.tenant_header(axum::http::HeaderName::from_static("x-tenant"))).await?;
    let send = |tenant: &'static str, auth: Option<&'static str>| {
        let mut request = app
            .client
            .post(format!("{}/decline", app.base))
            .header("idempotency-key", "victim-1")
            .header("x-tenant", tenant)
            .header("content-type", "application/json")
            .body(PAYMENT);
        if let Some(auth) = auth {
            request = request.header("authorization", auth);
        }
        request.send()
    };
    assert_eq!(send("m1", Some("Bearer victim")).await?.status(), 402);
    let records = app.engine.records(&Default::default())?;
    let victim_scope = records
        .iter()
        .flatten()
        .map(|r| r.key.scope().to_string())
        .find(|s| s.contains("caller="))
        .ok_or("the victim's record has no caller part")?;
    let caller = victim_scope
        .rsplit_once("caller=")
        .map(|(_, digest)| digest.to_string())
        .ok_or("no digest")?;
    // The attacker sends no credentials and puts the digest in the tenant.
    let forged: &'static str = Box::leak(format!("m1 caller={caller}").into_boxed_str());
    let r = send(forged, None).await?;
    assert!(
        r.headers().get("idempotent-replayed").is_none(),
        "replayed the victim's record"
    );
    assert_eq!(app.runs(), 2, "the forged scope must be a scope of its own");
    // A tenant sent twice is refused, not silently read as its first value.
    let r = app
        .client
        .post(format!("{}/decline", app.base))
        .header("idempotency-key", "victim-2")
        .header("x-tenant", "m1")
        .header("x-tenant", "m2")
        .header("content-type", "application/json")
        .body(PAYMENT)
        .send()
        .await?;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn json_pointers_ignore_other_fields() -> TestResult {
    let app =
        start(|l| l.route(Route::new("/decline").json_pointers(["/amount", "/currency"]))).await?;
    let a = r#"{"amount": 5, "currency": "EUR", "trace": "1"}"#;
    let b = r#"{"trace": "2", "currency": "EUR", "amount": 5}"#;
    let c = r#"{"trace": "2", "currency": "USD", "amount": 5}"#;
    assert!(!replayed(&app.post("/decline", Some("p-1"), a).await?));
    assert!(replayed(&app.post("/decline", Some("p-1"), b).await?));
    let r = app.post("/decline", Some("p-1"), c).await?;
    assert_eq!(problem(r, 409).await?, "key-mismatch");
    assert_eq!(app.runs(), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn handler_panic_leaves_the_key_unknown() -> TestResult {
    let app = start(|l| l).await?;
    // The panic unwinds through the layer into the server, which drops the
    // connection (or answers 500, depending on the stack).
    let first = app.post("/panic", Some("boom"), PAYMENT).await;
    assert!(first.map_or(true, |r| r.status().is_server_error()));
    let key = IdempotencyKey::new("POST /panic", "boom")?;
    let record = app.engine.record(&key)?.ok_or("no record")?;
    assert_eq!(record.state, State::Unknown);
    let r = app.post("/panic", Some("boom"), PAYMENT).await?;
    assert_eq!(problem(r, 503).await?, "outcome-unknown");
    assert_eq!(app.runs(), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn handler_panic_can_release_the_key() -> TestResult {
    let app = start(|l| l.on_panic(Disposition::Retry)).await?;
    for _ in 0..2 {
        let _ = app.post("/panic", Some("boom"), PAYMENT).await;
    }
    assert_eq!(app.runs(), 2, "a released key runs again");
    let key = IdempotencyKey::new("POST /panic", "boom")?;
    assert!(app.engine.record(&key)?.is_none());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn dropped_request_mid_handler_leaves_the_key_unknown() -> TestResult {
    let dir = tempfile::tempdir()?;
    let engine = Arc::new(Engine::builder().open(dir.path().join("drop.redb"))?);
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let mut app: Router = Router::new()
        .route(
            "/slow",
            post(move || {
                let runs = counter.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    "too late"
                }
            }),
        )
        .layer(IdempotencyLayer::new(engine.clone()));
    let request = || {
        axum::http::Request::post("/slow")
            .header("idempotency-key", "slow-1")
            .body(axum::body::Body::from("{}"))
    };
    // A timeout (or a client hanging up) drops the response future while
    // the handler runs.
    let call = tower::Service::call(&mut app, request()?);
    let outcome = tokio::time::timeout(Duration::from_millis(300), call).await;
    assert!(outcome.is_err(), "the handler should still be running");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let key = IdempotencyKey::new("POST /slow", "slow-1")?;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let state = app_state(&engine, &key)?;
        if state == Some(State::Unknown) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "still {state:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Never executed again. The dropped claim's handler may still be
    // running until its lease ends, so the retry hears "in progress" (409
    // with Retry-After), not yet "unknown".
    let response = tower::Service::call(&mut app, request()?).await?;
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert!(response.headers().contains_key("retry-after"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    Ok(())
}

fn app_state(engine: &Engine, key: &IdempotencyKey) -> idempotency::Result<Option<State>> {
    Ok(engine.record(key)?.map(|r| r.state))
}

/// axum's extractors reject a request (415 without a JSON content type, 422
/// for a wrongly shaped body) before the handler acts: storing that answer
/// would burn the key, and the corrected retry would replay the rejection.
#[tokio::test(flavor = "multi_thread")]
async fn extractor_rejections_are_not_stored() -> TestResult {
    let app = start(|l| l).await?;
    let url = format!("{}/typed", app.base);
    let rejected = app
        .client
        .post(&url)
        .header("idempotency-key", "ct-1")
        .body(PAYMENT)
        .send()
        .await?;
    assert_eq!(rejected.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(app.runs(), 0);
    let corrected = app.post("/typed", Some("ct-1"), PAYMENT).await?;
    assert_eq!(corrected.status(), StatusCode::CREATED);
    assert!(!replayed(&corrected));
    assert_eq!(app.runs(), 1);
    let again = app.post("/typed", Some("ct-1"), PAYMENT).await?;
    assert!(replayed(&again));
    assert_eq!(app.runs(), 1);
    Ok(())
}
