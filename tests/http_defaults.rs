//! The HTTP layer's defaults, as a payments team meets them (issue 13),
//! over loopback with a real client. Guards against: one caller receiving
//! another caller's stored response; a "try again" refusal (429) pinned to
//! a key; a 500 re-executed after the work may have happened; replays that
//! lose the headers needed to read their body; streams held back until they
//! end; a response too large to store turning into UNKNOWN; a bodiless JSON
//! POST refused; a blank key accepted; a Retry-After of the whole lease for
//! a short request; duplicates that cannot wait; mismatches that do not say
//! which field differs.

use std::error::Error;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::{Path, Request};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use idempotency::http::{Caller, Disposition, IdempotencyLayer, Route};
use idempotency::{Engine, EngineBuilder, IdempotencyKey, RecordFilter, State};
use tokio::sync::{mpsc, Semaphore};

type TestResult = Result<(), Box<dyn Error>>;

/// Bounds every wait of a test, so a regression fails instead of hanging.
const BOUND: Duration = Duration::from_secs(20);

struct Server {
    base: String,
    engine: Arc<Engine>,
    client: reqwest::Client,
    _dir: tempfile::TempDir,
}

async fn serve(
    builder: EngineBuilder,
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
    router: Router,
) -> Result<Server, Box<dyn Error>> {
    let dir = tempfile::tempdir()?;
    let engine = Arc::new(builder.open(dir.path().join("defaults.redb"))?);
    let app = router.layer(configure(IdempotencyLayer::new(engine.clone())));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(Server {
        base,
        engine,
        client: reqwest::Client::new(),
        _dir: dir,
    })
}

impl Server {
    fn post(&self, path: &str, key: &str) -> reqwest::RequestBuilder {
        self.client
            .post(format!("{}{path}", self.base))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
    }
}

fn replayed(r: &reqwest::Response) -> bool {
    r.headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

/// Reads a problem+json answer; returns its type fragment and the body.
async fn problem(
    r: reqwest::Response,
    status: u16,
) -> Result<(String, serde_json::Value), Box<dyn Error>> {
    assert_eq!(r.status().as_u16(), status);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let body: serde_json::Value = r.json().await?;
    let kind = body["type"].as_str().unwrap_or("");
    let kind = kind.rsplit('#').next().unwrap_or("").to_string();
    Ok((kind, body))
}

/// The record of `key` on `path` is COMPLETED (a known outcome, never
/// UNKNOWN), and a retry is replayed as a 409 `response-not-retained`
/// naming `original_status`, with `location` kept.
async fn completed_not_retained(
    s: &Server,
    path: &str,
    key: &str,
    location: &str,
    original_status: u16,
) -> TestResult {
    let record_key = IdempotencyKey::new(format!("POST {path}"), key)?;
    let record = s.engine.record(&record_key)?.ok_or("no record")?;
    assert_eq!(
        record.state,
        State::Completed,
        "a known outcome became {:?}",
        record.state
    );
    let retry = s.post(path, key).body(PAYMENT).send().await?;
    assert!(replayed(&retry));
    assert_eq!(retry.headers()["location"], location);
    let (kind, body) = problem(retry, 409).await?;
    assert_eq!(kind, "response-not-retained");
    assert_eq!(body["original_status"], original_status);
    Ok(())
}

/// A handler counting its runs, answering 201 with the run number and the
/// caller's `Authorization` value.
fn counting(runs: Arc<AtomicUsize>) -> Router {
    Router::new().route(
        "/payments",
        post(move |headers: HeaderMap| {
            let runs = runs.clone();
            async move {
                let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                let who = headers
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_string();
                let body = serde_json::json!({ "run": run, "who": who });
                (StatusCode::CREATED, body.to_string())
            }
        }),
    )
}

const PAYMENT: &str = r#"{"amount": 1000, "currency": "EUR"}"#;

#[tokio::test(flavor = "multi_thread")]
async fn callers_with_different_credentials_never_share_records() -> TestResult {
    let runs = Arc::new(AtomicUsize::new(0));
    // The default (`Authorization`) plus the session cookie, by name.
    let caller = Caller::headers_and_cookies([axum::http::header::AUTHORIZATION], ["session"]);
    let s = serve(
        Engine::builder(),
        |l| l.caller(caller),
        counting(runs.clone()),
    )
    .await?;
    let send = |auth: &'static str| {
        s.post("/payments", "\"order-1\"")
            .header("authorization", auth)
            .body(PAYMENT)
            .send()
    };
    let alice = send("Bearer alice-secret").await?;
    assert_eq!(alice.status(), StatusCode::CREATED);
    let bob = send("Bearer bob-secret").await?;
    assert_eq!(bob.status(), StatusCode::CREATED);
    assert!(!replayed(&bob), "bob got alice's stored response");
    let bob_body: serde_json::Value = bob.json().await?;
    assert_eq!(bob_body["who"], "Bearer bob-secret");
    let again = send("Bearer alice-secret").await?;
    assert!(replayed(&again), "alice's own retry replays");
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // Named cookies identify a caller too.
    for cookie in ["session=a", "session=b"] {
        let r = s
            .post("/payments", "\"order-2\"")
            .header("cookie", cookie)
            .body(PAYMENT)
            .send()
            .await?;
        assert!(!replayed(&r), "cookie {cookie}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 4);

    // Credentials are never stored in clear.
    for record in s.engine.records(&RecordFilter::default())? {
        let scope = record?.key.scope().to_string();
        assert!(
            !scope.contains("secret") && !scope.contains("session="),
            "{scope}"
        );
        assert!(scope.contains(" caller="), "{scope}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn shared_keys_and_custom_callers_are_explicit() -> TestResult {
    let runs = Arc::new(AtomicUsize::new(0));
    let shared = serve(
        Engine::builder(),
        |l| l.caller(Caller::shared()),
        counting(runs.clone()),
    )
    .await?;
    for auth in ["Bearer a", "Bearer b"] {
        let r = shared
            .post("/payments", "k")
            .header("authorization", auth)
            .body(PAYMENT)
            .send()
            .await?;
        assert_eq!(r.status(), StatusCode::CREATED);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "shared keys: one run");

    // The app's own identity: one account, two rotated credentials.
    let runs = Arc::new(AtomicUsize::new(0));
    let by_account = serve(
        Engine::builder(),
        |l| {
            l.caller(Caller::from_fn(|parts| {
                let account = parts.headers.get("x-account")?;
                account.to_str().ok().map(str::to_owned)
            }))
        },
        counting(runs.clone()),
    )
    .await?;
    for (account, auth) in [
        ("acct-1", "Bearer old"),
        ("acct-1", "Bearer new"),
        ("acct-2", "Bearer new"),
    ] {
        by_account
            .post("/payments", "k")
            .header("x-account", account)
            .header("authorization", auth)
            .body(PAYMENT)
            .send()
            .await?;
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2, "one run per account");
    Ok(())
}

/// Answers the status in the path; `?retry_after` adds `Retry-After: 1`.
fn by_status(runs: Arc<AtomicUsize>) -> Router {
    Router::new().route(
        "/status/{code}",
        post(move |Path(code): Path<u16>, req: Request| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let status = StatusCode::from_u16(code).unwrap_or(StatusCode::IM_A_TEAPOT);
                let mut response = (status, "answer").into_response();
                if req.uri().query() == Some("retry_after") {
                    response
                        .headers_mut()
                        .insert("retry-after", HeaderValue::from_static("1"));
                }
                response
            }
        }),
    )
}

#[derive(Debug, PartialEq)]
enum Fate {
    Released,
    Stored,
    Unknown,
}

/// The default table of `docs/http.md` and `IdempotencyLayer`, row by row.
#[tokio::test(flavor = "multi_thread")]
async fn default_status_table() -> TestResult {
    let runs = Arc::new(AtomicUsize::new(0));
    let s = serve(Engine::builder(), |l| l, by_status(runs.clone())).await?;
    let rows = [
        (201, false, Fate::Stored),
        (303, false, Fate::Stored),
        (400, false, Fate::Released),
        (402, false, Fate::Stored),
        (404, false, Fate::Stored),
        (408, false, Fate::Released),
        (409, false, Fate::Stored),
        (411, false, Fate::Released),
        (413, false, Fate::Released),
        (415, false, Fate::Released),
        (422, false, Fate::Released),
        (425, false, Fate::Released),
        (429, false, Fate::Released),
        (429, true, Fate::Released),
        (500, false, Fate::Unknown),
        (502, false, Fate::Unknown),
        (503, false, Fate::Unknown),
        (503, true, Fate::Released),
        (504, false, Fate::Unknown),
    ];
    for (code, retry_after, want) in rows {
        let path = format!("/status/{code}");
        let url = if retry_after {
            format!("{path}?retry_after")
        } else {
            path.clone()
        };
        let key = format!("k-{code}-{retry_after}");
        let r = s.post(&url, &key).body("{}").send().await?;
        assert_eq!(r.status().as_u16(), code);
        let scoped = IdempotencyKey::new(format!("POST {path}"), key.as_str())?;
        let fate = match s.engine.record(&scoped)?.map(|r| r.state) {
            None => Fate::Released,
            Some(State::Completed | State::FinalFailure) => Fate::Stored,
            Some(State::Unknown) => Fate::Unknown,
            Some(other) => return Err(format!("{code}: record is {other:?}").into()),
        };
        assert_eq!(fate, want, "status {code} (Retry-After: {retry_after})");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn rate_limited_retry_runs_after_the_delay() -> TestResult {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let router = Router::new().route(
        "/payments",
        post(move || {
            let runs = counter.clone();
            async move {
                if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                    (
                        StatusCode::TOO_MANY_REQUESTS,
                        [("retry-after", "1")],
                        "slow down",
                    )
                } else {
                    (StatusCode::CREATED, [("retry-after", "0")], "charged")
                }
            }
        }),
    );
    let s = serve(Engine::builder(), |l| l, router).await?;
    let first = s.post("/payments", "rl-1").body(PAYMENT).send().await?;
    assert_eq!(first.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry = s.post("/payments", "rl-1").body(PAYMENT).send().await?;
    assert_eq!(
        retry.status(),
        StatusCode::CREATED,
        "the 429 was pinned to the key"
    );
    assert!(!replayed(&retry));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn handler_can_release_a_500_it_knows_did_nothing() -> TestResult {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let router = Router::new().route(
        "/payments",
        post(move || {
            let runs = counter.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    Extension(Disposition::Retry),
                    "validation backend down; nothing charged",
                )
            }
        }),
    );
    let s = serve(Engine::builder(), |l| l, router).await?;
    for _ in 0..2 {
        let r = s.post("/payments", "r-500").body(PAYMENT).send().await?;
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_keeps_content_encoding_and_drops_credentials() -> TestResult {
    // Not valid gzip, and not meant to be: the client here does not decode,
    // so the test sees exactly the bytes and headers the server sends.
    let gzip_bytes: &'static [u8] = b"\x1f\x8b\x08\x00pretend-gzip";
    let router = Router::new().route(
        "/payments",
        post(move || async move {
            (
                StatusCode::CREATED,
                [
                    ("content-type", "application/json"),
                    ("content-encoding", "gzip"),
                    ("vary", "accept-encoding"),
                    ("set-cookie", "session=secret"),
                    ("etag", "\"v1\""),
                ],
                gzip_bytes,
            )
        }),
    );
    let s = serve(Engine::builder(), |l| l, router).await?;
    let first = s.post("/payments", "gz-1").body(PAYMENT).send().await?;
    assert_eq!(first.headers()["content-encoding"], "gzip");
    let first_bytes = first.bytes().await?;
    let replay = s.post("/payments", "gz-1").body(PAYMENT).send().await?;
    assert!(replayed(&replay));
    assert_eq!(replay.status(), StatusCode::CREATED);
    for name in ["content-encoding", "content-type", "vary", "etag"] {
        assert!(replay.headers().contains_key(name), "replay lacks {name}");
    }
    assert!(
        replay.headers().get("set-cookie").is_none(),
        "a credential was replayed"
    );
    assert_eq!(replay.bytes().await?, first_bytes);
    Ok(())
}

/// A body fed from a channel: data frames until the sender is dropped.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| Ok(http_body::Frame::data(c))))
    }
}

/// `/events` streams what the test sends into the channel it hands over.
fn streaming(senders: mpsc::UnboundedSender<mpsc::Sender<Bytes>>) -> Router {
    Router::new().route(
        "/events",
        post(move || {
            let senders = senders.clone();
            async move {
                let (tx, rx) = mpsc::channel(8);
                let _ = senders.send(tx);
                let mut response = Response::new(axum::body::Body::new(ChannelBody(rx)));
                *response.status_mut() = StatusCode::CREATED;
                response.headers_mut().insert(
                    "content-type",
                    HeaderValue::from_static("text/event-stream"),
                );
                response
            }
        }),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn streamed_response_reaches_the_client_before_it_ends() -> TestResult {
    let (senders, mut handed) = mpsc::unbounded_channel();
    let s = serve(Engine::builder(), |l| l, streaming(senders)).await?;
    let request = s.post("/events", "sse-1").body("{}").send();
    let client = tokio::spawn(request);
    let tx = tokio::time::timeout(BOUND, handed.recv())
        .await?
        .ok_or("handler never ran")?;
    tx.send(Bytes::from_static(b"data: first\n\n")).await?;
    let mut response = tokio::time::timeout(BOUND, client).await???;
    assert_eq!(response.status(), StatusCode::CREATED);
    // The stream is still open (the test holds its sender): the first event
    // must arrive anyway.
    let first = tokio::time::timeout(BOUND, response.chunk())
        .await
        .map_err(|_| "the first event was held back until the stream ends")??;
    assert_eq!(first.as_deref(), Some(&b"data: first\n\n"[..]));
    tx.send(Bytes::from_static(b"data: second\n\n")).await?;
    drop(tx);
    let mut rest = Vec::new();
    while let Some(chunk) = tokio::time::timeout(BOUND, response.chunk()).await?? {
        rest.extend_from_slice(&chunk);
    }
    assert_eq!(rest, b"data: second\n\n");

    // The end of the stream was held until the outcome was recorded: the
    // retry replays the whole stream.
    let replay = s.post("/events", "sse-1").body("{}").send().await?;
    assert!(replayed(&replay));
    assert_eq!(replay.headers()["content-type"], "text/event-stream");
    assert_eq!(replay.text().await?, "data: first\n\ndata: second\n\n");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn oversize_response_completes_and_is_never_unknown() -> TestResult {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let (senders, mut handed) = mpsc::unbounded_channel();
    let router = Router::new()
        .route(
            "/payments",
            post(move || {
                let runs = counter.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    (
                        StatusCode::CREATED,
                        [("location", "/payments/PAY-1")],
                        "x".repeat(4096),
                    )
                }
            }),
        )
        .merge(streaming(senders));
    let builder = Engine::builder().max_response_bytes(1024);
    let s = serve(builder, |l| l, router).await?;
    let first = s.post("/payments", "big-1").body(PAYMENT).send().await?;
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(
        first.text().await?.len(),
        4096,
        "the client gets the whole body"
    );
    completed_not_retained(&s, "/payments", "big-1", "/payments/PAY-1", 201).await?;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "never run again");

    // The same for a stream that outgrows the limit.
    let client = tokio::spawn(s.post("/events", "big-2").body("{}").send());
    let tx = tokio::time::timeout(BOUND, handed.recv())
        .await?
        .ok_or("handler never ran")?;
    for _ in 0..4 {
        tx.send(Bytes::from(vec![b'y'; 1024])).await?;
    }
    drop(tx);
    let streamed = tokio::time::timeout(BOUND, client).await???;
    assert_eq!(streamed.text().await?.len(), 4096);
    let retry = s.post("/events", "big-2").body("{}").send().await?;
    let (kind, _) = problem(retry, 409).await?;
    assert_eq!(kind, "response-not-retained");
    Ok(())
}

/// Headers alone over `max_response_bytes`, with an empty body (a 204 with
/// a long trace header): the outcome is known, so the key must complete
/// (not retained), never turn the handler's answer into a 503 and the key
/// UNKNOWN.
#[tokio::test(flavor = "multi_thread")]
async fn empty_body_with_oversize_headers_completes_and_is_never_unknown() -> TestResult {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let router = Router::new().route(
        "/things",
        post(move || {
            let runs = counter.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                (
                    StatusCode::NO_CONTENT,
                    [
                        ("x-trace", "t".repeat(300)),
                        ("location", "/things/1".to_owned()),
                    ],
                )
            }
        }),
    );
    // A limit of 1 byte is raised to the builder's minimum, 256 bytes, so
    // the not-retained marker always fits. The 339 bytes of `x-trace`
    // (RFC 7541 sizes: name, value, 32) are over it; Location and the
    // marker (117) fit.
    let builder = Engine::builder().max_response_bytes(1);
    let s = serve(builder, |l| l, router).await?;
    let first = s.post("/things", "hdr-1").body(PAYMENT).send().await?;
    assert_eq!(
        first.status(),
        StatusCode::NO_CONTENT,
        "the handler's answer"
    );
    completed_not_retained(&s, "/things", "hdr-1", "/things/1", 204).await?;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "never run again");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn bodiless_json_post_is_an_absent_body() -> TestResult {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let router = Router::new().route(
        "/payments/{id}/capture",
        post(move || {
            let runs = counter.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                (StatusCode::CREATED, "captured")
            }
        }),
    );
    // Both the content-type default and an explicit JSON route.
    let s = serve(
        Engine::builder(),
        |l| l.route(Route::new("/payments/{id}/capture").json()),
        router.clone(),
    )
    .await?;
    let auto = serve(Engine::builder(), |l| l, router).await?;
    for server in [&s, &auto] {
        for _ in 0..2 {
            let r = server
                .post("/payments/PAY-1/capture", "cap-1")
                .header("content-length", "0")
                .send()
                .await?;
            assert_eq!(r.status(), StatusCode::CREATED, "{}", r.text().await?);
        }
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "once per server, then replayed"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn blank_key_is_malformed() -> TestResult {
    let runs = Arc::new(AtomicUsize::new(0));
    let s = serve(Engine::builder(), |l| l, counting(runs.clone())).await?;
    for key in ["\"   \"", "\" \"", "\"\""] {
        let r = s.post("/payments", key).body(PAYMENT).send().await?;
        let (kind, _) = problem(r, 400).await?;
        assert_eq!(kind, "malformed-key", "key {key:?}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    Ok(())
}

/// Waits until the engine has answered `InProgress` at least `n` times:
/// a duplicate is then known to be waiting.
async fn until_in_progress_answers(engine: &Engine, n: u64) -> TestResult {
    let deadline = tokio::time::Instant::now() + BOUND;
    while engine.stats()?.processing_answers < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no duplicate is waiting"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

/// A handler that runs only when the test lets it: each run takes one
/// permit from `gate` and reports its start on `started`.
fn gated(
    gate: Arc<Semaphore>,
    started: mpsc::UnboundedSender<()>,
    runs: Arc<AtomicUsize>,
) -> Router {
    Router::new().route(
        "/payments",
        post(move || {
            let (gate, started, runs) = (gate.clone(), started.clone(), runs.clone());
            async move {
                let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                let _ = started.send(());
                if let Ok(permit) = gate.acquire().await {
                    permit.forget();
                }
                (StatusCode::CREATED, format!("{{\"run\":{run}}}"))
            }
        }),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn in_progress_retry_after_fits_the_route_not_the_lease() -> TestResult {
    let gate = Arc::new(Semaphore::new(0));
    let (started, mut started_rx) = mpsc::unbounded_channel();
    let runs = Arc::new(AtomicUsize::new(0));
    let builder = Engine::builder().lease(Duration::from_secs(60));
    let s = serve(builder, |l| l, gated(gate.clone(), started, runs.clone())).await?;
    // One quick request teaches the layer what the route takes.
    gate.add_permits(1);
    let r = s.post("/payments", "warm").body(PAYMENT).send().await?;
    assert_eq!(r.status(), StatusCode::CREATED);
    started_rx.recv().await;

    let first = tokio::spawn(s.post("/payments", "slow").body(PAYMENT).send());
    tokio::time::timeout(BOUND, started_rx.recv()).await?;
    let dup = s.post("/payments", "slow").body(PAYMENT).send().await?;
    assert_eq!(dup.headers()["retry-after"], "1", "not the 60 s lease");
    let (kind, _) = problem(dup, 409).await?;
    assert_eq!(kind, "processing");
    gate.add_permits(1);
    assert_eq!(
        tokio::time::timeout(BOUND, first).await???.status(),
        StatusCode::CREATED
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn duplicate_waits_for_the_outcome_on_an_opt_in_route() -> TestResult {
    let gate = Arc::new(Semaphore::new(0));
    let (started, mut started_rx) = mpsc::unbounded_channel();
    let runs = Arc::new(AtomicUsize::new(0));
    let s = serve(
        Engine::builder(),
        |l| l.route(Route::new("/payments").wait_for_outcome(Duration::from_secs(30))),
        gated(gate.clone(), started, runs.clone()),
    )
    .await?;
    let first = tokio::spawn(s.post("/payments", "w-1").body(PAYMENT).send());
    tokio::time::timeout(BOUND, started_rx.recv()).await?;
    let dup = tokio::spawn(s.post("/payments", "w-1").body(PAYMENT).send());
    // The duplicate is waiting, not answered 409; let the first finish.
    until_in_progress_answers(&s.engine, 1).await?;
    gate.add_permits(1);
    let first = tokio::time::timeout(BOUND, first).await???;
    let first_body = first.text().await?;
    let dup = tokio::time::timeout(BOUND, dup).await???;
    assert_eq!(dup.status(), StatusCode::CREATED);
    assert!(replayed(&dup));
    assert_eq!(dup.text().await?, first_body);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn waiting_duplicate_gets_409_when_time_runs_out() -> TestResult {
    let gate = Arc::new(Semaphore::new(0));
    let (started, mut started_rx) = mpsc::unbounded_channel();
    let runs = Arc::new(AtomicUsize::new(0));
    let s = serve(
        Engine::builder(),
        |l| l.route(Route::new("/payments").wait_for_outcome(Duration::from_millis(200))),
        gated(gate.clone(), started, runs.clone()),
    )
    .await?;
    let first = tokio::spawn(s.post("/payments", "w-2").body(PAYMENT).send());
    tokio::time::timeout(BOUND, started_rx.recv()).await?;
    // The gate stays shut until the duplicate is answered.
    let dup = s.post("/payments", "w-2").body(PAYMENT).send().await?;
    let (kind, _) = problem(dup, 409).await?;
    assert_eq!(kind, "processing");
    gate.add_permits(1);
    assert_eq!(
        tokio::time::timeout(BOUND, first).await???.status(),
        StatusCode::CREATED
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn mismatch_names_the_differing_pointers_not_their_values() -> TestResult {
    let runs = Arc::new(AtomicUsize::new(0));
    let s = serve(
        Engine::builder(),
        |l| l.route(Route::new("/payments").json_pointers(["/amount", "/currency", "/customer"])),
        counting(runs),
    )
    .await?;
    let original = r#"{"amount": 1000, "currency": "EUR", "customer": "c-1"}"#;
    let r = s.post("/payments", "m-1").body(original).send().await?;
    assert_eq!(r.status(), StatusCode::CREATED);
    let changed = r#"{"amount": 777000, "currency": "EUR", "customer": "c-9"}"#;
    let r = s.post("/payments", "m-1").body(changed).send().await?;
    let (kind, body) = problem(r, 409).await?;
    assert_eq!(kind, "key-mismatch");
    assert_eq!(
        body["pointers"],
        serde_json::json!(["/amount", "/customer"])
    );
    let text = body.to_string();
    for value in ["777000", "c-9", "1000", "c-1"] {
        assert!(!text.contains(value), "a value leaked: {text}");
    }
    Ok(())
}

/// tower-http conventions: named, `Send` future and body types, and the
/// inner service reachable through the layer's service.
#[test]
fn service_future_and_bodies_are_named_send_types() -> TestResult {
    use idempotency::http::{IdempotencyService, RequestBody, ResponseBody, ResponseFuture};
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<IdempotencyService<Router>>();
    send::<ResponseFuture<axum::body::Body, std::convert::Infallible>>();
    send::<ResponseBody<axum::body::Body>>();
    send::<RequestBody<axum::body::Body>>();

    let engine = Arc::new(Engine::builder().in_memory()?);
    let mut service = tower::Layer::layer(&IdempotencyLayer::new(engine), Router::new());
    let _: &Router = service.get_ref();
    let _: &mut Router = service.get_mut();
    let _: Router = service.into_inner();
    Ok(())
}

/// A duplicate on another server (another layer, same database) cannot be
/// woken by the first request's holder: it re-reads the key until the
/// outcome is there.
#[tokio::test(flavor = "multi_thread")]
async fn waiting_duplicate_on_another_server_polls_for_the_outcome() -> TestResult {
    let gate = Arc::new(Semaphore::new(0));
    let (started, mut started_rx) = mpsc::unbounded_channel();
    let runs = Arc::new(AtomicUsize::new(0));
    let wait = |l: IdempotencyLayer| {
        l.route(Route::new("/payments").wait_for_outcome(Duration::from_secs(30)))
    };
    let a = serve(
        Engine::builder(),
        wait,
        gated(gate.clone(), started.clone(), runs.clone()),
    )
    .await?;
    let app = gated(gate.clone(), started, runs.clone())
        .layer(wait(IdempotencyLayer::new(a.engine.clone())));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let b_base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });

    let first = tokio::spawn(a.post("/payments", "w-3").body(PAYMENT).send());
    tokio::time::timeout(BOUND, started_rx.recv()).await?;
    let dup = tokio::spawn(
        a.client
            .post(format!("{b_base}/payments"))
            .header("idempotency-key", "w-3")
            .header("content-type", "application/json")
            .body(PAYMENT)
            .send(),
    );
    // Two InProgress answers: the duplicate has polled at least once.
    until_in_progress_answers(&a.engine, 2).await?;
    gate.add_permits(1);
    let first = tokio::time::timeout(BOUND, first).await???;
    let first_body = first.text().await?;
    let dup = tokio::time::timeout(BOUND, dup).await???;
    assert!(replayed(&dup), "status {}", dup.status());
    assert_eq!(dup.text().await?, first_body);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    Ok(())
}
