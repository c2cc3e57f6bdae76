//! A poisoned engine keeps serving replays. A child process runs under a
//! file-size limit (`ulimit -f`, SIGXFSZ ignored, so a write past it fails
//! with EFBIG), and 8 threads claim and complete keys with large responses
//! until the engine poisons. Then, in the same process, every completion
//! acknowledged before the fault must still replay byte for byte: right
//! away, after the engine's own attempt to reopen itself (which may fail:
//! applying the journal needs the database file to grow), and from other
//! threads at once. The parent reopens without the limit and checks again.
//!
//! The same on a real full disk (a 24 MiB tmpfs, when the test runs as
//! root and may mount one; skipped otherwise): the engine poisons on
//! ENOSPC, then an operator frees a little space (512 KiB, enough for the
//! engine's probe file, not for applying its journal), and the engine's
//! reopen attempt fails.
//!
//! Guards against a reopen attempt that closes the database and leaves
//! reads with nothing to read, and against acknowledged values dropped with
//! the writer's overlay.

use std::collections::BTreeMap;
use std::error::Error;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const ROLE_VAR: &str = "IDEMPOTENCY_POISONED_READS_CHILD";
const DIR_VAR: &str = "IDEMPOTENCY_POISONED_READS_DIR";
/// A file the child deletes once poisoned (space freed on a full disk).
const FILLER_VAR: &str = "IDEMPOTENCY_POISONED_READS_FILLER";
/// The child's file-size limit, in KiB (bash's `ulimit -f` unit).
const LIMIT_KIB: u32 = 6 * 1024;
const BODY_BYTES: usize = 100 * 1024;
const THREADS: usize = 8;

fn key(i: usize) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("poisoned", format!("key-{i}"))
}

fn fingerprint(i: usize) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(format!(r#"{{"n":{i}}}"#).as_bytes(), &[])
}

fn body(i: usize) -> Vec<u8> {
    (0..BODY_BYTES)
        .map(|j| (j.wrapping_mul(31) ^ i) as u8)
        .collect()
}

fn open(dir: &Path) -> Result<Engine, idempotency::OpenError> {
    Engine::builder()
        .lease(Duration::from_secs(3600))
        .sweep_interval(None)
        .max_response_bytes(1 << 20)
        .open(dir.join("idem.redb"))
}

/// Every acknowledged completion replays with its bytes; the keys that do
/// not, with what came instead.
fn unreplayed(engine: &Engine, done: &[usize]) -> Vec<String> {
    let mut bad = Vec::new();
    for &i in done {
        let answer = key(i)
            .map_err(|e| e.to_string())
            .and_then(|k| Ok((k, fingerprint(i).map_err(|e| e.to_string())?)))
            .and_then(|(k, f)| engine.begin(&k, f).map_err(|e| e.to_string()));
        match answer {
            Ok(Begin::Replay(r)) if r.envelope.body == body(i) => {}
            Ok(other) => bad.push(format!("{i}: {other:?}")),
            Err(e) => bad.push(format!("{i}: {e}")),
        }
    }
    bad
}

/// Entry point of the child process; a no-op in the normal test run.
#[test]
fn child_entry() -> TestResult {
    if std::env::var(ROLE_VAR).is_err() {
        return Ok(());
    }
    let dir = PathBuf::from(std::env::var(DIR_VAR)?);
    let engine = open(&dir)?;
    // A hang (a read waiting for a writer that never answers) ends the
    // child with a distinct status instead of the parent's test.
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(60));
        eprintln!("child still running after 60 s: hung");
        std::process::exit(4);
    });
    let done = Mutex::new(Vec::new());
    let faults = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (engine, done, faults) = (&engine, &done, &faults);
            s.spawn(move || -> TestResult {
                for n in 0..10_000 {
                    let i = n * THREADS + t;
                    let claim = match engine.begin(&key(i)?, fingerprint(i)?) {
                        Ok(Begin::Claimed(claim)) => claim,
                        Ok(other) => return Err(format!("{i}: fresh key {other:?}").into()),
                        Err(_) => {
                            faults.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            return Ok(());
                        }
                    };
                    if engine
                        .complete(claim, Envelope::new(1, 201, body(i)))
                        .is_err()
                    {
                        faults.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        return Ok(());
                    }
                    done.lock().map_err(|_| "poisoned lock")?.push(i);
                }
                Ok(())
            });
        }
    });
    let done = done.into_inner().map_err(|_| "poisoned lock")?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "\nACKED {}", done.len())?;
    writeln!(out, "FAULTS {}", faults.into_inner())?;
    let cause = engine.poisoned();
    writeln!(out, "POISONED {cause:?}")?;
    let bad = unreplayed(&engine, &done);
    writeln!(
        out,
        "UNREPLAYED-AFTER-FAULT {} {:?}",
        bad.len(),
        bad.first()
    )?;
    // Whole-table reads ask the writer to commit first, unless poisoned:
    // they must answer (the last commit, or an error), not hang.
    writeln!(
        out,
        "WHOLE-TABLE {:?} {:?} {:?} {:?}",
        engine.in_doubt(10).map(|v| v.len()),
        engine.outbox().len(),
        engine.stats().map(|_| ()),
        engine.verify().map(|r| r.is_sound()),
    )?;
    if let Ok(filler) = std::env::var(FILLER_VAR) {
        std::fs::remove_file(filler)?;
    }
    // A write (or `poisoned()`) runs the probe and tries to reopen; once a
    // second has passed since the last attempt, again.
    std::thread::sleep(Duration::from_millis(1_100));
    let cause = engine.poisoned();
    writeln!(out, "AFTER-REOPEN-ATTEMPT {cause:?}")?;
    let bad = unreplayed(&engine, &done);
    writeln!(
        out,
        "UNREPLAYED-AFTER-REOPEN {} {:?}",
        bad.len(),
        bad.first()
    )?;
    for i in &done {
        writeln!(out, "done {i}")?;
    }
    writeln!(out, "CHILD DONE")?;
    Ok(())
}

#[test]
fn a_poisoned_engine_keeps_replaying_what_it_acknowledged() -> TestResult {
    let dir = tempfile::tempdir()?;
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!(
            r#"trap '' XFSZ; ulimit -c 0; ulimit -f {LIMIT_KIB}; exec "$0" "$@""#
        ))
        .arg(std::env::current_exe()?)
        .args([
            "--exact", // `<file>::child_entry` where this file is a module of a test binary.
            concat!(module_path!(), "::child_entry")
                .split_once("::")
                .map_or("child_entry", |(_, t)| t),
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_VAR, "1")
        .env(DIR_VAR, dir.path())
        .stdin(Stdio::null())
        .output()?;
    check_child(&out, dir.path())
}

/// A tmpfs mounted for the test, unmounted when dropped.
struct Mounted(PathBuf);

impl Mounted {
    /// `None` when this process may not mount one (not root, or in a
    /// container without the right).
    fn tmpfs(at: &Path, size: &str) -> Option<Mounted> {
        std::fs::create_dir_all(at).ok()?;
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .stderr(Stdio::null())
            .status()
            .ok()?
            .success();
        ok.then(|| Mounted(at.to_path_buf()))
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn replays_go_on_when_a_little_space_is_freed_on_a_full_disk() -> TestResult {
    let dir = tempfile::tempdir()?;
    let Some(mnt) = Mounted::tmpfs(&dir.path().join("mnt"), "24m") else {
        eprintln!("skipped: cannot mount a tmpfs (needs root)");
        return Ok(());
    };
    let filler = mnt.0.join("filler");
    std::fs::write(&filler, vec![0_u8; 512 * 1024])?;
    let out = Command::new(std::env::current_exe()?)
        .args([
            "--exact", // `<file>::child_entry` where this file is a module of a test binary.
            concat!(module_path!(), "::child_entry")
                .split_once("::")
                .map_or("child_entry", |(_, t)| t),
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_VAR, "1")
        .env(DIR_VAR, &mnt.0)
        .env(FILLER_VAR, &filler)
        .stdin(Stdio::null())
        .output()?;
    // The parent's check reopens on the full disk: copy the files out.
    let copy = dir.path().join("copy");
    std::fs::create_dir_all(&copy)?;
    for name in ["idem.redb", "idem.redb.journal"] {
        std::fs::copy(mnt.0.join(name), copy.join(name))?;
    }
    drop(mnt);
    check_child(&out, &copy)
}

/// Checks the child's report, then reopens the files in `dir` without
/// any limit and replays every acknowledged completion.
fn check_child(out: &std::process::Output, dir: &Path) -> TestResult {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("CHILD DONE"),
        "the child failed: {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines = BTreeMap::new();
    let mut done = Vec::new();
    for line in stdout.lines() {
        if let Some(i) = line.strip_prefix("done ") {
            done.push(i.parse::<usize>()?);
        } else if let Some((tag, rest)) = line.split_once(' ') {
            lines.insert(tag.to_string(), rest.to_string());
        }
    }
    let summary: Vec<String> = lines
        .iter()
        .filter(|(k, _)| k.chars().all(|c| c.is_ascii_uppercase() || c == '-'))
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    // (The engine may have reopened itself already: `POISONED None`.)
    assert!(
        lines.get("FAULTS").is_some_and(|f| f != "0"),
        "no call met the fault: {summary:#?}"
    );
    assert!(
        done.len() >= 3,
        "too few writes before the fault: {summary:#?}"
    );
    for stage in ["UNREPLAYED-AFTER-FAULT", "UNREPLAYED-AFTER-REOPEN"] {
        assert!(
            lines.get(stage).is_some_and(|v| v.starts_with("0 ")),
            "acknowledged completions not replayed by the poisoned engine: {summary:#?}"
        );
    }
    let engine = open(dir)?;
    let bad = unreplayed(&engine, &done);
    assert!(bad.is_empty(), "after the parent's reopen: {bad:?}");
    assert!(engine.verify()?.is_sound());
    Ok(())
}
