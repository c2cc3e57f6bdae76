//! Guards against a lost COMMIT acknowledgement being reported as "outcome
//! unknown" when the server can tell what happened (issue 23, item 3): the
//! connection breaks right after the client sends COMMIT, either after the
//! server committed (the call must succeed, the business row must exist
//! exactly once and a replay must answer the stored result) or before the
//! COMMIT ever reached it (the call must fail with a clean "not committed"
//! error, nothing may be written, and a retry of the same key must then
//! execute exactly once). Also guards the autocommitted statements (a
//! claim, an in-place completion) whose answer is lost: however the call
//! ends, the key is never executed twice and every replay answers the one
//! execution's result.
//!
//! The engine connects through a proxy in this test (`common/pg_proxy.rs`)
//! that cuts the connection at the COMMIT (or the next statement); a
//! second engine and a plain client look at the database directly. Time
//! moves on a `ManualClock`, so leases run out without sleeping.
//!
//! Needs a server: `IDEMPOTENCY_TEST_PG` (set by `scripts/with-postgres`).
//! Without it the tests are skipped, except under `CI=true`, where they fail.
#![cfg(unix)]

#[path = "common/pg_business.rs"]
mod pg_business;
#[path = "common/pg_chaos.rs"]
mod pg_chaos;
#[path = "common/pg_proxy.rs"]
mod pg_proxy;

use std::error::Error;
use std::time::Duration;

use idempotency::{
    Begin, Engine, Envelope, Failure, Fingerprint, IdempotencyKey, LocalRun, ManualClock, State,
};

use pg_business::{Business, Provider};
use pg_proxy::{Forward, PgProxy};

type TestResult<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

const T0: u64 = 1_700_000_000_000;
const LEASE: Duration = Duration::from_secs(10);

struct Setup {
    url: String,
    proxy: PgProxy,
    clock: ManualClock,
    prefix: String,
    provider: Provider,
    business: Business,
    /// Through the proxy; consults the provider for in-doubt keys.
    engine: Engine,
    /// Straight to the server, no resolver: looks without settling.
    direct: Engine,
}

fn setup(tag: &str) -> TestResult<Option<Setup>> {
    let Some(url) = pg_chaos::pg_url() else {
        return Ok(None);
    };
    let proxy = PgProxy::start(&url)?;
    let clock = ManualClock::new(T0);
    let prefix = pg_chaos::unique_prefix(tag);
    let provider = Provider::default();
    let builder = || {
        Engine::builder()
            .table_prefix(prefix.as_str())
            .pool_size(2)
            .database_clock(false)
            .clock(clock.clone())
            .lease(LEASE)
            .sweep_interval(None)
    };
    let engine = builder()
        .resolver(provider.resolver())
        .open_postgres(&proxy.url("")?)?;
    let direct = builder().open_postgres(&url)?;
    let business = Business::create(&url, &prefix)?;
    Ok(Some(Setup {
        url,
        proxy,
        clock,
        prefix,
        provider,
        business,
        engine,
        direct,
    }))
}

impl Setup {
    fn cleanup(self) -> TestResult {
        drop((self.engine, self.direct, self.proxy));
        pg_chaos::drop_prefix(&mut pg_chaos::connect(&self.url)?, &self.prefix)
    }

    /// The cut fired exactly once: the test really lost what it meant to.
    fn assert_fired(&self, what: &str) {
        assert_eq!(
            self.proxy.fired(),
            1,
            "{what}: the proxy never saw the message it was armed for"
        );
    }
}

fn key(name: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("tenant-1:bookings", name)
}

fn fp() -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(br#"{"room": 12, "nights": 2}"#, &[])
}

/// The error says plainly that nothing was committed, not the old "the
/// outcome is unknown".
fn assert_not_committed(what: &str, e: &idempotency::Error) {
    let text = e.to_string();
    let lower = text.to_lowercase();
    assert!(
        lower.contains("not committed") || lower.contains("nothing was written"),
        "{what}: the error does not say the write was not committed: {text} ({e:?})"
    );
    assert!(
        !lower.contains("outcome is unknown"),
        "{what}: a COMMIT the server never received reported as unknown: {text}"
    );
}

/// The replay of `k` through `engine` carries `body`.
fn assert_replays(engine: &Engine, k: &IdempotencyKey, body: &[u8]) -> TestResult {
    match engine.begin(k, fp()?)? {
        Begin::Replay(r) => {
            assert_eq!(
                r.envelope.body,
                body,
                "replay of {k}: {:?} instead of {:?}",
                String::from_utf8_lossy(&r.envelope.body),
                String::from_utf8_lossy(body)
            );
            Ok(())
        }
        other => Err(format!("{k}: expected a replay, got {other:?}").into()),
    }
}

/// The envelope the business write answers for `name` (see
/// `Business::write`).
fn booked(name: &str, note: &str) -> Vec<u8> {
    format!(r#"{{"booked":"{name}","note":"{note}"}}"#).into_bytes()
}

#[test]
fn local_write_whose_commit_answer_was_lost_succeeds_once() -> TestResult {
    let Some(s) = setup("lcy")? else {
        return Ok(());
    };
    let name = "booking-commit-went-through";
    let k = key(name)?;
    // Warm the pool, so the only COMMIT on the wire is the write's.
    assert!(s.engine.record(&k)?.is_none());

    s.proxy.cut_after_commit(Forward::Yes);
    let run = s
        .engine
        .execute_local(&k, fp()?, s.business.write(name, "first"));
    s.assert_fired("execute_local");
    match run {
        Ok(LocalRun::Executed) => {}
        Ok(other) => return Err(format!("expected Executed, got {other:?}").into()),
        Err(e) => {
            return Err(format!(
            "the server committed, yet execute_local failed (the lost answer was not settled): {e}"
        )
            .into())
        }
    }
    assert_eq!(s.business.rows(name)?, 1, "business rows of {name}");
    let rec = s
        .direct
        .record(&k)?
        .ok_or("no record after a committed write")?;
    assert_eq!(rec.state, State::Completed, "{rec:?}");

    // A retry replays the stored result and runs nothing.
    assert_replays(&s.engine, &k, &booked(name, "first"))?;
    match s
        .engine
        .execute_local(&k, fp()?, s.business.write(name, "second"))?
    {
        LocalRun::Skipped(Begin::Replay(r)) => assert_eq!(r.envelope.body, booked(name, "first")),
        other => return Err(format!("a retry: expected a skipped replay, got {other:?}").into()),
    }
    assert_eq!(
        s.business.rows(name)?,
        1,
        "business rows of {name} after a retry"
    );
    s.cleanup()
}

#[test]
fn local_write_whose_commit_never_arrived_is_a_clean_error_and_runs_once_on_retry() -> TestResult {
    let Some(s) = setup("lcn")? else {
        return Ok(());
    };
    let name = "booking-commit-never-sent";
    let k = key(name)?;
    assert!(s.engine.record(&k)?.is_none());

    s.proxy.cut_after_commit(Forward::No);
    let run = s
        .engine
        .execute_local(&k, fp()?, s.business.write(name, "first"));
    s.assert_fired("execute_local");
    match run {
        Ok(r) => return Err(format!("a COMMIT that never arrived returned Ok({r:?})").into()),
        Err(e) => assert_not_committed("execute_local", &e),
    }
    // Nothing was written: no business row, no record of the key.
    assert_eq!(s.business.rows(name)?, 0, "business rows of {name}");
    let rec = s.direct.record(&k)?;
    assert!(rec.is_none(), "a write that never committed left {rec:?}");

    // The retry runs the write, exactly once.
    match s
        .engine
        .execute_local(&k, fp()?, s.business.write(name, "second"))?
    {
        LocalRun::Executed => {}
        other => return Err(format!("the retry: expected Executed, got {other:?}").into()),
    }
    assert_eq!(
        s.business.rows(name)?,
        1,
        "business rows of {name} after the retry"
    );
    assert_replays(&s.direct, &k, &booked(name, "second"))?;
    s.cleanup()
}

/// A release (`Failure::Retryable`) is a transaction too: a lost answer to
/// a COMMIT that went through is a success (the key is free); a COMMIT
/// that never arrived is either sent again by the engine (a success, the
/// key is free) or a clean "not committed" error (the key is still held),
/// never "outcome unknown".
#[test]
fn release_whose_commit_answer_was_lost_is_settled_both_ways() -> TestResult {
    let Some(s) = setup("lcr")? else {
        return Ok(());
    };
    for (forward, name) in [
        (Forward::Yes, "release-went-through"),
        (Forward::No, "release-never-sent"),
    ] {
        let k = key(name)?;
        let claim = match s.engine.begin(&k, fp()?)? {
            Begin::Claimed(c) => c,
            other => return Err(format!("{name}: expected Claimed, got {other:?}").into()),
        };
        let token = claim.fencing_token();
        let fired = s.proxy.fired();
        s.proxy.cut_after_commit(forward);
        let res = s.engine.fail(claim, Failure::Retryable);
        assert_eq!(
            s.proxy.fired(),
            fired + 1,
            "{name}: the release sent no COMMIT"
        );
        let rec = s.direct.record(&k)?;
        match forward {
            Forward::Yes => {
                if let Err(e) = res {
                    return Err(
                        format!("{name}: the server committed the release, yet: {e}").into(),
                    );
                }
                assert!(rec.is_none(), "{name}: released, yet {rec:?}");
                let again = s.engine.begin(&k, fp()?)?;
                assert!(
                    matches!(&again, Begin::Claimed(c) if c.fencing_token() > token),
                    "{name}: after the release: {again:?}"
                );
            }
            // Settled as never committed, the engine may send the release
            // again (it is fenced by the token): then the key is free.
            Forward::No if res.is_ok() => {
                assert!(rec.is_none(), "{name}: released (retried), yet {rec:?}");
                let again = s.engine.begin(&k, fp()?)?;
                assert!(
                    matches!(&again, Begin::Claimed(c) if c.fencing_token() > token),
                    "{name}: after the retried release: {again:?}"
                );
            }
            Forward::No => {
                if let Err(e) = res {
                    assert_not_committed(name, &e);
                }
                let rec = rec.ok_or_else(|| format!("{name}: the held record vanished"))?;
                assert_eq!(
                    (rec.state, rec.fencing_token),
                    (State::Processing, token),
                    "{rec:?}"
                );
                let twin = s.direct.begin(&k, fp()?)?;
                assert!(
                    matches!(twin, Begin::Processing { .. }),
                    "{name}: twin: {twin:?}"
                );
            }
        }
    }
    s.cleanup()
}

/// The in-place completion is one autocommitted statement (no COMMIT on
/// the wire): its answer lost after (Yes) or before (No) the server ran
/// it. An `Ok` must mean the completion is stored. However `complete`
/// ends, once the lease is over the key settles
/// through the resolver to the one charge's result, and a second attempt
/// never charges again.
#[test]
fn complete_whose_statement_answer_was_lost_never_executes_twice() -> TestResult {
    let Some(s) = setup("lcc")? else {
        return Ok(());
    };
    for (forward, name) in [
        (Forward::Yes, "charge-completed"),
        (Forward::No, "charge-not-completed"),
    ] {
        let k = key(name)?;
        let claim = match s.engine.begin(&k, fp()?)? {
            Begin::Claimed(c) => c,
            other => return Err(format!("{name}: expected Claimed, got {other:?}").into()),
        };
        let body = s.provider.charge(name, claim.reference());
        let fired = s.proxy.fired();
        s.proxy.cut_after_statement(forward);
        let res = s
            .engine
            .complete(claim, Envelope::new(1, 201, body.clone()));
        s.proxy.disarm();
        assert_eq!(
            s.proxy.fired(),
            fired + 1,
            "{name}: complete sent no statement"
        );
        eprintln!("{name} ({forward:?}): complete answered {res:?}");
        if res.is_ok() {
            // Ok means stored, at once, whether or not the engine had to
            // settle a lost answer and send the completion again.
            let rec = s
                .direct
                .record(&k)?
                .ok_or_else(|| format!("{name}: no record"))?;
            assert_eq!(
                rec.state,
                State::Completed,
                "{name}: complete returned Ok: {rec:?}"
            );
            assert_eq!(rec.response.map(|e| e.body), Some(body.clone()), "{name}");
        }
        attempt_until_replay(&s, &k, name, &body)?;
    }
    assert_eq!(
        s.provider.executions(),
        2,
        "one charge per key, never a second"
    );
    s.cleanup()
}

/// The claim is one autocommitted statement: lost after (Yes, the key is
/// claimed by nobody who knows it) or before (No) the server ran it. The
/// work runs once either way: after the lease the resolver finds no
/// charge and the key is claimed afresh.
#[test]
fn claim_whose_statement_answer_was_lost_never_executes_twice() -> TestResult {
    let Some(s) = setup("lcb")? else {
        return Ok(());
    };
    for (forward, name) in [
        (Forward::Yes, "claim-landed"),
        (Forward::No, "claim-not-sent"),
    ] {
        let k = key(name)?;
        assert!(s.engine.record(&k)?.is_none());
        let fired = s.proxy.fired();
        s.proxy.cut_after_statement(forward);
        let first = s.engine.begin(&k, fp()?);
        s.proxy.disarm();
        assert_eq!(
            s.proxy.fired(),
            fired + 1,
            "{name}: begin sent no statement"
        );
        let mut body = None;
        match first {
            Ok(Begin::Claimed(c)) => {
                let b = s.provider.charge(name, c.reference());
                s.engine.complete(c, Envelope::new(1, 201, b.clone()))?;
                body = Some(b);
            }
            // The claim landed (its answer lost) and the statement was sent
            // again: held by nobody who knows it, so in flight until the
            // lease ends.
            Ok(Begin::Processing { .. }) if forward == Forward::Yes => {
                eprintln!("{name}: the first begin answered Processing");
            }
            Ok(other) => return Err(format!("{name}: first begin answered {other:?}").into()),
            Err(e) => eprintln!("{name} ({forward:?}): begin failed: {e}"),
        }
        let body = match body {
            Some(b) => b,
            None => {
                // A retry: run the work if (and only if) the key is ours.
                s.clock.advance(LEASE + Duration::from_millis(1));
                match s.engine.begin(&k, fp()?)? {
                    Begin::Claimed(c) => {
                        let b = s.provider.charge(name, c.reference());
                        s.engine.complete(c, Envelope::new(1, 201, b.clone()))?;
                        b
                    }
                    other => return Err(format!("{name}: the retry answered {other:?}").into()),
                }
            }
        };
        attempt_until_replay(&s, &k, name, &body)?;
    }
    assert_eq!(
        s.provider.executions(),
        2,
        "one charge per key, never a second"
    );
    s.cleanup()
}

/// Retries `k` the way a client would, past the lease: a replay of `body`
/// ends it; a fresh claim would be a second execution (charged, so the
/// count shows it).
fn attempt_until_replay(s: &Setup, k: &IdempotencyKey, name: &str, body: &[u8]) -> TestResult {
    s.clock.advance(LEASE + Duration::from_millis(1));
    match s.engine.begin(k, fp()?)? {
        Begin::Replay(r) => {
            assert_eq!(r.envelope.body, body, "{name}: replay");
            Ok(())
        }
        Begin::Claimed(c) => {
            s.provider.charge(name, c.reference());
            Err(format!("{name}: claimed a second time: a double execution").into())
        }
        other => Err(format!("{name}: after the lease, with a resolver: {other:?}").into()),
    }
}
