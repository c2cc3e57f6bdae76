//! Recovery with resumable keys on every backend. A key whose effect steps
//! are all settled stays UNKNOWN ("resumable") until its client retries,
//! and a client may never retry; such keys sit at the front of the recovery
//! queue. Guards against `recover_in_doubt(limit)` spending its whole limit
//! on them run after run, so that a newer in-doubt key is never settled,
//! and against resumable keys dropping out of `in_doubt` listings. (A
//! resumed claim released retryable: `steps_release.rs`.)

use std::time::Duration;

use idempotency::{
    EffectStep, Engine, Failure, IdempotencyKey, InDoubt, ManualClock, RecoveryReport, Resolution,
    Resolver,
};

use super::support::*;

const LIMIT: usize = 3;

/// Settles every whole key as not executed; never completes from steps.
struct NotSent;

impl Resolver for NotSent {
    fn resolve(&self, _: &InDoubt) -> Resolution {
        Resolution::NotExecuted
    }
}

/// Charges, confirms, and fails in doubt: every step is settled, so the
/// key is resumable at once.
fn leave_resumable(engine: &Engine, k: &IdempotencyKey) -> TestResult {
    let c = claimed(engine.begin(k, fp(1)?)?)?;
    assert!(matches!(c.effect("charge")?, EffectStep::Run { .. }));
    c.confirm("charge", b"ch_1")?;
    engine.fail(
        c,
        Failure::InDoubt {
            reason: "client went away".into(),
        },
    )?;
    Ok(())
}

both_backends! {
    /// `LIMIT + 2` resumable keys ahead of one fresh in-doubt key:
    /// `recover_in_doubt(LIMIT)` settles the fresh one, looks at resumable
    /// ones only with the room left, and every resumable key stays listed.
    fn resumable_keys_do_not_starve_recovery(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(
            h.builder()
                .clock(clock.clone())
                .lease(Duration::from_secs(1)),
        )?;
        let resumable: Vec<IdempotencyKey> = (0..LIMIT + 2)
            .map(|i| key(&format!("resumable-{i}")))
            .collect::<Result<_, _>>()?;
        for k in &resumable {
            leave_resumable(&engine, k)?;
            clock.advance(Duration::from_millis(10));
        }
        let fresh = key("fresh")?;
        let c = claimed(engine.begin(&fresh, fp(2)?)?)?;
        engine.fail(
            c,
            Failure::InDoubt {
                reason: "provider timed out".into(),
            },
        )?;

        let listed = engine.in_doubt(100)?;
        assert_eq!(listed.len(), LIMIT + 3, "{listed:#?}");
        let marked: Vec<(&str, bool)> = listed
            .iter()
            .map(|d| (d.key.key(), d.is_resumable()))
            .collect();
        let mut expected: Vec<(String, bool)> = resumable
            .iter()
            .map(|k| (k.key().to_string(), true))
            .collect();
        expected.push(("fresh".to_string(), false));
        let expected: Vec<(&str, bool)> =
            expected.iter().map(|(k, r)| (k.as_str(), *r)).collect();
        assert_eq!(marked, expected);

        // Twice: a second run must not meet the resumable keys' limit
        // either (and has nothing fresh left to settle).
        let first = engine.recover_in_doubt(&NotSent, LIMIT)?;
        assert_eq!(
            first,
            RecoveryReport {
                not_executed: 1,
                resumed: (LIMIT - 1) as u64,
                ..RecoveryReport::default()
            }
        );
        assert!(engine.record(&fresh)?.is_none(), "the fresh key was not settled");
        let second = engine.recover_in_doubt(&NotSent, LIMIT)?;
        assert_eq!(
            second,
            RecoveryReport {
                resumed: LIMIT as u64,
                ..RecoveryReport::default()
            }
        );
        // Still listed, still resumable, and the retry resumes them.
        let listed = engine.in_doubt(100)?;
        assert_eq!(listed.len(), LIMIT + 2);
        assert!(listed.iter().all(InDoubt::is_resumable), "{listed:#?}");
        let c = claimed(engine.begin(&resumable[0], fp(1)?)?)?;
        assert!(
            matches!(c.effect("charge")?, EffectStep::Confirmed { .. }),
            "a resumed key ran its confirmed step again"
        );
        Ok(())
    }
}
