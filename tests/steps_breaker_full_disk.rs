//! Breaker probe of effect steps on a really full disk (issue 22), redb on a
//! small tmpfs (needs root; skipped with a note elsewhere): payments with
//! two steps (charge, receipt, 4 KiB of evidence each) are made until the
//! engine refuses a write, at whatever point between the steps that comes;
//! the refused attempt is failed in doubt. Then the file system is grown,
//! the engine reopened, and each provider answers from its ledger. Guards
//! against a step stored without its log entry (or the reverse), a key
//! handed out as `Claimed` while a step is unsettled, and a call made twice
//! under one reference (a charge or receipt whose reference the provider
//! already saw handed out as `Run` again).

mod common;

#[path = "common/small_fs.rs"]
mod small_fs;

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idempotency::{
    Begin, EffectStep, Engine, EngineBuilder, Envelope, Failure, Fingerprint, IdempotencyKey,
    InDoubtStep, ManualClock, StepResolution, StepState,
};
use small_fs::{SmallFs, TestResult};

const T0: u64 = 1_700_000_000_000;
const LEASE_MS: u64 = 1_000;
const STEPS: [&str; 2] = ["charge", "receipt"];

type Ledger = Arc<Mutex<HashSet<String>>>;

fn builder(clock: &ManualClock, ledger: &Ledger) -> EngineBuilder {
    let mut b = Engine::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .lease(Duration::from_millis(LEASE_MS));
    for name in STEPS {
        let ledger = ledger.clone();
        b = b.step_resolver(name, move |s: &InDoubtStep| {
            if ledger
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .contains(&s.reference)
            {
                StepResolution::Executed(b"seen by the provider".to_vec())
            } else {
                StepResolution::NotExecuted
            }
        });
    }
    b
}

fn key(i: usize) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("POST /payments", format!("full-{i:05}"))
}

fn fp(i: usize) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(format!(r#"{{"amount":{i}}}"#).as_bytes(), &[])
}

/// One payment; `Ok(None)` when it went through, `Ok(Some(what))` when a
/// write was refused (`what` names where), the claim failed in doubt.
fn pay(engine: &Engine, ledger: &Ledger, i: usize) -> TestResult<Option<String>> {
    let c = match engine.begin(&key(i)?, fp(i)?) {
        Ok(Begin::Claimed(c)) => c,
        Ok(other) => return Err(format!("payment {i}: {other:?}").into()),
        Err(e) => return Ok(Some(format!("begin: {e}"))),
    };
    let evidence = vec![b'e'; 4000];
    for name in STEPS {
        let failed = match c.effect(name) {
            Ok(EffectStep::Run { reference }) => {
                ledger
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(reference);
                match c.confirm(name, &evidence) {
                    Ok(()) => None,
                    Err(e) => Some(format!("confirm {name}: {e}")),
                }
            }
            Ok(other) => return Err(format!("payment {i}: fresh step {name}: {other:?}").into()),
            Err(e) => Some(format!("effect {name}: {e}")),
        };
        if let Some(what) = failed {
            let marked = engine.fail(
                c,
                Failure::InDoubt {
                    reason: what.clone(),
                },
            );
            return Ok(Some(format!("{what} (fail in doubt: {marked:?})")));
        }
    }
    match engine.complete(c, Envelope::new(1, 201, format!("paid {i}"))) {
        Ok(()) => Ok(None),
        Err(e) => Ok(Some(format!("complete: {e}"))),
    }
}

/// File-system sizes (KiB): each fills at a different point between the
/// steps.
const SIZES: [u64; 6] = [1536, 1792, 2048, 2304, 2560, 3072];

#[test]
fn steps_on_a_full_disk_settle_without_double_calls() -> TestResult {
    for kib in SIZES {
        fill_then_settle(kib)?;
    }
    Ok(())
}

fn fill_then_settle(kib: u64) -> TestResult {
    let Some(fs) = SmallFs::mount(kib)? else {
        return Ok(());
    };
    let clock = ManualClock::new(T0);
    let ledger: Ledger = Arc::default();
    let mut refused = Vec::new();
    let mut n = 0;
    {
        let engine = builder(&clock, &ledger).open(fs.db())?;
        while n < 5_000 && refused.len() < 3 {
            if let Some(what) = pay(&engine, &ledger, n)? {
                refused.push((n, what));
            }
            n += 1;
        }
    }
    if refused.is_empty() {
        return Err(format!("the disk never filled: {n} payments ({})", fs.listing()).into());
    }
    eprintln!("{kib} KiB: refused: {refused:?}");
    fs.resize(65_536)?;
    clock.advance(Duration::from_millis(LEASE_MS + 1));
    let engine = builder(&clock, &ledger).open(fs.db())?;
    let mut problems = Vec::new();
    for i in 0..n {
        let k = key(i)?;
        // Every step has its log entry (no half-written transition).
        let logged: HashSet<String> = engine
            .history(&k)?
            .into_iter()
            .filter_map(|e| e.step)
            .collect();
        for s in engine.steps(&k)? {
            if !logged.contains(&s.name) {
                problems.push(format!(
                    "{k}: step {} ({:?}) has no log entry",
                    s.name, s.state
                ));
            }
        }
        match engine.begin(&k, fp(i)?)? {
            Begin::Replay(_) => {}
            Begin::Claimed(c) => {
                for s in c.steps() {
                    if !matches!(
                        s.state,
                        StepState::Confirmed | StepState::Failed | StepState::NotExecuted
                    ) {
                        problems.push(format!("{k}: Claimed with step {} {:?}", s.name, s.state));
                    }
                }
                for name in STEPS {
                    if let EffectStep::Run { reference } = c.effect(name)? {
                        if ledger
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .contains(&reference)
                        {
                            problems.push(format!(
                                "{k}: {name} handed out as Run again under {reference}, \
                                 which its provider already saw"
                            ));
                        }
                        c.confirm(name, b"ok")?;
                    }
                }
                engine.complete(c, Envelope::new(1, 201, format!("paid {i}")))?;
            }
            other => problems.push(format!(
                "{k}: not settled though both providers answer: {other:?}"
            )),
        }
    }
    if !problems.is_empty() {
        return Err(format!(
            "{kib} KiB: {} problems (refused: {refused:?}): {problems:#?}",
            problems.len()
        )
        .into());
    }
    Ok(())
}
