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

/// One racing `begin` (and, for the claim, its work and `complete`),
/// tallied; an answer a race may not give is an error.
fn one_call(
    engine: &Engine,
    key: &IdempotencyKey,
    fingerprint: Fingerprint,
    tally: &Tally,
) -> Result<(), String> {
    match engine.begin(key, fingerprint).map_err(|e| e.to_string())? {
        Begin::Claimed(claim) => {
            let n = tally.work.fetch_add(1, Ordering::SeqCst) + 1;
            let body = format!(r#"{{"payment":"{}","n":{n}}}"#, claim.reference());
            engine
                .complete(claim, Envelope::new(1, 201, body))
                .map_err(|e| e.to_string())?;
        }
        Begin::Processing { retry_after } => {
            if retry_after.is_zero() {
                return Err("retry_after is zero".to_string());
            }
            tally.processing.fetch_add(1, Ordering::SeqCst);
        }
        Begin::Replay(replay) => {
            if replay.envelope.status != 201 {
                return Err(format!("replayed status {}", replay.envelope.status));
            }
            tally.replay.fetch_add(1, Ordering::SeqCst);
        }
        other => {
            eprintln!("{key}: unexpected answer {other:?}");
            tally.other.fetch_add(1, Ordering::SeqCst);
        }
    }
    Ok(())
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
                s.spawn(move || -> Result<(), String> {
                    // A caller that fails keeps meeting the barrier, so
                    // the others never wait for it forever: the first
                    // failure is returned once every key has raced.
                    let mut failed = None;
                    for (key, tally) in keys.iter().zip(tallies) {
                        barrier.wait();
                        if failed.is_some() {
                            continue;
                        }
                        if let Err(e) = one_call(engine, key, fingerprint, tally) {
                            failed = Some(format!("{key}: {e}"));
                        }
                    }
                    failed.map_or(Ok(()), Err)
                })
            })
            .collect();
        let mut failures = Vec::new();
        for h in handles {
            match h.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => failures.push(e),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        assert!(failures.is_empty(), "racing callers failed: {failures:?}");
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
