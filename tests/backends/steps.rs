//! Effect steps on every backend: a step is reserved durably before its
//! call and confirmed or rejected with evidence; an attempt that dies
//! between calls is settled step by step by asking each provider (never by
//! calling again), and the next claim resumes: confirmed calls are skipped,
//! a call that never happened runs under the SAME reference. Guards against
//! a double call after a crash, a key handed out as `Claimed` while a step
//! is unsettled, a settlement that is not logged (or logged with the wrong
//! actor), steps or log outliving their record, and bad input that writes
//! half a change or stops other keys from being served.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idempotency::{
    Actor, Begin, Damage, EffectStep, Engine, Envelope, Error, ExpiryPolicy, Failure,
    IdempotencyKey, InDoubt, InDoubtStep, ManualClock, RecoveryReport, Resolution, Resolver, State,
    StepInfo, StepResolution, StepState, MAX_EVIDENCE_BYTES,
};

use super::support::*;

const LEASE_MS: u64 = 1_000;
const TTL_MS: u64 = 10_000;

type BoxResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// A per-step resolver answering what `answer` holds, counting questions.
#[derive(Clone)]
struct Provider {
    answer: Arc<Mutex<StepResolution>>,
    asked: Arc<Mutex<Vec<InDoubtStep>>>,
}

impl Provider {
    fn answering(answer: StepResolution) -> Provider {
        Provider {
            answer: Arc::new(Mutex::new(answer)),
            asked: Arc::default(),
        }
    }
    fn set(&self, answer: StepResolution) {
        *self.answer.lock().unwrap_or_else(PoisonError::into_inner) = answer;
    }
    fn asked(&self) -> Vec<InDoubtStep> {
        self.asked
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
    fn resolver(&self) -> impl Fn(&InDoubtStep) -> StepResolution + Send + Sync + 'static {
        let p = self.clone();
        move |step: &InDoubtStep| {
            p.asked
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(step.clone());
            p.answer
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone()
        }
    }
}

fn clocked(h: &Harness, clock: &ManualClock) -> idempotency::EngineBuilder {
    h.builder()
        .clock(clock.clone())
        .lease(Duration::from_millis(LEASE_MS))
        .ttl(Duration::from_millis(TTL_MS))
}

fn run_ref(step: EffectStep) -> BoxResult<String> {
    match step {
        EffectStep::Run { reference } => Ok(reference),
        other => Err(format!("expected Run, got {other:?}").into()),
    }
}

fn state_of(steps: &[StepInfo], name: &str) -> BoxResult<StepState> {
    Ok(steps
        .iter()
        .find(|s| s.name == name)
        .ok_or_else(|| format!("no step {name}"))?
        .state)
}

/// Charges, confirms, reserves the receipt and fails in doubt before its
/// answer: the receipt's outcome is unknown. Returns the first claim's
/// reference and token.
fn die_between_calls(engine: &Engine, k: &IdempotencyKey) -> BoxResult<(String, u64)> {
    let c = claimed(engine.begin(k, fp(1)?)?)?;
    let (reference, token) = (c.reference().to_owned(), c.fencing_token());
    assert_eq!(run_ref(c.effect("charge")?)?, format!("{reference}/charge"));
    c.confirm("charge", b"ch_1")?;
    assert_eq!(
        run_ref(c.effect("receipt")?)?,
        format!("{reference}/receipt")
    );
    engine.fail(
        c,
        Failure::InDoubt {
            reason: "mailer timed out".into(),
        },
    )?;
    Ok((reference, token))
}

both_backends! {
    /// Reserve, confirm, reject: each durable and logged by the claim's
    /// token; a name is used once per claim; the steps and their log stay
    /// with the COMPLETED record; the handle is fenced afterwards.
    fn reserve_confirm_reject(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(clocked(h, &clock))?;
        let k = key("steps-basic")?;
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        assert!(c.steps().is_empty());
        let token = c.fencing_token();
        let charge = run_ref(c.effect("charge")?)?;
        assert_eq!(charge, format!("{}/charge", c.reference()));
        let reused = c.effect("charge").err().ok_or("a reused name was accepted")?;
        assert!(matches!(reused, Error::StepReused { .. }), "{reused:?}");
        c.confirm("charge", b"ch_1")?;
        let effects = c.effects();
        run_ref(effects.effect("receipt")?)?;
        effects.reject("receipt", b"mailbox full")?;
        let live = engine.steps(&k)?;
        assert_eq!(state_of(&live, "charge")?, StepState::Confirmed);
        assert_eq!(state_of(&live, "receipt")?, StepState::Failed);
        engine.complete(c, Envelope::new(1, 201, "paid"))?;

        let steps = engine.steps(&k)?;
        let charge_step = steps.iter().find(|s| s.name == "charge").ok_or("no charge")?;
        assert_eq!(charge_step.evidence.as_deref(), Some(&b"ch_1"[..]));
        assert_eq!(charge_step.reference, charge);
        let history = engine.history(&k)?;
        let by_claim: Vec<_> = history
            .iter()
            .filter(|e| e.actor == Actor::Claim { fencing_token: token })
            .map(|e| (e.step.clone().unwrap_or_default(), e.to.to_lowercase()))
            .collect();
        assert!(by_claim.contains(&("charge".into(), "reserved".into())), "{history:?}");
        assert!(by_claim.contains(&("charge".into(), "confirmed".into())), "{history:?}");
        assert!(by_claim.contains(&("receipt".into(), "failed".into())), "{history:?}");
        let seqs: Vec<u32> = history.iter().map(|e| e.seq).collect();
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "log out of order: {seqs:?}");
        let confirmed = history.iter().find(|e| e.to.eq_ignore_ascii_case("confirmed")).ok_or("no confirm entry")?;
        assert_eq!(confirmed.evidence, b"ch_1");

        let after = effects.effect("late").err().ok_or("a step after complete was accepted")?;
        assert!(matches!(after, Error::Fenced { .. }), "{after:?}");
        assert_eq!(engine.steps(&k)?.len(), 2, "the refused step was written");
        assert_eq!(engine.history(&k)?.len(), history.len(), "the refusal was logged");
        assert_eq!(replay(engine.begin(&k, fp(1)?)?)?.envelope.body, b"paid");
        Ok(())
    }
}

both_backends! {
    /// The attempt dies between the two calls; the receipt's provider says
    /// it never got the call. The next `begin` resumes: charge is skipped
    /// with its evidence, the receipt runs under the same reference, and
    /// the key completes normally.
    fn resume_after_in_doubt(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let mailer = Provider::answering(StepResolution::NotExecuted);
        let engine = h.open(clocked(h, &clock).step_resolver("receipt", mailer.resolver()))?;
        let k = key("steps-resume")?;
        let (first_ref, first_token) = die_between_calls(&engine, &k)?;

        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        assert!(c.fencing_token() > first_token);
        assert_eq!(state_of(c.steps(), "charge")?, StepState::Confirmed);
        assert_eq!(state_of(c.steps(), "receipt")?, StepState::NotExecuted);
        let asked = mailer.asked();
        assert_eq!(asked.len(), 1, "the mailer was asked {} times", asked.len());
        assert_eq!(asked[0].reference, format!("{first_ref}/receipt"));
        assert_eq!(asked[0].operation_reference, first_ref);

        match c.effect("charge")? {
            EffectStep::Confirmed { reference, evidence } => {
                assert_eq!(reference, format!("{first_ref}/charge"));
                assert_eq!(evidence, b"ch_1");
            }
            other => return Err(format!("charge must be skipped, got {other:?}").into()),
        }
        assert_eq!(run_ref(c.effect("receipt")?)?, format!("{first_ref}/receipt"), "a new reference for the receipt");
        c.confirm("receipt", b"sent")?;
        engine.complete(c, Envelope::new(1, 201, "paid"))?;
        assert_eq!(replay(engine.begin(&k, fp(1)?)?)?.envelope.body, b"paid");
        let history = engine.history(&k)?;
        assert!(
            history.iter().any(|e| e.actor == Actor::Resolver
                && e.step.as_deref() == Some("receipt")
                && e.to.eq_ignore_ascii_case("not_executed")),
            "{history:?}"
        );
        Ok(())
    }
}

both_backends! {
    /// A step whose call was in flight is confirmed by its provider (per
    /// step resolver); an unregistered step goes to
    /// `Resolver::resolve_step`. A provider that keeps answering "still
    /// unknown" keeps the key in doubt, never `Claimed`, with the step's
    /// attempts and age visible in `in_doubt`.
    fn per_step_resolvers_and_still_unknown(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let card = Provider::answering(StepResolution::Executed(b"ch_9".to_vec()));
        let general = Provider::answering(StepResolution::StillUnknown);
        struct General(Provider);
        impl Resolver for General {
            fn resolve(&self, _: &InDoubt) -> Resolution {
                Resolution::StillInDoubt
            }
            fn resolve_step(&self, step: &InDoubtStep) -> StepResolution {
                (self.0.resolver())(step)
            }
        }
        let engine = h.open(
            clocked(h, &clock)
                .step_resolver("charge", card.resolver())
                .resolver(General(general.clone())),
        )?;
        let k = key("steps-unknown")?;
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        run_ref(c.effect("charge")?)?;
        run_ref(c.effect("receipt")?)?;
        drop(c);
        engine.flush()?;
        // A dropped claim's calls may still be in flight until its lease
        // ends: nobody is asked before then.
        assert!(matches!(engine.begin(&k, fp(1)?)?, Begin::Processing { .. }));
        assert!(card.asked().is_empty() && general.asked().is_empty());

        clock.advance(Duration::from_millis(LEASE_MS + 5));
        for round in 1..=2u32 {
            let in_doubt = unknown(engine.begin(&k, fp(1)?)?)?;
            assert_eq!(state_of(&in_doubt.steps, "charge")?, StepState::Confirmed);
            let receipt = in_doubt.steps.iter().find(|s| s.name == "receipt").ok_or("no receipt")?;
            assert_eq!((receipt.state, receipt.attempts), (StepState::Unknown, round));
            clock.advance(Duration::from_millis(100));
        }
        assert_eq!(card.asked().len(), 1, "a confirmed step was asked about again");
        assert_eq!(general.asked().len(), 2);
        let listed = engine.in_doubt(10)?;
        let entry = listed.iter().find(|d| d.key == k).ok_or("not listed in doubt")?;
        let receipt = entry.steps.iter().find(|s| s.name == "receipt").ok_or("no receipt")?;
        assert_eq!(receipt.attempts, 2);
        assert!(receipt.age >= Duration::from_millis(LEASE_MS), "age {:?}", receipt.age);

        general.set(StepResolution::Executed(b"mail-1".to_vec()));
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        assert!(c.steps().iter().all(|s| s.state == StepState::Confirmed), "{:?}", c.steps());
        engine.complete(c, Envelope::new(1, 201, "done"))?;
        Ok(())
    }
}

both_backends! {
    /// A resolver that can build the response from the steps' evidence
    /// completes the key without running the handler again.
    fn complete_from_steps(h: &Harness) -> TestResult {
        struct FromSteps;
        impl Resolver for FromSteps {
            fn resolve(&self, _: &InDoubt) -> Resolution {
                Resolution::StillInDoubt
            }
            fn resolve_step(&self, _: &InDoubtStep) -> StepResolution {
                StepResolution::Executed(b"mail-1".to_vec())
            }
            fn complete_from_steps(&self, _: &InDoubt, steps: &[StepInfo]) -> Option<Envelope> {
                let charge = steps.iter().find(|s| s.name == "charge")?;
                let evidence = String::from_utf8(charge.evidence.clone()?).ok()?;
                Some(Envelope::new(1, 201, format!("charged {evidence}")))
            }
        }
        let clock = ManualClock::new(T0);
        let engine = h.open(clocked(h, &clock).resolver(FromSteps))?;
        let k = key("steps-from-evidence")?;
        die_between_calls(&engine, &k)?;
        let r = replay(engine.begin(&k, fp(1)?)?)?;
        assert_eq!(r.envelope.body, b"charged ch_1");
        assert_eq!(engine.record(&k)?.ok_or("no record")?.state, State::Completed);
        Ok(())
    }
}

both_backends! {
    /// `recover_in_doubt` settles per step too, and resumes the key.
    fn recover_in_doubt_per_step(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(clocked(h, &clock))?;
        let k = key("steps-recover")?;
        die_between_calls(&engine, &k)?;
        struct NotSent;
        impl Resolver for NotSent {
            fn resolve(&self, _: &InDoubt) -> Resolution {
                Resolution::StillInDoubt
            }
            fn resolve_step(&self, _: &InDoubtStep) -> StepResolution {
                StepResolution::NotExecuted
            }
        }
        let report = engine.recover_in_doubt(&NotSent, 10)?;
        assert_eq!(report, RecoveryReport { resumed: 1, ..RecoveryReport::default() });
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        assert_eq!(state_of(c.steps(), "receipt")?, StepState::NotExecuted);
        assert!(matches!(c.effect("charge")?, EffectStep::Confirmed { .. }));
        Ok(())
    }
}

both_backends! {
    /// Without a resolver an operator settles each step with a reason; the
    /// last one resumes the key. Unknown step names and blank reasons are
    /// refused with nothing written.
    fn operator_settles_steps(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(clocked(h, &clock))?;
        let k = key("steps-operator")?;
        die_between_calls(&engine, &k)?;
        let in_doubt = unknown(engine.begin(&k, fp(1)?)?)?;
        assert_eq!(state_of(&in_doubt.steps, "receipt")?, StepState::Unknown);
        let before = engine.history(&k)?.len();

        let blank = engine.resolve_step(&k, "receipt", StepResolution::NotExecuted, "  ").err().ok_or("blank reason accepted")?;
        assert!(matches!(blank, Error::ReasonRequired), "{blank:?}");
        let blank = engine.resolve(&k, Resolution::NotExecuted, "").err().ok_or("blank reason accepted")?;
        assert!(matches!(blank, Error::ReasonRequired), "{blank:?}");
        let missing = engine.resolve_step(&k, "refund", StepResolution::NotExecuted, "checked").err().ok_or("unknown step accepted")?;
        assert!(matches!(missing, Error::StepNotFound { .. }), "{missing:?}");
        let big = vec![b'x'; MAX_EVIDENCE_BYTES + 1];
        let over = engine.resolve_step(&k, "receipt", StepResolution::Executed(big), "checked").err().ok_or("oversized evidence accepted")?;
        assert!(matches!(over, Error::EvidenceTooLarge { .. }), "{over:?}");
        assert_eq!(engine.history(&k)?.len(), before, "a refusal was logged");
        assert!(matches!(engine.begin(&k, fp(1)?)?, Begin::InDoubt(_)));

        engine.resolve_step(&k, "receipt", StepResolution::NotExecuted, "mailer log has no such id")?;
        let history = engine.history(&k)?;
        assert!(
            history.iter().any(|e| e.actor == Actor::Operator { reason: "mailer log has no such id".into() }
                && e.step.as_deref() == Some("receipt")),
            "{history:?}"
        );
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        assert_eq!(state_of(c.steps(), "charge")?, StepState::Confirmed);
        Ok(())
    }
}

both_backends! {
    /// Bad input: each a typed error, nothing written, other keys served.
    fn bad_input_is_refused_whole(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(clocked(h, &clock))?;
        let k = key("steps-bad")?;
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        let long = "x".repeat(65);
        // Not printable ASCII: a space, a bidi override, a zero-width space
        // (`idem show` could print one name as another).
        for bad in ["", long.as_str(), "tab\tname", "a/b", "a b", "charge\u{202e}", "\u{200b}charge", "é"] {
            let err = c.effect(bad).err().ok_or_else(|| format!("{bad:?} accepted"))?;
            assert!(matches!(err, Error::InvalidStepName { .. }), "{bad:?}: {err:?}");
        }
        run_ref(c.effect("charge")?)?;
        let big = vec![0u8; MAX_EVIDENCE_BYTES + 1];
        let err = c.confirm("charge", &big).err().ok_or("oversized evidence accepted")?;
        assert!(matches!(err, Error::EvidenceTooLarge { bytes, .. } if bytes == MAX_EVIDENCE_BYTES + 1), "{err:?}");
        let err = c.confirm("never-reserved", b"x").err().ok_or("confirm of an unreserved step")?;
        assert!(matches!(err, Error::StepNotFound { .. }), "{err:?}");
        let steps = engine.steps(&k)?;
        assert_eq!(steps.len(), 1);
        assert_eq!(steps[0].state, StepState::Reserved);
        let logged = engine.history(&k)?.len();
        assert_eq!(logged, 1, "only the reservation is logged");
        // A reserved step blocks completion: the app must confirm or
        // reject it first.
        let err = engine.complete(c, Envelope::new(1, 201, "x")).err().ok_or("complete with a reserved step")?;
        assert!(matches!(err, Error::InvalidState { .. }), "{err:?}");
        assert_eq!(engine.record(&k)?.ok_or("no record")?.state, State::Processing);

        // A stale token: the lease ran out and recovery took over.
        let stale_key = key("steps-stale")?;
        let old = claimed(engine.begin(&stale_key, fp(1)?)?)?;
        let old_effects = old.effects();
        drop(old);
        clock.advance(Duration::from_millis(LEASE_MS + 1));
        engine.resolve(&stale_key, Resolution::NotExecuted, "provider has nothing")?;
        let new = claimed(engine.begin(&stale_key, fp(1)?)?)?;
        let err = old_effects.effect("charge").err().ok_or("a stale token reserved a step")?;
        assert!(matches!(err, Error::Fenced { .. }), "{err:?}");
        assert!(engine.steps(&stale_key)?.is_empty());
        engine.complete(new, Envelope::new(1, 201, "ok"))?;

        // A key that expired (and was swept away).
        let gone = key("steps-expired")?;
        let c = claimed(engine.begin(&gone, fp(1)?)?)?;
        let effects = c.effects();
        engine.complete(c, Envelope::new(1, 201, "ok"))?;
        clock.advance(Duration::from_millis(TTL_MS + 1));
        engine.sweep_now()?;
        let err = effects.effect("charge").err().ok_or("a step on an expired key")?;
        assert!(matches!(err, Error::Fenced { .. } | Error::NotFound { .. }), "{err:?}");
        assert!(engine.steps(&gone)?.is_empty() && engine.history(&gone)?.is_empty());

        // Other keys are still served.
        let other = key("steps-other")?;
        let c = claimed(engine.begin(&other, fp(1)?)?)?;
        run_ref(c.effect("charge")?)?;
        c.confirm("charge", b"ok")?;
        engine.complete(c, Envelope::new(1, 201, "fine"))?;
        assert_eq!(replay(engine.begin(&other, fp(1)?)?)?.envelope.body, b"fine");
        Ok(())
    }
}

both_backends! {
    /// Steps and their log expire with the record; a tombstone keeps one
    /// summary entry naming each step's final state.
    fn steps_expire_with_the_record(h: &Harness) -> TestResult {
        for (name, policy) in [
            ("steps-forget", ExpiryPolicy::Forget),
            ("steps-tomb", ExpiryPolicy::Tombstone { keep: Duration::from_millis(5_000) }),
        ] {
            let store = h.another();
            let clock = ManualClock::new(T0);
            let engine = store.open(clocked(&store, &clock).expiry_policy(policy))?;
            let k = key(name)?;
            let c = claimed(engine.begin(&k, fp(1)?)?)?;
            run_ref(c.effect("charge")?)?;
            c.confirm("charge", b"ch_1")?;
            engine.complete(c, Envelope::new(1, 201, "paid"))?;
            assert!(!engine.history(&k)?.is_empty());
            clock.advance(Duration::from_millis(TTL_MS + 1));
            engine.sweep_now()?;
            assert!(engine.steps(&k)?.is_empty(), "{name}: steps outlived the record");
            let history = engine.history(&k)?;
            match policy {
                ExpiryPolicy::Forget => assert!(history.is_empty(), "{name}: {history:?}"),
                _ => {
                    assert_eq!(history.len(), 1, "{name}: {history:?}");
                    assert!(history[0].to.eq_ignore_ascii_case("tombstone"), "{history:?}");
                    let summary = String::from_utf8_lossy(&history[0].evidence).to_string();
                    assert!(summary.contains("charge"), "{summary}");
                }
            }
        }
        Ok(())
    }
}

both_backends! {
    /// Steps and a local write: the claim's steps are kept with the
    /// COMPLETED record `complete_local` stores; a local write that fails
    /// after a confirmed step does not release the key (work happened) but
    /// leaves it in doubt, and the next `begin` resumes it.
    fn steps_with_complete_local(h: &Harness) -> TestResult {
        let ledger = h.ledger()?;
        let clock = ManualClock::new(T0);
        let engine = h.open(clocked(h, &clock))?;
        let k = key("steps-local")?;
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        run_ref(c.effect("charge")?)?;
        c.confirm("charge", b"ch_1")?;
        let err = engine
            .complete_local(c, |_tx| Err("ledger rule violated".into()))
            .err()
            .ok_or("a failing local write succeeded")?;
        assert!(matches!(err, Error::LocalWrite { .. }), "{err:?}");
        assert_eq!(engine.record(&k)?.ok_or("the key was released")?.state, State::Unknown);

        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        assert!(matches!(c.effect("charge")?, EffectStep::Confirmed { .. }));
        let l = ledger.clone();
        engine.complete_local(c, move |tx| {
            l.insert(tx, "steps-local", 10)?;
            Ok(Envelope::new(1, 201, "booked"))
        })?;
        assert_eq!(replay(engine.begin(&k, fp(1)?)?)?.envelope.body, b"booked");
        assert_eq!(state_of(&engine.steps(&k)?, "charge")?, StepState::Confirmed);
        drop(engine);
        assert_eq!(h.ledger_rows(&ledger)?, [("steps-local".to_owned(), 10)]);
        Ok(())
    }
}

both_backends! {
    /// The 17th distinct step name of a key is refused, nothing written;
    /// an operator's settlement of a key without steps is logged with the
    /// reason.
    fn bounds_and_whole_key_reason(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(clocked(h, &clock))?;
        let k = key("steps-many")?;
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        for n in 0..idempotency::MAX_STEPS_PER_KEY {
            let name = format!("s{n}");
            run_ref(c.effect(&name)?)?;
            c.confirm(&name, b"ok")?;
        }
        let logged = engine.history(&k)?.len();
        let err = c.effect("one-too-many").err().ok_or("a 17th step was accepted")?;
        assert!(matches!(err, Error::TooManySteps { .. }), "{err:?}");
        assert_eq!(engine.steps(&k)?.len(), idempotency::MAX_STEPS_PER_KEY);
        assert_eq!(engine.history(&k)?.len(), logged);
        engine.complete(c, Envelope::new(1, 201, "ok"))?;

        let plain = key("steps-none")?;
        let c = claimed(engine.begin(&plain, fp(1)?)?)?;
        engine.fail(c, Failure::InDoubt { reason: "timeout".into() })?;
        engine.resolve(&plain, Resolution::NotExecuted, "provider has no such payment")?;
        let c = claimed(engine.begin(&plain, fp(1)?)?)?;
        engine.complete(c, Envelope::new(1, 201, "ok"))?;
        // The released record's log went with it; a completed settlement
        // stays with its record.
        let done = key("steps-none-2")?;
        let c = claimed(engine.begin(&done, fp(1)?)?)?;
        engine.fail(c, Failure::InDoubt { reason: "timeout".into() })?;
        engine.resolve(&done, Resolution::Completed(Envelope::new(1, 201, "from provider")), "provider shows it paid")?;
        let history = engine.history(&done)?;
        assert!(
            history.iter().any(|e| e.step.is_none()
                && e.actor == Actor::Operator { reason: "provider shows it paid".into() }),
            "{history:?}"
        );
        Ok(())
    }
}

/// The handle an async handler gets must cross threads and tasks.
#[test]
fn effects_is_send_sync_clone() {
    fn check<T: Send + Sync + Clone + 'static>() {}
    check::<idempotency::Effects>();
}

both_backends! {
    /// A process that dies after its last confirmation but before
    /// `complete` (no drop notice: the record stays PROCESSING) needs no
    /// resolver: once the lease ends every step is settled, so the next
    /// `begin` resumes the key and the handler skips both calls.
    fn crash_after_the_last_step_resumes(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(clocked(h, &clock))?;
        let k = key("steps-crash")?;
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        for name in ["charge", "receipt"] {
            run_ref(c.effect(name)?)?;
            c.confirm(name, name.as_bytes())?;
        }
        // The process dies here: no outcome, no drop notice.
        std::mem::forget(c);
        assert!(matches!(engine.begin(&k, fp(1)?)?, Begin::Processing { .. }));
        clock.advance(Duration::from_millis(LEASE_MS + 1));
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        for name in ["charge", "receipt"] {
            match c.effect(name)? {
                EffectStep::Confirmed { evidence, .. } => assert_eq!(evidence, name.as_bytes()),
                other => return Err(format!("{name} must be skipped, got {other:?}").into()),
            }
        }
        engine.complete(c, Envelope::new(1, 201, "paid"))?;
        assert_eq!(replay(engine.begin(&k, fp(1)?)?)?.envelope.body, b"paid");
        Ok(())
    }
}

both_backends! {
    /// A key whose evidence log is full: the transition that would write
    /// one entry too many is refused with `HistoryFull` and writes nothing;
    /// the log never grows past its bound; other keys are served and an
    /// operator can still purge the key.
    fn a_full_log_refuses_whole(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(clocked(h, &clock).step_resolver("s", |_: &InDoubtStep| StepResolution::NotExecuted))?;
        let k = key("steps-full-log")?;
        let mut refused = None;
        for _ in 0..idempotency::MAX_HISTORY_ENTRIES {
            let c = match engine.begin(&k, fp(1)?) {
                Ok(Begin::Claimed(c)) => c,
                Ok(other) => return Err(format!("expected Claimed, got {other:?}").into()),
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            };
            let before = engine.history(&k)?.len();
            match c.effect("s") {
                Ok(step) => {
                    run_ref(step)?;
                }
                Err(e) => {
                    assert_eq!(engine.history(&k)?.len(), before, "a refused reserve wrote to the log");
                    refused = Some(e);
                    break;
                }
            }
            engine.fail(c, Failure::InDoubt { reason: "timeout".into() })?;
        }
        let err = refused.ok_or("the log never filled up")?;
        assert!(matches!(err, Error::HistoryFull { .. }), "{err:?}");
        assert!(engine.history(&k)?.len() <= idempotency::MAX_HISTORY_ENTRIES);
        let other = key("steps-full-other")?;
        let c = claimed(engine.begin(&other, fp(1)?)?)?;
        engine.complete(c, Envelope::new(1, 201, "ok"))?;
        engine.purge(&k, idempotency::PurgeMode::Force)?;
        assert!(engine.history(&k)?.is_empty() && engine.steps(&k)?.is_empty());
        Ok(())
    }
}

both_backends! {
    /// A claim whose lease ended, and whose key another request's `begin`
    /// then moved to UNKNOWN, can still report its call's outcome: its
    /// `confirm` settles its own step from Unknown (as a late `complete`
    /// carrying the same confirmation does), the record stays UNKNOWN, and
    /// the next `begin` resumes the key with the charge skipped. Guards
    /// against a provider's answer that reached the app being refused (the
    /// resolver would then have to find it again), and against a late
    /// confirm that completes the key or touches a step it did not reserve.
    fn a_late_confirm_settles_its_own_step(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let provider = Provider::answering(StepResolution::StillUnknown);
        let engine = h.open(clocked(h, &clock).step_resolver("charge", provider.resolver()))?;
        let k = key("steps-late-confirm")?;
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        run_ref(c.effect("charge")?)?;
        // The provider is slow; the lease ends and a retry finds the key
        // stale: it goes UNKNOWN and the provider cannot tell yet.
        clock.advance(Duration::from_millis(LEASE_MS + 1));
        let retry = engine.begin(&k, fp(1)?)?;
        assert!(!matches!(retry, Begin::Claimed(_)), "claimed while the charge was unsettled: {retry:?}");
        assert_eq!(engine.record(&k)?.ok_or("no record")?.state, State::Unknown);
        assert_eq!(state_of(&engine.steps(&k)?, "charge")?, StepState::Unknown);
        // Then the provider's answer reaches the first claim.
        c.confirm("charge", b"ch_late")?;
        assert_eq!(state_of(&engine.steps(&k)?, "charge")?, StepState::Confirmed);
        assert_eq!(engine.record(&k)?.ok_or("no record")?.state, State::Unknown, "a confirm is not an outcome");
        let last = engine.history(&k)?.pop().ok_or("no log")?;
        assert_eq!((last.from.as_str(), last.to.as_str()), ("unknown", "confirmed"));
        assert_eq!(last.actor, Actor::Claim { fencing_token: c.fencing_token() });
        // Confirming again is refused; nothing else changes.
        let again = c.confirm("charge", b"ch_late").err().ok_or("a second confirm was accepted")?;
        assert!(matches!(again, Error::StepReused { .. }), "{again:?}");
        drop(c);
        let asked = provider.asked().len();
        let resumed = claimed(engine.begin(&k, fp(1)?)?)?;
        assert_eq!(provider.asked().len(), asked, "the resolver was asked about a settled step");
        match resumed.effect("charge")? {
            EffectStep::Confirmed { evidence, .. } => assert_eq!(evidence, b"ch_late"),
            other => return Err(format!("the charge must be skipped, got {other:?}").into()),
        }
        engine.complete(resumed, Envelope::new(1, 201, "paid"))?;
        assert_eq!(replay(engine.begin(&k, fp(1)?)?)?.envelope.body, b"paid");
        Ok(())
    }
}

both_backends! {
    /// A record deleted behind the engine's back (a bug, a lost row or
    /// page), its steps and log left: `verify` names the key once, with
    /// its steps and how many log entries, and not the key beside it; a
    /// sound store with steps is sound.
    fn verify_names_steps_whose_record_is_gone(h: &Harness) -> TestResult {
        let (k, kept) = (key("steps-orphaned")?, key("steps-kept")?);
        let log_entries = {
            let engine = h.engine()?;
            for key in [&k, &kept] {
                let c = claimed(engine.begin(key, fp(1)?)?)?;
                run_ref(c.effect("charge")?)?;
                c.confirm("charge", b"ch_1")?;
                run_ref(c.effect("receipt")?)?;
                c.confirm("receipt", b"rc_1")?;
                engine.complete(c, Envelope::new(1, 201, "paid"))?;
            }
            let report = engine.verify()?;
            assert!(report.is_sound(), "{:?}", report.damage);
            engine.history(&k)?.len() as u64
        };
        assert!(log_entries > 0);
        h.remove_record_row(&k)?;
        let engine = h.engine()?;
        let report = engine.verify()?;
        let found: Vec<&Damage> = report
            .damage
            .iter()
            .filter(|d| matches!(d, Damage::StepsWithoutRecord { .. }))
            .collect();
        let mut rkey = vec![u8::try_from(k.scope().len())?];
        rkey.extend_from_slice(k.scope().as_bytes());
        rkey.extend_from_slice(k.key().as_bytes());
        let key_hex: String = rkey.iter().map(|b| format!("{b:02x}")).collect();
        match found.as_slice() {
            [Damage::StepsWithoutRecord {
                key_hex: named,
                record_in: None,
                steps,
                log_entries: n,
                ..
            }] => {
                assert_eq!(*named, key_hex);
                assert_eq!(steps, &["charge", "receipt"]);
                assert_eq!(*n, log_entries);
            }
            other => return Err(format!("expected one report naming {k}, got {other:?}").into()),
        }
        assert!(found[0].to_string().contains(&k.to_string()), "{}", found[0]);
        Ok(())
    }
}
