//! Fencing: a holder whose token no longer owns the record is refused with
//! `Error::Fenced` and changes nothing; tokens grow per key across release,
//! expiry, recovery and reopen, so a later claim always outranks an
//! earlier one.

use std::time::Duration;

use idempotency::{Envelope, Failure, InDoubt, ManualClock, Resolution};

use super::support::*;

const LEASE_MS: u64 = 1_000;
const TTL_MS: u64 = 10_000;

fn fenced(result: idempotency::Result<()>) -> TestResult {
    let err = result.err().ok_or("a fenced holder was accepted")?;
    assert!(matches!(err, idempotency::Error::Fenced { .. }), "{err:?}");
    Ok(())
}

both_backends! {
    /// A stale holder whose key was recovered and claimed afresh: its
    /// complete, fail and extend are all refused; the new holder's result
    /// stands.
    fn late_holder_is_fenced_after_recovery(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(h.builder().clock(clock.clone()).lease(Duration::from_millis(LEASE_MS)))?;
        let k = key("race")?;
        let mut a = claimed(engine.begin(&k, fp(1)?)?)?;
        clock.advance(Duration::from_millis(LEASE_MS));
        assert_eq!(engine.sweep_now()?.moved_to_unknown, 1);
        let report = engine.recover_in_doubt(&|_: &InDoubt| Resolution::NotExecuted, 10)?;
        assert_eq!(report.not_executed, 1);

        let b = claimed(engine.begin(&k, fp(1)?)?)?;
        assert!(b.fencing_token() > a.fencing_token());
        assert_ne!(b.reference(), a.reference());
        let before = engine.record(&k)?;
        let err = a.extend(Duration::from_secs(60)).err().ok_or("extend accepted")?;
        assert!(matches!(err, idempotency::Error::Fenced { .. }), "{err:?}");
        assert_eq!(engine.record(&k)?, before, "a fenced extend changed the record");
        fenced(engine.complete(a, Envelope::new(1, 201, "A")))?;
        assert_eq!(engine.record(&k)?, before, "a fenced complete changed the record");

        engine.complete(b, Envelope::new(1, 201, "B"))?;
        assert_eq!(replay(engine.begin(&k, fp(1)?)?)?.envelope.body, b"B");
        Ok(())
    }
}

both_backends! {
    /// Holders whose record was settled by someone else: by an operator's
    /// `Completed` resolution, or force-purged and claimed again. Their
    /// late outcomes are refused and leave the record as it is.
    fn fenced_after_resolution_and_after_purge(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(h.builder().clock(clock.clone()).lease(Duration::from_millis(LEASE_MS)))?;

        let k = key("resolved")?;
        let a = claimed(engine.begin(&k, fp(1)?)?)?;
        clock.advance(Duration::from_millis(LEASE_MS));
        engine.resolve(&k, Resolution::Completed(Envelope::new(1, 201, "from provider")), "provider has it")?;
        let settled = engine.record(&k)?;
        fenced(engine.fail(a, Failure::Final(Envelope::new(1, 402, "late"))))?;
        assert_eq!(engine.record(&k)?, settled);
        assert_eq!(replay(engine.begin(&k, fp(1)?)?)?.envelope.body, b"from provider");

        let k = key("purged")?;
        let a = claimed(engine.begin(&k, fp(1)?)?)?;
        engine.purge(&k, idempotency::PurgeMode::Force)?;
        let b = claimed(engine.begin(&k, fp(1)?)?)?;
        assert!(b.fencing_token() > a.fencing_token());
        let held = engine.record(&k)?;
        fenced(engine.complete(a, Envelope::new(1, 201, "A")))?;
        assert_eq!(engine.record(&k)?, held);
        engine.complete(b, Envelope::new(1, 201, "B"))?;
        assert_eq!(replay(engine.begin(&k, fp(1)?)?)?.envelope.body, b"B");
        Ok(())
    }
}

both_backends! {
    /// Tokens grow for one key through every way it can become free again:
    /// a retryable release, an expiry (swept or not), a `NotExecuted`
    /// resolution, a purge, and a reopen.
    fn tokens_grow_per_key(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let builder = || {
            h.builder()
                .clock(clock.clone())
                .lease(Duration::from_millis(LEASE_MS))
                .ttl(Duration::from_millis(TTL_MS))
        };
        let k = key("tokens")?;
        let mut tokens = Vec::new();
        {
            let engine = h.open(builder())?;
            // Released.
            let c = claimed(engine.begin(&k, fp(1)?)?)?;
            tokens.push(c.fencing_token());
            engine.fail(c, Failure::Retryable)?;
            // Expired, read-time (no sweep).
            let c = claimed(engine.begin(&k, fp(1)?)?)?;
            tokens.push(c.fencing_token());
            engine.complete(c, Envelope::new(1, 201, "1"))?;
            clock.advance(Duration::from_millis(TTL_MS));
            // Expired and swept.
            let c = claimed(engine.begin(&k, fp(1)?)?)?;
            tokens.push(c.fencing_token());
            engine.complete(c, Envelope::new(1, 201, "2"))?;
            clock.advance(Duration::from_millis(TTL_MS));
            assert_eq!(engine.sweep_now()?.deleted, 1);
            assert_eq!(engine.record(&k)?, None);
            // Recovered as not executed.
            let c = claimed(engine.begin(&k, fp(1)?)?)?;
            tokens.push(c.fencing_token());
            engine.fail(c, Failure::InDoubt { reason: "timeout".into() })?;
            engine.resolve(&k, Resolution::NotExecuted, "provider has nothing")?;
            // Purged.
            let c = claimed(engine.begin(&k, fp(1)?)?)?;
            tokens.push(c.fencing_token());
            engine.complete(c, Envelope::new(1, 201, "3"))?;
            engine.purge(&k, idempotency::PurgeMode::FinishedOnly)?;
        }
        // Reopened: the counter carries on.
        let engine = h.open(builder())?;
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        tokens.push(c.fencing_token());
        engine.complete(c, Envelope::new(1, 201, "4"))?;
        assert!(tokens.windows(2).all(|w| w[0] < w[1]), "tokens did not grow: {tokens:?}");
        assert_eq!(engine.record(&k)?.ok_or("missing")?.fencing_token, tokens[5]);
        Ok(())
    }
}
