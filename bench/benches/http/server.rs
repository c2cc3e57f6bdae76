//! The child processes: one HTTP server per mode (the same axum app, with
//! or without an idempotency layer), or the engine called directly.
//!
//! A child prints `PORT <n>` (a server) or `RESULT …` (direct) on stdout
//! and exits when its stdin closes, so it never outlives the parent.

use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{header, StatusCode};
use axum::routing::post;
use axum::Router;
use idempotency::http::IdempotencyLayer;
use idempotency::Engine;

use super::Mode;

/// The route every mode serves.
pub const PATH: &str = "/orders";
/// The handler's answer (201 with this body, at once).
const CREATED: &str = r#"{"id":"ord_1","status":"created"}"#;

/// How many times the handler ran (printed as `RUNS <n>` at exit, so the
/// parent can check that replays did not reach it).
static RUNS: AtomicU64 = AtomicU64::new(0);

/// The handler: reads the body (as an app would before acting) and answers
/// 201 at once.
async fn create(_body: axum::body::Bytes) -> impl axum::response::IntoResponse {
    RUNS.fetch_add(1, Ordering::Relaxed);
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/json")],
        CREATED,
    )
}

/// Prints `RUNS <n>` and exits once stdin reaches its end (the parent
/// closed it or died).
fn exit_when_stdin_closes() {
    std::thread::spawn(|| {
        let mut sink = String::new();
        while std::io::stdin()
            .lock()
            .read_line(&mut sink)
            .is_ok_and(|n| n > 0)
        {
            sink.clear();
        }
        println!("RUNS {}", RUNS.load(Ordering::Relaxed));
        let _ = std::io::stdout().flush();
        std::process::exit(0);
    });
}

/// Serves `mode` on 127.0.0.1 at a free port until stdin closes. `dir`
/// holds the redb file; `pg_prefix` is the table prefix on PostgreSQL.
pub fn serve(mode: Mode, dir: &Path, pg_prefix: &str) {
    exit_when_stdin_closes();
    let app = Router::new().route(PATH, post(create));
    let app = match mode {
        Mode::None => app,
        Mode::Mem => app.layer(IdempotencyLayer::new(Arc::new(
            Engine::builder().in_memory().expect("in-memory engine"),
        ))),
        Mode::Redb => app.layer(IdempotencyLayer::new(Arc::new(
            Engine::builder()
                .open(dir.join("http.redb"))
                .expect("open the redb engine"),
        ))),
        Mode::Pg => {
            let url = std::env::var("IDEMPOTENCY_TEST_PG").expect("IDEMPOTENCY_TEST_PG");
            app.layer(IdempotencyLayer::new(Arc::new(
                Engine::builder()
                    .table_prefix(pg_prefix)
                    .open_postgres(&url)
                    .expect("open the PostgreSQL engine"),
            )))
        }
        Mode::Peer => peer(app),
        Mode::Direct => unreachable!("the direct mode runs no server"),
    };
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .expect("bind 127.0.0.1");
        let port = listener.local_addr().expect("local addr").port();
        println!("PORT {port}");
        std::io::stdout().flush().expect("stdout");
        axum::serve(listener, app).await.expect("serve");
    });
}

/// The peer crate `axum-idempotent` in the order its README gives: cookies
/// outermost, then `ruts`' session layer over its in-memory moka store,
/// then the idempotency layer keyed by the `Idempotency-Key` header (it
/// caches a response only for a request that carries a session cookie).
fn peer(app: Router) -> Router {
    use axum_idempotent::{IdempotentLayer, IdempotentOptions};
    use ruts::store::moka::MokaStore;
    use ruts::{CookieOptions, SessionLayer};
    let store = Arc::new(MokaStore::builder().build());
    let options = IdempotentOptions::default()
        .use_idempotency_key_header(Some("Idempotency-Key"), true)
        .expire_after(60 * 60);
    app.layer(IdempotentLayer::<MokaStore>::new(options))
        .layer(
            SessionLayer::new(store)
                .with_cookie_options(CookieOptions::build().name("session").max_age(3600)),
        )
        .layer(tower_cookies::CookieManagerLayer::new())
}

/// The engine called directly, without HTTP: `threads` threads each run
/// durable begin+complete on fresh keys for `secs`, on a redb file in
/// `dir` (bench/benches/durable.rs's workload). Prints `RESULT <requests>
/// <elapsed_s> <p50_us> <p99_us>`.
pub fn direct(dir: &Path, threads: usize, secs: Duration, max_requests: u64) {
    exit_when_stdin_closes();
    let engine = Engine::builder()
        .open(dir.join("direct.redb"))
        .expect("open the redb engine");
    println!("PORT 0");
    std::io::stdout().flush().expect("stdout");
    let count = std::sync::atomic::AtomicU64::new(0);
    let start = Instant::now();
    let deadline = start + secs;
    let mut lat: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (engine, count) = (&engine, &count);
                s.spawn(move || {
                    let mut local = Vec::new();
                    while Instant::now() < deadline
                        && count.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < max_requests
                    {
                        let t = Instant::now();
                        super::common::engine_request(engine, &super::common::random_key());
                        local.push(t.elapsed().as_micros() as u64);
                    }
                    local
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("client thread"))
            .collect()
    });
    let elapsed = start.elapsed().as_secs_f64();
    let (p50, p99) = super::client::percentiles(&mut lat);
    println!("RESULT {} {elapsed} {p50} {p99}", lat.len());
    std::io::stdout().flush().expect("stdout");
    // Wait to be told to go, so the parent reads the final VmHWM.
    std::thread::sleep(Duration::from_secs(3600));
}
