//! What the engine drops or repairs reaches the operator: `idem` prints
//! the library's `tracing` warnings on stderr. A crashed child leaves a
//! journal whose frames no checkpoint holds; its last frame is then
//! damaged as a torn write would leave it. The open drops that frame
//! with a warning naming the journal, its offset and LSN
//! (`docs/operations.md`), and `idem salvage` and `idem sweep`, which
//! open the file, must show it.

mod common;

use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::*;
use idempotency::{Begin, Engine, Envelope};

const ROLE_VAR: &str = "IDEM_JOURNAL_WARNINGS_CHILD";
const KEYS: usize = 3;
const SIGABRT: i32 = 6;
const TORN: &str = "dropped the journal's last frame as a torn write";

/// Entry point of the child process; a no-op in the normal test run.
#[test]
fn child_entry() -> TestResult {
    let Ok(dir) = std::env::var(ROLE_VAR) else {
        return Ok(());
    };
    let engine = Engine::builder()
        .lease(Duration::from_secs(3600))
        .sweep_interval(None)
        .open(db_path(Path::new(&dir)))?;
    for i in 0..KEYS {
        let Begin::Claimed(c) = engine.begin(&key("shop", &format!("k{i}"))?, fp("{}")?)? else {
            return Err(format!("child: key {i} not claimed").into());
        };
        engine.complete(c, Envelope::new(1, 201, format!("body {i}")))?;
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "\nALL COMPLETED")?;
    out.flush()?;
    // No clean close: no checkpoint, the journal holds every frame.
    std::process::abort()
}

/// Runs the child in `dir`; returns the journal's path.
fn crashed(dir: &Path) -> TestResult<PathBuf> {
    let out: Output = Command::new("/bin/sh")
        .arg("-c")
        .arg(r#"ulimit -c 0 2>/dev/null; exec "$0" "$@""#)
        .arg(std::env::current_exe()?)
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(ROLE_VAR, dir)
        .stdin(Stdio::null())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if out.status.signal() != Some(SIGABRT) || !stdout.contains("ALL COMPLETED\n") {
        return Err(format!(
            "child did not complete and abort: {:?}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    Ok(dir.join("idem.redb.journal"))
}

/// Flips the last 8 bytes of the journal's last frame. Frames follow the
/// 4096-byte header: length u32, 0u32, LSN u64, 16-byte checksum,
/// payload, padding to 8 (`src/store/redb/journal.rs`); a zero length
/// ends them.
fn tear_last_frame(journal: &Path) -> TestResult {
    let mut bytes = std::fs::read(journal)?;
    let (mut pos, mut last) = (4096, None);
    while let Some(head) = bytes.get(pos..pos + 32) {
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        if len == 0 {
            break;
        }
        let total = (32 + len).div_ceil(8) * 8;
        last = Some((pos, total));
        pos += total;
    }
    let (at, len) = last.ok_or("the journal holds no frame")?;
    for b in &mut bytes[at + len - 8..at + len] {
        *b ^= 0x5A;
    }
    std::fs::write(journal, &bytes)?;
    Ok(())
}

/// A store in `dir` left by the crashed child with its journal's last
/// frame torn; returns the database's path.
fn torn_store(dir: &Path) -> TestResult<PathBuf> {
    tear_last_frame(&crashed(dir)?)?;
    Ok(db_path(dir))
}

#[test]
fn salvage_prints_the_torn_frame_warning() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = torn_store(dir.path())?;
    let new = dir.path().join("new.redb");
    let out = idem(["salvage".as_ref(), db.as_os_str(), new.as_os_str()])?;
    let stderr = String::from_utf8(out.stderr)?;
    assert!(out.status.success(), "{:?}\n{stderr}", out.status);
    assert!(stderr.contains(TORN), "stderr: {stderr}");
    assert!(stderr.contains("WARN"), "stderr: {stderr}");
    assert!(stderr.contains("idem.redb.journal"), "stderr: {stderr}");
    // The keys before the torn frame are all there; the last key's
    // completion was the torn frame: its claim is, in progress.
    let out = idem_ok(["inspect".as_ref(), new.as_os_str()])?;
    assert_eq!(out.matches("COMPLETED").count(), KEYS - 1, "{out}");
    Ok(())
}

#[test]
fn sweep_prints_the_torn_frame_warning_and_rust_log_off_silences_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = torn_store(dir.path())?;
    let out = idem(["sweep".as_ref(), db.as_os_str()])?;
    let stderr = String::from_utf8(out.stderr)?;
    assert!(out.status.success(), "{:?}\n{stderr}", out.status);
    assert!(stderr.contains(TORN), "stderr: {stderr}");

    // The same damage again, with logging off: nothing on stderr.
    let dir2 = tempfile::tempdir()?;
    let db2 = torn_store(dir2.path())?;
    let out = idem_command()
        .args(["sweep".as_ref(), db2.as_os_str()])
        .env("RUST_LOG", "off")
        .output()?;
    assert!(out.status.success(), "{:?}", out.status);
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
