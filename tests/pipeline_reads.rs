//! Read-your-writes across threads on the pipelined journal writer: the
//! writer keeps one redb write transaction open across group commits, the
//! syncer puts synced values in an overlay, and the writer commits and
//! empties the overlay every few groups. Guards against a reader that
//! misses a write acknowledged before it started (a stale read between the
//! redb commit and the overlay's clear, a deletion the overlay does not
//! carry, an outbox or recovery listing that does not ask for a commit):
//!
//! - thread A completes a key, thread B's `begin` must replay it;
//! - A purges a completed key, B must find no record and claim it afresh;
//! - A moves an entity, B must read the new state;
//! - a relay's `take` after `mark_published` must not return those messages,
//!   and sequence numbers come out in order, each once;
//! - A drops a claim and flushes, B's `in_doubt` must list it.
//!
//! `IDEMPOTENCY_PIPELINE_ROUNDS` scales the run (default 150 per thread).

use std::collections::BTreeSet;
use std::error::Error;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency::{
    Begin, Engine, Envelope, Fingerprint, IdempotencyKey, OutgoingMessage, PurgeMode, Transition,
};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const PRODUCERS: usize = 4;

fn rounds() -> usize {
    std::env::var("IDEMPOTENCY_PIPELINE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(150)
}

fn key(name: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("pipeline", name)
}

fn fp(name: &str) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(format!(r#"{{"k":"{name}"}}"#).as_bytes(), &[])
}

fn body(name: &str) -> Vec<u8> {
    format!("response of {name}").into_bytes()
}

fn open(dir: &std::path::Path) -> Result<Engine, idempotency::OpenError> {
    Engine::builder()
        .lease(Duration::from_secs(3600))
        .sweep_interval(None)
        .open(dir.join("idem.redb"))
}

/// What a producer did, for the checker thread to read back at once.
enum Done {
    Completed(String),
    Purged(String),
    Moved(String, String),
    Dropped(String),
}

fn produce(engine: &Engine, t: usize, tx: &crossbeam_channel::Sender<Done>) -> TestResult {
    for n in 0..rounds() {
        let name = format!("t{t}-n{n}");
        let Begin::Claimed(claim) = engine.begin(&key(&name)?, fp(&name)?)? else {
            return Err(format!("{name}: fresh key not claimed").into());
        };
        match n % 5 {
            0 | 1 => {
                engine.complete(claim, Envelope::new(1, 200, body(&name)))?;
                tx.send(Done::Completed(name))?;
            }
            2 => {
                engine.complete(claim, Envelope::new(1, 200, body(&name)))?;
                engine.purge(&key(&name)?, PurgeMode::FinishedOnly)?;
                tx.send(Done::Purged(name))?;
            }
            3 => {
                let msg = OutgoingMessage::new("topic", name.clone().into_bytes());
                engine.complete_with_messages(
                    claim,
                    Envelope::new(1, 200, body(&name)),
                    vec![msg],
                )?;
                let entity = format!("e-{name}");
                let to = format!("s{n}");
                match engine.transition(&entity, &[], &to)? {
                    Transition::Applied { .. } => {}
                    other => return Err(format!("{entity}: {other:?}").into()),
                }
                tx.send(Done::Moved(entity, to))?;
            }
            _ => {
                drop(claim);
                engine.flush()?;
                tx.send(Done::Dropped(name))?;
            }
        }
    }
    Ok(())
}

fn check(engine: &Engine, done: Done) -> TestResult {
    match done {
        Done::Completed(name) => match engine.begin(&key(&name)?, fp(&name)?)? {
            Begin::Replay(r) if r.envelope.body == body(&name) => {}
            other => return Err(format!("{name} completed, another thread saw {other:?}").into()),
        },
        Done::Purged(name) => {
            if let Some(info) = engine.record(&key(&name)?)? {
                return Err(format!("{name} purged, another thread saw {:?}", info.state).into());
            }
            match engine.begin(&key(&name)?, fp(&name)?)? {
                Begin::Claimed(c) => engine.complete(c, Envelope::new(1, 200, body(&name)))?,
                other => return Err(format!("{name} purged, begin answered {other:?}").into()),
            }
        }
        Done::Moved(entity, to) => match engine.entity_state(&entity)? {
            Some((state, _)) if state == to => {}
            other => return Err(format!("{entity} moved to {to}, read {other:?}").into()),
        },
        Done::Dropped(name) => {
            let listed = engine.in_doubt(100_000)?;
            if !listed.iter().any(|d| d.key == key(&name).expect("valid")) {
                return Err(format!("{name} dropped and flushed, not in doubt").into());
            }
        }
    }
    Ok(())
}

/// Takes, checks and marks published until told to stop and the outbox is
/// empty: every `seq` comes once, in increasing order, and never again
/// after `mark_published` returned.
fn relay(engine: &Engine, stop: &AtomicBool) -> Result<usize, Box<dyn Error + Send + Sync>> {
    let mut published = BTreeSet::new();
    let mut last = 0;
    loop {
        let stopping = stop.load(Ordering::Acquire);
        let batch = engine.outbox().take(64)?;
        if batch.is_empty() && stopping {
            return Ok(published.len());
        }
        let mut seqs = Vec::new();
        for entry in &batch {
            if published.contains(&entry.seq) {
                return Err(format!("seq {} taken again after mark_published", entry.seq).into());
            }
            if entry.seq <= last {
                return Err(format!("seq {} after seq {last}", entry.seq).into());
            }
            last = entry.seq;
            seqs.push(entry.seq);
        }
        if !seqs.is_empty() {
            engine.outbox().mark_published(&seqs)?;
            published.extend(seqs);
        }
        std::thread::yield_now();
    }
}

#[test]
fn every_reader_sees_every_write_acknowledged_before_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let engine = Arc::new(open(dir.path())?);
    let (tx, rx) = crossbeam_channel::unbounded();
    let stop = AtomicBool::new(false);
    let published = std::thread::scope(|s| -> Result<usize, Box<dyn Error + Send + Sync>> {
        let relay = s.spawn(|| relay(&engine, &stop));
        let checkers: Vec<_> = (0..2)
            .map(|_| {
                let rx = rx.clone();
                let engine = &engine;
                s.spawn(move || -> TestResult {
                    for done in rx {
                        check(engine, done)?;
                    }
                    Ok(())
                })
            })
            .collect();
        let producers: Vec<_> = (0..PRODUCERS)
            .map(|t| {
                let tx = tx.clone();
                let engine = &engine;
                s.spawn(move || produce(engine, t, &tx))
            })
            .collect();
        drop(tx);
        let mut result = Ok(());
        for p in producers {
            result = result.and(p.join().map_err(|_| "producer panicked")?);
        }
        for c in checkers {
            result = result.and(c.join().map_err(|_| "checker panicked")?);
        }
        stop.store(true, Ordering::Release);
        let published = relay.join().map_err(|_| "relay panicked")??;
        result.map(|()| published)
    })?;
    let expected = (0..rounds()).filter(|n| n % 5 == 3).count() * PRODUCERS;
    assert_eq!(published, expected, "every message published once");
    Ok(())
}

/// Records a sweep deletes or tombstones (the sweeper's writes go through
/// the same pipelined path): right after `sweep_now` returns, a point read
/// sees the deletion or the tombstone, not the record the open transaction
/// replaced, and a stale lease moved to UNKNOWN reads as UNKNOWN; the
/// recovery listing agrees at once.
#[test]
fn what_a_sweep_changed_is_what_every_read_sees() -> TestResult {
    use idempotency::{ExpiryPolicy, ManualClock, State};
    for policy in [
        ExpiryPolicy::Forget,
        ExpiryPolicy::Tombstone {
            keep: Duration::from_secs(60),
        },
    ] {
        let dir = tempfile::tempdir()?;
        let clock = ManualClock::new(1_000_000);
        let engine = Engine::builder()
            .clock(clock.clone())
            .ttl(Duration::from_secs(10))
            .lease(Duration::from_secs(5))
            .expiry_policy(policy)
            .sweep_interval(None)
            .open(dir.path().join("idem.redb"))?;
        let mut stale = Vec::new();
        for i in 0..40 {
            let name = format!("k{i}");
            let Begin::Claimed(c) = engine.begin(&key(&name)?, fp(&name)?)? else {
                return Err(format!("{name} not claimed").into());
            };
            if i % 2 == 0 {
                engine.complete(c, Envelope::new(1, 200, body(&name)))?;
            } else {
                stale.push(c);
            }
        }
        clock.advance(Duration::from_secs(11));
        let swept = engine.sweep_now()?;
        assert!(swept.moved_to_unknown == 20, "{swept:?}");
        for i in 0..40 {
            let name = format!("k{i}");
            let info = engine.record(&key(&name)?)?;
            let state = info.as_ref().map(|r| r.state);
            let want = match (i % 2, policy) {
                (1, _) => Some(State::Unknown),
                (_, ExpiryPolicy::Forget) => None,
                _ => Some(State::Tombstone),
            };
            assert_eq!(state, want, "{name} under {policy:?} after the sweep");
        }
        assert_eq!(engine.in_doubt(1000)?.len(), 20);
        drop(stale);
    }
    Ok(())
}

/// `Engine::flush` "waits until every write queued before this call has
/// committed durably, including the notices of dropped claims". A dropped
/// claim's notice is sent without waiting; with the writer's queue full
/// (a small `queue_capacity`, busy threads) it is dropped on the floor, and
/// the claim is not in doubt after `flush` (only once its lease ends).
#[test]
fn a_dropped_claim_is_in_doubt_after_flush_even_with_a_full_queue() -> TestResult {
    let dir = tempfile::tempdir()?;
    let engine = Engine::builder()
        .lease(Duration::from_secs(3600))
        .sweep_interval(None)
        .queue_capacity(2)
        .open(dir.path().join("idem.redb"))?;
    let stop = AtomicBool::new(false);
    let missing = std::thread::scope(|s| -> Result<Vec<String>, Box<dyn Error + Send + Sync>> {
        for t in 0..6 {
            let (engine, stop) = (&engine, &stop);
            s.spawn(move || -> TestResult {
                for n in 0.. {
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    let name = format!("busy-{t}-{n}");
                    if let Begin::Claimed(c) = engine.begin(&key(&name)?, fp(&name)?)? {
                        engine.complete(c, Envelope::new(1, 200, body(&name)))?;
                    }
                }
                Ok(())
            });
        }
        let mut missing = Vec::new();
        for i in 0..100 {
            let name = format!("dropped-{i}");
            drop(engine.begin(&key(&name)?, fp(&name)?)?);
            engine.flush()?;
            let k = key(&name)?;
            if !engine.in_doubt(100_000)?.iter().any(|d| d.key == k) {
                missing.push(name);
            }
        }
        stop.store(true, Ordering::Release);
        Ok(missing)
    })?;
    assert!(
        missing.is_empty(),
        "{} of 100 dropped claims not in doubt after flush: {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    Ok(())
}

/// Monotonic reads under the writer's commit and overlay clear: one thread
/// moves an entity through states s1, s2, ... and extends a claim's lease
/// again and again, publishing each acknowledged version; reader threads
/// must never see less than what was acknowledged before their read
/// started, nor go backwards between two of their own reads.
#[test]
fn reads_never_go_back_across_commits() -> TestResult {
    use std::sync::atomic::AtomicU64;
    let dir = tempfile::tempdir()?;
    let engine = open(dir.path())?;
    let acked_version = AtomicU64::new(0);
    let acked_lease = AtomicU64::new(0);
    let done = AtomicBool::new(false);
    let k = key("leased")?;
    let Begin::Claimed(mut claim) = engine.begin(&k, fp("leased")?)? else {
        return Err("not claimed".into());
    };
    let steps = rounds();
    std::thread::scope(|s| -> TestResult {
        let readers: Vec<_> = (0..3)
            .map(|_| {
                let (engine, k) = (&engine, &k);
                let (acked_version, acked_lease, done) = (&acked_version, &acked_lease, &done);
                s.spawn(move || -> TestResult {
                    let (mut last_v, mut last_l) = (0, 0);
                    while !done.load(Ordering::Acquire) {
                        let want_v = acked_version.load(Ordering::Acquire);
                        let want_l = acked_lease.load(Ordering::Acquire);
                        let v = engine.entity_state("mono")?.map_or(0, |(_, v)| v);
                        let l = engine
                            .record(k)?
                            .and_then(|r| r.lease_until_ms)
                            .unwrap_or(0);
                        if v < want_v.max(last_v) || l < want_l.max(last_l) {
                            return Err(format!(
                                "read version {v} lease {l}, acknowledged {want_v}/{want_l}, \
                                 read before {last_v}/{last_l}"
                            )
                            .into());
                        }
                        (last_v, last_l) = (v, l);
                    }
                    Ok(())
                })
            })
            .collect();
        let mut result = Ok(());
        for i in 1..=steps as u64 {
            let from = format!("s{}", i - 1);
            let froms: Vec<&str> = if i == 1 { vec![] } else { vec![&from] };
            match engine.transition("mono", &froms, &format!("s{i}")) {
                Ok(Transition::Applied { version }) => {
                    acked_version.store(version, Ordering::Release)
                }
                other => {
                    result = Err(format!("transition {i}: {other:?}").into());
                    break;
                }
            }
            if let Err(e) = claim.extend(Duration::from_secs(3600 + i)) {
                result = Err(e.into());
                break;
            }
            acked_lease.store(claim.lease_until_ms(), Ordering::Release);
        }
        done.store(true, Ordering::Release);
        for r in readers {
            result = result.and(r.join().map_err(|_| "reader panicked")?);
        }
        result
    })?;
    engine.complete(claim, Envelope::new(1, 200, "done"))?;
    Ok(())
}
