//! A resumed claim that fails retryable before a call of its own, on every
//! backend. Guards against such a key losing its record while the earlier
//! claim's confirmed steps stay: the next `begin` with a DIFFERENT
//! fingerprint (another request under the same idempotency key) would then
//! adopt those steps and skip their calls, a wrong answer for it; and
//! nothing would ever expire the steps and log. The key must stay UNKNOWN
//! ("resumable") with its fingerprint: a different request answers
//! `Mismatch`, the same request resumes it, purge and recovery treat it as
//! any resumable key. A claim whose steps are all its own is still
//! released outright.

use idempotency::{
    Actor, Begin, EffectStep, Engine, Failure, IdempotencyKey, PurgeMode, State, StepState,
};

use super::support::*;

/// Charges and confirms under `fp(1)`, fails in doubt (resumable), resumes
/// with the same request and fails that claim retryable before any call of
/// its own. Returns the resumed claim's fencing token.
fn released_after_resume(
    engine: &Engine,
    k: &IdempotencyKey,
) -> Result<u64, Box<dyn std::error::Error + Send + Sync>> {
    let c = claimed(engine.begin(k, fp(1)?)?)?;
    assert!(matches!(c.effect("charge")?, EffectStep::Run { .. }));
    c.confirm("charge", b"ch_1")?;
    engine.fail(
        c,
        Failure::InDoubt {
            reason: "client went away".into(),
        },
    )?;
    let resumed = claimed(engine.begin(k, fp(1)?)?)?;
    let token = resumed.fencing_token();
    engine.fail(resumed, Failure::Retryable)?;
    Ok(token)
}

both_backends! {
    /// The record stays, UNKNOWN and resumable, with one log entry for the
    /// move; another request with the same key is a mismatch and never
    /// sees the earlier charge.
    fn a_released_resume_keeps_its_record(h: &Harness) -> TestResult {
        let engine = h.open(h.builder())?;
        let k = key("released")?;
        let token = released_after_resume(&engine, &k)?;

        let rec = engine.record(&k)?.ok_or("the record of a key with steps was deleted")?;
        assert_eq!((rec.state, rec.fencing_token), (State::Unknown, token));
        assert!(rec.reason.contains("released to resume"), "{}", rec.reason);
        let steps = engine.steps(&k)?;
        assert_eq!(steps.len(), 1);
        assert_eq!(steps[0].state, StepState::Confirmed);
        let history = engine.history(&k)?;
        let last = history.last().ok_or("no log")?;
        assert_eq!(
            (&last.actor, last.step.as_deref(), last.from.as_str(), last.to.as_str()),
            (&Actor::Claim { fencing_token: token }, None, "PROCESSING", "UNKNOWN"),
            "{history:#?}"
        );
        let listed = engine.in_doubt(10)?;
        assert_eq!(listed.len(), 1);
        assert!(listed[0].is_resumable(), "{listed:#?}");

        // A different request under the same key: not the earlier charge.
        let other = engine.begin(&k, fp(2)?)?;
        assert!(matches!(other, Begin::Mismatch), "{other:?}");

        // The same request resumes, the charge is not made again.
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        assert!(
            matches!(c.effect("charge")?, EffectStep::Confirmed { .. }),
            "a resumed key ran its confirmed step again"
        );
        Ok(())
    }
}

both_backends! {
    /// The async entry points resume it the same way.
    fn a_released_resume_resumes_async(h: &Harness) -> TestResult {
        let engine = h.open(h.builder())?;
        let k = key("released-async")?;
        released_after_resume(&engine, &k)?;
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let other = rt.block_on(engine.begin_async(&k, fp(2)?))?;
        assert!(matches!(other, Begin::Mismatch), "{other:?}");
        let c = claimed(rt.block_on(engine.begin_async(&k, fp(1)?))?)?;
        assert!(
            matches!(c.effect("charge")?, EffectStep::Confirmed { .. }),
            "an async resume ran its confirmed step again"
        );
        Ok(())
    }
}

both_backends! {
    /// Purge treats it as any UNKNOWN record: refused without force, and
    /// force takes the record, steps and log together.
    fn a_released_resume_is_purged_as_unknown(h: &Harness) -> TestResult {
        let engine = h.open(h.builder())?;
        let k = key("released-purge")?;
        released_after_resume(&engine, &k)?;
        let refused = engine.purge(&k, PurgeMode::FinishedOnly);
        assert!(
            matches!(refused, Err(idempotency::Error::InvalidState { state: State::Unknown, .. })),
            "{refused:?}"
        );
        assert_eq!(engine.steps(&k)?.len(), 1);
        assert_eq!(engine.purge(&k, PurgeMode::Force)?, Some(State::Unknown));
        assert!(engine.record(&k)?.is_none());
        assert_eq!((engine.steps(&k)?.len(), engine.history(&k)?.len()), (0, 0));
        let again = engine.purge(&k, PurgeMode::Force);
        assert!(matches!(again, Err(idempotency::Error::NotFound { .. })), "{again:?}");
        Ok(())
    }
}

both_backends! {
    /// A resumed claim's own rejected step is kept beside the earlier
    /// charge; a claim whose steps are all its own is released with them.
    fn own_steps_decide_what_a_release_keeps(h: &Harness) -> TestResult {
        let engine = h.open(h.builder())?;
        let k = key("own-failed")?;
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        assert!(matches!(c.effect("charge")?, EffectStep::Run { .. }));
        c.confirm("charge", b"ch_1")?;
        engine.fail(c, Failure::InDoubt { reason: "client went away".into() })?;
        let resumed = claimed(engine.begin(&k, fp(1)?)?)?;
        assert!(matches!(resumed.effect("receipt")?, EffectStep::Run { .. }));
        resumed.reject("receipt", b"mailer down")?;
        engine.fail(resumed, Failure::Retryable)?;
        let rec = engine.record(&k)?.ok_or("record deleted")?;
        assert_eq!(rec.state, State::Unknown);
        let mut states: Vec<(String, StepState)> =
            engine.steps(&k)?.into_iter().map(|s| (s.name, s.state)).collect();
        states.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            states,
            vec![("charge".into(), StepState::Confirmed), ("receipt".into(), StepState::Failed)]
        );

        let fresh = key("own-only")?;
        let c = claimed(engine.begin(&fresh, fp(1)?)?)?;
        assert!(matches!(c.effect("receipt")?, EffectStep::Run { .. }));
        c.reject("receipt", b"mailer down")?;
        engine.fail(c, Failure::Retryable)?;
        assert!(engine.record(&fresh)?.is_none());
        assert_eq!((engine.steps(&fresh)?.len(), engine.history(&fresh)?.len()), (0, 0));
        let again = claimed(engine.begin(&fresh, fp(2)?)?)?;
        assert!(matches!(again.effect("receipt")?, EffectStep::Run { .. }));
        Ok(())
    }
}
