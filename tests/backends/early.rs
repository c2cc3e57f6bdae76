//! Early settlement of dropped claims (UNKNOWN while their lease still
//! runs): a resolver's positive answer settles the key at once; "not
//! executed" waits for the lease (the dropped claim's work may still reach
//! the provider); a crowd of retries asks the resolver about one key at
//! most once per `resolver_interval`.

use std::time::Duration;

use idempotency::{Begin, Engine, Envelope, ManualClock, Resolution, State};

use super::recovery::Scripted;
use super::support::*;

const LEASE_MS: u64 = 1_000;
const INTERVAL_MS: u64 = 200;

fn engine(
    h: &Harness,
    clock: &ManualClock,
    script: &Scripted,
) -> Result<Engine, idempotency::OpenError> {
    h.open(
        h.builder()
            .clock(clock.clone())
            .lease(Duration::from_millis(LEASE_MS))
            .resolver_interval(Duration::from_millis(INTERVAL_MS))
            .resolver(script.resolver()),
    )
}

/// Claims `k` and drops the claim: UNKNOWN, its lease still running.
fn dropped(
    engine: &Engine,
    k: &idempotency::IdempotencyKey,
) -> Result<u64, Box<dyn std::error::Error + Send + Sync>> {
    let c = claimed(engine.begin(k, fp(1)?)?)?;
    let token = c.fencing_token();
    drop(c);
    engine.flush()?;
    assert_eq!(engine.record(k)?.ok_or("missing")?.state, State::Unknown);
    Ok(token)
}

fn retry_after(b: Begin) -> Result<Duration, String> {
    match b {
        Begin::Processing { retry_after } => Ok(retry_after),
        other => Err(format!("expected Processing, got {other:?}")),
    }
}

both_backends! {
    /// The provider has the reference: the dropped claim is settled at
    /// once, before its lease ends, and later retries replay without
    /// asking again.
    fn a_found_charge_settles_a_dropped_claim_at_once(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let provider = Envelope::new(1, 201, r#"{"charge":"ch_1"}"#);
        let script = Scripted::answering(Resolution::Completed(provider.clone()));
        let engine = engine(h, &clock, &script)?;
        let k = key("early-found")?;
        dropped(&engine, &k)?;
        clock.set(T0 + 10);
        assert_eq!(replay(engine.begin(&k, fp(1)?)?)?.envelope, provider);
        assert_eq!(script.asked().len(), 1);
        assert_eq!(engine.record(&k)?.ok_or("missing")?.state, State::Completed);
        assert_eq!(replay(engine.begin(&k, fp(1)?)?)?.envelope, provider);
        assert_eq!(script.asked().len(), 1, "asked again after settling");
        assert_eq!(engine.stats()?.resolved, 1);
        Ok(())
    }
}

both_backends! {
    /// "Not executed" before the lease ends settles nothing: Processing
    /// until the lease end (no second question meanwhile), then a fresh
    /// claim with a larger token.
    fn not_executed_waits_for_a_dropped_claims_lease(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let script = Scripted::answering(Resolution::NotExecuted);
        let engine = engine(h, &clock, &script)?;
        let k = key("early-not-executed")?;
        let token = dropped(&engine, &k)?;
        for step in [100, 300, 999] {
            clock.set(T0 + step);
            let wait = retry_after(engine.begin(&k, fp(1)?)?)?;
            assert_eq!(wait, Duration::from_millis(LEASE_MS - step), "at +{step} ms");
        }
        assert_eq!(script.asked().len(), 1, "asked again before the lease ended");
        assert_eq!(engine.record(&k)?.ok_or("missing")?.state, State::Unknown);
        clock.set(T0 + LEASE_MS);
        let fresh = claimed(engine.begin(&k, fp(1)?)?)?;
        assert!(fresh.fencing_token() > token);
        assert_eq!(script.asked().len(), 2);
        engine.complete(fresh, Envelope::new(1, 201, "fresh"))?;
        Ok(())
    }
}

both_backends! {
    /// "Still unknown" while the lease runs: Processing with the interval
    /// as the hint, one question per interval however many retries come,
    /// and a later positive answer settles the key.
    fn a_crowd_of_retries_asks_once_per_interval(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let script = Scripted::answering(Resolution::StillInDoubt);
        let engine = engine(h, &clock, &script)?;
        let k = key("early-crowd")?;
        dropped(&engine, &k)?;
        assert_eq!(retry_after(engine.begin(&k, fp(1)?)?)?, Duration::from_millis(INTERVAL_MS));
        for _ in 0..20 {
            retry_after(engine.begin(&k, fp(1)?)?)?;
        }
        clock.set(T0 + 150);
        assert_eq!(retry_after(engine.begin(&k, fp(1)?)?)?, Duration::from_millis(50));
        assert_eq!(script.asked().len(), 1);
        clock.set(T0 + INTERVAL_MS);
        retry_after(engine.begin(&k, fp(1)?)?)?;
        assert_eq!(script.asked().len(), 2);
        // Nothing was written for "still unknown" while the lease runs.
        assert_eq!(engine.record(&k)?.ok_or("missing")?.attempts, 0);
        script.set(Resolution::Completed(Envelope::new(1, 201, "found")));
        clock.set(T0 + 2 * INTERVAL_MS);
        assert_eq!(replay(engine.begin(&k, fp(1)?)?)?.envelope.body, b"found");
        assert_eq!(script.asked().len(), 3);
        Ok(())
    }
}
