//! Breaker probe of effect steps under concurrency (issue 22), redb and
//! PostgreSQL: eight threads reserve the same step through clones of one
//! claim's `Effects` (exactly one may get `Run`, the others `StepReused`);
//! on PostgreSQL two engines on one store race `begin` on a key whose
//! steps are settled and whose receipt must be re-sent (exactly one claim,
//! one `Run` for the receipt under its first reference, the charge never
//! `Run` again); a claim used after its lease ended and after another
//! claim took the key is `Fenced`, naming the key. Guards against a step's
//! call handed out twice and a stale holder writing a step.

mod common;

// Declared once at the test binary's root (tests/services/main.rs): its
// table and key prefixes are unique through one counter per process.
use crate::harness;

use std::sync::Barrier;
use std::time::Duration;

use common::{claimed, CannotTell};
use harness::{run, run_format2, run_format3, Backend, Harness, TestResult};
use idempotency::{
    Begin, EffectStep, Engine, EngineBuilder, Error, Failure, Fingerprint, IdempotencyKey,
    InDoubtStep, ManualClock, Resolution, StepResolution,
};

const T0: u64 = 1_700_000_000_000;
const LEASE_MS: u64 = 1_000;

fn key(k: &str) -> Result<IdempotencyKey, Error> {
    IdempotencyKey::new("tenant-1:create_payment", k)
}

fn fp() -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(br#"{"amount": 100}"#, &[])
}

fn clocked(h: &Harness, clock: &ManualClock) -> EngineBuilder {
    h.builder()
        .clock(clock.clone())
        .lease(Duration::from_millis(LEASE_MS))
        .step_resolver("receipt", |_: &InDoubtStep| StepResolution::NotExecuted)
}

both_backends! {
    fn eight_threads_reserve_one_step(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(clocked(h, &clock))?;
        let k = key("race-one-step")?;
        let c = claimed(engine.begin(&k, fp()?)?)?;
        let effects = c.effects();
        let barrier = Barrier::new(8);
        let answers: Vec<Result<EffectStep, Error>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    let e = effects.clone();
                    let b = &barrier;
                    s.spawn(move || {
                        b.wait();
                        e.effect("charge")
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(Error::Closed)))
                .collect()
        });
        let runs = answers
            .iter()
            .filter(|a| matches!(a, Ok(EffectStep::Run { .. })))
            .count();
        let reused = answers
            .iter()
            .filter(|a| matches!(a, Err(Error::StepReused { step, .. }) if step == "charge"))
            .count();
        assert_eq!((runs, reused), (1, 7), "{answers:?}");
        c.confirm("charge", b"ch")?;
        Ok(())
    }
}

both_backends! {
    fn stale_claim_is_fenced_after_takeover(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(clocked(h, &clock))?;
        let k = key("race-stale-claim")?;
        let old = claimed(engine.begin(&k, fp()?)?)?;
        let stale = old.effects();
        clock.advance(Duration::from_millis(LEASE_MS + 1));
        // No step yet: the key is in doubt as a whole; settle it by hand.
        engine.resolve(&k, Resolution::NotExecuted, "never started")?;
        let new = claimed(engine.begin(&k, fp()?)?)?;
        for (what, r) in [
            ("effect", stale.effect("charge").map(drop)),
            ("confirm", stale.confirm("charge", b"x")),
        ] {
            match r {
                Err(Error::Fenced { key, .. }) if key == k => {}
                other => return Err(format!("stale {what}: {other:?}").into()),
            }
        }
        let EffectStep::Run { .. } = new.effect("charge")? else {
            return Err("the new claim's charge should run".into());
        };
        drop(old);
        new.confirm("charge", b"ch")?;
        engine.complete(new, idempotency::Envelope::new(1, 200, b"ok".to_vec()))?;
        Ok(())
    }
}

/// Two engines on one PostgreSQL store race `begin` on a key whose charge
/// is confirmed and whose receipt the mailer never got.
#[test]
fn two_engines_race_a_resumable_key_on_postgres() -> TestResult {
    let Some(h) = Harness::new(Backend::Postgres) else {
        return Ok(());
    };
    for round in 0..20 {
        let clock = ManualClock::new(T0);
        let a = h.open(clocked(&h, &clock))?;
        let b = h.open(clocked(&h, &clock))?;
        let k = key(&format!("race-resume-{round}"))?;
        let c = claimed(a.begin(&k, fp()?)?)?;
        let EffectStep::Run { reference: charge } = c.effect("charge")? else {
            return Err("fresh charge".into());
        };
        c.confirm("charge", b"ch")?;
        let EffectStep::Run { reference: receipt } = c.effect("receipt")? else {
            return Err("fresh receipt".into());
        };
        a.fail(
            c,
            Failure::InDoubt {
                reason: "mailer".into(),
            },
        )?;
        clock.advance(Duration::from_millis(LEASE_MS + 1));
        let barrier = Barrier::new(2);
        let results: Vec<Result<Option<String>, String>> = std::thread::scope(|s| {
            let hs: Vec<_> = [&a, &b]
                .into_iter()
                .map(|e: &Engine| {
                    let barrier = &barrier;
                    let k = &k;
                    s.spawn(move || -> Result<Option<String>, String> {
                        barrier.wait();
                        let begun = e.begin(k, fp().map_err(|e| e.to_string())?);
                        match begun.map_err(|e| format!("begin: {e:?}"))? {
                            Begin::Claimed(c) => {
                                let got = match c.effect("charge").map_err(|e| e.to_string())? {
                                    EffectStep::Run { reference } => {
                                        return Err(format!("charge Run again: {reference}"))
                                    }
                                    _ => match c.effect("receipt").map_err(|e| e.to_string())? {
                                        EffectStep::Run { reference } => reference,
                                        other => return Err(format!("receipt: {other:?}")),
                                    },
                                };
                                c.confirm("receipt", b"mail").map_err(|e| e.to_string())?;
                                e.complete(c, idempotency::Envelope::new(1, 201, b"paid".to_vec()))
                                    .map_err(|e| e.to_string())?;
                                Ok(Some(got))
                            }
                            _ => Ok(None),
                        }
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("panicked".into())))
                .collect()
        });
        let mut runs = Vec::new();
        for r in results {
            if let Some(reference) = r.map_err(|e| format!("round {round}: {e}"))? {
                runs.push(reference);
            }
        }
        if runs.len() != 1 || runs.iter().any(|r| *r != receipt) {
            return Err(format!(
                "round {round}: receipt Run {runs:?} (first reference {receipt}, charge {charge})"
            )
            .into());
        }
        let _ = a.recover_in_doubt(&CannotTell, 10)?;
    }
    Ok(())
}
