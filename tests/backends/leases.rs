//! Leases on a `ManualClock`: a claim is in progress until its lease ends
//! (exactly at its deadline), `extend` renews it until the record has moved
//! to UNKNOWN, a dropped or expired claim becomes UNKNOWN and is never
//! claimed again, and a clock stepping back never revives a lease.

use std::time::Duration;

use idempotency::{Begin, Envelope, ManualClock, State};

use super::support::*;

const LEASE_MS: u64 = 1_000;

fn leased(h: &Harness, clock: &ManualClock) -> Result<idempotency::Engine, idempotency::OpenError> {
    h.open(
        h.builder()
            .clock(clock.clone())
            .lease(Duration::from_millis(LEASE_MS)),
    )
}

fn retry_after(answer: Begin) -> Result<Duration, String> {
    match answer {
        Begin::Processing { retry_after } => Ok(retry_after),
        other => Err(format!("expected Processing, got {other:?}")),
    }
}

both_backends! {
    /// A lease ends exactly at its deadline: 1 ms before, the key is in
    /// progress with 1 ms to go; at and after it, UNKNOWN; never Claimed.
    fn lease_boundaries_before_any_sweep(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = leased(h, &clock)?;
        let mut holders = Vec::new();
        for (i, offset) in [LEASE_MS - 1, LEASE_MS, LEASE_MS + 1].into_iter().enumerate() {
            let start = T0 + 1_000_000 * (i as u64 + 1);
            clock.set(start);
            let k = key(&format!("lease-{offset}"))?;
            let c = claimed(engine.begin(&k, fp(1)?)?)?;
            assert_eq!((c.claimed_at_ms(), c.lease_until_ms()), (start, start + LEASE_MS));
            holders.push(c);
            clock.set(start + offset);
            let answer = engine.begin(&k, fp(1)?)?;
            if offset < LEASE_MS {
                assert_eq!(retry_after(answer)?, Duration::from_millis(LEASE_MS - offset));
            } else {
                let p = unknown(answer)?;
                assert_eq!(p.unknown_since_ms, start + offset);
                assert!(p.reason.contains("lease"), "{}", p.reason);
            }
            for _ in 0..2 {
                let again = engine.begin(&k, fp(1)?)?;
                assert!(!matches!(again, Begin::Claimed(_)), "claimed at lease + {offset} ms");
            }
        }
        Ok(())
    }
}

both_backends! {
    /// `extend` renews from now; past the renewed lease the record is
    /// UNKNOWN, extend is fenced, and the holder's own result is still
    /// taken.
    fn extend_renews_the_lease_until_fenced(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = leased(h, &clock)?;
        let k = key("long-work")?;
        let mut c = claimed(engine.begin(&k, fp(1)?)?)?;
        assert_eq!(c.lease_until_ms(), T0 + LEASE_MS);

        clock.advance(Duration::from_millis(500));
        assert_eq!(retry_after(engine.begin(&k, fp(1)?)?)?, Duration::from_millis(500));
        c.extend(Duration::from_secs(10))?;
        assert_eq!(c.lease_until_ms(), T0 + 500 + 10_000);
        let stored = engine.record(&k)?.ok_or("missing")?;
        assert_eq!(stored.lease_until_ms, Some(T0 + 500 + 10_000));
        assert_eq!(retry_after(engine.begin(&k, fp(1)?)?)?, Duration::from_secs(10));

        // Still PROCESSING 1 ms before the renewed end, across a sweep.
        clock.advance(Duration::from_millis(9_999));
        assert_eq!(engine.sweep_now()?.moved_to_unknown, 0);
        assert_eq!(retry_after(engine.begin(&k, fp(1)?)?)?, Duration::from_millis(1));

        // Past the renewed lease: seen (and moved) by a begin, then fenced.
        clock.advance(Duration::from_millis(1));
        unknown(engine.begin(&k, fp(1)?)?)?;
        let err = c.extend(Duration::from_secs(10)).err().ok_or("extended an UNKNOWN record")?;
        assert!(matches!(err, idempotency::Error::Fenced { .. }), "{err:?}");
        assert_eq!(engine.record(&k)?.ok_or("missing")?.state, State::Unknown);
        engine.complete(c, Envelope::new(1, 201, "done"))?;
        assert_eq!(replay(engine.begin(&k, fp(1)?)?)?.envelope.body, b"done");
        Ok(())
    }
}

both_backends! {
    /// A per-call lease (`begin_with_lease`) replaces the default.
    fn per_call_lease(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = leased(h, &clock)?;
        let k = key("withdrawal")?;
        let c = claimed(engine.begin_with_lease(&k, fp(1)?, Duration::from_secs(3_600))?)?;
        assert_eq!(c.lease_until_ms(), T0 + 3_600_000);
        clock.advance(Duration::from_secs(3_599));
        assert_eq!(retry_after(engine.begin(&k, fp(1)?)?)?, Duration::from_secs(1));
        assert_eq!(engine.sweep_now()?.moved_to_unknown, 0);
        engine.complete(c, Envelope::new(1, 201, "ok"))?;
        Ok(())
    }
}

both_backends! {
    /// A dropped claim is UNKNOWN at once, but its work may still run: it
    /// answers Processing (never Claimed) until the lease ends, then
    /// Unknown; the same for a claim whose holder vanished (lease ran out).
    fn dropped_and_expired_claims_become_unknown_never_claimed(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = leased(h, &clock)?;

        let dropped = key("dropped")?;
        let c = claimed(engine.begin(&dropped, fp(1)?)?)?;
        let reference = c.reference().to_string();
        drop(c);
        engine.flush()?;
        // Its holder vanishes without a word (a crash).
        let vanished = key("vanished")?;
        std::mem::forget(claimed(engine.begin(&vanished, fp(1)?)?)?);
        assert_eq!(engine.record(&vanished)?.ok_or("missing")?.state, State::Processing);
        assert_eq!(engine.record(&dropped)?.ok_or("missing")?.state, State::Unknown);
        for step in [0, 400, 599] {
            clock.set(T0 + step);
            let answer = engine.begin(&dropped, fp(1)?)?;
            assert_eq!(retry_after(answer)?, Duration::from_millis(LEASE_MS - step), "at +{step} ms");
        }
        // Neither the sweeper nor a settlement takes it early.
        assert_eq!(engine.sweep_now()?.moved_to_unknown, 0);
        let err = engine
            .resolve(&dropped, idempotency::Resolution::NotExecuted, "test")
            .err()
            .ok_or("NotExecuted before the lease ends was taken")?;
        assert!(matches!(err, idempotency::Error::InvalidState { .. }), "{err:?}");
        let answer = engine.begin(&vanished, fp(1)?)?;
        assert_eq!(retry_after(answer)?, Duration::from_millis(LEASE_MS - 599));

        clock.set(T0 + LEASE_MS);
        for _ in 0..3 {
            let p = unknown(engine.begin(&dropped, fp(1)?)?)?;
            assert_eq!(p.reference, reference);
            assert!(p.reason.contains("dropped"), "{}", p.reason);
            let p = unknown(engine.begin(&vanished, fp(1)?)?)?;
            assert!(p.reason.contains("lease"), "{}", p.reason);
            clock.advance(Duration::from_secs(3_600));
            engine.sweep_now()?;
        }
        let in_doubt: Vec<_> = engine.in_doubt(10)?.into_iter().map(|d| d.key).collect();
        assert_eq!(in_doubt, [dropped.clone(), vanished.clone()]);
        let stats = engine.stats()?;
        assert_eq!((stats.unknown, stats.processing, stats.claims), (2, 0, 2));
        Ok(())
    }
}

both_backends! {
    /// `flush` waits for the notices of dropped claims (sent without
    /// waiting): once it returns, every dropped claim's record is UNKNOWN.
    fn flush_waits_for_dropped_claims(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = leased(h, &clock)?;
        for round in 0..5 {
            let keys = (0..20)
                .map(|i| key(&format!("dropped-{round}-{i}")))
                .collect::<Result<Vec<_>, _>>()?;
            let claims = keys
                .iter()
                .map(|k| claimed(engine.begin(k, fp(1)?)?).map_err(Into::into))
                .collect::<Result<Vec<_>, Box<dyn std::error::Error + Send + Sync>>>()?;
            drop(claims);
            engine.flush()?;
            for k in &keys {
                let state = engine.record(k)?.ok_or("missing")?.state;
                assert_eq!(state, State::Unknown, "{k} after flush (round {round})");
            }
        }
        Ok(())
    }
}

both_backends! {
    /// A clock stepping backwards never turns UNKNOWN back into
    /// PROCESSING, whether a begin or a sweep judged the lease.
    fn clock_stepping_back_never_revives_a_lease(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = leased(h, &clock)?;

        let k = key("backwards-begin")?;
        let mut holder = claimed(engine.begin(&k, fp(1)?)?)?;
        clock.set(T0 + LEASE_MS + 1);
        unknown(engine.begin(&k, fp(1)?)?)?;
        clock.set(T0);
        for _ in 0..3 {
            unknown(engine.begin(&k, fp(1)?)?)?;
            assert_eq!(engine.sweep_now()?, idempotency::SweepCounts::default());
        }
        let err = holder.extend(Duration::from_secs(60)).err().ok_or("extend revived the lease")?;
        assert!(matches!(err, idempotency::Error::Fenced { .. }), "{err:?}");
        assert_eq!(engine.record(&k)?.ok_or("missing")?.state, State::Unknown);

        let k2 = key("backwards-sweep")?;
        clock.set(T0 + 50_000);
        let holder2 = claimed(engine.begin(&k2, fp(1)?)?)?;
        clock.set(T0 + 50_000 + LEASE_MS);
        assert_eq!(engine.sweep_now()?.moved_to_unknown, 1);
        clock.set(T0);
        unknown(engine.begin(&k2, fp(1)?)?)?;
        assert_eq!(engine.record(&k2)?.ok_or("missing")?.state, State::Unknown);
        drop((holder, holder2));
        Ok(())
    }
}
