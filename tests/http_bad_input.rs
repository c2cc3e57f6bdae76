//! Odd input through the layer: long paths, cookies that are not UTF-8,
//! many cookies, bodies at the inline-fingerprint threshold, concurrent
//! duplicates with different bodies.

use std::error::Error;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, Request, StatusCode};
use axum::routing::post;
use axum::Router;
use http_body_util::BodyExt;
use idempotency::http::{Caller, IdempotencyLayer};
use idempotency::Engine;
use tower::ServiceExt;

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

fn app(layer: IdempotencyLayer, runs: Arc<AtomicUsize>) -> Router {
    let handler = move || {
        let runs = runs.clone();
        async move {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            tokio::time::sleep(Duration::from_millis(30)).await;
            (StatusCode::CREATED, format!("run {n}"))
        }
    };
    Router::new().fallback(post(handler)).layer(layer)
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

/// A POST with a key to a long path (an id in the URL) is served as it
/// would be without the layer: the layer must not refuse it because the
/// path does not fit in the key's scope.
#[tokio::test]
async fn a_long_path_with_a_key_is_served_not_refused() -> TestResult {
    let engine = Arc::new(Engine::builder().in_memory()?);
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(IdempotencyLayer::new(engine), runs.clone());
    let path = format!("/v1/objects/{}/actions/capture", "a".repeat(230));
    let req = || {
        Request::post(path.as_str())
            .header("idempotency-key", "k1")
            .header("authorization", "Bearer t")
            .body(Body::from("x"))
    };
    let (status, body) = send(&app, req()?).await?;
    assert_eq!(status, 201, "{body}");
    let (status, body) = send(&app, req()?).await?;
    assert_eq!((status, body.as_str()), (201, "run 1"), "replayed");
    // Two long paths that differ only past any cut are different scopes.
    let other = format!("/v1/objects/{}/actions/refund", "a".repeat(230));
    let req = Request::post(other.as_str())
        .header("idempotency-key", "k1")
        .header("authorization", "Bearer t")
        .body(Body::from("x"))?;
    let (status, body) = send(&app, req).await?;
    assert_eq!(
        (status, body.as_str()),
        (201, "run 2"),
        "another route, another key"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    Ok(())
}

/// A `Cookie` header that is not UTF-8, and hundreds of cookies: the
/// session cookie still tells callers apart, nothing panics.
#[tokio::test]
async fn cookies_that_are_not_utf8_or_many_still_scope_by_session() -> TestResult {
    let engine = Arc::new(Engine::builder().in_memory()?);
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(
        IdempotencyLayer::new(engine).caller(Caller::cookies(["session"])),
        runs.clone(),
    );
    let many: String = (0..500).map(|i| format!("c{i}=v{i}; ")).collect();
    let req = |cookie: HeaderValue| {
        Request::post("/p")
            .header("idempotency-key", "k")
            .header("cookie", cookie)
            .body(Body::from("x"))
    };
    let a = HeaderValue::from_bytes(b"junk=\xff\xfe; session=s1")?;
    let a_again = HeaderValue::from_str(&format!("{many}session=s1"))?;
    let b = HeaderValue::from_bytes(b"session=\xff\xfe")?;
    assert_eq!(send(&app, req(a)?).await?, (201, "run 1".into()));
    assert_eq!(send(&app, req(a_again)?).await?, (201, "run 1".into()));
    assert_eq!(send(&app, req(b)?).await?, (201, "run 2".into()));
    Ok(())
}

/// Bodies just under and just over the 64 KiB inline threshold, the same
/// JSON document padded with whitespace: one fingerprint on both paths (a
/// replay, not a mismatch); too-deep JSON is a 400 on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inline_threshold_does_not_change_the_fingerprint() -> TestResult {
    let engine = Arc::new(Engine::builder().in_memory()?);
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(IdempotencyLayer::new(engine), runs.clone());
    let doc = r#"{"amount":1}"#;
    let padded = |len: usize| format!("{doc}{}", " ".repeat(len - doc.len()));
    let req = |key: &str, body: String| {
        Request::post("/p")
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Body::from(body))
    };
    for (a, b) in [(65_535, 65_536), (65_536, 65_535), (10, 70_000)] {
        let key = format!("pad-{a}-{b}");
        let (s1, first) = send(&app, req(&key, padded(a.max(doc.len())))?).await?;
        let (s2, again) = send(&app, req(&key, padded(b))?).await?;
        assert_eq!((s1, s2), (201, 201), "{a}/{b}: {first} / {again}");
        assert_eq!(first, again, "{a}/{b}");
    }
    for len in [65_535usize, 65_536, 70_000] {
        // 129 levels: one more than the parser takes.
        let deep = format!("{}{}", "[".repeat(129), "]".repeat(129));
        let body = format!("{deep}{}", " ".repeat(len - deep.len()));
        let (status, text) = send(&app, req(&format!("deep-{len}"), body)?).await?;
        assert_eq!(status, 400, "{len}: {text}");
    }
    Ok(())
}

/// Concurrent duplicates with different bodies: exactly one runs; the
/// others are told processing or mismatch, never run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_with_different_bodies_run_once() -> TestResult {
    let engine = Arc::new(Engine::builder().in_memory()?);
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(IdempotencyLayer::new(engine), runs.clone());
    let mut tasks = Vec::new();
    for i in 0..200 {
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            let req = Request::post("/p")
                .header("idempotency-key", "same")
                .header("content-type", "application/json")
                .body(Body::from(format!(r#"{{"amount":{}}}"#, i % 4)))?;
            send(&app, req).await
        }));
    }
    let mut created = 0;
    for t in tasks {
        let (status, body) = t.await??;
        match status {
            201 => created += 1,
            409 | 422 => {}
            other => return Err(format!("unexpected {other}: {body}").into()),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(created >= 1);
    Ok(())
}
