//! Breaker finding on the evidence log (issue 22: "`idem resolve` requires
//! `--reason` and records it"), redb and PostgreSQL: an operator who
//! answers "still unknown" (for the whole key, or for one step with
//! `--step`) must give a reason, and that reason is then recorded nowhere:
//! no log entry names the operator. Guards against an operator's action on
//! a key in doubt leaving no trace in `Engine::history` / `idem show`.

mod common;

// Declared once at the test binary's root (tests/services/main.rs): its
// table and key prefixes are unique through one counter per process.
use crate::harness;

use std::time::Duration;

use common::claimed;
use harness::{run, run_format2, run_format3, Backend, Harness, TestResult};
use idempotency::{
    Actor, Engine, Error, Failure, Fingerprint, IdempotencyKey, ManualClock, Resolution,
    StepResolution,
};

const T0: u64 = 1_700_000_000_000;
const LEASE_MS: u64 = 1_000;

fn key(k: &str) -> Result<IdempotencyKey, Error> {
    IdempotencyKey::new("tenant-1:create_payment", k)
}

/// A key whose charge was reserved and whose claim failed in doubt, past
/// its lease.
fn charge_in_doubt(
    h: &Harness,
    clock: &ManualClock,
    k: &IdempotencyKey,
) -> Result<Engine, Box<dyn std::error::Error + Send + Sync>> {
    let engine = h.open(
        h.builder()
            .clock(clock.clone())
            .lease(Duration::from_millis(LEASE_MS)),
    )?;
    let c = claimed(engine.begin(k, Fingerprint::of_json(br#"{"a":1}"#, &[])?)?)?;
    let _ = c.effect("charge")?;
    engine.fail(
        c,
        Failure::InDoubt {
            reason: "card network timed out".into(),
        },
    )?;
    clock.advance(Duration::from_millis(LEASE_MS + 1));
    Ok(engine)
}

fn operator_reasons(engine: &Engine, k: &IdempotencyKey) -> Result<Vec<String>, Error> {
    Ok(engine
        .history(k)?
        .into_iter()
        .filter_map(|e| match e.actor {
            Actor::Operator { reason } => Some(reason),
            _ => None,
        })
        .collect())
}

both_backends! {
    fn operator_still_unknown_on_a_step_is_recorded(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let k = key("audit-step-still-unknown")?;
        let engine = charge_in_doubt(h, &clock, &k)?;
        let reason = "called the bank: they cannot tell before Monday";
        engine.resolve_step(&k, "charge", StepResolution::StillUnknown, reason)?;
        let reasons = operator_reasons(&engine, &k)?;
        assert!(
            reasons.iter().any(|r| r == reason),
            "the operator's mandatory reason for 'still unknown' on step charge is not in the \
             log: operator entries {reasons:?}"
        );
        Ok(())
    }
}

both_backends! {
    fn operator_still_unknown_on_the_key_is_recorded(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let k = key("audit-key-still-unknown")?;
        let engine = charge_in_doubt(h, &clock, &k)?;
        let reason = "provider support ticket 4711 open";
        engine.resolve(&k, Resolution::StillInDoubt, reason)?;
        let reasons = operator_reasons(&engine, &k)?;
        assert!(
            reasons.iter().any(|r| r == reason),
            "the operator's mandatory reason for 'still in doubt' is not in the log: operator \
             entries {reasons:?}"
        );
        Ok(())
    }
}
