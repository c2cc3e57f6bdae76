//! A poisoned engine keeps trying to reopen, but backs off while reopens
//! fail (issue 28.3): every attempt that fails after the health probe
//! passed doubles the wait before the next (1 s, 2 s, 4 s, ... at most
//! 30 s), so a storage that keeps failing is not hammered (each attempt
//! may write: redb's recovery, the journal's replay), yet the engine never
//! gives up, and one attempt that works resets the wait to 1 s. Time comes
//! from a `ManualClock`: nothing sleeps.

#[path = "common/storage_faults.rs"]
mod storage_faults;

use std::error::Error;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey, ManualClock};
use storage_faults::FailingBackend;

type TestResult = Result<(), Box<dyn Error>>;

const T0: u64 = 1_700_000_000_000;

fn key(name: &str) -> Result<IdempotencyKey, Box<dyn Error>> {
    Ok(IdempotencyKey::new("backoff", name)?)
}

fn fingerprint() -> Result<Fingerprint, Box<dyn Error>> {
    Ok(Fingerprint::of_json(br#"{"a":1}"#, &[])?)
}

/// Seconds (from the poison on) at which `make` was called while reopens
/// kept failing, over `secs` seconds of probing once a second.
fn attempts(engine: &Engine, clock: &ManualClock, made: &AtomicUsize, secs: u64) -> Vec<u64> {
    let mut at = Vec::new();
    for s in 0..=secs {
        let before = made.load(Ordering::SeqCst);
        let _ = engine.poisoned();
        if made.load(Ordering::SeqCst) > before {
            at.push(s);
        }
        clock.advance(Duration::from_secs(1));
    }
    at
}

#[test]
fn failing_reopens_back_off_and_one_that_works_resets_the_wait() -> TestResult {
    let clock = ManualClock::new(T0);
    let backend = FailingBackend::new();
    let faults = backend.faults();
    let made = Arc::new(AtomicUsize::new(0));
    let refuse = Arc::new(AtomicBool::new(false));
    let (count, no) = (made.clone(), refuse.clone());
    let engine = Engine::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .open_with_backend_factory(
            move || {
                count.fetch_add(1, Ordering::SeqCst);
                if no.load(Ordering::SeqCst) {
                    return Err(std::io::Error::other("the device is gone"));
                }
                Ok(backend.clone())
            },
            || Ok(()),
        )?;
    let Begin::Claimed(claim) = engine.begin(&key("before")?, fingerprint()?)? else {
        return Err("not claimed".into());
    };
    engine.complete(claim, Envelope::new(1, 201, "ok"))?;
    // Poisoned, and every reopen fails.
    refuse.store(true, Ordering::SeqCst);
    faults.disk_full();
    assert!(engine.begin(&key("during")?, fingerprint()?).is_err());
    faults.heal();
    let at = attempts(&engine, &clock, &made, 70);
    assert_eq!(at, vec![0, 2, 6, 14, 30, 60], "attempts at these seconds");
    // It never gave up: the next attempt due (30 s on) reopens.
    refuse.store(false, Ordering::SeqCst);
    clock.advance(Duration::from_secs(30));
    assert_eq!(engine.poisoned(), None, "not back after the storage was");
    let Begin::Claimed(claim) = engine.begin(&key("after")?, fingerprint()?)? else {
        return Err("not claimed after the reopen".into());
    };
    engine.complete(claim, Envelope::new(1, 201, "ok"))?;
    // A new failure (a second later) starts again from 1 s.
    clock.advance(Duration::from_secs(1));
    refuse.store(true, Ordering::SeqCst);
    faults.disk_full();
    assert!(engine.begin(&key("again")?, fingerprint()?).is_err());
    faults.heal();
    let at = attempts(&engine, &clock, &made, 6);
    assert_eq!(
        at,
        vec![0, 2, 6],
        "the wait was not reset by the reopen that worked"
    );
    Ok(())
}
