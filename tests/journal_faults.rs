//! A real write fault on the journal's path: a child process runs under a
//! file-size limit (`ulimit -f`, with SIGXFSZ ignored, so a write past the
//! limit fails with EFBIG instead of killing the process). It claims and
//! completes keys with large responses until the journal (or the database
//! file) cannot grow. The engine must poison: the failing call gets an
//! error and nothing panics (the engine may then reopen itself: a small
//! probe file still fits). The parent reopens the files without the limit:
//! every acknowledged completion replays byte for byte, and no acknowledged
//! claim can be claimed again.

use std::error::Error;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey};

type TestResult = Result<(), Box<dyn Error>>;

const ROLE_VAR: &str = "IDEMPOTENCY_JOURNAL_FAULT_CHILD";
const DIR_VAR: &str = "IDEMPOTENCY_JOURNAL_FAULT_DIR";
/// The child's file-size limit, in KiB (bash's `ulimit -f` unit).
const LIMIT_KIB: u32 = 6 * 1024;
const BODY_BYTES: usize = 200 * 1024;

fn key(i: usize) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("fault", format!("key-{i}"))
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

/// Appends one line to the acknowledgement log (one write per line).
fn ack(dir: &Path, line: &str) -> std::io::Result<()> {
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("acks.log"))?;
    log.write_all(format!("{line}\n").as_bytes())
}

/// Entry point of the child process; a no-op in the normal test run.
#[test]
fn child_entry() -> TestResult {
    if std::env::var(ROLE_VAR).is_err() {
        return Ok(());
    }
    let dir = PathBuf::from(std::env::var(DIR_VAR)?);
    let engine = open(&dir)?;
    for i in 0..10_000 {
        let claim = match engine.begin(&key(i)?, fingerprint(i)?) {
            Ok(Begin::Claimed(claim)) => claim,
            Ok(other) => return Err(format!("key {i}: fresh key answered {other:?}").into()),
            Err(e) => {
                println!("FAULT at claim {i}: {e}");
                break;
            }
        };
        ack(&dir, &format!("claimed {i} {}", claim.fencing_token()))?;
        match engine.complete(claim, Envelope::new(1, 201, body(i))) {
            Ok(()) => ack(&dir, &format!("completed {i}"))?,
            Err(e) => {
                println!("FAULT at complete {i}: {e}");
                break;
            }
        }
    }
    // The engine poisoned; a probe file next to the database still fits
    // under the limit, so it may already have reopened itself (after
    // applying its journal). Whatever it answers now must hold after the
    // parent's reopen too.
    let i = 20_000;
    if let Ok(Begin::Claimed(claim)) = engine.begin(&key(i)?, fingerprint(i)?) {
        ack(&dir, &format!("claimed {i} {}", claim.fencing_token()))?;
        if engine
            .complete(claim, Envelope::new(1, 201, body(i)))
            .is_ok()
        {
            ack(&dir, &format!("completed {i}"))?;
        }
    }
    println!("CHILD DONE");
    Ok(())
}

#[test]
fn a_failed_journal_write_poisons_and_loses_nothing_acknowledged() -> TestResult {
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
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("FAULT at ") && stdout.contains("CHILD DONE"),
        "the child did not meet the fault and poison cleanly: {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let log = std::fs::read_to_string(dir.path().join("acks.log"))?;
    let mut claimed = Vec::new();
    let mut completed = Vec::new();
    for line in log.lines() {
        match line.split(' ').collect::<Vec<_>>().as_slice() {
            ["claimed", i, token] => claimed.push((i.parse::<usize>()?, token.parse::<u64>()?)),
            ["completed", i] => completed.push(i.parse::<usize>()?),
            _ => return Err(format!("bad log line {line:?}").into()),
        }
    }
    assert!(
        completed.len() >= 3,
        "too few writes before the fault: {log}"
    );
    let engine = open(dir.path())?;
    for &i in &completed {
        match engine.begin(&key(i)?, fingerprint(i)?)? {
            Begin::Replay(r) => assert!(r.envelope.body == body(i), "key {i}: other bytes"),
            other => return Err(format!("acknowledged completion {i}: {other:?}").into()),
        }
    }
    for &(i, token) in &claimed {
        if let Begin::Claimed(c) = engine.begin(&key(i)?, fingerprint(i)?)? {
            return Err(format!(
                "acknowledged claim {i} (token {token}) claimed again as {}",
                c.fencing_token()
            )
            .into());
        }
    }
    assert!(engine.verify()?.is_sound());
    Ok(())
}
