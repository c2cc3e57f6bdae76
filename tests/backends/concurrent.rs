//! Many callers racing on new keys: the atomic claim lets exactly one caller
//! run each key's work; everyone else sees it in progress or replays the one
//! stored result. On PostgreSQL also with two engines on one table prefix
//! (two processes of one service).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Barrier;

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey};

use super::support::*;

const THREADS: usize = 100;
const KEYS: usize = 200;

/// Per key: how often the work ran and how each caller was answered.
#[derive(Default)]
struct Tally {
    work: AtomicUsize,
    processing: AtomicUsize,
    replay: AtomicUsize,
    other: AtomicUsize,
}

/// Every thread calls `begin` on every key, all threads on the same key at
/// once (a barrier per key); a claim runs the work and completes.
fn race(engines: &[&Engine], keys: &[IdempotencyKey], fingerprint: Fingerprint) -> Vec<Tally> {
    let tallies: Vec<Tally> = keys.iter().map(|_| Tally::default()).collect();
    let barrier = Barrier::new(THREADS);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let engine = engines[t % engines.len()];
                let (barrier, tallies) = (&barrier, &tallies);
                s.spawn(move || -> idempotency::Result<()> {
                    for (key, tally) in keys.iter().zip(tallies) {
                        barrier.wait();
                        match engine.begin(key, fingerprint)? {
                            Begin::Claimed(claim) => {
                                let n = tally.work.fetch_add(1, Ordering::SeqCst) + 1;
                                let body =
                                    format!(r#"{{"payment":"{}","n":{n}}}"#, claim.reference());
                                engine.complete(claim, Envelope::new(1, 201, body))?;
                            }
                            Begin::Processing { retry_after } => {
                                assert!(!retry_after.is_zero(), "retry_after is never zero");
                                tally.processing.fetch_add(1, Ordering::SeqCst);
                            }
                            Begin::Replay(replay) => {
                                assert_eq!(replay.envelope.status, 201);
                                tally.replay.fetch_add(1, Ordering::SeqCst);
                            }
                            other => {
                                eprintln!("{key}: unexpected answer {other:?}");
                                tally.other.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            match h.join() {
                Ok(result) => result.expect("a racing caller failed"),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
    });
    tallies
}

/// Each key's work ran exactly once, every answer was one of the three a
/// race may give, and the one stored result replays.
fn check(
    engine: &Engine,
    keys: &[IdempotencyKey],
    fingerprint: Fingerprint,
    tallies: &[Tally],
) -> TestResult {
    for (key, t) in keys.iter().zip(tallies) {
        let work = t.work.load(Ordering::SeqCst);
        let processing = t.processing.load(Ordering::SeqCst);
        let replay_count = t.replay.load(Ordering::SeqCst);
        let other = t.other.load(Ordering::SeqCst);
        assert_eq!(work, 1, "{key}: the work ran {work} times");
        assert_eq!(
            other, 0,
            "{key}: {other} answers neither Processing nor Replay"
        );
        assert_eq!(work + processing + replay_count, THREADS, "{key}");

        let stored = replay(engine.begin(key, fingerprint)?)?;
        let body = String::from_utf8(stored.envelope.body)?;
        assert!(body.ends_with(r#","n":1}"#), "{key}: {body}");
        assert!(body.contains(&stored.reference), "{key}: {body}");
    }
    Ok(())
}

fn keys(prefix: &str) -> Result<Vec<IdempotencyKey>, idempotency::Error> {
    (0..KEYS).map(|i| key(&format!("{prefix}-{i}"))).collect()
}

both_backends! {
    /// 100 threads × 200 keys: each key's work runs once.
    fn hundred_threads_two_hundred_keys(h: &Harness) -> TestResult {
        // The default pool: 100 threads share it.
        let engine = h.open(Engine::builder().sweep_interval(None))?;
        let fingerprint = fp(10)?;
        let keys = keys("race")?;
        let tallies = race(&[&engine], &keys, fingerprint);
        check(&engine, &keys, fingerprint, &tallies)?;

        let stats = engine.stats()?;
        assert_eq!(stats.claims, KEYS as u64);
        assert_eq!(stats.completed, KEYS as u64);
        assert_eq!(stats.processing + stats.unknown + stats.corrupt, 0);
        Ok(())
    }
}

/// Two engines on one PostgreSQL prefix (as two processes of a service
/// would be), threads split between them: still one execution per key.
#[test]
fn postgres_two_engines_on_one_prefix() -> TestResult {
    two_engines_on_one_prefix(Backend::Postgres)
}

/// The same on one Redis key prefix: the guarded scripts of two engines
/// decide every key once.
#[test]
fn redis_two_engines_on_one_prefix() -> TestResult {
    two_engines_on_one_prefix(Backend::Redis)
}

fn two_engines_on_one_prefix(backend: Backend) -> TestResult {
    let Some(h) = Harness::new(backend) else {
        return Ok(());
    };
    let first = h.open(Engine::builder().sweep_interval(None))?;
    let second = h.open(Engine::builder().sweep_interval(None))?;
    let fingerprint = fp(10)?;
    let keys = keys("two-engines")?;
    let tallies = race(&[&first, &second], &keys, fingerprint);
    check(&first, &keys, fingerprint, &tallies)?;
    check(&second, &keys, fingerprint, &tallies)?;
    let (a, b) = (first.stats()?, second.stats()?);
    assert_eq!(a.claims + b.claims, KEYS as u64, "claims won across both");
    assert_eq!((a.completed, b.completed), (KEYS as u64, KEYS as u64));
    Ok(())
}
