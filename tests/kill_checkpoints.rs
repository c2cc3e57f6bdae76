//! SIGKILL while the journal wraps around: large responses (48-96 KiB) make
//! the writer checkpoint every 32 MiB of journal under load, so the kill
//! lands before, during and after checkpoints, while new frames overwrite
//! the previous cycle's frames from the start of the file. Eight child
//! threads claim and complete keys and log each acknowledged answer; the
//! parent kills the child at a random moment, reopens the file and checks
//! every acknowledged claim and completion (byte for byte).
//!
//! 3 rounds by default; `IDEMPOTENCY_KILL_CHECKPOINT_ROUNDS=50` for a long
//! run.
#![cfg(unix)]

#[path = "common/kill.rs"]
mod kill;

use std::collections::BTreeMap;
use std::error::Error;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const THREADS: usize = 8;

fn key(name: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("ckpt", name)
}

fn fp(name: &str) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(format!(r#"{{"k":"{name}"}}"#).as_bytes(), &[])
}

/// 48-96 KiB, different for every key.
fn body(name: &str) -> Vec<u8> {
    let seed = name.bytes().fold(0xCBF2_9CE4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    });
    let len = 48 * 1024 + (seed % (48 * 1024)) as usize;
    (0..len)
        .map(|i| (seed.rotate_left((i % 64) as u32) as u8) ^ (i as u8))
        .collect()
}

fn open(db: &Path) -> Result<Engine, idempotency::OpenError> {
    Engine::builder()
        .lease(Duration::from_secs(3600))
        .sweep_interval(None)
        .max_response_bytes(1 << 20)
        .open(db)
}

#[test]
fn child_entry() -> TestResult {
    let Some(kill::Child { db, round, log }) = kill::child()? else {
        return Ok(());
    };
    let engine = open(&db)?;
    kill::say_ready()?;
    kill::exit_if_never_killed();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (engine, log) = (&engine, &log);
            s.spawn(move || {
                let run = || -> TestResult {
                    for n in 0.. {
                        let name = format!("r{round}-t{t}-{n}");
                        let Begin::Claimed(c) = engine.begin(&key(&name)?, fp(&name)?)? else {
                            return Err(format!("{name} not claimed").into());
                        };
                        (&*log).write_all(
                            format!("claimed {name} {}\n", c.fencing_token()).as_bytes(),
                        )?;
                        engine.complete(c, Envelope::new(1, 200, body(&name)))?;
                        (&*log).write_all(format!("completed {name} -\n").as_bytes())?;
                    }
                    Ok(())
                };
                if let Err(e) = run() {
                    eprintln!("worker {t}: {e}");
                    std::process::exit(3);
                }
            });
        }
    });
    Err("workers stopped".into())
}

#[test]
fn sigkill_across_journal_checkpoints_loses_nothing_acknowledged() -> TestResult {
    let rounds: u64 = std::env::var("IDEMPOTENCY_KILL_CHECKPOINT_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("idem.redb");
    let mut seed = kill::time_seed()?;
    let mut claimed: BTreeMap<String, u64> = BTreeMap::new();
    let mut completed: Vec<String> = Vec::new();
    let mut fails = Vec::new();
    for round in 0..rounds {
        let log = dir.path().join(format!("acks-{round}.log"));
        let stderr = dir.path().join(format!("child-{round}.stderr"));
        let delay;
        (seed, delay) = kill::next_delay(seed, 150, 600);
        kill::kill_round(round, &db, &log, &stderr, delay)?;
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let whole = text.rsplit_once('\n').map_or("", |(done, _)| done);
        let mut names = Vec::new();
        for l in whole.lines() {
            match l.split(' ').collect::<Vec<_>>().as_slice() {
                ["claimed", name, token] => {
                    claimed.insert(name.to_string(), token.parse()?);
                    names.push(name.to_string());
                }
                ["completed", name, _] => completed.push(name.to_string()),
                _ => return Err(format!("bad line {l:?}").into()),
            }
        }
        let journal_len = std::fs::metadata(dir.path().join("idem.redb.journal"))?.len();
        let engine = Engine::builder()
            .sweep_interval(None)
            .max_response_bytes(1 << 20)
            .open_existing(&db)?;
        let done: std::collections::BTreeSet<&String> = completed.iter().collect();
        for name in &names {
            let rec = engine.record(&key(name)?)?;
            match rec {
                Some(r) if r.fencing_token == claimed[name] => {
                    if done.contains(name)
                        && r.response.as_ref().map(|e| &e.body) != Some(&body(name))
                    {
                        fails.push(format!("round {round}: {name}: completion lost or changed"));
                    }
                }
                other => fails.push(format!(
                    "round {round}: {name}: acked claim, record {:?}",
                    other.map(|r| (r.state, r.fencing_token))
                )),
            }
        }
        println!(
            "round {round}: {} claims acked, journal {} MiB",
            names.len(),
            journal_len >> 20
        );
        drop(engine);
    }
    let engine = Engine::builder()
        .sweep_interval(None)
        .max_response_bytes(1 << 20)
        .open_existing(&db)?;
    for name in &completed {
        match engine.begin(&key(name)?, fp(name)?)? {
            Begin::Replay(r) if r.envelope.body == body(name) => {}
            other => fails.push(format!(
                "final: {name}: {:?}",
                std::mem::discriminant(&other)
            )),
        }
    }
    assert!(engine.verify()?.is_sound());
    assert!(
        fails.is_empty(),
        "{} failures: {:#?}",
        fails.len(),
        &fails[..fails.len().min(10)]
    );
    Ok(())
}
