//! Guards against expiry and leases deciding wrongly at their boundaries:
//! a record replayed after its TTL (or re-executed before it), a tombstone
//! that lets a key run twice, a stale claim ever re-claimed or deleted instead
//! of going UNKNOWN, a clock stepping backwards reviving a dead lease, and a
//! sweep that misses records or miscounts them. All time is a ManualClock; no
//! background sweeper runs, so every sweep is explicit.

mod common;

use std::error::Error;
use std::time::Duration;

use common::claimed;
use idempotency::{
    Begin, Engine, Envelope, ExpiryPolicy, Fingerprint, IdempotencyKey, ManualClock, State,
    SweepCounts,
};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const T0: u64 = 1_700_000_000_000;
const LEASE_MS: u64 = 1_000;
const TTL_MS: u64 = 10_000;

fn key(k: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("tenant-1:create_payment", k)
}

fn fp() -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(br#"{"amount": 10}"#, &[])
}

fn engine(policy: ExpiryPolicy) -> Result<(Engine, ManualClock), idempotency::Error> {
    let clock = ManualClock::new(T0);
    let engine = Engine::builder()
        .clock(clock.clone())
        .lease(Duration::from_millis(LEASE_MS))
        .ttl(Duration::from_millis(TTL_MS))
        .expiry_policy(policy)
        .sweep_interval(None)
        .in_memory()?;
    Ok((engine, clock))
}

fn complete_new(engine: &Engine, k: &IdempotencyKey, body: &str) -> TestResult {
    let c = claimed(engine.begin(k, fp()?)?)?;
    engine.complete(c, Envelope::new(1, 201, body))?;
    Ok(())
}

#[test]
fn forget_reuses_key_after_ttl_and_sweep() -> TestResult {
    let (engine, clock) = engine(ExpiryPolicy::Forget)?;
    let k = key("forget")?;
    complete_new(&engine, &k, "first")?;
    clock.advance(Duration::from_millis(TTL_MS + 1));
    let swept = engine.sweep_now()?;
    assert_eq!(
        swept,
        SweepCounts {
            deleted: 1,
            ..SweepCounts::default()
        }
    );
    assert!(engine.record(&k)?.is_none());
    let c = claimed(engine.begin(&k, fp()?)?)?;
    engine.complete(c, Envelope::new(1, 201, "second"))?;
    match engine.begin(&k, fp()?)? {
        Begin::Replay(r) => assert_eq!(r.envelope.body, b"second"),
        other => return Err(format!("expected Replay, got {other:?}").into()),
    }
    Ok(())
}

#[test]
fn tombstone_refuses_reuse_until_it_runs_out() -> TestResult {
    const KEEP_MS: u64 = 5_000;
    let (engine, clock) = engine(ExpiryPolicy::Tombstone {
        keep: std::time::Duration::from_millis(KEEP_MS),
    })?;
    let k = key("tomb")?;
    complete_new(&engine, &k, "first")?;
    let expires = T0 + TTL_MS;

    // Past the TTL, before any sweep: read-time truth already says Expired.
    clock.set(expires + 1);
    let answer = engine.begin(&k, fp()?)?;
    assert!(
        matches!(answer, Begin::Tombstoned { expired_at_ms, reusable_at_ms }
            if expired_at_ms == expires && reusable_at_ms == expires + KEEP_MS),
        "got {answer:?}"
    );
    let swept = engine.sweep_now()?;
    assert_eq!((swept.tombstoned, swept.deleted), (1, 0));
    let info = engine.record(&k)?.ok_or("tombstone missing")?;
    assert_eq!(info.state, State::Tombstone);
    assert_eq!(info.response, None, "a tombstone keeps no response");
    for at in [expires + 2, expires + KEEP_MS - 1] {
        clock.set(at);
        let answer = engine.begin(&k, fp()?)?;
        assert!(
            matches!(answer, Begin::Tombstoned { .. }),
            "at +{}: {answer:?}",
            at - T0
        );
    }

    // The tombstone runs out: the key executes afresh (before a sweep)...
    clock.set(expires + KEEP_MS);
    let c = claimed(engine.begin(&k, fp()?)?)?;
    engine.complete(c, Envelope::new(1, 201, "second"))?;
    // ...and sweeps tombstone both records, then delete them once the
    // tombstones run out.
    let k2 = key("tomb-2")?;
    complete_new(&engine, &k2, "x")?;
    clock.advance(Duration::from_millis(TTL_MS));
    assert_eq!(engine.sweep_now()?.tombstoned, 2);
    clock.advance(Duration::from_millis(KEEP_MS));
    assert_eq!(engine.sweep_now()?.deleted, 2);
    assert!(engine.record(&k2)?.is_none());
    assert!(engine.record(&k)?.is_none());
    Ok(())
}

#[test]
fn stale_processing_goes_unknown_and_is_never_swept_away() -> TestResult {
    let (engine, clock) = engine(ExpiryPolicy::Forget)?;
    let k = key("stale")?;
    let holder = claimed(engine.begin(&k, fp()?)?)?;
    clock.advance(Duration::from_millis(TTL_MS + 1));
    let swept = engine.sweep_now()?;
    assert_eq!(
        swept,
        SweepCounts {
            moved_to_unknown: 1,
            ..SweepCounts::default()
        }
    );
    for _ in 0..5 {
        clock.advance(Duration::from_millis(TTL_MS * 100));
        assert_eq!(engine.sweep_now()?, SweepCounts::default());
        let info = engine.record(&k)?.ok_or("UNKNOWN record was deleted")?;
        assert_eq!(info.state, State::Unknown);
        let answer = engine.begin(&k, fp()?)?;
        assert!(matches!(answer, Begin::InDoubt(_)), "got {answer:?}");
    }
    assert_eq!(engine.in_doubt(10)?.len(), 1);
    drop(holder);
    Ok(())
}

#[test]
fn lease_boundaries_before_any_sweep() -> TestResult {
    let (engine, clock) = engine(ExpiryPolicy::Forget)?;
    let cases = [
        (LEASE_MS - 1, "processing"),
        (LEASE_MS, "unknown"),
        (LEASE_MS + 1, "unknown"),
    ];
    let mut holders = Vec::new();
    for (i, (offset, want)) in cases.into_iter().enumerate() {
        let start = T0 + 1_000_000 * (i as u64 + 1);
        clock.set(start);
        let k = key(&format!("lease-{offset}"))?;
        holders.push(claimed(engine.begin(&k, fp()?)?)?);
        clock.set(start + offset);
        let answer = engine.begin(&k, fp()?)?;
        match (want, &answer) {
            ("processing", Begin::Processing { retry_after }) => {
                assert_eq!(*retry_after, Duration::from_millis(LEASE_MS - offset));
            }
            ("unknown", Begin::InDoubt(p)) => {
                assert_eq!(p.unknown_since_ms, start + offset);
                assert!(p.reason.contains("lease"), "{}", p.reason);
            }
            _ => return Err(format!("lease + {offset} ms: want {want}, got {answer:?}").into()),
        }
        // Asking again never turns into a claim.
        let again = engine.begin(&k, fp()?)?;
        assert!(
            !matches!(again, Begin::Claimed(_)),
            "claimed at lease + {offset} ms"
        );
    }
    Ok(())
}

#[test]
fn ttl_boundaries_before_any_sweep() -> TestResult {
    let (engine, clock) = engine(ExpiryPolicy::Forget)?;
    let cases = [(TTL_MS - 1, true), (TTL_MS, false), (TTL_MS + 1, false)];
    for (i, (offset, replays)) in cases.into_iter().enumerate() {
        let start = T0 + 1_000_000 * (i as u64 + 1);
        clock.set(start);
        let k = key(&format!("ttl-{offset}"))?;
        complete_new(&engine, &k, "first")?;
        clock.set(start + offset);
        match engine.begin(&k, fp()?)? {
            Begin::Replay(r) if replays => assert_eq!(r.completed_at_ms, start),
            Begin::Claimed(c) if !replays => engine.complete(c, Envelope::new(1, 201, "second"))?,
            other => return Err(format!("TTL + {offset} ms: got {other:?}").into()),
        }
    }
    Ok(())
}

#[test]
fn clock_stepping_back_never_revives_a_lease() -> TestResult {
    let (engine, clock) = engine(ExpiryPolicy::Forget)?;

    // Judged by a begin.
    let k = key("backwards-begin")?;
    let mut holder = claimed(engine.begin(&k, fp()?)?)?;
    clock.set(T0 + LEASE_MS + 1);
    let answer = engine.begin(&k, fp()?)?;
    assert!(matches!(answer, Begin::InDoubt(_)), "got {answer:?}");
    clock.set(T0);
    for _ in 0..3 {
        let answer = engine.begin(&k, fp()?)?;
        assert!(
            matches!(answer, Begin::InDoubt(_)),
            "clock went back: {answer:?}"
        );
        assert_eq!(engine.sweep_now()?, SweepCounts::default());
    }
    assert_eq!(engine.record(&k)?.ok_or("missing")?.state, State::Unknown);
    let err = holder
        .extend(Duration::from_secs(60))
        .err()
        .ok_or("extend revived the lease")?;
    assert!(matches!(err, idempotency::Error::Fenced { .. }), "{err:?}");
    assert_eq!(engine.record(&k)?.ok_or("missing")?.state, State::Unknown);

    // Judged by a sweep.
    let k2 = key("backwards-sweep")?;
    clock.set(T0 + 50_000);
    let holder2 = claimed(engine.begin(&k2, fp()?)?)?;
    clock.set(T0 + 50_000 + LEASE_MS);
    assert_eq!(engine.sweep_now()?.moved_to_unknown, 1);
    clock.set(T0);
    let answer = engine.begin(&k2, fp()?)?;
    assert!(
        matches!(answer, Begin::InDoubt(_)),
        "clock went back: {answer:?}"
    );
    assert_eq!(engine.record(&k2)?.ok_or("missing")?.state, State::Unknown);
    drop((holder, holder2));
    Ok(())
}

#[test]
fn sweep_counts_match_what_was_done() -> TestResult {
    let (engine, clock) = engine(ExpiryPolicy::Forget)?;
    let mut holders = Vec::new();
    for i in 0..3 {
        holders.push(claimed(engine.begin(&key(&format!("stale-{i}"))?, fp()?)?)?);
    }
    for i in 0..4 {
        complete_new(&engine, &key(&format!("done-{i}"))?, "x")?;
    }
    // Not yet due: nothing happens.
    clock.advance(Duration::from_millis(LEASE_MS - 1));
    assert_eq!(engine.sweep_now()?, SweepCounts::default());
    // Leases run out, TTLs not yet.
    clock.advance(Duration::from_millis(1));
    let swept = engine.sweep_now()?;
    assert_eq!(
        (swept.moved_to_unknown, swept.deleted, swept.tombstoned),
        (3, 0, 0)
    );
    // A fresh record completed now must survive the next sweep.
    complete_new(&engine, &key("fresh")?, "x")?;
    clock.set(T0 + TTL_MS);
    let swept = engine.sweep_now()?;
    assert_eq!(
        (swept.moved_to_unknown, swept.deleted, swept.tombstoned),
        (0, 4, 0)
    );
    let stats = engine.stats()?;
    assert_eq!((stats.unknown, stats.completed), (3, 1));
    assert_eq!((stats.moved_to_unknown, stats.expired_deleted), (3, 4));
    drop(holders);
    Ok(())
}

#[test]
fn expiry_index_sweeps_ten_thousand_records() -> TestResult {
    const N: usize = 10_000;
    const THREADS: usize = 50;
    let dir = tempfile::tempdir()?;
    let clock = ManualClock::new(T0);
    let engine = Engine::builder()
        .clock(clock.clone())
        .ttl(Duration::from_millis(TTL_MS))
        .sweep_interval(None)
        .open(dir.path().join("idem.redb"))?;
    // Many threads so that claims and completes share group commits.
    std::thread::scope(|s| -> TestResult {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let engine = &engine;
                s.spawn(move || -> TestResult {
                    for i in (t..N).step_by(THREADS) {
                        complete_new(engine, &key(&format!("bulk-{i}"))?, "x")?;
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| "worker panicked")??;
        }
        Ok(())
    })?;
    assert_eq!(engine.stats()?.completed, N as u64);

    clock.advance(Duration::from_millis(TTL_MS - 1));
    assert_eq!(engine.sweep_now()?, SweepCounts::default());
    clock.advance(Duration::from_millis(1));
    let swept = engine.sweep_now()?;
    assert_eq!(swept.deleted, N as u64);
    assert!(!swept.more);
    let stats = engine.stats()?;
    assert_eq!(stats.completed, 0);
    assert_eq!(stats.expired_deleted, N as u64);
    assert_eq!(
        engine.sweep_now()?,
        SweepCounts::default(),
        "index left entries"
    );
    Ok(())
}
