//! Breaker probe of salvage with effect steps (issue 22), redb: a key's
//! claim reserved its charge and failed in doubt (the charge's call may
//! have happened); then the page holding the key's RECORD is damaged, and
//! `Engine::salvage` copies what still reads into a new file. The record is
//! lost (listed), but the key's steps and log live in other tables and are
//! copied. Guards against the salvaged key looking like a key released to
//! resume: its next `begin` handed out as `Claimed` while its charge is
//! still in doubt (a step nobody can settle any more: settling needs the
//! record). Adjusted to the decided design (FIXES22, finding 11): salvage
//! copies a key's steps and log only with its record and lists them lost
//! otherwise; the key's loss is then in the report, as for any lost record.

mod common;

use std::error::Error;
use std::time::Duration;

use common::{claimed, CannotTell};
use idempotency::{
    Begin, EffectStep, Engine, EngineBuilder, Failure, Fingerprint, IdempotencyKey, InDoubtStep,
    ManualClock, StepResolution,
};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const T0: u64 = 1_700_000_000_000;
const LEASE_MS: u64 = 1_000;

fn builder(clock: &ManualClock) -> EngineBuilder {
    Engine::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .lease(Duration::from_millis(LEASE_MS))
        .resolver(CannotTell)
        .step_resolver("charge", |_: &InDoubtStep| StepResolution::StillUnknown)
}

#[test]
fn salvaged_key_with_a_charge_in_doubt_is_not_claimed() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("pay.redb");
    let clock = ManualClock::new(T0);
    let k = IdempotencyKey::new("shop:pay", "salvage-charge-in-doubt")?;
    let fp = Fingerprint::of_json(br#"{"amount": 100}"#, &[])?;
    let step_ref = {
        let engine = builder(&clock).open(&path)?;
        let c = claimed(engine.begin(&k, fp)?)?;
        let EffectStep::Run { reference } = c.effect("charge")? else {
            return Err("fresh charge".into());
        };
        engine.fail(
            c,
            Failure::InDoubt {
                reason: "card network timed out".into(),
            },
        )?;
        reference
    };
    // Damage every copy of the operation's reference that is not the
    // start of a step's reference (`<reference>/charge`): the record.
    let op_ref = step_ref
        .strip_suffix("/charge")
        .ok_or("step reference without /charge")?
        .as_bytes()
        .to_vec();
    let mut bytes = std::fs::read(&path)?;
    let mut flipped = 0;
    let mut at = 0;
    while let Some(pos) = bytes[at..]
        .windows(op_ref.len())
        .position(|w| w == op_ref.as_slice())
    {
        let hit = at + pos;
        at = hit + op_ref.len();
        if bytes.get(at) != Some(&b'/') {
            bytes[hit + op_ref.len() - 2] ^= 0x01;
            flipped += 1;
        }
    }
    if flipped == 0 {
        return Err("the record's reference is not in the file".into());
    }
    std::fs::write(&path, &bytes)?;
    let new = dir.path().join("new.redb");
    let report = Engine::salvage(&path, &new)?;
    eprintln!("salvage: {report:?}");
    clock.advance(Duration::from_millis(LEASE_MS + 1));
    let engine = builder(&clock).open(&new)?;
    // Decided design (FIXES22, finding 11): a key's steps and log are
    // copied only with its record; otherwise they are listed lost beside
    // it, so nothing in the new file looks resumable. (A `begin` then
    // claims the key afresh, as for any key whose record salvage lost: the
    // report is the operator's list of keys to check with the provider.)
    let lost_record = report.lost.iter().find_map(|l| match l {
        idempotency::Lost::Record { key_hex, .. } => Some(key_hex.clone()),
        _ => None,
    });
    let lost_step = report.lost.iter().any(|l| {
        matches!(l, idempotency::Lost::Step { key_hex, step, .. }
            if Some(key_hex) == lost_record.as_ref() && step == "charge")
    });
    let lost_record = lost_record.is_some();
    if !(lost_step && lost_record) {
        return Err(format!(
            "the lost record's key and its charge step must both be listed lost: {report:?}"
        )
        .into());
    }
    let steps = engine.steps(&k)?;
    let history = engine.history(&k)?;
    if !steps.is_empty() || !history.is_empty() {
        return Err(format!(
            "salvage lost the record but copied {} steps and {} log entries: a record-less \
             key nobody can settle ({steps:?})",
            steps.len(),
            history.len()
        )
        .into());
    }
    match engine.begin(&k, fp)? {
        Begin::Claimed(c) if !c.steps().is_empty() => {
            let states: Vec<_> = c
                .steps()
                .iter()
                .map(|s| (s.name.clone(), s.state))
                .collect();
            Err(format!("the salvaged key is Claimed with the old steps {states:?}").into())
        }
        other => {
            eprintln!("begin after salvage: {other:?}");
            Ok(())
        }
    }
}
