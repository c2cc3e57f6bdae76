//! Expiry under both policies, decided at read time before any sweep and
//! then cleaned up by `sweep_now` with exact counts; stale PROCESSING goes
//! UNKNOWN and is never swept away; `stats` counts states as requests see
//! them.

use std::time::Duration;

use idempotency::{
    Begin, Engine, Envelope, ExpiryPolicy, Failure, IdempotencyKey, ManualClock, State, SweepCounts,
};

use super::support::*;

const LEASE_MS: u64 = 1_000;
const TTL_MS: u64 = 10_000;
const KEEP_MS: u64 = 5_000;

fn expiring(
    h: &Harness,
    policy: ExpiryPolicy,
) -> Result<(Engine, ManualClock), idempotency::OpenError> {
    let clock = ManualClock::new(T0);
    let engine = h.open(
        h.builder()
            .clock(clock.clone())
            .lease(Duration::from_millis(LEASE_MS))
            .ttl(Duration::from_millis(TTL_MS))
            .expiry_policy(policy),
    )?;
    Ok((engine, clock))
}

fn complete_new(engine: &Engine, k: &IdempotencyKey, body: &str) -> TestResult {
    let c = claimed(engine.begin(k, fp(1)?)?)?;
    engine.complete(c, Envelope::new(1, 201, body))?;
    Ok(())
}

both_backends! {
    /// Forget: replayed until 1 ms before the TTL ends; from the deadline
    /// on the key is free (before a sweep too); a sweep deletes only what
    /// is due, and counts it.
    fn forget_policy(h: &Harness) -> TestResult {
        let (engine, clock) = expiring(h, ExpiryPolicy::Forget)?;
        let k = key("forget")?;
        complete_new(&engine, &k, "first")?;
        let final_failure = key("final")?;
        let c = claimed(engine.begin(&final_failure, fp(1)?)?)?;
        engine.fail(c, Failure::Final(Envelope::new(1, 402, "declined")))?;

        clock.set(T0 + TTL_MS - 1);
        assert_eq!(replay(engine.begin(&k, fp(1)?)?)?.completed_at_ms, T0);
        assert_eq!(engine.sweep_now()?, SweepCounts::default());
        clock.set(T0 + TTL_MS);
        // Read-time truth: expired, though no sweep has run.
        let stats = engine.stats()?;
        assert_eq!((stats.expired, stats.completed, stats.final_failures), (2, 0, 0));
        let c = claimed(engine.begin(&k, fp(1)?)?)?;
        engine.complete(c, Envelope::new(1, 201, "second"))?;
        assert_eq!(replay(engine.begin(&k, fp(1)?)?)?.envelope.body, b"second");

        // The sweep deletes the expired FINAL_FAILURE, not the fresh record.
        let swept = engine.sweep_now()?;
        assert_eq!(swept, SweepCounts { deleted: 1, ..SweepCounts::default() });
        assert_eq!(engine.record(&final_failure)?, None);
        assert_eq!(engine.record(&k)?.ok_or("missing")?.state, State::Completed);
        assert_eq!(engine.sweep_now()?, SweepCounts::default(), "a second sweep found more");
        let stats = engine.stats()?;
        assert_eq!((stats.expired, stats.completed, stats.expired_deleted), (0, 1, 1));
        Ok(())
    }
}

both_backends! {
    /// Tombstone: past the TTL the key answers Tombstoned (never a second
    /// execution) for `keep` more, before and after the sweep turns it into
    /// a TOMBSTONE; then it is free, and a later sweep deletes it.
    fn tombstone_policy(h: &Harness) -> TestResult {
        let (engine, clock) = expiring(h, ExpiryPolicy::Tombstone { keep: Duration::from_millis(KEEP_MS) })?;
        let k = key("tomb")?;
        complete_new(&engine, &k, "first")?;
        let expires = T0 + TTL_MS;

        clock.set(expires);
        let answer = engine.begin(&k, fp(1)?)?;
        assert!(
            matches!(answer, Begin::Tombstoned { expired_at_ms, reusable_at_ms }
                if expired_at_ms == expires && reusable_at_ms == expires + KEEP_MS),
            "got {answer:?}"
        );
        assert_eq!(engine.stats()?.tombstones, 1, "read-time tombstone");
        let swept = engine.sweep_now()?;
        assert_eq!(swept, SweepCounts { tombstoned: 1, ..SweepCounts::default() });
        let info = engine.record(&k)?.ok_or("tombstone missing")?;
        assert_eq!((info.state, info.response), (State::Tombstone, None));
        assert_eq!(info.expires_at_ms, Some(expires + KEEP_MS));
        clock.set(expires + KEEP_MS - 1);
        let answer = engine.begin(&k, fp(1)?)?;
        assert!(matches!(answer, Begin::Tombstoned { .. }), "got {answer:?}");
        let answer = engine.begin(&k, fp(2)?)?;
        assert!(matches!(answer, Begin::Mismatch), "got {answer:?}");

        // The tombstone runs out: free before any sweep.
        clock.set(expires + KEEP_MS);
        let c = claimed(engine.begin(&k, fp(2)?)?)?;
        engine.complete(c, Envelope::new(1, 201, "second"))?;
        let k2 = key("tomb-2")?;
        complete_new(&engine, &k2, "x")?;
        clock.advance(Duration::from_millis(TTL_MS));
        assert_eq!(engine.sweep_now()?.tombstoned, 2);
        clock.advance(Duration::from_millis(KEEP_MS));
        assert_eq!(engine.sweep_now()?.deleted, 2);
        assert_eq!((engine.record(&k)?, engine.record(&k2)?), (None, None));
        let stats = engine.stats()?;
        assert_eq!((stats.tombstoned, stats.expired_deleted, stats.tombstone_answers), (3, 2, 2));
        Ok(())
    }
}

both_backends! {
    /// A stale PROCESSING record goes UNKNOWN at the sweep and is never
    /// deleted by later sweeps, under either policy.
    fn stale_processing_is_never_swept_away(h: &Harness) -> TestResult {
        for policy in [ExpiryPolicy::Forget, ExpiryPolicy::Tombstone { keep: Duration::from_millis(KEEP_MS) }] {
            let h = h.another();
            let (engine, clock) = expiring(&h, policy)?;
            let k = key("stale")?;
            let holder = claimed(engine.begin(&k, fp(1)?)?)?;
            clock.advance(Duration::from_millis(TTL_MS + 1));
            assert_eq!(engine.sweep_now()?, SweepCounts { moved_to_unknown: 1, ..SweepCounts::default() });
            for _ in 0..3 {
                clock.advance(Duration::from_millis(TTL_MS * 100));
                assert_eq!(engine.sweep_now()?, SweepCounts::default());
                assert_eq!(engine.record(&k)?.ok_or("UNKNOWN record deleted")?.state, State::Unknown);
                unknown(engine.begin(&k, fp(1)?)?)?;
            }
            drop(holder);
        }
        Ok(())
    }
}

both_backends! {
    /// Sweep counts and `stats` agree with what was done, counted at read
    /// time, over a few hundred records in bounded sweep steps.
    fn sweep_counts_and_stats(h: &Harness) -> TestResult {
        let clock = ManualClock::new(T0);
        let engine = h.open(
            h.builder()
                .clock(clock.clone())
                .lease(Duration::from_millis(LEASE_MS))
                .ttl(Duration::from_millis(TTL_MS))
                .sweep_batch(16),
        )?;
        let mut holders = Vec::new();
        for i in 0..30 {
            holders.push(claimed(engine.begin(&key(&format!("stale-{i}"))?, fp(1)?)?)?);
        }
        for i in 0..200 {
            complete_new(&engine, &key(&format!("done-{i}"))?, "x")?;
        }
        let stats = engine.stats()?;
        assert_eq!((stats.processing, stats.completed, stats.claims), (30, 200, 230));

        clock.advance(Duration::from_millis(LEASE_MS - 1));
        assert_eq!(engine.sweep_now()?, SweepCounts::default());
        clock.advance(Duration::from_millis(1));
        let stats = engine.stats()?;
        assert_eq!((stats.processing, stats.unknown), (0, 30), "read-time UNKNOWN");
        assert_eq!(stats.oldest_in_doubt_age, Some(Duration::ZERO));
        let swept = engine.sweep_now()?;
        assert_eq!((swept.moved_to_unknown, swept.deleted, swept.tombstoned, swept.more), (30, 0, 0, false));

        complete_new(&engine, &key("fresh")?, "x")?;
        clock.set(T0 + TTL_MS);
        let swept = engine.sweep_now()?;
        assert_eq!((swept.moved_to_unknown, swept.deleted, swept.more), (0, 200, false));
        let stats = engine.stats()?;
        assert_eq!((stats.unknown, stats.completed, stats.expired), (30, 1, 0));
        assert_eq!((stats.moved_to_unknown, stats.expired_deleted), (30, 200));
        assert_eq!(stats.oldest_in_doubt_age, Some(Duration::from_millis(TTL_MS - LEASE_MS)));
        assert_eq!(engine.sweep_now()?, SweepCounts::default(), "the index kept entries");
        drop(holders);
        Ok(())
    }
}
