//! Guards `EngineBuilder::compact` (a closed file's free pages given back)
//! against losing or changing what the file holds, against running on a
//! file an app has open, and against a crash part way: a SIGKILL of a
//! child while it compacts (this test binary re-invoked with
//! `IDEM_COMPACT_ROLE` set, running only `child_entry`) must leave a file
//! that opens with every record replaying byte for byte and `verify`
//! finding it sound.
//!
//! The file: 3,000 records whose TTL has run out (swept away, `Forget`),
//! then 1,200 that live, each with a 2 KiB response, so most of the file
//! is free pages below the live ones.
//!
//! Rounds of the kill test: `IDEMPOTENCY_COMPACT_KILL_ROUNDS` (default 6).
//! Unix only (the kill is observed as SIGKILL).
#![cfg(unix)]

mod common;

use std::error::Error;
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::claimed;
use idempotency::{
    Begin, Engine, Envelope, ExpiryPolicy, Fingerprint, IdempotencyKey, ManualClock, OpenError,
};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const T0: u64 = 1_700_000_000_000;
const TTL: Duration = Duration::from_secs(3_600);
/// When the live records are written, and the file is read: two TTLs on.
const LATER: u64 = T0 + 2 * 3_600_000;
const EXPIRED: usize = 3_000;
const LIVE: usize = 1_200;
const ROLE_VAR: &str = "IDEM_COMPACT_ROLE";
const FILE_VAR: &str = "IDEM_COMPACT_FILE";

fn key(i: usize) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("compact", format!("order-{i:05}"))
}

fn fp(i: usize) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(format!(r#"{{"order": {i}}}"#).as_bytes(), &[])
}

/// A response of 2 KiB that names its key.
fn body(i: usize) -> Vec<u8> {
    let mut b = format!("receipt {i:05} ").into_bytes();
    b.resize(2_048, b'a' + (i % 26) as u8);
    b
}

fn builder(at: u64) -> idempotency::EngineBuilder {
    Engine::builder()
        .clock(ManualClock::new(at))
        .ttl(TTL)
        .expiry_policy(ExpiryPolicy::Forget)
        .sweep_interval(None)
}

/// The file described above, closed cleanly.
fn write_file(path: &Path) -> TestResult {
    {
        let engine = builder(T0).open(path)?;
        for i in 0..EXPIRED {
            let c = claimed(engine.begin(&key(i)?, fp(i)?)?)?;
            engine.complete(c, Envelope::new(1, 201, body(i)))?;
        }
    }
    let engine = builder(LATER).open_existing(path)?;
    for i in EXPIRED..EXPIRED + LIVE {
        let c = claimed(engine.begin(&key(i)?, fp(i)?)?)?;
        engine.complete(c, Envelope::new(1, 201, body(i)))?;
    }
    let swept = engine.sweep_now()?;
    assert_eq!(swept.deleted, EXPIRED as u64, "{swept:?}");
    Ok(())
}

/// Every live record replays byte for byte, the expired ones are gone,
/// and `verify` finds the file sound.
fn check_file(path: &Path) -> TestResult {
    let engine = builder(LATER).open_existing(path)?;
    let report = engine.verify()?;
    assert!(report.is_sound(), "{path:?}: {:?}", report.damage);
    for i in EXPIRED..EXPIRED + LIVE {
        match engine.begin(&key(i)?, fp(i)?)? {
            Begin::Replay(r) => assert_eq!(r.envelope.body, body(i), "key {i}"),
            other => return Err(format!("key {i}: expected a replay, got {other:?}").into()),
        }
    }
    for i in [0, EXPIRED / 2, EXPIRED - 1] {
        assert!(
            engine.record(&key(i)?)?.is_none(),
            "expired key {i} is back"
        );
    }
    Ok(())
}

#[test]
fn compaction_gives_back_the_free_pages_and_keeps_every_record() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.redb");
    write_file(&path)?;
    let report = builder(LATER).compact(&path)?;
    let now = std::fs::metadata(&path)?.len();
    assert_eq!(report.bytes_after, now);
    // 4,200 records' worth of pages were written, 1,200 live: the file
    // must come down to well under half.
    assert!(
        report.bytes_after * 2 < report.bytes_before,
        "{report:?}: too little given back"
    );
    assert_eq!(
        report.bytes_freed(),
        report.bytes_before - report.bytes_after
    );
    check_file(&path)?;
    // Compacting again finds nothing more to give.
    let again = builder(LATER).compact(&path)?;
    assert!(again.bytes_after <= report.bytes_after, "{again:?}");
    check_file(&path)
}

#[test]
fn compaction_refuses_a_file_an_engine_has_open() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.redb");
    write_file(&path)?;
    let engine = builder(LATER).open_existing(&path)?;
    engine.flush()?;
    let before = std::fs::read(&path)?;
    match builder(LATER).compact(&path) {
        Err(OpenError::AlreadyOpen { .. }) => {}
        other => return Err(format!("expected AlreadyOpen, got {other:?}").into()),
    }
    // The refused call wrote nothing: the file is as the open engine
    // holds it.
    assert_eq!(std::fs::read(&path)?, before);
    drop(engine);
    check_file(&path)
}

#[test]
fn compaction_of_a_missing_file_says_so_and_creates_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("nothing.redb");
    match builder(T0).compact(&path) {
        Err(OpenError::MissingDatabase { path: named }) => assert_eq!(named, path),
        other => return Err(format!("expected MissingDatabase, got {other:?}").into()),
    }
    assert!(!path.exists());
    Ok(())
}

/// Entry point of the child process; a no-op in the normal test run.
#[test]
fn child_entry() -> TestResult {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return Ok(());
    };
    let path = PathBuf::from(std::env::var(FILE_VAR)?);
    match role.as_str() {
        "compact" => {
            println!("ready");
            builder(LATER).compact(&path)?;
            println!("done");
            Ok(())
        }
        _ => Err(format!("unknown child role {role:?}").into()),
    }
}

/// Starts a child compacting `path`; returns it once it said "ready",
/// with its stdout for the rest.
fn start_child(
    path: &Path,
) -> std::io::Result<(std::process::Child, BufReader<std::process::ChildStdout>)> {
    let mut child = common::child_entry_command!()
        .env(ROLE_VAR, "compact")
        .env(FILE_VAR, path)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let mut out = BufReader::new(
        child
            .stdout
            .take()
            .ok_or_else(|| std::io::Error::other("no stdout"))?,
    );
    let mut line = String::new();
    // The harness prints the test's name on the same line first.
    while !line.contains("ready") {
        line.clear();
        if out.read_line(&mut line)? == 0 {
            return Err(std::io::Error::other("the child ended before it was ready"));
        }
    }
    Ok((child, out))
}

#[test]
fn sigkill_during_compaction_loses_nothing() -> TestResult {
    let rounds: u64 = std::env::var("IDEMPOTENCY_COMPACT_KILL_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let dir = tempfile::tempdir()?;
    let original = dir.path().join("original.redb");
    write_file(&original)?;
    let copy = |to: &Path| -> std::io::Result<()> {
        for suffix in ["", ".journal"] {
            let from = PathBuf::from(format!("{}{suffix}", original.display()));
            if from.exists() {
                std::fs::copy(&from, format!("{}{suffix}", to.display()))?;
            }
        }
        Ok(())
    };
    // How long a whole compaction takes in a child, from "ready".
    let timed = dir.path().join("timed.redb");
    copy(&timed)?;
    let (mut child, _out) = start_child(&timed)?;
    let started = Instant::now();
    let status = child.wait()?;
    let whole = started.elapsed();
    assert!(status.success(), "the timing child failed: {status:?}");
    check_file(&timed)?;
    let mut killed_mid = 0;
    for round in 0..rounds {
        let path = dir.path().join(format!("round-{round}.redb"));
        copy(&path)?;
        // Spread over the compaction and a little past it.
        let delay = whole.mul_f64((round as f64 + 0.5) / rounds as f64 * 1.1);
        let (mut child, mut out) = start_child(&path)?;
        std::thread::sleep(delay);
        child.kill()?;
        let status = child.wait()?;
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut out, &mut rest);
        let finished = rest.contains("done");
        if status.signal() == Some(libc_sigkill()) && !finished {
            killed_mid += 1;
        }
        check_file(&path).map_err(|e| format!("round {round}, killed after {delay:?}: {e}"))?;
        // A compaction after the crash completes and keeps everything.
        builder(LATER).compact(&path)?;
        check_file(&path).map_err(|e| format!("round {round}, compacted again: {e}"))?;
    }
    println!(
        "compaction kill test: {killed_mid} of {rounds} kills landed before the child finished (a whole compaction took {whole:?})"
    );
    Ok(())
}

/// SIGKILL's number (9 on every Unix this runs on).
fn libc_sigkill() -> i32 {
    9
}
