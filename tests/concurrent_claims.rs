//! Guards against a double execution when many callers race on one new key:
//! the atomic claim must let exactly one caller run the work, and every other
//! caller must see it as in progress or replay its result, never a second
//! claim, an UNKNOWN or a mismatch. Also checks at compile time that the
//! engine handle can be shared across threads and a claim moved between them.

use std::error::Error;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Barrier;

use idempotency::{Begin, Claim, Engine, Envelope, Fingerprint, IdempotencyKey};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const THREADS: usize = 100;
const KEYS: usize = 200;

#[test]
fn engine_and_claim_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Engine>();
    send_sync::<Claim>();
    send::<Begin>();
    send_sync::<idempotency::Error>();
}

/// Per key: how often the work ran and how each caller was answered.
#[derive(Default)]
struct Tally {
    work: AtomicUsize,
    claimed: AtomicUsize,
    in_progress: AtomicUsize,
    replay: AtomicUsize,
    other: AtomicUsize,
}

#[test]
fn hundred_threads_one_key_work_runs_once() -> TestResult {
    let dir = tempfile::tempdir()?;
    let engine = Engine::builder()
        .sweep_interval(None)
        .open(dir.path().join("idem.redb"))?;
    let fingerprint = Fingerprint::of_json(br#"{"amount": 10, "currency": "EUR"}"#, &[])?;
    let keys = (0..KEYS)
        .map(|i| IdempotencyKey::new("tenant-1:create_payment", format!("race-{i}")))
        .collect::<Result<Vec<_>, _>>()?;
    let tallies: Vec<Tally> = (0..KEYS).map(|_| Tally::default()).collect();
    let barrier = Barrier::new(THREADS);

    std::thread::scope(|s| -> TestResult {
        let handles: Vec<_> = (0..THREADS)
            .map(|_| {
                s.spawn(|| -> Result<(), idempotency::Error> {
                    for (key, tally) in keys.iter().zip(&tallies) {
                        barrier.wait();
                        match engine.begin(key, fingerprint)? {
                            Begin::Claimed(claim) => {
                                tally.claimed.fetch_add(1, Ordering::SeqCst);
                                let n = tally.work.fetch_add(1, Ordering::SeqCst) + 1;
                                let body =
                                    format!(r#"{{"payment":"{}","n":{n}}}"#, claim.reference());
                                engine.complete(claim, Envelope::new(1, 201, body))?;
                            }
                            Begin::Processing { retry_after } => {
                                assert!(!retry_after.is_zero(), "retry_after is never zero");
                                tally.in_progress.fetch_add(1, Ordering::SeqCst);
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
            h.join().map_err(|_| "worker thread panicked")??;
        }
        Ok(())
    })?;

    for (key, t) in keys.iter().zip(&tallies) {
        let work = t.work.load(Ordering::SeqCst);
        let claimed = t.claimed.load(Ordering::SeqCst);
        let in_progress = t.in_progress.load(Ordering::SeqCst);
        let replay = t.replay.load(Ordering::SeqCst);
        let other = t.other.load(Ordering::SeqCst);
        assert_eq!(work, 1, "{key}: work ran {work} times");
        assert_eq!(claimed, 1, "{key}: {claimed} claims");
        assert_eq!(
            other, 0,
            "{key}: {other} answers neither InProgress nor Replay"
        );
        assert_eq!(claimed + in_progress + replay, THREADS, "{key}");

        // Afterwards every caller replays the one stored response.
        let stored = match engine.begin(key, fingerprint)? {
            Begin::Replay(r) => r,
            other => return Err(format!("{key}: expected a replay, got {other:?}").into()),
        };
        let body = String::from_utf8(stored.envelope.body)?;
        assert!(body.ends_with(r#","n":1}"#), "{key}: {body}");
        assert!(body.contains(&stored.reference), "{key}: {body}");
    }
    let stats = engine.stats()?;
    assert_eq!(stats.claims, KEYS as u64);
    assert_eq!(stats.completed, KEYS as u64);
    assert_eq!(stats.processing + stats.unknown + stats.corrupt, 0);
    Ok(())
}

/// The same race on keys that went UNKNOWN: every caller's `begin` asks the
/// resolver, which says the work never ran; exactly one caller may claim it
/// afresh.
#[test]
fn hundred_threads_recovering_one_unknown_key_work_runs_once() -> TestResult {
    use idempotency::{InDoubt, ManualClock, Resolution};
    use std::time::Duration;

    const ROUNDS: usize = 20;
    let clock = ManualClock::new(1_700_000_000_000);
    let engine = Engine::builder()
        .clock(clock.clone())
        .lease(Duration::from_secs(1))
        .sweep_interval(None)
        .resolver(|_: &InDoubt| Resolution::NotExecuted)
        .in_memory()?;
    let fingerprint = Fingerprint::of_json(br#"{"amount": 10}"#, &[])?;
    let barrier = Barrier::new(THREADS);
    for round in 0..ROUNDS {
        let key = IdempotencyKey::new("tenant-1:create_payment", format!("recover-{round}"))?;
        // A crashed holder: claimed, lease ran out.
        let old = match engine.begin(&key, fingerprint)? {
            Begin::Claimed(c) => c,
            other => return Err(format!("expected Claimed, got {other:?}").into()),
        };
        clock.advance(Duration::from_secs(2));
        let tally = Tally::default();
        std::thread::scope(|s| -> TestResult {
            let handles: Vec<_> = (0..THREADS)
                .map(|_| {
                    s.spawn(|| -> Result<(), idempotency::Error> {
                        barrier.wait();
                        match engine.begin(&key, fingerprint)? {
                            Begin::Claimed(claim) => {
                                tally.work.fetch_add(1, Ordering::SeqCst);
                                engine.complete(claim, Envelope::new(1, 201, "recovered"))?;
                            }
                            Begin::Processing { .. } => {
                                tally.in_progress.fetch_add(1, Ordering::SeqCst);
                            }
                            Begin::Replay(_) => {
                                tally.replay.fetch_add(1, Ordering::SeqCst);
                            }
                            other => {
                                eprintln!("{key}: unexpected answer {other:?}");
                                tally.other.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            for h in handles {
                h.join().map_err(|_| "worker thread panicked")??;
            }
            Ok(())
        })?;
        assert_eq!(
            tally.work.load(Ordering::SeqCst),
            1,
            "{key}: work ran more than once"
        );
        assert_eq!(tally.other.load(Ordering::SeqCst), 0, "{key}");
        let err = engine.complete(old, Envelope::new(1, 201, "old holder"));
        assert!(
            matches!(err, Err(idempotency::Error::Fenced { .. })),
            "{err:?}"
        );
    }
    Ok(())
}
