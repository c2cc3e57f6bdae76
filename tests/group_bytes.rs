//! A burst of large responses is framed in groups of at most
//! `max_group_bytes` (plus the operation that reaches it), so no group can
//! outgrow a journal frame (4 GiB) and poison the engine; every
//! acknowledged response is still replayed, byte for byte, after a reopen.

use std::error::Error;
use std::sync::{Arc, Barrier};

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

type TestResult = Result<(), Box<dyn Error>>;

const GROUP_BYTES: usize = 64 << 10;
const BODY: usize = 40 << 10;
const THREADS: usize = 32;
const ROUNDS: usize = 4;

fn body(thread: usize, round: usize) -> Vec<u8> {
    let mut b = vec![b'a' + (thread % 26) as u8; BODY];
    b[..8].copy_from_slice(&(round as u64).to_le_bytes());
    b
}

fn key(thread: usize, round: usize) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("export:run", format!("t{thread}-r{round}"))
}

#[test]
fn large_responses_are_framed_within_max_group_bytes() -> TestResult {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install()?;

    let dir = tempfile::tempdir()?;
    let path = dir.path().join("groups.redb");
    let fp = Fingerprint::of_json(br#"{"export":1}"#, &[])?;
    let open = || {
        Engine::builder()
            .max_group_bytes(GROUP_BYTES)
            .max_response_bytes(BODY + 1024)
            .sweep_interval(None)
            .open(&path)
    };
    let engine = Arc::new(open()?);
    // All clients complete at once, so the writer finds many 40 KiB
    // completions queued together.
    let start = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (engine, start) = (engine.clone(), start.clone());
            std::thread::spawn(move || -> Result<(), String> {
                let mut failures = Vec::new();
                for r in 0..ROUNDS {
                    let begun = key(t, r).and_then(|k| engine.begin(&k, fp));
                    // Every client reaches every barrier, even one that
                    // failed, so a failure is reported and never hangs.
                    start.wait();
                    let outcome = match begun {
                        Ok(Begin::Claimed(claim)) => engine
                            .complete(claim, Envelope::new(1, 200, body(t, r)))
                            .map_err(|e| e.to_string()),
                        other => Err(format!("expected a claim, got {other:?}")),
                    };
                    if let Err(e) = outcome {
                        failures.push(format!("t{t}-r{r}: {e}"));
                    }
                }
                if failures.is_empty() {
                    Ok(())
                } else {
                    Err(failures.join("; "))
                }
            })
        })
        .collect();
    for h in handles {
        h.join().map_err(|_| "a client panicked")??;
    }

    let mut sizes = Vec::new();
    for (k, _, _, value) in snapshotter.snapshot().into_vec() {
        if k.key().name() == "idempotency_group_commit_bytes" {
            if let DebugValue::Histogram(samples) = value {
                sizes.extend(samples.into_iter().map(|s| s.into_inner() as usize));
            }
        }
    }
    let largest = sizes
        .iter()
        .copied()
        .max()
        .ok_or("no group sizes recorded")?;
    // A group stops taking completions once it holds GROUP_BYTES; the one
    // that reached it (a 40 KiB record with its key) is the last.
    let bound = GROUP_BYTES + BODY + 1024;
    assert!(
        largest <= bound,
        "a group of {largest} bytes, over {bound}: {sizes:?}"
    );
    // Some groups held two completions (the bound was exercised, not
    // dodged by groups of one).
    assert!(
        sizes.iter().any(|&s| s > BODY + 1024),
        "no group held two completions: {sizes:?}"
    );

    // Every acknowledged response comes back after a reopen, exactly.
    drop(Arc::try_unwrap(engine).map_err(|_| "engine still shared")?);
    let engine = open()?;
    for t in 0..THREADS {
        for r in 0..ROUNDS {
            match engine.begin(&key(t, r)?, fp)? {
                Begin::Replay(replay) => assert_eq!(replay.envelope.body, body(t, r)),
                other => return Err(format!("t{t}-r{r}: expected a replay, got {other:?}").into()),
            }
        }
    }
    Ok(())
}
