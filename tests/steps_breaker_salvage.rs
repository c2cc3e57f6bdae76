//! Breaker probe of salvage with effect steps (issue 22), redb: a key's
//! claim reserved its charge and failed in doubt (the charge's call may
//! have happened); then the page holding the key's RECORD is damaged, and
//! `Engine::salvage` copies what still reads into a new file. The record is
//! lost (listed), but the key's steps and log live in other tables and are
//! copied. Guards against the salvaged key looking like a key released to
//! resume: its next `begin` handed out as `Claimed` while its charge is
//! still in doubt (a step nobody can settle any more: settling needs the
//! record), or the charge re-run.

mod common;

use std::error::Error;
use std::time::Duration;

use common::claimed;
use idempotency::{
    Begin, EffectStep, Engine, EngineBuilder, Failure, Fingerprint, IdempotencyKey, InDoubt,
    InDoubtStep, ManualClock, Resolution, Resolver, StepResolution,
};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const T0: u64 = 1_700_000_000_000;
const LEASE_MS: u64 = 1_000;

struct Unsure;

impl Resolver for Unsure {
    fn resolve(&self, _: &InDoubt) -> Resolution {
        Resolution::StillInDoubt
    }
}

fn builder(clock: &ManualClock) -> EngineBuilder {
    Engine::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .lease(Duration::from_millis(LEASE_MS))
        .resolver(Unsure)
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
    let steps = engine.steps(&k)?;
    match engine.begin(&k, fp)? {
        Begin::Claimed(c) => {
            let states: Vec<_> = c
                .steps()
                .iter()
                .map(|s| (s.name.clone(), s.state))
                .collect();
            let charge = c.effect("charge");
            Err(format!(
                "after salvage lost the record ({flipped} copies flipped; report {report:?}), \
                 the key is Claimed with steps {states:?} (Engine::steps: {:?}); its charge \
                 answers {charge:?}",
                steps
                    .iter()
                    .map(|s| (s.name.clone(), s.state))
                    .collect::<Vec<_>>()
            )
            .into())
        }
        other => {
            eprintln!("begin after salvage: {other:?}; steps {steps:?}");
            Ok(())
        }
    }
}
