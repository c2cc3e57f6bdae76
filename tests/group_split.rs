//! Groups split by `max_group_bytes` on the journaled writer, attacked:
//!
//! - a 1-byte bound (every operation its own frame) under many concurrent
//!   callers mixing claims, completions, failures, purges, transitions,
//!   completions with messages and whole-table reads (which commit the
//!   open transaction): every caller gets exactly one answer, nothing
//!   hangs, and everything acknowledged is there, byte for byte, after a
//!   reopen;
//! - SIGKILL while bursts of large responses with headers are being split
//!   into frames: after a reopen every acknowledged completion replays
//!   byte for byte and no acknowledged claim can be claimed again.
#![cfg(unix)]

#[path = "common/kill.rs"]
mod kill;

use std::collections::{BTreeMap, BTreeSet};
use std::error::Error;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency::{
    Begin, Engine, Envelope, Failure, Fingerprint, IdempotencyKey, OutgoingMessage, PurgeMode,
    RecordFilter, State, Transition,
};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

fn key(name: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("split", name)
}

fn fp(name: &str) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(format!(r#"{{"k":"{name}"}}"#).as_bytes(), &[])
}

/// A deterministic envelope for `name`, `len` body bytes, with headers.
fn envelope(name: &str, len: usize) -> Envelope {
    let mut seed = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let body: Vec<u8> = (0..len)
        .map(|_| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (seed >> 56) as u8
        })
        .collect();
    Envelope::new(1, 201, body)
        .with_header("content-type", "application/octet-stream")
        .with_header("x-name", name.as_bytes().to_vec())
        .with_header("x-empty", Vec::new())
}

#[test]
fn one_byte_groups_under_concurrent_mixed_ops_answer_everyone() -> TestResult {
    const THREADS: usize = 16;
    const OPS: usize = 60;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("tiny.redb");
    let open = || {
        Engine::builder()
            .max_group_bytes(1)
            .lease(Duration::from_secs(3600))
            .sweep_interval(None)
            .open(&path)
    };
    let engine = Arc::new(open()?);
    let answered = Arc::new(AtomicUsize::new(0));
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    for t in 0..THREADS {
        let (engine, answered, done_tx) = (engine.clone(), answered.clone(), done_tx.clone());
        std::thread::spawn(move || {
            let result = (|| -> Result<Vec<(String, &'static str)>, String> {
                let mut acked = Vec::new();
                let entity = format!("ent-{t}");
                let mut version = 0;
                for n in 0..OPS {
                    let name = format!("t{t}-{n}");
                    let k = key(&name).map_err(|e| e.to_string())?;
                    let f = fp(&name).map_err(|e| e.to_string())?;
                    let Begin::Claimed(claim) = engine.begin(&k, f).map_err(|e| e.to_string())?
                    else {
                        return Err(format!("{name}: fresh key not claimed"));
                    };
                    answered.fetch_add(1, Ordering::SeqCst);
                    match n % 6 {
                        0 | 5 => {
                            engine
                                .complete(claim, envelope(&name, 100 + n * 37))
                                .map_err(|e| format!("{name}: {e}"))?;
                            acked.push((name, "completed"));
                        }
                        1 => {
                            engine
                                .complete_with_messages(
                                    claim,
                                    envelope(&name, 3000),
                                    vec![OutgoingMessage::new("topic", name.clone().into_bytes())],
                                )
                                .map_err(|e| format!("{name}: {e}"))?;
                            acked.push((name, "completed"));
                        }
                        2 => {
                            engine
                                .fail(
                                    claim,
                                    Failure::InDoubt {
                                        reason: "timeout".into(),
                                    },
                                )
                                .map_err(|e| format!("{name}: {e}"))?;
                            acked.push((name, "unknown"));
                        }
                        3 => {
                            engine
                                .complete(claim, envelope(&name, 10))
                                .map_err(|e| format!("{name}: {e}"))?;
                            engine
                                .purge(&k, PurgeMode::FinishedOnly)
                                .map_err(|e| format!("{name}: {e}"))?;
                            acked.push((name, "purged"));
                        }
                        _ => {
                            drop(claim);
                            let from = format!("s{version}");
                            let to = format!("s{}", version + 1);
                            let froms: Vec<&str> = if version == 0 { vec![] } else { vec![&from] };
                            match engine
                                .transition(&entity, &froms, &to)
                                .map_err(|e| e.to_string())?
                            {
                                Transition::Applied { version: v } if v == version + 1 => {
                                    version = v;
                                }
                                other => return Err(format!("{entity}: {other:?}")),
                            }
                            // A whole-table read commits the open transaction.
                            engine
                                .records(&RecordFilter::default())
                                .map_err(|e| e.to_string())?;
                        }
                    }
                    answered.fetch_add(1, Ordering::SeqCst);
                }
                Ok(acked)
            })();
            // The engine handle goes before the answer, so the main
            // thread can take the engine back once every answer is in.
            drop(engine);
            let _ = done_tx.send(result);
        });
    }
    drop(done_tx);
    let mut acked = Vec::new();
    for _ in 0..THREADS {
        let result = done_rx
            .recv_timeout(Duration::from_secs(120))
            .map_err(|_| format!("a caller hung: {} answers", answered.load(Ordering::SeqCst)))?;
        acked.extend(result?);
    }
    assert!(engine.poisoned().is_none());
    let report = engine.verify()?;
    assert!(report.damage.is_empty(), "{report:?}");

    drop(Arc::try_unwrap(engine).map_err(|_| "engine still shared")?);
    let engine = open()?;
    let mut messages = BTreeSet::new();
    for e in engine.outbox().take(10_000)? {
        messages.insert(String::from_utf8(e.payload)?);
    }
    for (name, what) in &acked {
        let record = engine.record(&key(name)?)?;
        match *what {
            "completed" => {
                let Begin::Replay(replay) = engine.begin(&key(name)?, fp(name)?)? else {
                    return Err(format!("{name}: completed, not replayed: {record:?}").into());
                };
                let n: usize = name.rsplit('-').next().ok_or("name")?.parse()?;
                let len = if n % 6 == 1 { 3000 } else { 100 + n * 37 };
                assert_eq!(replay.envelope, envelope(name, len), "{name}");
            }
            "unknown" => assert_eq!(record.map(|r| r.state), Some(State::Unknown), "{name}"),
            "purged" => assert!(record.is_none(), "{name} purged, still {record:?}"),
            _ => {}
        }
        let n: usize = name.rsplit('-').next().ok_or("name")?.parse()?;
        if n % 6 == 1 {
            assert!(messages.contains(name), "{name}: message lost");
        }
    }
    for t in 0..THREADS {
        let version = engine.entity_state(&format!("ent-{t}"))?.map(|(_, v)| v);
        assert_eq!(version, Some((OPS as u64).div_ceil(6)), "ent-{t}");
    }
    Ok(())
}

const KILL_WORKERS: usize = 6;

fn kill_open(db: &Path) -> Result<Engine, idempotency::OpenError> {
    Engine::builder()
        .max_group_bytes(48 << 10)
        .max_response_bytes(1 << 20)
        .lease(Duration::from_secs(3600))
        .sweep_interval(None)
        .open(db)
}

fn kill_len(name: &str) -> usize {
    let h = name.bytes().fold(7_usize, |h, b| {
        h.wrapping_mul(31).wrapping_add(usize::from(b))
    });
    20_000 + h % 200_000
}

fn append(mut log: &File, line: String) -> std::io::Result<()> {
    log.write_all(format!("{line}\n").as_bytes())
}

#[test]
fn child_entry() -> TestResult {
    let Some(kill::Child { db, round, log }) = kill::child()? else {
        return Ok(());
    };
    let engine = kill_open(&db)?;
    kill::say_ready()?;
    kill::exit_if_never_killed();
    std::thread::scope(|s| {
        for t in 0..KILL_WORKERS {
            let (engine, log) = (&engine, &log);
            s.spawn(move || {
                let work = || -> TestResult {
                    for n in 0.. {
                        let name = format!("r{round}-t{t}-{n}");
                        let Begin::Claimed(claim) = engine.begin(&key(&name)?, fp(&name)?)? else {
                            return Err(format!("{name}: fresh key not claimed").into());
                        };
                        append(log, format!("claimed {name}"))?;
                        engine.complete(claim, envelope(&name, kill_len(&name)))?;
                        append(log, format!("completed {name}"))?;
                    }
                    Ok(())
                };
                if let Err(e) = work() {
                    eprintln!("worker {t}: {e}");
                    std::process::exit(3);
                }
            });
        }
    });
    Err("the child's workers stopped".into())
}

#[test]
fn kill_while_large_responses_are_split_loses_no_acknowledged_completion() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("kill.redb");
    let log = dir.path().join("acks.log");
    let stderr = dir.path().join("stderr.txt");
    let mut seed = kill::time_seed()?;
    for round in 0..4 {
        let delay;
        (seed, delay) = kill::next_delay(seed, 300, 700);
        kill::kill_round(round, &db, &log, &stderr, delay)?;
        let mut claimed = BTreeSet::new();
        let mut completed = BTreeMap::new();
        for line in BufReader::new(File::open(&log)?).lines() {
            let line = line?;
            match line.split_once(' ') {
                Some(("claimed", name)) => {
                    claimed.insert(name.to_owned());
                }
                Some(("completed", name)) => {
                    completed.insert(name.to_owned(), ());
                }
                _ => {} // a line cut by the kill
            }
        }
        let engine = kill_open(&db)?;
        for name in completed.keys() {
            match engine.begin(&key(name)?, fp(name)?)? {
                Begin::Replay(replay) => assert_eq!(
                    replay.envelope,
                    envelope(name, kill_len(name)),
                    "round {round}: {name}"
                ),
                other => {
                    return Err(format!("round {round}: {name} completed, now {other:?}").into())
                }
            }
        }
        for name in claimed.iter().filter(|n| !completed.contains_key(*n)) {
            if let Begin::Claimed(_) = engine.begin(&key(name)?, fp(name)?)? {
                return Err(format!("round {round}: {name} claimed again").into());
            }
        }
        let report = engine.verify()?;
        assert!(report.damage.is_empty(), "round {round}: {report:?}");
        assert!(
            completed.len() > 5,
            "round {round}: only {} completions",
            completed.len()
        );
    }
    Ok(())
}

const FAULT_VAR: &str = "IDEMPOTENCY_SPLIT_FAULT_DIR";
/// The fault child's file-size limit, in KiB (bash's `ulimit -f` unit).
const FAULT_LIMIT_KIB: u32 = 6 * 1024;

/// Entry point of the file-size-limited child; a no-op in the normal run.
/// Eight callers complete 200 KiB responses at once, split into frames of
/// about 64 KiB, until the journal cannot grow: every caller must get an
/// answer (within a minute), and the first failure stops it.
#[test]
fn fault_child_entry() -> TestResult {
    let Ok(dir) = std::env::var(FAULT_VAR) else {
        return Ok(());
    };
    let dir = std::path::PathBuf::from(dir);
    let engine = Engine::builder()
        .max_group_bytes(64 << 10)
        .max_response_bytes(1 << 20)
        .lease(Duration::from_secs(3600))
        .sweep_interval(None)
        .open(dir.join("idem.redb"))?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("acks.log"))?;
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(60));
        println!("HUNG");
        std::process::exit(5);
    });
    let faults = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..8 {
            let (engine, log, faults) = (&engine, &log, &faults);
            s.spawn(move || {
                let work = || -> TestResult {
                    for n in 0..10_000 {
                        let name = format!("f-t{t}-{n}");
                        let claim = match engine.begin(&key(&name)?, fp(&name)?) {
                            Ok(Begin::Claimed(claim)) => claim,
                            Ok(other) => return Err(format!("{name}: {other:?}").into()),
                            Err(_) => break,
                        };
                        append(log, format!("claimed {name}"))?;
                        if engine.complete(claim, envelope(&name, 200 << 10)).is_err() {
                            break;
                        }
                        append(log, format!("completed {name}"))?;
                    }
                    faults.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                };
                if let Err(e) = work() {
                    eprintln!("worker {t}: {e}");
                    std::process::exit(3);
                }
            });
        }
    });
    println!("FAULTS {}", faults.load(Ordering::SeqCst));
    println!("CHILD DONE");
    Ok(())
}

#[test]
fn a_journal_fault_among_split_groups_loses_nothing_acknowledged() -> TestResult {
    let dir = tempfile::tempdir()?;
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!(
            r#"trap '' XFSZ; ulimit -c 0; ulimit -f {FAULT_LIMIT_KIB}; exec "$0" "$@""#
        ))
        .arg(std::env::current_exe()?)
        .args([
            "--exact",
            // `<file>::fault_child_entry` where this file is a module of a test binary.
            concat!(module_path!(), "::fault_child_entry")
                .split_once("::")
                .map_or("fault_child_entry", |(_, t)| t),
            "--nocapture",
            "--test-threads=1",
        ])
        .env(FAULT_VAR, dir.path())
        .stdin(std::process::Stdio::null())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("FAULTS 8") && stdout.contains("CHILD DONE"),
        "the child did not meet the fault cleanly: {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let mut claimed = BTreeSet::new();
    let mut completed = BTreeSet::new();
    for line in std::fs::read_to_string(dir.path().join("acks.log"))?.lines() {
        match line.split_once(' ') {
            Some(("claimed", name)) => claimed.insert(name.to_owned()),
            Some(("completed", name)) => completed.insert(name.to_owned()),
            _ => return Err(format!("bad log line {line:?}").into()),
        };
    }
    assert!(completed.len() >= 3, "too few writes before the fault");
    let engine = Engine::builder()
        .max_response_bytes(1 << 20)
        .lease(Duration::from_secs(3600))
        .sweep_interval(None)
        .open(dir.path().join("idem.redb"))?;
    for name in &completed {
        match engine.begin(&key(name)?, fp(name)?)? {
            Begin::Replay(r) => assert_eq!(r.envelope, envelope(name, 200 << 10), "{name}"),
            other => return Err(format!("acknowledged completion {name}: {other:?}").into()),
        }
    }
    for name in claimed.difference(&completed) {
        if let Begin::Claimed(_) = engine.begin(&key(name)?, fp(name)?)? {
            return Err(format!("acknowledged claim {name} claimed again").into());
        }
    }
    assert!(engine.verify()?.is_sound());
    Ok(())
}
