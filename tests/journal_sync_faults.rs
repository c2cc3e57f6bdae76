//! A real failed `fdatasync` of the journal, in the syncer thread. A child
//! process runs with a small `LD_PRELOAD` library (built here with `cc`;
//! the test is skipped without one) that makes the Nth `fdatasync`/`fsync`
//! of a file named `*.journal` fail with EIO, for a few calls in a row.
//! Eight threads claim and complete keys throughout, logging each
//! acknowledged answer. Guards against:
//!
//! - a caller that hangs, or hears "claimed"/"completed" for a group whose
//!   sync failed (the log is checked after the parent's reopen);
//! - a poisoned engine that stops replaying what it acknowledged;
//! - a self-reopen after the fault that loses acknowledged writes.
//!
//! `IDEMPOTENCY_SYNC_FAULT_AT=N` picks the failing call (default: a few
//! values); `IDEMPOTENCY_SYNC_FAULT_TIMES` how many calls fail in a row.
#![cfg(target_os = "linux")]

use std::collections::BTreeMap;
use std::error::Error;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const ROLE_VAR: &str = "IDEMPOTENCY_SYNC_FAULT_CHILD";
const DIR_VAR: &str = "IDEMPOTENCY_SYNC_FAULT_DIR";
const THREADS: usize = 8;
const OPS: usize = 150;
const SEQUENTIAL_KEYS: usize = 10;

const SHIM: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <stdatomic.h>
static atomic_long calls;
static int is_journal(int fd) {
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) return 0;
    path[n] = 0;
    size_t len = strlen(path);
    return len > 8 && strcmp(path + len - 8, ".journal") == 0;
}
static int should_fail(int fd) {
    const char *after = getenv("FAILSYNC_AT");
    if (!after || !is_journal(fd)) return 0;
    long n = atomic_fetch_add(&calls, 1) + 1;
    long at = atol(after);
    const char *times = getenv("FAILSYNC_TIMES");
    long k = times ? atol(times) : 1;
    return n >= at && n < at + k;
}
int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = dlsym(RTLD_NEXT, "fdatasync");
    if (should_fail(fd)) { errno = EIO; return -1; }
    return real(fd);
}
int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = dlsym(RTLD_NEXT, "fsync");
    if (should_fail(fd)) { errno = EIO; return -1; }
    return real(fd);
}
"#;

fn key(name: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("syncfault", name)
}

fn fp(name: &str) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(format!(r#"{{"k":"{name}"}}"#).as_bytes(), &[])
}

fn body(name: &str) -> Vec<u8> {
    format!("the response of {name}").into_bytes()
}

fn open(dir: &Path) -> Result<Engine, idempotency::OpenError> {
    Engine::builder()
        .lease(Duration::from_secs(3600))
        .sweep_interval(None)
        .open(dir.join("idem.redb"))
}

fn log_line(mut log: &File, line: String) -> std::io::Result<()> {
    log.write_all(format!("{line}\n").as_bytes())
}

#[test]
fn child_entry() -> TestResult {
    if std::env::var(ROLE_VAR).is_err() {
        return Ok(());
    }
    let dir = PathBuf::from(std::env::var(DIR_VAR)?);
    if std::env::var(ROLE_VAR)? == "sequential" {
        return sequential_child(&dir);
    }
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("acks.log"))?;
    let mut stdout = std::io::stdout().lock();
    let engine = match open(&dir) {
        Ok(engine) => engine,
        // The fault hit the open itself (the journal's header or anchor).
        Err(e) => {
            writeln!(stdout, "\nERRORS open failed: {e}\nCHILD DONE")?;
            return Ok(());
        }
    };
    let errors = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (engine, log, errors) = (&engine, &log, &errors);
            s.spawn(move || -> TestResult {
                let mut done: Vec<String> = Vec::new();
                for n in 0..OPS {
                    let name = format!("t{t}-{n}");
                    let claim = match engine.begin(&key(&name)?, fp(&name)?) {
                        Ok(Begin::Claimed(c)) => c,
                        Ok(other) => {
                            log_line(log, format!("odd {name} {other:?}"))?;
                            continue;
                        }
                        Err(_) => {
                            errors.fetch_add(1, Ordering::Relaxed);
                            // Give the engine time to reopen itself.
                            std::thread::sleep(Duration::from_millis(50));
                            continue;
                        }
                    };
                    log_line(log, format!("claimed {name} {}", claim.fencing_token()))?;
                    match engine.complete(claim, Envelope::new(1, 200, body(&name))) {
                        Ok(()) => {
                            log_line(log, format!("completed {name} -"))?;
                            done.push(name);
                        }
                        Err(_) => {
                            errors.fetch_add(1, Ordering::Relaxed);
                            std::thread::sleep(Duration::from_millis(50));
                        }
                    }
                    // Replays of this thread's acknowledged keys keep
                    // working, poisoned or not.
                    if n % 10 == 0 {
                        for again in &done {
                            match engine.begin(&key(again)?, fp(again)?) {
                                Ok(Begin::Replay(r)) if r.envelope.body == body(again) => {}
                                Ok(other) => log_line(log, format!("odd {again} {other:?}"))?,
                                Err(e) => log_line(log, format!("readerr {again} {e}"))?,
                            }
                        }
                    }
                }
                Ok(())
            });
        }
    });
    writeln!(
        stdout,
        "\nERRORS {} POISONED {:?}",
        errors.load(Ordering::Relaxed),
        engine.poisoned()
    )?;
    writeln!(stdout, "CHILD DONE")?;
    Ok(())
}

/// Completes `SEQUENTIAL_KEYS` keys one by one (with the journal syncs of
/// the open, two syncs per key: the fault is set to hit the claim after
/// them, and every journal sync after it), then reports whether each
/// acknowledged completion replays: once poisoned, and again after the
/// engine's attempt to reopen itself failed (its journal still cannot
/// sync, though the probe file beside it can).
fn sequential_child(dir: &Path) -> TestResult {
    let engine = open(dir)?;
    let mut out = std::io::stdout().lock();
    for i in 0..SEQUENTIAL_KEYS {
        let name = format!("seq-{i}");
        let Begin::Claimed(c) = engine.begin(&key(&name)?, fp(&name)?)? else {
            return Err(format!("{name} not claimed").into());
        };
        engine.complete(c, Envelope::new(1, 200, body(&name)))?;
    }
    let name = "seq-fault";
    let refused = engine.begin(&key(name)?, fp(name)?);
    writeln!(out, "\nFAULT {:?}", refused.as_ref().err())?;
    let replays = |stage: &str, out: &mut std::io::StdoutLock<'_>| -> TestResult {
        for i in 0..SEQUENTIAL_KEYS {
            let name = format!("seq-{i}");
            match engine.begin(&key(&name)?, fp(&name)?) {
                Ok(Begin::Replay(r)) if r.envelope.body == body(&name) => {}
                other => writeln!(out, "UNREPLAYED {stage} {name}: {other:?}")?,
            }
        }
        Ok(())
    };
    replays("poisoned", &mut out)?;
    // A write attempt runs the probe (a file beside the database, which
    // syncs) and then the reopen, which fails on the journal.
    let again = engine.begin(&key(name)?, fp(name)?);
    writeln!(out, "REOPEN {:?} / {:?}", again.err(), engine.poisoned())?;
    replays("after a failed reopen", &mut out)?;
    writeln!(out, "CHILD DONE")?;
    Ok(())
}

/// Builds the fault library in `dir`; `None` without a C compiler.
fn build_shim(dir: &Path) -> Option<PathBuf> {
    let src = dir.join("failsync.c");
    let lib = dir.join("failsync.so");
    std::fs::write(&src, SHIM).ok()?;
    let ok = Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&lib)
        .arg(&src)
        .arg("-ldl")
        .status()
        .ok()?
        .success();
    ok.then_some(lib)
}

fn run(shim: &Path, at: u64, times: u64) -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut child = Command::new(std::env::current_exe()?)
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
        .env("LD_PRELOAD", shim)
        .env("FAILSYNC_AT", at.to_string())
        .env("FAILSYNC_TIMES", times.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let started = Instant::now();
    while child.try_wait()?.is_none() {
        if started.elapsed() > Duration::from_secs(60) {
            child.kill()?;
            let out = child.wait_with_output()?;
            return Err(format!(
                "fault at sync {at} x{times}: the child hung (a caller never answered?)\n{}",
                String::from_utf8_lossy(&out.stdout)
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("CHILD DONE"),
        "fault at sync {at} x{times}: {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let log = std::fs::read_to_string(dir.path().join("acks.log"))?;
    let mut claimed = BTreeMap::new();
    let mut completed = Vec::new();
    let mut odd = Vec::new();
    for line in log.lines() {
        match line.splitn(3, ' ').collect::<Vec<_>>().as_slice() {
            ["claimed", name, token] => {
                claimed.insert(name.to_string(), token.parse::<u64>()?);
            }
            ["completed", name, _] => completed.push(name.to_string()),
            _ => odd.push(line.to_string()),
        }
    }
    assert!(odd.is_empty(), "fault at sync {at} x{times}: {odd:#?}");
    let engine = open(dir.path())?;
    for name in &completed {
        match engine.begin(&key(name)?, fp(name)?)? {
            Begin::Replay(r) if r.envelope.body == body(name) => {}
            other => return Err(format!("sync {at}: acked {name} answers {other:?}").into()),
        }
    }
    for (name, token) in &claimed {
        if let Begin::Claimed(c) = engine.begin(&key(name)?, fp(name)?)? {
            return Err(format!(
                "sync {at}: acked claim {name} (token {token}) claimed again ({})",
                c.fencing_token()
            )
            .into());
        }
    }
    assert!(engine.verify()?.is_sound());
    let summary = stdout
        .lines()
        .find(|l| l.starts_with("ERRORS"))
        .unwrap_or("");
    println!(
        "fault at sync {at} x{times}: {} acked completions, {summary}",
        completed.len()
    );
    Ok(())
}

#[test]
fn a_failed_journal_sync_poisons_answers_everyone_and_loses_nothing() -> TestResult {
    let tools = tempfile::tempdir()?;
    let Some(shim) = build_shim(tools.path()) else {
        eprintln!("skipped: no C compiler to build the fdatasync fault library");
        return Ok(());
    };
    let times: u64 = std::env::var("IDEMPOTENCY_SYNC_FAULT_TIMES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let ats: Vec<u64> = match std::env::var("IDEMPOTENCY_SYNC_FAULT_AT") {
        Ok(v) => v.split(',').map(str::parse).collect::<Result<_, _>>()?,
        Err(_) => vec![3, 40, 200],
    };
    for at in ats {
        run(&shim, at, times)?;
    }
    Ok(())
}

/// Promise: a poisoned engine keeps serving replays. Broken when the
/// engine's own reopen attempt fails (its probe passed, the journal did
/// not): the attempt has closed the database, and every read, replays of
/// acknowledged completions included, then fails with `Error::Poisoned`
/// ("writes refused") until a later attempt succeeds.
#[test]
fn replays_go_on_after_a_failed_reopen_attempt() -> TestResult {
    let tools = tempfile::tempdir()?;
    let Some(shim) = build_shim(tools.path()) else {
        eprintln!("skipped: no C compiler to build the fdatasync fault library");
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    // Journal syncs: the header and the anchor at open, then one per
    // claim and one per completion.
    let at = 2 + 2 * SEQUENTIAL_KEYS + 1;
    let out = Command::new(std::env::current_exe()?)
        .args([
            "--exact", // `<file>::child_entry` where this file is a module of a test binary.
            concat!(module_path!(), "::child_entry")
                .split_once("::")
                .map_or("child_entry", |(_, t)| t),
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_VAR, "sequential")
        .env(DIR_VAR, dir.path())
        .env("LD_PRELOAD", &shim)
        .env("FAILSYNC_AT", at.to_string())
        .env("FAILSYNC_TIMES", "1000000")
        .stdin(Stdio::null())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("CHILD DONE"),
        "{:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("FAULT Some(Poisoned"),
        "the fault did not poison the engine where expected:\n{stdout}"
    );
    let unreplayed: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("UNREPLAYED"))
        .collect();
    assert!(
        unreplayed.is_empty(),
        "acknowledged completions not replayed while poisoned:\n{}",
        unreplayed.join("\n")
    );
    Ok(())
}
