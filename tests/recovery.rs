//! Guards against recovery executing work twice or losing a known result:
//! a holder whose lease ran out must be fenced once recovery has handed the
//! key to someone else, but may still record its result while it owns the
//! record; `begin` must settle UNKNOWN records through the engine's resolver
//! (replay, fresh claim with a larger token, or still unknown); every kind of
//! failure must leave the record in its documented state; and a claim's
//! provider reference must be the one every later view reports.

mod common;

use std::error::Error;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{claimed, replay, unknown};
use idempotency::{
    Begin, Claim, Engine, EngineBuilder, Envelope, Failure, Fingerprint, IdempotencyKey, InDoubt,
    ManualClock, RecoveryReport, ReplayKind, Resolution, State,
};

type TestResult = Result<(), Box<dyn Error>>;

const T0: u64 = 1_700_000_000_000;
const LEASE_MS: u64 = 1_000;

fn key(k: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("tenant-1:create_payment", k)
}

fn fp() -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(br#"{"amount": 10}"#, &[])
}

fn builder(clock: &ManualClock) -> EngineBuilder {
    Engine::builder()
        .clock(clock.clone())
        .lease(Duration::from_millis(LEASE_MS))
        .sweep_interval(None)
}

#[test]
fn recovered_key_fences_the_late_holder() -> TestResult {
    let clock = ManualClock::new(T0);
    let engine = builder(&clock).in_memory()?;
    let k = key("race")?;

    let a = claimed(engine.begin(&k, fp()?)?)?;
    clock.advance(Duration::from_millis(LEASE_MS));
    assert_eq!(engine.sweep_now()?.moved_to_unknown, 1);
    let asked = Mutex::new(Vec::new());
    let resolver = |p: &InDoubt| {
        asked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(p.reference.clone());
        Resolution::NotExecuted
    };
    let report = engine.recover_in_doubt(&resolver, 10)?;
    assert_eq!(
        report,
        RecoveryReport {
            not_executed: 1,
            ..RecoveryReport::default()
        }
    );
    assert_eq!(
        *asked.lock().unwrap_or_else(|e| e.into_inner()),
        [a.reference().to_string()]
    );
    assert!(engine.in_doubt(10)?.is_empty());

    let b = claimed(engine.begin(&k, fp()?)?)?;
    assert!(b.fencing_token() > a.fencing_token());
    assert_ne!(b.reference(), a.reference());
    let err = engine
        .complete(a, Envelope::new(1, 201, "A"))
        .err()
        .ok_or("the fenced holder's complete was accepted")?;
    assert!(matches!(err, idempotency::Error::Fenced { .. }), "{err:?}");
    engine.complete(b, Envelope::new(1, 201, "B"))?;
    let r = replay(engine.begin(&k, fp()?)?)?;
    assert_eq!(r.envelope.body, b"B");
    Ok(())
}

#[test]
fn late_complete_by_the_current_holder_succeeds() -> TestResult {
    let clock = ManualClock::new(T0);
    let engine = builder(&clock).in_memory()?;
    let k = key("late")?;
    let a = claimed(engine.begin(&k, fp()?)?)?;
    clock.advance(Duration::from_millis(LEASE_MS + 1));
    assert_eq!(engine.sweep_now()?.moved_to_unknown, 1);
    assert_eq!(engine.record(&k)?.ok_or("missing")?.state, State::Unknown);

    engine.complete(a, Envelope::new(1, 201, "late but known"))?;
    let r = replay(engine.begin(&k, fp()?)?)?;
    assert_eq!(r.envelope.body, b"late but known");
    assert!(
        engine.in_doubt(10)?.is_empty(),
        "recovery queue kept the record"
    );
    assert_eq!(
        engine.recover_in_doubt(&|_: &InDoubt| Resolution::NotExecuted, 10)?,
        RecoveryReport::default()
    );
    Ok(())
}

/// An engine whose resolver answers whatever `answer` holds, recording what
/// it was asked.
struct Scripted {
    answer: Arc<Mutex<Resolution>>,
    asked: Arc<Mutex<Vec<InDoubt>>>,
}

fn scripted_engine(clock: &ManualClock) -> Result<(Engine, Scripted), idempotency::Error> {
    let s = Scripted {
        answer: Arc::new(Mutex::new(Resolution::StillInDoubt)),
        asked: Arc::new(Mutex::new(Vec::new())),
    };
    let (answer, asked) = (s.answer.clone(), s.asked.clone());
    let engine = builder(clock)
        .resolver(move |p: &InDoubt| {
            asked
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(p.clone());
            answer.lock().unwrap_or_else(|e| e.into_inner()).clone()
        })
        .in_memory()?;
    Ok((engine, s))
}

impl Scripted {
    fn set(&self, r: Resolution) {
        *self.answer.lock().unwrap_or_else(|e| e.into_inner()) = r;
    }
    fn asked(&self) -> Vec<InDoubt> {
        self.asked.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Claims `k` and lets the lease run out (the record is stale PROCESSING).
fn stale_claim(
    engine: &Engine,
    clock: &ManualClock,
    k: &IdempotencyKey,
) -> Result<Claim, Box<dyn Error>> {
    let c = claimed(engine.begin(k, fp()?)?)?;
    clock.advance(Duration::from_millis(LEASE_MS + 1));
    Ok(c)
}

#[test]
fn begin_consults_the_resolver_completed() -> TestResult {
    let clock = ManualClock::new(T0);
    let (engine, script) = scripted_engine(&clock)?;
    let k = key("resolved-completed")?;
    let old = stale_claim(&engine, &clock, &k)?;
    let provider =
        Envelope::new(1, 201, r#"{"charge":"ch_1"}"#).with_header("x-source", "provider");
    script.set(Resolution::Completed(provider.clone()));

    let r = replay(engine.begin(&k, fp()?)?)?;
    assert_eq!(r.envelope, provider);
    assert_eq!(r.kind, ReplayKind::Completed);
    assert_eq!(r.reference, old.reference());
    let asked = script.asked();
    assert_eq!(asked.len(), 1);
    assert_eq!(asked[0].reference, old.reference());
    assert_eq!(asked[0].fencing_token, old.fencing_token());
    // Settled: the next begin replays without asking again.
    assert_eq!(replay(engine.begin(&k, fp()?)?)?.envelope, provider);
    assert_eq!(script.asked().len(), 1);
    // The old holder's outcome is refused now.
    let err = engine
        .complete(old, Envelope::new(1, 500, "x"))
        .err()
        .ok_or("accepted")?;
    assert!(matches!(err, idempotency::Error::Fenced { .. }), "{err:?}");
    Ok(())
}

#[test]
fn begin_consults_the_resolver_not_executed() -> TestResult {
    let clock = ManualClock::new(T0);
    let (engine, script) = scripted_engine(&clock)?;
    let k = key("resolved-not-executed")?;
    let old = stale_claim(&engine, &clock, &k)?;
    script.set(Resolution::NotExecuted);

    let fresh = claimed(engine.begin(&k, fp()?)?)?;
    assert!(fresh.fencing_token() > old.fencing_token());
    assert_ne!(fresh.reference(), old.reference());
    assert_eq!(script.asked().len(), 1);
    // While the fresh claim runs, another caller sees it in progress.
    let twin = engine.begin(&k, fp()?)?;
    assert!(matches!(twin, Begin::Processing { .. }), "got {twin:?}");
    engine.complete(fresh, Envelope::new(1, 201, "fresh"))?;
    assert_eq!(replay(engine.begin(&k, fp()?)?)?.envelope.body, b"fresh");
    let err = engine
        .complete(old, Envelope::new(1, 201, "old"))
        .err()
        .ok_or("accepted")?;
    assert!(matches!(err, idempotency::Error::Fenced { .. }), "{err:?}");
    assert_eq!(replay(engine.begin(&k, fp()?)?)?.envelope.body, b"fresh");
    Ok(())
}

#[test]
fn begin_consults_the_resolver_still_in_doubt() -> TestResult {
    let clock = ManualClock::new(T0);
    let (engine, script) = scripted_engine(&clock)?;
    let k = key("resolved-still-unknown")?;
    let old = stale_claim(&engine, &clock, &k)?;
    script.set(Resolution::StillInDoubt);

    for want in 1..=3u32 {
        let p = unknown(engine.begin(&k, fp()?)?)?;
        assert_eq!(p.attempts, want);
        assert_eq!(p.reference, old.reference());
        assert_eq!(p.fencing_token, old.fencing_token());
    }
    let asked: Vec<u32> = script.asked().iter().map(|p| p.attempts).collect();
    assert_eq!(asked, [0, 1, 2], "the resolver sees earlier attempts");
    assert_eq!(engine.record(&k)?.ok_or("missing")?.attempts, 3);
    drop(old);
    Ok(())
}

#[test]
fn failure_kinds_and_dropped_claims() -> TestResult {
    let clock = ManualClock::new(T0);
    let engine = builder(&clock).in_memory()?;

    // Dropped without an outcome: UNKNOWN with a reason, never re-claimed.
    // Its work may still run until its lease ends: until then `begin`
    // answers Processing (with the rest of the lease), then Unknown.
    let k = key("dropped")?;
    let c = claimed(engine.begin(&k, fp()?)?)?;
    let reference = c.reference().to_string();
    drop(c);
    // The dropped claim's report is queued to the writer ahead of this op.
    engine.flush()?;
    assert_eq!(engine.record(&k)?.ok_or("missing")?.state, State::Unknown);
    match engine.begin(&k, fp()?)? {
        Begin::Processing { retry_after } => {
            assert_eq!(retry_after, Duration::from_millis(LEASE_MS));
        }
        other => return Err(format!("expected Processing, got {other:?}").into()),
    }
    clock.advance(Duration::from_millis(LEASE_MS));
    let p = unknown(engine.begin(&k, fp()?)?)?;
    assert_eq!(p.reference, reference);
    assert!(p.reason.contains("dropped"), "reason: {}", p.reason);
    assert_eq!(engine.in_doubt(10)?.len(), 1);

    // Retryable: released, the next begin claims afresh.
    let k = key("retryable")?;
    let c = claimed(engine.begin(&k, fp()?)?)?;
    let first = c.fencing_token();
    engine.fail(c, Failure::Retryable)?;
    assert!(engine.record(&k)?.is_none());
    let c = claimed(engine.begin(&k, fp()?)?)?;
    assert!(c.fencing_token() > first);
    engine.complete(c, Envelope::new(1, 201, "second try"))?;

    // Final: stored and replayed as a final failure.
    let k = key("final")?;
    let c = claimed(engine.begin(&k, fp()?)?)?;
    let declined = Envelope::new(1, 402, r#"{"error":"insufficient_funds"}"#);
    engine.fail(c, Failure::Final(declined.clone()))?;
    let r = replay(engine.begin(&k, fp()?)?)?;
    assert_eq!(r.kind, ReplayKind::FinalFailure);
    assert_eq!(r.envelope, declined);
    assert_eq!(
        engine.record(&k)?.ok_or("missing")?.state,
        State::FinalFailure
    );

    // Unknown: with the app's reason.
    let k = key("unknown")?;
    let c = claimed(engine.begin(&k, fp()?)?)?;
    engine.fail(
        c,
        Failure::InDoubt {
            reason: "provider timed out".into(),
        },
    )?;
    assert_eq!(
        unknown(engine.begin(&k, fp()?)?)?.reason,
        "provider timed out"
    );
    Ok(())
}

#[test]
fn extend_renews_the_lease_until_fenced() -> TestResult {
    let clock = ManualClock::new(T0);
    let engine = builder(&clock).in_memory()?;
    let k = key("long-work")?;
    let mut c = claimed(engine.begin(&k, fp()?)?)?;
    assert_eq!(c.lease_until_ms(), T0 + LEASE_MS);

    clock.advance(Duration::from_millis(500));
    let before = match engine.begin(&k, fp()?)? {
        Begin::Processing { retry_after } => retry_after,
        other => return Err(format!("expected InProgress, got {other:?}").into()),
    };
    assert_eq!(before, Duration::from_millis(500));
    c.extend(Duration::from_secs(10))?;
    assert_eq!(c.lease_until_ms(), T0 + 500 + 10_000);
    let after = match engine.begin(&k, fp()?)? {
        Begin::Processing { retry_after } => retry_after,
        other => return Err(format!("expected InProgress, got {other:?}").into()),
    };
    assert_eq!(after, Duration::from_secs(10));
    assert!(after > before);

    // Past the renewed lease: first seen (and moved) by a begin, then fenced.
    clock.advance(Duration::from_millis(10_000));
    unknown(engine.begin(&k, fp()?)?)?;
    let err = c
        .extend(Duration::from_secs(10))
        .err()
        .ok_or("extended an UNKNOWN record")?;
    assert!(matches!(err, idempotency::Error::Fenced { .. }), "{err:?}");
    assert_eq!(engine.record(&k)?.ok_or("missing")?.state, State::Unknown);
    // Its own result is still welcome.
    engine.complete(c, Envelope::new(1, 201, "done"))?;
    assert_eq!(replay(engine.begin(&k, fp()?)?)?.envelope.body, b"done");
    Ok(())
}

#[test]
fn claim_reference_is_stable_everywhere() -> TestResult {
    let clock = ManualClock::new(T0);
    let engine = builder(&clock).in_memory()?;
    let k = key("reference")?;
    let c = claimed(engine.begin(&k, fp()?)?)?;
    let reference = c.reference().to_string();
    assert!(reference.starts_with("idem_"), "{reference}");
    assert!(
        reference
            .chars()
            .all(|ch| ch.is_ascii_alphanumeric() || ch == '_'),
        "{reference}"
    );
    assert_eq!(c.reference(), reference, "reference() changed");
    assert_eq!(engine.record(&k)?.ok_or("missing")?.reference, reference);

    clock.advance(Duration::from_millis(LEASE_MS));
    let p = unknown(engine.begin(&k, fp()?)?)?;
    assert_eq!(p.reference, reference);
    assert_eq!(engine.in_doubt(1)?[0].reference, reference);
    engine.complete(c, Envelope::new(1, 201, "ok"))?;
    let r = replay(engine.begin(&k, fp()?)?)?;
    assert_eq!(r.reference, reference);
    assert_eq!(engine.record(&k)?.ok_or("missing")?.reference, reference);

    // Different keys, scopes and claims get different references.
    let other_scope = IdempotencyKey::new("tenant-2:create_payment", "reference")?;
    let c2 = claimed(engine.begin(&other_scope, fp()?)?)?;
    assert_ne!(c2.reference(), reference);
    engine.complete(c2, Envelope::new(1, 201, "ok"))?;
    Ok(())
}

#[test]
fn an_oversized_resolver_answer_does_not_stop_recovery() -> TestResult {
    let clock = ManualClock::new(T0);
    let engine = builder(&clock).max_response_bytes(256).in_memory()?;
    for k in ["a", "b"] {
        let c = claimed(engine.begin(&key(k)?, fp()?)?)?;
        engine.fail(
            c,
            Failure::InDoubt {
                reason: "timeout".into(),
            },
        )?;
    }
    let resolver = |p: &InDoubt| {
        if p.key.key() == "a" {
            Resolution::Completed(Envelope::new(1, 200, vec![b'x'; 1000]))
        } else {
            Resolution::NotExecuted
        }
    };
    let report = engine.recover_in_doubt(&resolver, 10)?;
    assert_eq!(
        report,
        RecoveryReport {
            not_executed: 1,
            still_in_doubt: 1,
            ..RecoveryReport::default()
        }
    );
    assert_eq!(
        engine.record(&key("a")?)?.map(|r| r.state),
        Some(State::Unknown)
    );
    assert_eq!(engine.record(&key("b")?)?, None);
    Ok(())
}

/// A dropped claim's work may still be running (an orphaned task, a client
/// that hung up): a "not executed" answer before the lease ends could miss
/// a provider call still in flight, and a fresh claim would charge twice.
/// The resolver may be asked early (a positive answer would settle the key
/// at once: issue 28), but until the lease ends "not executed" releases
/// nothing, the key stays in progress, and it is not asked again.
#[test]
fn a_dropped_claim_is_not_released_before_its_lease_ends() -> TestResult {
    let clock = ManualClock::new(T0);
    let asked = Arc::new(Mutex::new(0));
    let counter = asked.clone();
    let engine = builder(&clock)
        .resolver(move |_: &InDoubt| {
            if let Ok(mut n) = counter.lock() {
                *n += 1;
            }
            Resolution::NotExecuted
        })
        .in_memory()?;
    let k = key("dropped")?;
    drop(claimed(engine.begin(&k, fp()?)?)?);
    // The drop notifies the writer without waiting; flush waits for it.
    engine.flush()?;
    assert_eq!(engine.record(&k)?.map(|r| r.state), Some(State::Unknown));

    clock.advance(Duration::from_millis(LEASE_MS - 1));
    for _ in 0..3 {
        match engine.begin(&k, fp()?)? {
            Begin::Processing { retry_after } => {
                assert_eq!(retry_after, Duration::from_millis(1));
            }
            other => return Err(format!("expected Processing, got {other:?}").into()),
        }
    }
    assert_eq!(
        *asked.lock().map_err(|_| "poisoned")?,
        1,
        "asked once early, not once per retry"
    );
    let report = engine.recover_in_doubt(&|_: &InDoubt| Resolution::NotExecuted, 10)?;
    assert_eq!(
        report.not_executed, 0,
        "recovery must wait for the lease too"
    );
    assert_eq!(engine.record(&k)?.map(|r| r.state), Some(State::Unknown));

    clock.advance(Duration::from_millis(1));
    let second = claimed(engine.begin(&k, fp()?)?)?;
    assert_eq!(*asked.lock().map_err(|_| "poisoned")?, 2);
    engine.complete(second, Envelope::new(1, 201, "once"))?;
    Ok(())
}

/// An explicit `Failure::InDoubt` means the holder stopped acting: the
/// resolver may settle it at once.
#[test]
fn an_explicit_unknown_failure_is_resolvable_at_once() -> TestResult {
    let clock = ManualClock::new(T0);
    let engine = builder(&clock)
        .resolver(|_: &InDoubt| Resolution::Completed(Envelope::new(1, 201, "charged")))
        .in_memory()?;
    let k = key("timed-out")?;
    let c = claimed(engine.begin(&k, fp()?)?)?;
    engine.fail(
        c,
        Failure::InDoubt {
            reason: "provider timed out".into(),
        },
    )?;
    let r = replay(engine.begin(&k, fp()?)?)?;
    assert_eq!(r.envelope.body, b"charged");
    Ok(())
}

/// The operator path has the same rule: "not executed" for a dropped claim
/// is refused until its lease ends; a known result is taken at once.
#[test]
fn operator_cannot_release_a_dropped_claim_before_its_lease_ends() -> TestResult {
    let clock = ManualClock::new(T0);
    let engine = builder(&clock).in_memory()?;
    let k = key("operator")?;
    let first = claimed(engine.begin(&k, fp()?)?)?;
    let first_token = first.fencing_token();
    drop(first);
    engine.flush()?;
    let err = engine
        .resolve(&k, Resolution::NotExecuted, "test")
        .err()
        .ok_or("NotExecuted before the lease ends must be refused")?;
    assert!(err.to_string().contains("may still be running"), "{err}");
    clock.advance(Duration::from_millis(LEASE_MS));
    engine.resolve(&k, Resolution::NotExecuted, "test")?;
    let again = claimed(engine.begin(&k, fp()?)?)?;
    assert!(again.fencing_token() > first_token);
    engine.complete(again, Envelope::new(1, 201, "once"))?;
    Ok(())
}

/// Read-time truth holds in operator views, not only in `begin`: once a
/// crashed claim's lease has run out, the record is listed as in doubt,
/// counted as UNKNOWN and can be resolved, with no sweep in between.
#[test]
fn lease_ended_claim_is_in_doubt_in_every_view_before_any_sweep() -> TestResult {
    let clock = ManualClock::new(T0);
    let engine = builder(&clock).in_memory()?;
    let (a, b) = (key("crashed-a")?, key("crashed-b")?);
    let crashed_a = claimed(engine.begin(&a, fp()?)?)?;
    let crashed_b = claimed(engine.begin(&b, fp()?)?)?;
    // The holders vanish without a word, as in a crash.
    std::mem::forget(crashed_a);
    std::mem::forget(crashed_b);
    assert!(
        engine.in_doubt(10)?.is_empty(),
        "in doubt before the lease ended"
    );
    assert!(engine.resolve(&a, Resolution::NotExecuted, "test").is_err());

    clock.advance(Duration::from_millis(LEASE_MS));
    let listed = engine.in_doubt(10)?;
    let keys: Vec<_> = listed.iter().map(|d| d.key.clone()).collect();
    assert_eq!(keys, [a.clone(), b.clone()]);
    assert_eq!(listed[0].unknown_since_ms, T0 + LEASE_MS);
    assert!(
        listed[0].reason.contains("ran out without an outcome"),
        "{}",
        listed[0].reason
    );
    let stats = engine.stats()?;
    assert_eq!((stats.processing, stats.unknown), (0, 2));
    assert_eq!(stats.oldest_in_doubt_age, Some(Duration::ZERO));

    engine.resolve(&a, Resolution::NotExecuted, "test")?;
    assert!(
        engine.record(&a)?.is_none(),
        "not executed releases the key"
    );
    engine.resolve(&b, Resolution::StillInDoubt, "test")?;
    let rec = engine.record(&b)?.ok_or("b vanished")?;
    assert_eq!((rec.state, rec.attempts), (State::Unknown, 1));
    let report = engine.recover_in_doubt(&|_: &InDoubt| Resolution::StillInDoubt, 10)?;
    assert_eq!(report.still_in_doubt, 1);
    Ok(())
}
