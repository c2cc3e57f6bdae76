//! Deferred step confirmations on every backend: `confirm_deferred` /
//! `reject_deferred` ride the claim's next write (the next `effect`, or the
//! completion) instead of a write of their own. Guards against a deferred
//! answer that is lost although that write succeeded, one that is written
//! twice or without its log entry, one written although the write that
//! carried it was refused, and a crash before that write being answered as
//! anything but a step to settle by asking its provider.

use std::time::Duration;

use idempotency::{
    Actor, EffectStep, Envelope, Error, Failure, ManualClock, StepResolution, StepState,
};

use super::support::*;

type BoxResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn state(
    engine: &idempotency::Engine,
    k: &idempotency::IdempotencyKey,
    name: &str,
) -> BoxResult<StepState> {
    Ok(engine
        .steps(k)?
        .into_iter()
        .find(|s| s.name == name)
        .ok_or_else(|| format!("no step {name}"))?
        .state)
}

fn run_ref(step: EffectStep) -> BoxResult<String> {
    match step {
        EffectStep::Run { reference } => Ok(reference),
        other => Err(format!("expected Run, got {other:?}").into()),
    }
}

both_backends! {
    /// The charge's deferred confirmation lands with the receipt's
    /// reservation, the receipt's with the completion; each is logged once,
    /// by the claim's token, with its evidence.
    fn deferred_answers_ride_the_next_write(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(h.builder().clock(clock.clone()))?;
        let k = key("deferred-ride")?;
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        let token = c.fencing_token();
        run_ref(c.effect("charge")?)?;
        c.confirm_deferred("charge", b"ch_1")?;
        // Not written yet: the step is still Reserved in the store.
        assert_eq!(state(&engine, &k, "charge")?, StepState::Reserved);
        run_ref(c.effect("receipt")?)?;
        assert_eq!(state(&engine, &k, "charge")?, StepState::Confirmed);
        c.reject_deferred("receipt", b"mailbox full")?;
        assert_eq!(state(&engine, &k, "receipt")?, StepState::Reserved);
        engine.complete(c, Envelope::new(1, 201, "paid"))?;
        assert_eq!(state(&engine, &k, "receipt")?, StepState::Failed);

        let history = engine.history(&k)?;
        let answers: Vec<_> = history
            .iter()
            .filter(|e| e.actor == Actor::Claim { fencing_token: token })
            .filter(|e| matches!(e.to.to_lowercase().as_str(), "confirmed" | "failed"))
            .map(|e| (e.step.clone().unwrap_or_default(), e.evidence.clone()))
            .collect();
        assert_eq!(
            answers,
            vec![
                ("charge".to_string(), b"ch_1".to_vec()),
                ("receipt".to_string(), b"mailbox full".to_vec()),
            ],
            "{history:?}"
        );
        Ok(())
    }
}

both_backends! {
    /// A deferred answer is checked against what the claim reserved before
    /// anything is written: an unreserved name, a name already waiting and
    /// a durable confirm of a waiting name are refused; the refusals write
    /// nothing and the waiting answer still lands with the next write.
    fn deferred_answers_are_checked(h: &Harness) -> TestResult {
        let engine = h.open(h.builder().clock(ManualClock::new(T0)))?;
        let k = key("deferred-checked")?;
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        let never = c.confirm_deferred("never-reserved", b"x").err().ok_or("an unreserved step was deferred")?;
        assert!(matches!(never, Error::StepNotFound { .. }), "{never:?}");
        run_ref(c.effect("charge")?)?;
        let too_big = c.confirm_deferred("charge", &vec![0; idempotency::MAX_EVIDENCE_BYTES + 1]).err().ok_or("oversized evidence deferred")?;
        assert!(matches!(too_big, Error::EvidenceTooLarge { .. }), "{too_big:?}");
        c.confirm_deferred("charge", b"ch_1")?;
        let twice = c.confirm_deferred("charge", b"ch_2").err().ok_or("a step was deferred twice")?;
        assert!(matches!(twice, Error::StepNotFound { .. } | Error::StepReused { .. }), "{twice:?}");
        let durable = c.confirm("charge", b"ch_3").err().ok_or("a durable confirm of a waiting step was accepted")?;
        assert!(matches!(durable, Error::StepReused { .. }), "{durable:?}");
        let before = engine.history(&k)?.len();
        assert_eq!(state(&engine, &k, "charge")?, StepState::Reserved);
        engine.complete(c, Envelope::new(1, 201, "paid"))?;
        let charge = engine.steps(&k)?.into_iter().find(|s| s.name == "charge").ok_or("no charge")?;
        assert_eq!(charge.state, StepState::Confirmed);
        assert_eq!(charge.evidence.as_deref(), Some(&b"ch_1"[..]));
        assert!(engine.history(&k)?.len() > before);
        Ok(())
    }
}

both_backends! {
    /// The process "dies" (the claim fails in doubt) before the write that
    /// would carry the deferred confirmation: the step is Unknown, its
    /// provider is asked, and the next claim skips the call.
    fn deferred_answer_lost_in_a_crash_is_settled_by_asking(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(
            h.builder()
                .clock(clock.clone())
                .lease(Duration::from_millis(1_000))
                .step_resolver("charge", |_: &idempotency::InDoubtStep| {
                    StepResolution::Executed(b"ch_1 (from the provider)".to_vec())
                }),
        )?;
        let k = key("deferred-lost")?;
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        let reference = run_ref(c.effect("charge")?)?;
        c.confirm_deferred("charge", b"ch_1")?;
        engine.fail(c, Failure::InDoubt { reason: "crashed before the next write".into() })?;
        assert_eq!(state(&engine, &k, "charge")?, StepState::Unknown);
        clock.advance(Duration::from_millis(2_000));
        let again = claimed(engine.begin(&k, fp(1)?)?)?;
        match again.effect("charge")? {
            EffectStep::Confirmed { reference: r, evidence } => {
                assert_eq!(r, reference);
                assert_eq!(evidence, b"ch_1 (from the provider)");
            }
            other => return Err(format!("the charge must be skipped, got {other:?}").into()),
        }
        engine.complete(again, Envelope::new(1, 201, "paid"))?;
        Ok(())
    }
}
