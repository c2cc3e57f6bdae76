//! Cancellation at every point, thousands at once: request futures dropped
//! before the claim commits, while the handler runs, while the outcome is
//! recorded and mid-response-stream; `begin_async` futures dropped after
//! one poll; `complete_async` futures dropped at once. Afterwards no handler
//! ran twice for a key, every response a client saw in full is what a
//! retry replays, and no key is PROCESSING past its lease.

use std::collections::HashMap;
use std::convert::Infallible;
use std::error::Error;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http_body::Frame;
use http_body_util::BodyExt;
use idempotency::http::IdempotencyLayer;
use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey, State};
use parking_lot::Mutex;
use tower::ServiceExt;

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const LEASE: Duration = Duration::from_millis(400);

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// A response body of unknown length: five chunks, 1 ms apart.
struct Slow {
    left: u8,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl http_body::Body for Slow {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(Duration::from_millis(1))));
        match sleep.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => {
                self.sleep = None;
                self.left -= 1;
                Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"chunk;")))))
            }
        }
    }
}

type Runs = Arc<Mutex<HashMap<String, u32>>>;

fn app(engine: Arc<Engine>, runs: Runs) -> Router {
    let fixed = {
        let runs = runs.clone();
        move |headers: axum::http::HeaderMap| {
            let runs = runs.clone();
            async move {
                let key = headers["idempotency-key"].to_str().unwrap_or("").to_owned();
                let n = {
                    let mut runs = runs.lock();
                    let n = runs.entry(key.clone()).or_default();
                    *n += 1;
                    *n
                };
                tokio::time::sleep(Duration::from_millis(u64::from(key.len() as u8 % 7))).await;
                (StatusCode::CREATED, format!("{key} run {n}"))
            }
        }
    };
    let streamed = move |headers: axum::http::HeaderMap| {
        let runs = runs.clone();
        async move {
            let key = headers["idempotency-key"].to_str().unwrap_or("").to_owned();
            *runs.lock().entry(key).or_default() += 1;
            Body::new(Slow {
                left: 5,
                sleep: None,
            })
        }
    };
    Router::new()
        .route("/pay", post(fixed))
        .route("/stream", post(streamed))
        .layer(IdempotencyLayer::new(engine))
}

fn request(path: &str, key: &str) -> Request<Body> {
    Request::post(path)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(r#"{"amount":1}"#))
        .expect("valid request")
}

/// What the first attempt's client saw in full, if anything.
async fn attempt(
    app: Router,
    path: &'static str,
    key: String,
    cut_us: u64,
    mid_stream: bool,
) -> Option<(u16, Vec<u8>)> {
    let call = async move {
        let response = app.oneshot(request(path, &key)).await.ok()?;
        let status = response.status().as_u16();
        let mut body = response.into_body();
        let mut bytes = Vec::new();
        while let Some(frame) = body.frame().await {
            let data = frame.ok()?.into_data().ok()?;
            bytes.extend_from_slice(&data);
            if mid_stream {
                return None; // dropped mid-stream
            }
        }
        Some((status, bytes))
    };
    tokio::time::timeout(Duration::from_micros(cut_us), call)
        .await
        .ok()
        .flatten()
}

#[test]
fn requests_dropped_at_every_point_leave_no_double_run_and_no_lost_answer() -> TestResult {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let dir = tempfile::tempdir()?;
    let engine = Arc::new(
        Engine::builder()
            .lease(LEASE)
            .open(dir.path().join("cancel.redb"))?,
    );
    let runs: Runs = Arc::default();
    let app = app(engine.clone(), runs.clone());
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let n = 2000;
    let plan: Vec<(&'static str, String, u64, bool)> = (0..n)
        .map(|i| {
            let path = if i % 3 == 0 { "/stream" } else { "/pay" };
            // Cut anywhere from at once to well after the answer.
            let cut = rng.next() % 20_000;
            let mid = i % 5 == 0;
            (path, format!("k{i}"), cut, mid)
        })
        .collect();
    let told: Vec<Option<(u16, Vec<u8>)>> = runtime.block_on(async {
        let tasks: Vec<_> = plan
            .iter()
            .map(|(p, k, c, m)| tokio::spawn(attempt(app.clone(), p, k.clone(), *c, *m)))
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.ok().flatten());
        }
        out
    });
    // Every lease has ended once LEASE has passed since the last claim.
    std::thread::sleep(LEASE + Duration::from_millis(300));
    engine.flush()?;
    let now = engine.clock().now_ms();
    let mut counts: HashMap<String, usize> = HashMap::new();
    let mut problems = Vec::new();
    for ((path, key, _, _), seen) in plan.iter().zip(&told) {
        let scoped = IdempotencyKey::new(format!("POST {path}"), key.as_str())?;
        let record = engine.record(&scoped)?;
        if let Some(r) = &record {
            if r.state == State::Processing && r.lease_until_ms.is_none_or(|l| l > now) {
                problems.push(format!("{key}: PROCESSING past its lease: {r:?}"));
            }
        }
        let (status, body) = runtime.block_on(async {
            let response = app.clone().oneshot(request(path, key)).await?;
            let status = response.status().as_u16();
            let body = response.into_body().collect().await?.to_bytes().to_vec();
            Ok::<_, Box<dyn Error + Send + Sync>>((status, body))
        })?;
        let state = record.as_ref().map(|r| r.state);
        *counts.entry(format!("{state:?} -> {status}")).or_default() += 1;
        if let Some((s, b)) = seen {
            if (*s, b) != (status, &body) {
                problems.push(format!(
                    "{key}: told {s} {:?}, retry got {status} {:?}",
                    String::from_utf8_lossy(b),
                    String::from_utf8_lossy(&body)
                ));
            }
        }
        // A stream the client left mid-way is recorded without its body
        // (documented): its retry is 409 response-not-retained, never a run.
        let not_retained = String::from_utf8_lossy(&body).contains("response-not-retained");
        if status == 409 && !(not_retained && state == Some(State::Completed)) {
            problems.push(format!(
                "{key}: retry after every lease ended got 409 ({state:?}) {:?}",
                String::from_utf8_lossy(&body)
            ));
        }
    }
    for (key, n) in runs.lock().iter() {
        if *n > 1 {
            problems.push(format!("{key}: handler ran {n} times"));
        }
    }
    eprintln!("record state before retry -> retry status: {counts:?}");
    assert!(
        problems.is_empty(),
        "{} problems, first: {:#?}",
        problems.len(),
        &problems[..problems.len().min(10)]
    );
    Ok(())
}

fn fp() -> Fingerprint {
    Fingerprint::builder().part("n", b"1").finish()
}

#[test]
fn begin_async_dropped_after_one_poll_thousands_at_once_releases_every_claim() -> TestResult {
    let dir = tempfile::tempdir()?;
    let engine = Arc::new(Engine::builder().open(dir.path().join("once.redb"))?);
    let keys: Vec<IdempotencyKey> = (0..3000)
        .map(|i| IdempotencyKey::new("once", format!("k{}", i % 2500)))
        .collect::<Result<_, _>>()?;
    let waker = Waker::noop();
    let mut cx = Context::from_waker(waker);
    for key in &keys {
        let mut f = Box::pin(engine.begin_async(key, fp()));
        let _ = f.as_mut().poll(&mut cx);
        drop(f);
    }
    // The releases are queued when the claims' answers arrive.
    let mut left = Vec::new();
    for _ in 0..100 {
        engine.flush()?;
        left = keys
            .iter()
            .filter_map(|k| engine.record(k).ok().flatten())
            .filter(|r| r.state == State::Processing)
            .map(|r| r.key.to_string())
            .collect();
        if left.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        left.is_empty(),
        "{} keys still PROCESSING, e.g. {:?}",
        left.len(),
        left.first()
    );
    for key in &keys[..2500] {
        let b = engine.begin(key, fp())?;
        assert!(matches!(b, Begin::Claimed(_)), "{key}: {b:?}");
    }
    Ok(())
}

#[test]
fn complete_async_dropped_at_once_thousands_records_every_outcome() -> TestResult {
    let dir = tempfile::tempdir()?;
    let engine = Arc::new(Engine::builder().open(dir.path().join("done.redb"))?);
    let mut keys = Vec::new();
    for i in 0..2000 {
        let key = IdempotencyKey::new("done", format!("k{i}"))?;
        let Begin::Claimed(claim) = engine.begin(&key, fp())? else {
            return Err("not claimed".into());
        };
        drop(engine.complete_async(claim, Envelope::new(1, 200, format!("b{i}"))));
        keys.push(key);
    }
    engine.flush()?;
    for (i, key) in keys.iter().enumerate() {
        match engine.begin(key, fp())? {
            Begin::Replay(r) => assert_eq!(r.envelope.body, format!("b{i}").into_bytes()),
            other => return Err(format!("{key}: {other:?}").into()),
        }
    }
    Ok(())
}
