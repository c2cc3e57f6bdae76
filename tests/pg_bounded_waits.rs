//! Guards against a PostgreSQL server that stops answering turning into a
//! hung caller (issue 23, item 4): a black-holing network (a proxy that
//! keeps the connections open and forwards nothing), a frozen backend
//! process (SIGSTOP: the kernel still ACKs, nothing answers, the server's
//! own `statement_timeout` cannot fire), a frozen postmaster (no new
//! connection ever completes its startup), and a pool whose only
//! connection is held by another caller. Each must give the caller an
//! error within the documented bound (`statement_timeout` plus the
//! client-side margin, or `connect_timeout`), and the engine must work
//! again once the server answers.
//!
//! Bounds are generous (an error within 10 s for a 1 s statement timeout
//! and a 2 s connect timeout, on a shared 2-core machine): the failure
//! guarded against is a hang, not slowness. Every call runs on a thread;
//! one that has not returned after 30 s fails the test instead of hanging
//! the suite. Every SIGSTOP is undone by a guard's SIGCONT, panics
//! included. The tests take one lock, so a frozen postmaster never stalls
//! another test of this file.
//!
//! Needs a server: `IDEMPOTENCY_TEST_PG` (set by `scripts/with-postgres`).
//! Without it the tests are skipped, except under `CI=true`, where they fail.
#![cfg(unix)]

#[path = "common/pg_chaos.rs"]
mod pg_chaos;
#[path = "common/pg_proxy.rs"]
mod pg_proxy;
#[path = "common/pg_server.rs"]
mod pg_server;

use std::error::Error;
use std::sync::{mpsc, Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use idempotency::{Engine, EngineBuilder, Envelope, Fingerprint, IdempotencyKey, LocalRun};

use pg_proxy::PgProxy;
use pg_server::{within, Frozen};

type TestResult<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

/// What a statement inside a local write answered, and how long it took.
type Seen = Arc<Mutex<Option<(Result<(), String>, Duration)>>>;

const STATEMENT_TIMEOUT: Duration = Duration::from_secs(1);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// An error must come within this (the documented bound is about 2-3 s).
const BOUND: Duration = Duration::from_secs(10);
/// A call still running after this is a hang: the test fails.
const HANG: Duration = Duration::from_secs(30);
/// How long the engine may take to work again once the server answers.
const RECOVER_WITHIN: Duration = Duration::from_secs(40);

/// One test at a time: a frozen postmaster stalls every new connection.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(PoisonError::into_inner)
}

fn key(name: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("bounded-waits", name)
}

fn fp() -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(br#"{"amount": 5}"#, &[])
}

fn builder(prefix: &str) -> EngineBuilder {
    Engine::builder()
        .table_prefix(prefix)
        .pool_size(1)
        .connect_timeout(CONNECT_TIMEOUT)
        .statement_timeout(STATEMENT_TIMEOUT)
        .database_clock(false)
        .sweep_interval(None)
}

/// `call` on a thread: it must return an error (not `Ok`, not a hang)
/// within [`BOUND`]. Returns the error's text.
fn errs_within<T: std::fmt::Debug + Send + 'static>(
    what: &str,
    call: impl FnOnce() -> Result<T, idempotency::Error> + Send + 'static,
) -> TestResult<String> {
    let (res, took) = within(HANG, call).map_err(|e| format!("{what}: {e}"))?;
    eprintln!("{what}: {res:?} after {took:?}");
    match res {
        Ok(v) => Err(format!("{what}: Ok({v:?}) while the server did not answer").into()),
        Err(e) => {
            assert!(
                took < BOUND,
                "{what}: the error came after {took:?}, beyond {BOUND:?}: {e}"
            );
            Ok(e.to_string())
        }
    }
}

/// The error says which bound ran out (`Error::Timeout`).
fn assert_timeout_text(what: &str, text: &str) {
    assert!(
        text.contains("did not answer within"),
        "{what}: the error does not say the server did not answer in time: {text}"
    );
}

/// The error says the server did not answer in time, or that no
/// connection could be had in time (a new connection into a black hole:
/// the pool's wait and the connect timeout are the same bound).
fn assert_wait_text(what: &str, text: &str) {
    assert!(
        text.contains("did not answer within")
            || text.contains("no connection to PostgreSQL within"),
        "{what}: the error does not say the server did not answer in time: {text}"
    );
}

/// Calls `f` until it succeeds, for at most [`RECOVER_WITHIN`].
fn recovers<T>(what: &str, mut f: impl FnMut() -> Result<T, idempotency::Error>) -> TestResult<T> {
    let start = Instant::now();
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if start.elapsed() < RECOVER_WITHIN => {
                eprintln!("{what}, not yet: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => {
                return Err(
                    format!("{what}: still failing after {:?}: {e}", start.elapsed()).into(),
                )
            }
        }
    }
}

fn cleanup(url: &str, prefix: &str) -> TestResult {
    pg_chaos::drop_prefix(&mut pg_chaos::connect(url)?, prefix)
}

#[test]
fn a_black_holed_connection_errors_within_the_bound() -> TestResult {
    let _serial = serial();
    let Some(url) = pg_chaos::pg_url() else {
        return Ok(());
    };
    let prefix = pg_chaos::unique_prefix("bwh");
    let proxy = PgProxy::start(&url)?;
    let engine = Arc::new(builder(&prefix).open_postgres(&proxy.url("")?)?);
    let k = key("black-hole")?;
    assert!(engine.record(&k)?.is_none(), "warm-up");

    proxy.black_hole();
    let e = engine.clone();
    let text = errs_within("begin through a black hole", move || {
        e.begin(&key("black-hole")?, fp()?)
    })?;
    assert_timeout_text("begin through a black hole", &text);
    // A read, too (a different path through the engine).
    let e = engine.clone();
    let text = errs_within("record through a black hole", move || {
        e.record(&key("black-hole")?)
    })?;
    assert_wait_text("record through a black hole", &text);

    proxy.heal();
    recovers("begin after heal", || engine.begin(&k, fp()?).map(drop))?;
    drop(engine);
    drop(proxy);
    cleanup(&url, &prefix)
}

/// A statement in flight when the network starts black-holing (inside a
/// local write, so no other connection can stand in): the client-side
/// deadline must end it with a timeout error.
#[test]
fn a_statement_in_flight_into_a_black_hole_errors_within_the_bound() -> TestResult {
    let _serial = serial();
    let Some(url) = pg_chaos::pg_url() else {
        return Ok(());
    };
    let prefix = pg_chaos::unique_prefix("bwf");
    let proxy = Arc::new(PgProxy::start(&url)?);
    let engine = Arc::new(builder(&prefix).open_postgres(&proxy.url("")?)?);
    let seen: Seen = Arc::default();
    let (inner, hole, e) = (seen.clone(), proxy.clone(), engine.clone());
    let answered = within(HANG, move || {
        e.execute_local(&key("black-hole-statement")?, fp()?, move |tx| {
            let pg = tx.postgres().ok_or("the engine is not on PostgreSQL")?;
            pg.query_one("SELECT 1", &[])?;
            hole.black_hole();
            let t = Instant::now();
            let r = pg.query_one("SELECT 2", &[]);
            let shown = r.as_ref().map(drop).map_err(ToString::to_string);
            *inner.lock().unwrap_or_else(PoisonError::into_inner) = Some((shown, t.elapsed()));
            r?;
            Ok(Envelope::new(1, 200, b"never stored".to_vec()))
        })
    });
    proxy.heal();
    let (res, took) = answered.map_err(|e| format!("execute_local into a black hole: {e}"))?;
    eprintln!("execute_local into a black hole: {res:?} after {took:?}");
    let statement = seen
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()
        .ok_or("the local write never ran its statement")?;
    eprintln!("the statement into a black hole: {statement:?}");
    match statement {
        (Ok(()), took) => {
            return Err(format!("a black hole answered a statement (after {took:?})").into())
        }
        (Err(text), took) => {
            assert!(
                took < BOUND,
                "the statement failed only after {took:?}: {text}"
            );
            assert_timeout_text("a statement into a black hole", &text);
        }
    }
    assert!(
        res.is_err(),
        "the local write whose statement failed: {res:?}"
    );
    assert!(took < BOUND, "execute_local ended after {took:?}");
    let k = key("black-hole-statement")?;
    let rec = recovers("reading after heal", || engine.record(&k))?;
    assert!(rec.is_none(), "a rolled-back local write left {rec:?}");
    drop(engine);
    drop(proxy);
    cleanup(&url, &prefix)
}

#[test]
fn opening_through_a_black_hole_errors_within_the_bound() -> TestResult {
    let _serial = serial();
    let Some(url) = pg_chaos::pg_url() else {
        return Ok(());
    };
    let prefix = pg_chaos::unique_prefix("bwo");
    let proxy = PgProxy::start(&url)?;
    proxy.black_hole();
    let to = proxy.url("")?;
    let p = prefix.clone();
    let (res, took) = within(HANG, move || builder(&p).open_postgres(&to))?;
    eprintln!(
        "open through a black hole: {:?} after {took:?}",
        res.as_ref().err()
    );
    assert!(res.is_err(), "open_postgres succeeded through a black hole");
    assert!(took < BOUND, "open_postgres failed only after {took:?}");
    proxy.heal();
    drop(proxy);
    cleanup(&url, &prefix)
}

/// The engine's backends (there is one: pool size 1), found by the
/// connection's `application_name`.
fn backend_pids(admin: &mut idempotency::postgres::Client, app: &str) -> TestResult<Vec<u32>> {
    let rows = admin.query(
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1",
        &[&app],
    )?;
    let pids: Vec<u32> = rows
        .iter()
        .map(|r| u32::try_from(r.get::<_, i32>(0)))
        .collect::<Result<_, _>>()?;
    if pids.is_empty() {
        return Err(format!("no backend with application_name {app}").into());
    }
    Ok(pids)
}

/// A pooled connection whose backend froze: the call may take another
/// connection (the pool's check finds the frozen one dead) or fail, but
/// it answers within the bound.
#[test]
fn a_call_meeting_a_frozen_pooled_backend_answers_within_the_bound() -> TestResult {
    let _serial = serial();
    let Some(url) = pg_chaos::pg_url() else {
        return Ok(());
    };
    let prefix = pg_chaos::unique_prefix("bwb");
    let app = format!("idem_frozen_{}", std::process::id());
    let engine =
        Arc::new(builder(&prefix).open_postgres(&format!("{url} application_name={app}"))?);
    let k = key("frozen-backend")?;
    assert!(engine.record(&k)?.is_none(), "warm-up");
    let mut admin = pg_chaos::connect(&url)?;
    let pids = backend_pids(&mut admin, &app)?;
    eprintln!("freezing backends {pids:?}");

    let answered = {
        let frozen: Vec<Frozen> = pids
            .iter()
            .map(|&p| Frozen::stop(p))
            .collect::<Result<_, _>>()?;
        let e = engine.clone();
        let answered = within(HANG, move || {
            e.begin(&key("frozen-backend")?, fp()?).map(drop)
        });
        drop(frozen); // SIGCONT, whatever happened
        answered
    };
    let (res, took) = answered.map_err(|e| format!("begin on a frozen backend: {e}"))?;
    eprintln!("begin on a frozen backend: {res:?} after {took:?}");
    assert!(
        took < BOUND,
        "begin on a frozen backend answered after {took:?}: {res:?}"
    );
    if let Err(e) = res {
        assert_timeout_text("begin on a frozen backend", &e.to_string());
    }
    recovers("begin after thaw", || engine.begin(&k, fp()?).map(drop))?;
    drop(engine);
    cleanup(&url, &prefix)
}

/// A statement in flight on a backend that froze (inside a local write,
/// so no other connection can stand in): the server's own
/// `statement_timeout` cannot fire in a stopped process, so only the
/// client-side deadline ends the wait.
#[test]
fn a_statement_on_a_frozen_backend_errors_within_the_bound() -> TestResult {
    let _serial = serial();
    let Some(url) = pg_chaos::pg_url() else {
        return Ok(());
    };
    let prefix = pg_chaos::unique_prefix("bws");
    let engine = Arc::new(builder(&prefix).open_postgres(&url)?);
    let seen: Seen = Arc::default();
    let inner = seen.clone();
    // The closure names its backend; this thread freezes it and holds the
    // guard, so the SIGCONT comes even if the closure never returns.
    let (pid_tx, pid_rx) = mpsc::channel::<i32>();
    let (frozen_tx, frozen_rx) = mpsc::channel::<()>();
    let e = engine.clone();
    let call = std::thread::spawn(move || {
        within(HANG, move || {
            e.execute_local(&key("frozen-statement")?, fp()?, move |tx| {
                let pg = tx.postgres().ok_or("the engine is not on PostgreSQL")?;
                let pid: i32 = pg.query_one("SELECT pg_backend_pid()", &[])?.get(0);
                pid_tx.send(pid)?;
                frozen_rx.recv_timeout(HANG)?;
                let t = Instant::now();
                let r = pg.query_one("SELECT 1", &[]);
                let shown = r.as_ref().map(drop).map_err(ToString::to_string);
                *inner.lock().unwrap_or_else(PoisonError::into_inner) = Some((shown, t.elapsed()));
                r?;
                Ok(Envelope::new(1, 200, b"never stored".to_vec()))
            })
        })
    });
    let pid = pid_rx
        .recv_timeout(HANG)
        .map_err(|_| "the local write never named its backend")?;
    let frozen = Frozen::stop(u32::try_from(pid)?)?;
    frozen_tx.send(())?;
    let joined = call.join();
    drop(frozen); // SIGCONT, whatever happened
    let (res, took) = joined
        .map_err(|_| "the calling thread panicked")?
        .map_err(|e| format!("execute_local on a frozen backend: {e}"))?;
    eprintln!("execute_local on a frozen backend: {res:?} after {took:?}");
    let statement = seen
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()
        .ok_or("the local write never ran its statement")?;
    eprintln!("the statement on the frozen backend: {statement:?}");
    match statement {
        (Ok(()), took) => {
            return Err(format!("a stopped backend answered a statement (after {took:?})").into())
        }
        (Err(text), took) => {
            assert!(
                took < BOUND,
                "the statement failed only after {took:?}: {text}"
            );
            assert_timeout_text("a statement on a frozen backend", &text);
        }
    }
    assert!(
        res.is_err(),
        "the local write whose statement failed: {res:?}"
    );
    assert!(took < BOUND, "execute_local ended after {took:?}");
    let k = key("frozen-statement")?;
    let rec = recovers("reading after thaw", || engine.record(&k))?;
    assert!(rec.is_none(), "a rolled-back local write left {rec:?}");
    drop(engine);
    cleanup(&url, &prefix)
}

#[test]
fn a_frozen_postmaster_errors_within_the_bound() -> TestResult {
    let _serial = serial();
    let Some(url) = pg_chaos::pg_url() else {
        return Ok(());
    };
    let prefix = pg_chaos::unique_prefix("bwp");
    let app = format!("idem_postmaster_{}", std::process::id());
    let engine =
        Arc::new(builder(&prefix).open_postgres(&format!("{url} application_name={app}"))?);
    let k = key("frozen-postmaster")?;
    assert!(engine.record(&k)?.is_none(), "warm-up");
    // Its only connection goes, so the next call needs a new one.
    let mut admin = pg_chaos::connect(&url)?;
    for pid in backend_pids(&mut admin, &app)? {
        let pid = i32::try_from(pid)?;
        admin.execute("SELECT pg_terminate_backend($1)", &[&pid])?;
    }
    let postmaster = pg_server::postmaster_pid()?;

    let (open, call) = {
        let frozen = Frozen::stop(postmaster)?;
        let to = url.clone();
        let p = prefix.clone();
        let open = within(HANG, move || builder(&p).open_postgres(&to).map(drop));
        let e = engine.clone();
        let call = errs_within("begin needing a new connection", move || {
            e.begin(&key("frozen-postmaster")?, fp()?)
        });
        drop(frozen);
        (open, call)
    };
    let (opened, took) = open.map_err(|e| format!("open_postgres: {e}"))?;
    eprintln!("open_postgres on a frozen postmaster: {opened:?} after {took:?}");
    assert!(
        opened.is_err(),
        "open_postgres succeeded on a frozen postmaster"
    );
    assert!(took < BOUND, "open_postgres failed only after {took:?}");
    call?;

    recovers("begin after thaw", || engine.begin(&k, fp()?).map(drop))?;
    drop(engine);
    cleanup(&url, &prefix)
}

#[test]
fn an_exhausted_pool_errors_after_the_connect_timeout() -> TestResult {
    let _serial = serial();
    let Some(url) = pg_chaos::pg_url() else {
        return Ok(());
    };
    let prefix = pg_chaos::unique_prefix("bwx");
    let engine = Arc::new(builder(&prefix).open_postgres(&url)?);

    // A local write holds the pool's only connection until told to go on.
    let (inside_tx, inside_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let e = engine.clone();
    let holder = std::thread::spawn(move || {
        e.execute_local(&key("holder")?, fp()?, move |_tx| {
            let _ = inside_tx.send(());
            // Bounded: a test that fails still lets go.
            let _ = go_rx.recv_timeout(HANG);
            Ok(Envelope::new(1, 200, b"held".to_vec()))
        })
    });
    inside_rx
        .recv_timeout(HANG)
        .map_err(|_| "the local write never started")?;

    let e = engine.clone();
    let text = errs_within("begin on an exhausted pool", move || {
        e.begin(&key("second")?, fp()?)
    });
    let _ = go_tx.send(());
    let held = holder.join().map_err(|_| "the holder panicked")?;
    let text = text?;
    assert!(
        text.to_lowercase().contains("connection"),
        "the error does not say it waited for a connection: {text}"
    );
    assert!(
        matches!(held, Ok(LocalRun::Executed)),
        "the local write holding the connection: {held:?}"
    );
    recovers("begin once the pool is free", || {
        engine.begin(&key("second")?, fp()?).map(drop)
    })?;
    drop(engine);
    cleanup(&url, &prefix)
}

/// A connection past `pool_max_lifetime` is replaced (so connections move
/// to a failed-over server in time): calls go on, and the proxy sees new
/// connections. The pool enforces lifetimes in a periodic pass (r2d2's,
/// every 30 s), so this waits up to 45 s.
#[test]
fn a_connection_past_its_lifetime_is_replaced() -> TestResult {
    let _serial = serial();
    let Some(url) = pg_chaos::pg_url() else {
        return Ok(());
    };
    let prefix = pg_chaos::unique_prefix("bwl");
    let proxy = PgProxy::start(&url)?;
    let engine = builder(&prefix)
        .pool_max_lifetime(Some(Duration::from_secs(1)))
        .pool_idle_timeout(None)
        .open_postgres(&proxy.url("")?)?;
    let k = key("lifetime")?;
    assert!(engine.record(&k)?.is_none(), "warm-up");
    let before = proxy.connections();
    let start = Instant::now();
    while proxy.connections() == before {
        assert!(
            start.elapsed() < Duration::from_secs(45),
            "no connection replaced in {:?} with a 1 s lifetime",
            start.elapsed()
        );
        std::thread::sleep(Duration::from_millis(500));
        assert!(engine.record(&k)?.is_none());
    }
    eprintln!(
        "a new connection after {:?} ({before} before, {} now)",
        start.elapsed(),
        proxy.connections()
    );
    drop(engine);
    drop(proxy);
    cleanup(&url, &prefix)
}
