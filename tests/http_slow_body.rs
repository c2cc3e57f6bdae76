//! Slow request bodies: a client that sends half a body and stops must not
//! hold its in-flight slot (and its connection) for ever. The layer answers
//! 408 `body-timeout` after `body_read_timeout`, before any claim, so the
//! same key later runs the whole request; other requests get the freed
//! slots. The timeouts are short (200 ms): a real timer, since the engine
//! answers from its own threads, which tokio's paused clock does not wait
//! for.

use std::error::Error;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::Router;
use http_body::Frame;
use http_body_util::BodyExt;
use idempotency::http::IdempotencyLayer;
use idempotency::Engine;
use tower::ServiceExt;

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

/// A body that yields its first chunk, then never another (a client that
/// stopped sending halfway through).
struct HalfSent {
    first: Option<Bytes>,
}

impl http_body::Body for HalfSent {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        match self.first.take() {
            Some(chunk) => Poll::Ready(Some(Ok(Frame::data(chunk)))),
            None => Poll::Pending,
        }
    }
}

fn app(layer: IdempotencyLayer, runs: Arc<AtomicUsize>) -> Router {
    let handler = move || {
        let runs = runs.clone();
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            (StatusCode::CREATED, "charged")
        }
    };
    Router::new().fallback(post(handler)).layer(layer)
}

fn request(key: &str, body: Body) -> Result<Request<Body>, axum::http::Error> {
    Request::post("/charges")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body)
}

fn half_sent() -> Body {
    Body::new(HalfSent {
        first: Some(Bytes::from_static(b"{\"amount\":")),
    })
}

async fn send(
    app: &Router,
    req: Request<Body>,
) -> Result<(u16, String), Box<dyn Error + Send + Sync>> {
    let response = app.clone().oneshot(req).await?;
    let status = response.status().as_u16();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// A half-sent body gets 408 `body-timeout` (retryable) after the timeout;
/// nothing was claimed, so the whole request with the same key then runs
/// once.
#[tokio::test]
async fn a_half_sent_body_times_out_before_any_claim() -> TestResult {
    let engine = Arc::new(Engine::builder().in_memory()?);
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(engine).body_read_timeout(Duration::from_millis(200));
    let app = app(layer, runs.clone());

    let started = tokio::time::Instant::now();
    let (status, body) = send(&app, request("k1", half_sent())?).await?;
    assert_eq!(status, 408, "{body}");
    assert!(body.contains("body-timeout"), "{body}");
    assert!(body.contains("\"retryable\":true"), "{body}");
    assert!(
        started.elapsed() >= Duration::from_millis(200),
        "answered before the timeout: {:?}",
        started.elapsed()
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the handler ran on half a body"
    );

    let (status, body) = send(&app, request("k1", Body::from("{\"amount\":5}"))?).await?;
    assert_eq!(status, 201, "{body}");
    let (status, body) = send(&app, request("k1", Body::from("{\"amount\":5}"))?).await?;
    assert_eq!(status, 201, "{body}");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the replay ran the handler again"
    );
    Ok(())
}

/// With every in-flight slot held by a half-sent body, a complete request
/// waiting for a slot is served once those bodies time out, instead of
/// waiting for ever behind them.
#[tokio::test]
async fn half_sent_bodies_free_their_slots() -> TestResult {
    let engine = Arc::new(Engine::builder().in_memory()?);
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(engine)
        .max_in_flight(2)
        .body_read_timeout(Duration::from_millis(200));
    let app = app(layer, runs.clone());

    let stalled: Vec<_> = (0..2)
        .map(|i| {
            let app = app.clone();
            tokio::spawn(async move {
                let req = request(&format!("stalled-{i}"), half_sent())?;
                send(&app, req).await
            })
        })
        .collect();
    tokio::task::yield_now().await;
    let whole = tokio::time::timeout(
        Duration::from_secs(60),
        send(&app, request("whole", Body::from("{\"amount\":7}"))?),
    )
    .await
    .map_err(|_| "a complete request waited behind half-sent bodies for 60 s")??;
    assert_eq!(whole.0, 201, "{}", whole.1);
    for task in stalled {
        let (status, body) = task.await??;
        assert_eq!(status, 408, "{body}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    Ok(())
}
