//! Breaker finding on purging a key released to RESUME (issue 22), redb: such
//! a key had no record, only its effect steps and evidence log (`idem show`
//! and `Engine::steps` list them; now the record stays UNKNOWN, also after
//! a resumed claim's retryable failure). `purge` with `PurgeMode::Force` (what
//! `idem purge --force` runs, and the design's escape for a stuck key, e.g.
//! one whose log is full or whose step does not decode) answers `NotFound`
//! and deletes nothing. Guards against a key the operator can see but not
//! clear.

mod common;

use std::error::Error;
use std::path::Path;
use std::time::Duration;

use common::{claimed, CannotTell};
use idempotency::{
    EffectStep, Engine, EngineBuilder, Failure, Fingerprint, IdempotencyKey, InDoubtStep,
    ManualClock, PurgeMode, State, StepResolution,
};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const T0: u64 = 1_700_000_000_000;
const LEASE_MS: u64 = 1_000;

fn builder(clock: &ManualClock) -> EngineBuilder {
    Engine::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .lease(Duration::from_millis(LEASE_MS))
        .step_resolver("receipt", |_: &InDoubtStep| StepResolution::NotExecuted)
}

fn fp() -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(br#"{"amount": 100, "currency": "EUR"}"#, &[])
}

/// Charges (confirmed), reserves the receipt, fails in doubt; recovery
/// learns the receipt never went out and releases the key to resume.
/// Returns the charge step's reference.
fn resumed_key(
    path: &Path,
    clock: &ManualClock,
    k: &IdempotencyKey,
) -> Result<String, Box<dyn Error + Send + Sync>> {
    let engine = builder(clock).open(path)?;
    let c = claimed(engine.begin(k, fp()?)?)?;
    let EffectStep::Run { reference } = c.effect("charge")? else {
        return Err("expected Run for a fresh charge".into());
    };
    c.confirm("charge", b"ch_1")?;
    let _ = c.effect("receipt")?;
    engine.fail(
        c,
        Failure::InDoubt {
            reason: "mailer timed out".into(),
        },
    )?;
    clock.advance(Duration::from_millis(LEASE_MS + 1));
    let report = engine.recover_in_doubt(&CannotTell, 10)?;
    if report.resumed != 1 {
        return Err(format!("expected one resumed key, got {report:?}").into());
    }
    Ok(reference)
}

#[test]
fn purge_clears_a_resumed_key() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("resumed.redb");
    let clock = ManualClock::new(T0);
    let k = IdempotencyKey::new("shop:pay", "breaker-purge-resumed")?;
    resumed_key(&path, &clock, &k)?;
    let engine = builder(&clock).open(&path)?;
    let steps = engine.steps(&k)?.len();
    let purged = engine.purge(&k, PurgeMode::Force);
    let left = (engine.steps(&k)?.len(), engine.history(&k)?.len());
    if left != (0, 0) {
        return Err(format!(
            "purge --force of a resumed key ({steps} steps shown) answered {purged:?} and left \
             {} steps and {} log entries",
            left.0, left.1
        )
        .into());
    }
    Ok(())
}

/// A resumed claim that fails retryable before a call of its own leaves
/// the key UNKNOWN with the earlier charge: `purge --force` takes the
/// record, steps and log together, and says the record was UNKNOWN.
#[test]
fn purge_clears_a_released_resume() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("released.redb");
    let clock = ManualClock::new(T0);
    let k = IdempotencyKey::new("shop:pay", "breaker-purge-released")?;
    resumed_key(&path, &clock, &k)?;
    let engine = builder(&clock).open(&path)?;
    let resumed = claimed(engine.begin(&k, fp()?)?)?;
    engine.fail(resumed, Failure::Retryable)?;
    let purged = engine.purge(&k, PurgeMode::Force)?;
    let left = (
        engine.record(&k)?.is_some(),
        engine.steps(&k)?.len(),
        engine.history(&k)?.len(),
    );
    if (purged, left) != (Some(State::Unknown), (false, 0, 0)) {
        return Err(format!(
            "purge --force of a released resume answered {purged:?} and left (record, steps, \
             log entries) {left:?}"
        )
        .into());
    }
    Ok(())
}
