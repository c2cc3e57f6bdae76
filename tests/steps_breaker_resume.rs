//! Breaker findings on a key RESUMED with its effect steps (issue 22), run
//! on redb and on PostgreSQL (`scripts/with-postgres`): when every step of
//! an in-doubt key was settled and the key released to resume, the record
//! was deleted and only the steps and the evidence log stayed (now the
//! record stays UNKNOWN, "resumable", also when a resumed claim fails
//! retryable). Guards against
//! (1) a retry with a DIFFERENT payload under the same key inheriting the
//! first payload's confirmed calls (the fingerprint is no longer checked,
//! so a 5 EUR request is handed the 100 EUR charge as "already done"),
//! while resumable and after a resumed claim's retryable failure;
//! (2) the steps and log of a resumed key that nobody retries living
//! forever (no record, so nothing expires them); (3) an operator's
//! whole-key "not executed" over a step still in doubt handing the key out
//! as `Claimed` and re-running that step under a NEW reference (its
//! provider cannot dedupe: a double execution if the first call happened);
//! (4) an operator's reason, stored in every log entry it writes, with no
//! bound (the log's size per key is then unbounded); (5) an operator's
//! step answer on a dropped claim's key (lease still running) that stores
//! the step's settlement and its log entry, then returns an error although
//! `Engine::resolve_step` documents "nothing is written on an error".

mod common;

// Declared once at the test binary's root (tests/services/main.rs): its
// table and key prefixes are unique through one counter per process.
use crate::harness;

use std::time::Duration;

use common::{claimed, CannotTell};
use harness::{run, run_format2, run_format3, Backend, Harness, TestResult};
use idempotency::{
    Begin, EffectStep, Engine, EngineBuilder, Envelope, Error, ExpiryPolicy, Failure, Fingerprint,
    IdempotencyKey, InDoubtStep, ManualClock, Resolution, StepResolution, MAX_EVIDENCE_BYTES,
};

const T0: u64 = 1_700_000_000_000;
const LEASE_MS: u64 = 1_000;
const TTL_MS: u64 = 10_000;

type BoxResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn key(k: &str) -> Result<IdempotencyKey, Error> {
    IdempotencyKey::new("tenant-1:create_payment", k)
}

fn fp(amount: u64) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(
        format!(r#"{{"amount": {amount}, "currency": "EUR"}}"#).as_bytes(),
        &[],
    )
}

/// The receipt provider's ledger never saw the receipt.
fn receipt_never_sent(_: &InDoubtStep) -> StepResolution {
    StepResolution::NotExecuted
}

fn clocked(h: &Harness, clock: &ManualClock) -> EngineBuilder {
    h.builder()
        .clock(clock.clone())
        .lease(Duration::from_millis(LEASE_MS))
        .ttl(Duration::from_millis(TTL_MS))
        .expiry_policy(ExpiryPolicy::Tombstone {
            keep: Duration::from_millis(TTL_MS),
        })
        .step_resolver("receipt", receipt_never_sent)
}

fn run_ref(step: EffectStep) -> BoxResult<String> {
    match step {
        EffectStep::Run { reference } => Ok(reference),
        other => Err(format!("expected Run, got {other:?}").into()),
    }
}

/// A payment of `amount` that charges (confirmed), reserves the receipt
/// and fails in doubt before the receipt's answer; then, past the lease,
/// recovery asks the receipt's provider ("never sent") and the key is
/// released to resume with its steps. Returns the first claim's reference.
fn charge_then_resume(
    engine: &Engine,
    clock: &ManualClock,
    k: &IdempotencyKey,
    amount: u64,
) -> BoxResult<String> {
    let c = claimed(engine.begin(k, fp(amount)?)?)?;
    let reference = c.reference().to_owned();
    run_ref(c.effect("charge")?)?;
    c.confirm("charge", format!("charged {amount} EUR").as_bytes())?;
    run_ref(c.effect("receipt")?)?;
    engine.fail(
        c,
        Failure::InDoubt {
            reason: "mailer timed out".into(),
        },
    )?;
    clock.advance(Duration::from_millis(LEASE_MS + 1));
    let report = engine.recover_in_doubt(&CannotTell, 10)?;
    if report.resumed != 1 {
        return Err(format!("expected the key resumed by recovery, got {report:?}").into());
    }
    Ok(reference)
}

both_backends! {
    /// The key was used for a payment of 100 EUR whose charge went
    /// through; once it is resumed, a request with the same key and a
    /// payment of 5 EUR must be told its payload does not match (as it is
    /// while the record exists), not claimed with the 100 EUR charge
    /// marked done.
    fn fingerprint_checked_after_resume(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(clocked(h, &clock))?;
        let k = key("breaker-fp-after-resume")?;
        charge_then_resume(&engine, &clock, &k, 100)?;
        five_eur_is_a_mismatch(&engine, &k, "resumable")?;
        // The 100 EUR retry resumes it and fails retryable before a call
        // of its own: the key must stay the 100 EUR payment's.
        let resumed = claimed(engine.begin(&k, fp(100)?)?)?;
        engine.fail(resumed, Failure::Retryable)?;
        five_eur_is_a_mismatch(&engine, &k, "released after a resume")
    }
}

/// A 5 EUR request under `k` (a 100 EUR payment's key, whose charge is
/// confirmed) is told its payload does not match; `when` names the phase.
fn five_eur_is_a_mismatch(engine: &Engine, k: &IdempotencyKey, when: &str) -> TestResult {
    match engine.begin(k, fp(5)?)? {
        Begin::Mismatch => Ok(()),
        Begin::Claimed(c) => {
            let charge = c.effect("charge")?;
            Err(format!(
                "{when}: a 5 EUR request under the key of a resumed 100 EUR payment was \
                 Claimed (not Mismatch); its charge step reads {charge:?}: the \
                 handler skips charging 5 EUR and answers with the 100 EUR charge"
            )
            .into())
        }
        other => Err(format!("{when}: expected Mismatch, got {other:?}").into()),
    }
}

both_backends! {
    /// A resumed key that nobody retries: its steps and evidence log must
    /// not outlive every TTL and tombstone the store has with no record to
    /// expire or purge them. Adjusted to the decided design (FIXES22): the
    /// record stays UNKNOWN ("resumable") until the client's retry resumes
    /// it, so the key stays listed in doubt (with every step settled) like
    /// any UNKNOWN record, its steps go with the record, and the retry
    /// resumes it with the confirmed charge skipped.
    fn resumed_key_steps_expire(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(clocked(h, &clock))?;
        let k = key("breaker-resumed-forever")?;
        let first = charge_then_resume(&engine, &clock, &k, 100)?;
        if engine.history(&k)?.is_empty() {
            return Err("the resumed key should keep its log until retried".into());
        }
        // A hundred TTLs (and tombstone keeps) later, after sweeps.
        for _ in 0..3 {
            clock.advance(Duration::from_millis(100 * TTL_MS));
            engine.sweep_now()?;
        }
        let listed = engine.in_doubt(100)?;
        let Some(entry) = listed.iter().find(|d| d.key == k) else {
            return Err(format!(
                "{} steps of a resumable key are stored but the key is not listed in doubt: \
                 nothing would ever clear them",
                engine.steps(&k)?.len()
            )
            .into());
        };
        if entry.steps.is_empty() || entry.steps.iter().any(|s| {
            !matches!(
                s.state,
                idempotency::StepState::Confirmed
                    | idempotency::StepState::Failed
                    | idempotency::StepState::NotExecuted
            )
        }) {
            return Err(format!("a resumable key lists unsettled steps: {:?}", entry.steps).into());
        }
        let c = claimed(engine.begin(&k, fp(100)?)?)?;
        if c.reference() == first {
            return Err("the resumed claim must get a fresh reference".into());
        }
        match c.effect("charge")? {
            EffectStep::Confirmed { .. } => Ok(()),
            other => Err(format!("the retry must skip the confirmed charge, got {other:?}").into()),
        }
    }
}

both_backends! {
    /// The charge was reserved and its claim failed in doubt: the charge's
    /// call may have happened. An operator's whole-key "not executed" must
    /// either be refused while that step is unsettled, or keep the step's
    /// reference so the re-run call is deduplicated by the provider.
    fn whole_key_not_executed_over_unknown_step(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(clocked(h, &clock))?;
        let k = key("breaker-operator-over-step")?;
        let c = claimed(engine.begin(&k, fp(100)?)?)?;
        let first = run_ref(c.effect("charge")?)?;
        engine.fail(
            c,
            Failure::InDoubt {
                reason: "card network timed out".into(),
            },
        )?;
        clock.advance(Duration::from_millis(LEASE_MS + 1));
        match engine.resolve(&k, Resolution::NotExecuted, "looked at the order table") {
            Err(Error::InvalidState { .. }) => return Ok(()),
            Err(e) => return Err(format!("refused, but not with InvalidState: {e:?}").into()),
            Ok(()) => {}
        }
        let c = claimed(engine.begin(&k, fp(100)?)?)?;
        let again = run_ref(c.effect("charge")?)?;
        if again != first {
            return Err(format!(
                "whole-key NotExecuted over the Unknown step 'charge' was accepted, the key \
                 was Claimed again and the charge re-runs under a NEW reference {again:?} \
                 (first call: {first:?}): the provider cannot dedupe a double charge"
            )
            .into());
        }
        Ok(())
    }
}

both_backends! {
    /// An operator's reason goes into the log entry; the log's size per
    /// key is documented as bounded (256 entries, evidence <= 4096 bytes),
    /// so a 1 MiB reason must be refused with a typed error (or cut).
    fn operator_reason_is_bounded(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(clocked(h, &clock))?;
        let k = key("breaker-long-reason")?;
        let c = claimed(engine.begin(&k, fp(100)?)?)?;
        run_ref(c.effect("charge")?)?;
        engine.fail(
            c,
            Failure::InDoubt {
                reason: "card network timed out".into(),
            },
        )?;
        clock.advance(Duration::from_millis(LEASE_MS + 1));
        let reason = "x".repeat(1 << 20);
        let outcome = engine.resolve(
            &k,
            Resolution::Completed(Envelope::new(1, 200, b"ok".to_vec())),
            &reason,
        );
        if outcome.is_err() {
            return Ok(());
        }
        let stored: usize = engine
            .history(&k)?
            .iter()
            .map(|e| match &e.actor {
                idempotency::Actor::Operator { reason } => reason.len(),
                _ => 0,
            })
            .sum();
        if stored > MAX_EVIDENCE_BYTES {
            return Err(format!(
                "a {} byte operator reason was accepted and {stored} bytes of it stored in \
                 one log entry: the log's size per key has no bound",
                reason.len()
            )
            .into());
        }
        Ok(())
    }
}

both_backends! {
    /// A claim dropped without an outcome (its lease still runs) after
    /// reserving the charge; the operator checks the provider and settles
    /// the step as executed. `resolve_step` must either succeed, or fail
    /// having written nothing (its documented contract).
    fn operator_step_answer_on_dropped_claim_is_all_or_nothing(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(clocked(h, &clock))?;
        let k = key("breaker-dropped-operator")?;
        let c = claimed(engine.begin(&k, fp(100)?)?)?;
        run_ref(c.effect("charge")?)?;
        drop(c);
        // The drop notice is written in the background: wait (bounded) for
        // the record to be in doubt.
        let mut in_doubt = false;
        for _ in 0..500 {
            if engine.in_doubt(10)?.iter().any(|d| d.key == k) {
                in_doubt = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if !in_doubt {
            return Err("the dropped claim never became in doubt".into());
        }
        let before = engine.history(&k)?.len();
        let outcome = engine.resolve_step(
            &k,
            "charge",
            StepResolution::Executed(b"ch_1".to_vec()),
            "provider dashboard shows ch_1",
        );
        let after = engine.history(&k)?;
        if let Err(e) = outcome {
            if after.len() != before {
                return Err(format!(
                    "resolve_step returned {e:?} but wrote {} log entries (last: {:?}) and the \
                     step now reads {:?}: documented as 'nothing is written on an error'",
                    after.len() - before,
                    after.last(),
                    engine
                        .steps(&k)?
                        .iter()
                        .map(|s| (s.name.clone(), s.state))
                        .collect::<Vec<_>>()
                )
                .into());
            }
        }
        Ok(())
    }
}
