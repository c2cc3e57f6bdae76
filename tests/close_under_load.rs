//! Dropping the engine while work is in flight: worker threads claim and
//! complete keys through an `Arc<Engine>` and the last of them to stop
//! drops the engine, while other threads keep extending (and dropping)
//! claims they hold, racing the close. Guards against a drop that hangs,
//! a caller left waiting, an answer that was a success but did not
//! commit, and a file not closed cleanly (a read-only open must not need
//! recovery). After the drop the file reopens with every acknowledged
//! claim, completion and lease extension.

use std::collections::BTreeMap;
use std::error::Error;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::{Begin, Claim, Engine, Envelope, Fingerprint, IdempotencyKey};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const WORKERS: usize = 4;
const EXTENDERS: usize = 3;

fn key(name: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("close", name)
}

fn fp(name: &str) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(format!(r#"{{"k":"{name}"}}"#).as_bytes(), &[])
}

fn open(path: &std::path::Path) -> Result<Engine, idempotency::OpenError> {
    Engine::builder()
        .lease(Duration::from_secs(3600))
        .sweep_interval(Some(Duration::from_millis(1)))
        .open(path)
}

#[derive(Default)]
struct Acks {
    claimed: BTreeMap<String, u64>,
    completed: BTreeMap<String, Vec<u8>>,
    /// Key -> the lease end of the last acknowledged extension.
    extended: BTreeMap<String, u64>,
}

fn round(seed: usize) -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.redb");
    let engine = Arc::new(open(&path)?);
    let acks = Mutex::new(Acks::default());
    let stop = &AtomicBool::new(false);
    let (tx, rx) = crossbeam_channel::unbounded::<(String, Claim)>();
    std::thread::scope(|s| -> TestResult {
        let extenders: Vec<_> = (0..EXTENDERS)
            .map(|_| {
                let (rx, acks) = (rx.clone(), &acks);
                s.spawn(move || -> TestResult {
                    let mut held: Vec<(String, Claim)> = Vec::new();
                    loop {
                        if let Ok(c) = rx.try_recv() {
                            held.push(c);
                        }
                        if held.is_empty() {
                            if rx.is_empty() && stop.load(Ordering::Acquire) {
                                return Ok(());
                            }
                            std::thread::yield_now();
                            continue;
                        }
                        let i = held.len() - 1;
                        let (name, claim) = &mut held[i];
                        match claim.extend(Duration::from_secs(7200)) {
                            Ok(()) => {
                                let until = claim.lease_until_ms();
                                acks.lock()
                                    .map_err(|_| "lock")?
                                    .extended
                                    .insert(name.clone(), until);
                            }
                            Err(idempotency::Error::Closed) => {
                                // The engine is gone: drop every claim (their
                                // notices go nowhere) and stop.
                                if stop.load(Ordering::Acquire) {
                                    held.clear();
                                    if rx.is_empty() {
                                        return Ok(());
                                    }
                                }
                            }
                            Err(e) => return Err(format!("extend {name}: {e}").into()),
                        }
                        if held.len() > 5 {
                            // Dropped without an outcome: a detached notice.
                            held.remove(0);
                        }
                    }
                })
            })
            .collect();
        let workers: Vec<_> = (0..WORKERS)
            .map(|t| {
                let (engine, tx, acks) = (engine.clone(), tx.clone(), &acks);
                s.spawn(move || -> TestResult {
                    for n in 0.. {
                        if stop.load(Ordering::Acquire) && n > 10 + seed % 7 {
                            break;
                        }
                        let name = format!("t{t}-{n}");
                        let Begin::Claimed(c) = engine.begin(&key(&name)?, fp(&name)?)? else {
                            return Err(format!("{name} not claimed").into());
                        };
                        acks.lock()
                            .map_err(|_| "lock")?
                            .claimed
                            .insert(name.clone(), c.fencing_token());
                        if n % 3 == 0 {
                            tx.send((name, c))?;
                            continue;
                        }
                        let body = format!("response {name}").into_bytes();
                        engine.complete(c, Envelope::new(1, 200, body.clone()))?;
                        acks.lock()
                            .map_err(|_| "lock")?
                            .completed
                            .insert(name, body);
                    }
                    // The last worker out drops the engine, under load.
                    drop(engine);
                    Ok(())
                })
            })
            .collect();
        drop(tx);
        std::thread::sleep(Duration::from_millis(20 + (seed as u64 * 37) % 80));
        stop.store(true, Ordering::Release);
        drop(engine);
        for w in workers {
            w.join().map_err(|_| "worker panicked")??;
        }
        for e in extenders {
            e.join().map_err(|_| "extender panicked")??;
        }
        Ok(())
    })?;
    let acks = acks.into_inner().map_err(|_| "lock")?;
    // Closed cleanly: a read-only open needs no recovery.
    drop(
        Engine::builder()
            .sweep_interval(None)
            .open_read_only(&path)?,
    );
    let engine = open(&path)?;
    for (name, token) in &acks.claimed {
        let rec = engine
            .record(&key(name)?)?
            .ok_or(format!("{name}: no record"))?;
        if rec.fencing_token != *token {
            return Err(format!("{name}: token {} != {token}", rec.fencing_token).into());
        }
        if let Some(body) = acks.completed.get(name) {
            match rec.response {
                Some(r) if &r.body == body => {}
                other => return Err(format!("{name}: completed, stored {other:?}").into()),
            }
        } else if let Some(&until) = acks.extended.get(name) {
            if rec.lease_until_ms.is_some_and(|l| l < until) {
                return Err(format!(
                    "{name}: extended to {until}, stored {:?}",
                    rec.lease_until_ms
                )
                .into());
            }
        }
    }
    Ok(())
}

#[test]
fn dropping_the_engine_under_load_returns_and_keeps_everything() -> TestResult {
    let rounds: usize = std::env::var("IDEMPOTENCY_CLOSE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    for seed in 0..rounds {
        round(seed)?;
    }
    Ok(())
}
