//! Guards against a server restart between a claim and its completion
//! causing a double execution or a lost result (issue 23, item 5): the
//! deterministic companion of `pg_multiprocess.rs`, which restarts the
//! server at a random moment. A claimed key whose work ran is completed
//! after `pg_ctl restart -m immediate`: the completion either lands or the
//! key ends in doubt and the resolver (which asks a fake provider, never
//! re-executes) settles it; a second attempt of the key replays the first
//! result and never executes again. A local write (`execute_local`) whose
//! server restarts between its claim and its commit leaves nothing behind
//! (no business row, no record), and its retry runs exactly once. And a
//! completion sent once the server is back is stored, not left in doubt
//! because its pooled connection died in the restart.
//!
//! Needs a server: `IDEMPOTENCY_TEST_PG` and `IDEMPOTENCY_TEST_PG_DATA`
//! (set by `scripts/with-postgres`); restarts it, so the tests take one
//! lock. Without a server the tests are skipped, except under `CI=true`,
//! where they fail. Unix only (pg_ctl).
#![cfg(unix)]

#[path = "common/pg_business.rs"]
mod pg_business;
#[path = "common/pg_chaos.rs"]
mod pg_chaos;
#[path = "common/pg_server.rs"]
mod pg_server;

use std::error::Error;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use idempotency::{
    Begin, Engine, EngineBuilder, Envelope, Fingerprint, IdempotencyKey, LocalRun, ManualClock,
};

use pg_business::{Business, Provider};

type TestResult<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

const T0: u64 = 1_700_000_000_000;
const LEASE: Duration = Duration::from_secs(10);
/// How long the engine may take to work again after the restart.
const RECOVER_WITHIN: Duration = Duration::from_secs(40);

/// One restart at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(PoisonError::into_inner)
}

fn key(name: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("restart-midway", name)
}

fn fp() -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(br#"{"amount": 7}"#, &[])
}

fn builder(prefix: &str, clock: &ManualClock) -> EngineBuilder {
    Engine::builder()
        .table_prefix(prefix)
        .pool_size(2)
        .database_clock(false)
        .clock(clock.clone())
        .lease(LEASE)
        .sweep_interval(None)
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

#[test]
fn a_restart_between_claim_and_complete_never_executes_twice() -> TestResult {
    let _serial = serial();
    let Some(url) = pg_chaos::pg_url() else {
        return Ok(());
    };
    let prefix = pg_chaos::unique_prefix("rmc");
    let clock = ManualClock::new(T0);
    let provider = Provider::default();
    let engine = builder(&prefix, &clock)
        .resolver(provider.resolver())
        .open_postgres(&url)?;
    let name = "charge-across-restart";
    let k = key(name)?;

    let claim = match engine.begin(&k, fp()?)? {
        Begin::Claimed(c) => c,
        other => return Err(format!("expected Claimed, got {other:?}").into()),
    };
    let body = provider.charge(name, claim.reference());
    let took = pg_server::restart_server()?;
    eprintln!("server restarted in {took:?}");
    let completed = engine.complete(claim, Envelope::new(1, 201, body.clone()));
    eprintln!("complete after the restart: {completed:?}");

    // A second attempt, once any lease is over: a replay of the charge,
    // settled through the resolver if the completion did not land.
    clock.advance(LEASE + Duration::from_millis(1));
    match recovers("the second attempt", || engine.begin(&k, fp()?))? {
        Begin::Replay(r) => assert_eq!(r.envelope.body, body, "replay"),
        Begin::Claimed(c) => {
            provider.charge(name, c.reference());
            return Err("the key was claimed again after the restart: a double execution".into());
        }
        other => return Err(format!("the second attempt answered {other:?}").into()),
    }
    assert_eq!(provider.executions(), 1, "charges of {name}");
    // And a fresh engine, without a resolver, sees the same result.
    drop(engine);
    let fresh = builder(&prefix, &clock).open_postgres(&url)?;
    match fresh.begin(&k, fp()?)? {
        Begin::Replay(r) => assert_eq!(r.envelope.body, body, "replay (fresh engine)"),
        other => return Err(format!("a fresh engine answered {other:?}").into()),
    }
    drop(fresh);
    pg_chaos::drop_prefix(&mut pg_chaos::connect(&url)?, &prefix)
}

/// The server is back when `pg_ctl restart -w` returns: a completion sent
/// then finds its pooled connection dead, which is no reason to leave the
/// key in doubt (the dead connection sent nothing, or the engine can read
/// what it did). The completion is stored and replays at once, with no
/// lease to wait out and no resolver.
#[test]
fn a_completion_after_a_restart_is_stored_not_left_in_doubt() -> TestResult {
    let _serial = serial();
    let Some(url) = pg_chaos::pg_url() else {
        return Ok(());
    };
    let prefix = pg_chaos::unique_prefix("rms");
    let clock = ManualClock::new(T0);
    let provider = Provider::default();
    let engine = builder(&prefix, &clock).open_postgres(&url)?;
    let name = "charge-stored-after-restart";
    let k = key(name)?;

    let claim = match engine.begin(&k, fp()?)? {
        Begin::Claimed(c) => c,
        other => return Err(format!("expected Claimed, got {other:?}").into()),
    };
    let body = provider.charge(name, claim.reference());
    pg_server::restart_server()?;
    if let Err(e) = engine.complete(claim, Envelope::new(1, 201, body.clone())) {
        return Err(format!("the server was back, yet the completion failed: {e}").into());
    }
    match engine.begin(&k, fp()?)? {
        Begin::Replay(r) => assert_eq!(r.envelope.body, body, "replay"),
        other => return Err(format!("after the completion: {other:?}").into()),
    }
    assert_eq!(provider.executions(), 1, "charges of {name}");
    drop(engine);
    pg_chaos::drop_prefix(&mut pg_chaos::connect(&url)?, &prefix)
}

#[test]
fn a_restart_inside_a_local_write_leaves_nothing_and_the_retry_runs_once() -> TestResult {
    let _serial = serial();
    let Some(url) = pg_chaos::pg_url() else {
        return Ok(());
    };
    let prefix = pg_chaos::unique_prefix("rml");
    let clock = ManualClock::new(T0);
    let engine = builder(&prefix, &clock).open_postgres(&url)?;
    let business = Business::create(&url, &prefix)?;
    let name = "booking-across-restart";
    let k = key(name)?;

    // The write claims the key, inserts its row, then the server restarts
    // before the commit.
    let write = business.write(name, "first");
    let first = engine.execute_local(&k, fp()?, move |tx| {
        let envelope = write(tx)?;
        pg_server::restart_server().map_err(|e| format!("restart: {e}"))?;
        Ok(envelope)
    });
    eprintln!("execute_local across the restart: {first:?}");
    let rows = recovers("counting rows", || {
        business
            .rows(name)
            .map_err(|e| idempotency::Error::Storage {
                context: "counting business rows",
                source: e.to_string().into(),
            })
    })?;
    match &first {
        Ok(r) => {
            return Err(
                format!("a write whose server restarted before COMMIT returned Ok({r:?})").into(),
            )
        }
        Err(_) => assert_eq!(rows, 0, "the restart must have rolled the write back"),
    }
    let rec = recovers("reading the record", || engine.record(&k))?;
    assert!(rec.is_none(), "a write that never committed left {rec:?}");

    // The retry runs once; a third attempt replays it.
    match recovers("the retry", || {
        engine.execute_local(&k, fp()?, business.write(name, "second"))
    })? {
        LocalRun::Executed => {}
        other => return Err(format!("the retry answered {other:?}").into()),
    }
    assert_eq!(business.rows(name)?, 1, "business rows of {name}");
    match engine.execute_local(&k, fp()?, business.write(name, "third"))? {
        LocalRun::Skipped(Begin::Replay(r)) => assert_eq!(
            r.envelope.body,
            format!(r#"{{"booked":"{name}","note":"second"}}"#).into_bytes()
        ),
        other => return Err(format!("the third attempt answered {other:?}").into()),
    }
    assert_eq!(
        business.rows(name)?,
        1,
        "business rows of {name} after a replay"
    );
    drop(engine);
    pg_chaos::drop_prefix(&mut pg_chaos::connect(&url)?, &prefix)
}
