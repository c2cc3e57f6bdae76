//! The write-ahead journal after a real crash: a child process completes a
//! few keys and aborts before any checkpoint, so its work lives only in
//! `<db>.journal`. The parent then damages the journal the way a torn write
//! or a bad sector would, and opens the database again.
//!
//! - A damaged LAST frame is a torn write: the end of the log. Everything
//!   before it is applied.
//! - A damaged frame with valid frames after it is corruption: opening
//!   fails with `OpenError::Journal` naming the file and the byte offset.
//!   Nothing is skipped silently.
//! - A journal deleted, emptied or cut to its header after a crash is
//!   refused too (it lost acknowledged writes), and so is another
//!   database's journal put in its place. After a clean close the database
//!   file alone is enough. Another name for the file (a symbolic link)
//!   finds the same journal.
//! - A refused open changes nothing on disk (an operator may be about to
//!   copy the files): the database file keeps every byte and no journal is
//!   created. With the original journal put back, the next open recovers
//!   every acknowledged write.

use std::collections::{BTreeMap, BTreeSet};
use std::error::Error;
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey, OpenError};

type TestResult = Result<(), Box<dyn Error>>;

const ROLE_VAR: &str = "IDEMPOTENCY_JOURNAL_CHILD";
const DIR_VAR: &str = "IDEMPOTENCY_JOURNAL_DIR";
const KEYS: usize = 5;
const SIGABRT: i32 = 6;

fn key(i: usize) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("journal", format!("key-{i}"))
}

fn fingerprint(i: usize) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(format!(r#"{{"n":{i}}}"#).as_bytes(), &[])
}

fn body(i: usize) -> String {
    format!(r#"{{"receipt":{i},"pad":"{}"}}"#, "x".repeat(100 + i))
}

fn open(dir: &Path) -> Result<Engine, OpenError> {
    Engine::builder()
        .lease(Duration::from_secs(3600))
        .sweep_interval(None)
        .open(dir.join("idem.redb"))
}

/// Entry point of the child process; a no-op in the normal test run.
#[test]
fn child_entry() -> TestResult {
    if std::env::var(ROLE_VAR).is_err() {
        return Ok(());
    }
    let dir = PathBuf::from(std::env::var(DIR_VAR)?);
    let engine = open(&dir)?;
    for i in 0..KEYS {
        let Begin::Claimed(claim) = engine.begin(&key(i)?, fingerprint(i)?)? else {
            return Err(format!("child: key {i} not claimed").into());
        };
        engine.complete(claim, Envelope::new(1, 201, body(i)))?;
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "\nALL COMPLETED")?;
    out.flush()?;
    // No clean close: no checkpoint, the journal holds everything.
    std::process::abort()
}

fn run_child(dir: &Path) -> std::io::Result<Output> {
    Command::new("/bin/sh")
        .arg("-c")
        .arg(r#"ulimit -c 0 2>/dev/null; exec "$0" "$@""#)
        .arg(std::env::current_exe()?)
        .args([
            "--exact", // `<file>::child_entry` where this file is a module of a test binary.
            concat!(module_path!(), "::child_entry")
                .split_once("::")
                .map_or("child_entry", |(_, t)| t),
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_VAR, "write")
        .env(DIR_VAR, dir)
        .stdin(Stdio::null())
        .output()
}

/// A journal left by the crashed child.
struct Crashed {
    path: PathBuf,
    bytes: Vec<u8>,
    /// Each frame's offset and length (header, payload and padding).
    frames: Vec<(usize, usize)>,
}

/// Runs the child; returns the journal it left.
fn crashed_journal(dir: &Path) -> Result<Crashed, Box<dyn Error>> {
    let out = run_child(dir)?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if out.status.signal() != Some(SIGABRT) || !stdout.contains("ALL COMPLETED\n") {
        return Err(format!(
            "child did not complete and abort: {:?}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    let path = dir.join("idem.redb.journal");
    let bytes = std::fs::read(&path)?;
    // Frames follow the 4096-byte header: length u32, 0u32, LSN u64,
    // 16-byte checksum, payload, padding to 8 (see src/store/redb/journal.rs).
    let mut frames = Vec::new();
    let mut pos = 4096;
    while let Some(head) = bytes.get(pos..pos + 32) {
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        if len == 0 {
            break;
        }
        let total = (32 + len).div_ceil(8) * 8;
        frames.push((pos, total));
        pos += total;
    }
    // The anchor written at open (the empty frame of the checkpoint), then
    // one frame per claim and one per completion.
    if frames.len() != 2 * KEYS + 1 {
        return Err(format!("expected {} frames, found {}", 2 * KEYS + 1, frames.len()).into());
    }
    frames.remove(0);
    Ok(Crashed {
        path,
        bytes,
        frames,
    })
}

#[test]
fn a_torn_last_frame_is_the_end_of_the_log() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut crashed = crashed_journal(dir.path())?;
    // The last frame (the last key's completion) lost its final bytes.
    let (at, len) = crashed.frames[crashed.frames.len() - 1];
    for b in &mut crashed.bytes[at + len - 8..at + len] {
        *b ^= 0x5A;
    }
    std::fs::write(&crashed.path, &crashed.bytes)?;
    let engine = open(dir.path())?;
    for i in 0..KEYS - 1 {
        match engine.begin(&key(i)?, fingerprint(i)?)? {
            Begin::Replay(r) => assert_eq!(r.envelope.body, body(i).as_bytes()),
            other => return Err(format!("key {i}: expected a replay, got {other:?}").into()),
        }
    }
    // Its claim survived; its completion did not: still in progress, never
    // claimable again.
    match engine.begin(&key(KEYS - 1)?, fingerprint(KEYS - 1)?)? {
        Begin::Processing { .. } => {}
        other => return Err(format!("last key: expected Processing, got {other:?}").into()),
    }
    assert!(engine.verify()?.is_sound());
    Ok(())
}

#[test]
fn a_damaged_middle_frame_is_an_error_naming_the_file_and_offset() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut crashed = crashed_journal(dir.path())?;
    let (at, _) = crashed.frames[3];
    crashed.bytes[at + 40] ^= 0x01;
    std::fs::write(&crashed.path, &crashed.bytes)?;
    let path = crashed.path;
    let before = on_disk(dir.path())?;
    match open(dir.path()) {
        Err(OpenError::Journal {
            path: named,
            detail,
        }) => {
            assert_eq!(named, path);
            assert!(
                detail.contains(&format!("offset {at}")),
                "detail does not name offset {at}: {detail}"
            );
        }
        Err(other) => return Err(format!("expected OpenError::Journal, got {other}").into()),
        Ok(_) => return Err("a damaged journal opened: frames were skipped".into()),
    }
    // Nothing was applied or rewritten: the same error again.
    assert_unchanged(&before, &on_disk(dir.path())?, "damaged middle frame");
    assert!(matches!(open(dir.path()), Err(OpenError::Journal { .. })));
    Ok(())
}

#[test]
fn a_lost_journal_after_a_crash_is_refused_and_nothing_changes() -> TestResult {
    for lose in [
        "delete",
        "empty",
        "header only",
        "zeroed header",
        "another database's",
    ] {
        let dir = tempfile::tempdir()?;
        let crashed = crashed_journal(dir.path())?;
        let expected = match lose {
            "delete" => {
                std::fs::remove_file(&crashed.path)?;
                "not closed cleanly"
            }
            "empty" => {
                std::fs::write(&crashed.path, b"")?;
                "not closed cleanly"
            }
            "header only" => {
                std::fs::write(&crashed.path, &crashed.bytes[..4096])?;
                "not closed cleanly"
            }
            // What a header never written looks like (see
            // `a_journal_whose_header_was_never_written_is_no_journal`).
            "zeroed header" => {
                std::fs::write(&crashed.path, [0_u8; 4096])?;
                "not closed cleanly"
            }
            _ => {
                std::fs::write(&crashed.path, another_databases_journal()?)?;
                "another database"
            }
        };
        let before = on_disk(dir.path())?;
        match open(dir.path()) {
            Err(OpenError::Journal { detail, .. }) => {
                assert!(detail.contains(expected), "{lose}: {detail}");
            }
            Err(other) => return Err(format!("{lose}: wrong error: {other}").into()),
            Ok(_) => return Err(format!("{lose}: opened without its journal").into()),
        }
        // A refused open changes nothing on disk (an operator may be about
        // to copy the files): the database file keeps every byte, and no
        // journal appears or changes.
        assert_unchanged(&before, &on_disk(dir.path())?, lose);
        // Read-only views refuse it too, instead of showing an old state.
        assert!(
            Engine::builder()
                .open_read_only(dir.path().join("idem.redb"))
                .is_err(),
            "{lose}: a read-only open showed the state without the journal"
        );
        assert_unchanged(&before, &on_disk(dir.path())?, lose);
        // With its journal back, the database recovers every acknowledged
        // write.
        std::fs::write(&crashed.path, &crashed.bytes)?;
        let engine = open(dir.path())?;
        for i in 0..KEYS {
            match engine.begin(&key(i)?, fingerprint(i)?)? {
                Begin::Replay(r) => assert_eq!(r.envelope.body, body(i).as_bytes()),
                other => {
                    return Err(format!("{lose}, key {i}: expected a replay, got {other:?}").into())
                }
            }
        }
        assert!(
            engine.verify()?.is_sound(),
            "{lose}: unsound after recovery"
        );
    }
    Ok(())
}

/// The journal of another database, closed cleanly: a valid journal with
/// another id.
fn another_databases_journal() -> Result<Vec<u8>, Box<dyn Error>> {
    let other = tempfile::tempdir()?;
    drop(open(other.path())?);
    Ok(std::fs::read(other.path().join("idem.redb.journal"))?)
}

/// Every file in `dir` and its bytes, by name.
fn on_disk(dir: &Path) -> Result<BTreeMap<String, Vec<u8>>, Box<dyn Error>> {
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        files.insert(name, std::fs::read(entry.path())?);
    }
    Ok(files)
}

/// Fails naming every file that appeared, vanished or changed.
fn assert_unchanged(
    before: &BTreeMap<String, Vec<u8>>,
    after: &BTreeMap<String, Vec<u8>>,
    case: &str,
) {
    let names = before.keys().chain(after.keys()).collect::<BTreeSet<_>>();
    let changes = names
        .into_iter()
        .filter_map(|name| match (before.get(name), after.get(name)) {
            (Some(old), Some(new)) if old == new => None,
            (Some(old), Some(new)) => Some(format!(
                "{name} changed ({} bytes before, {} after)",
                old.len(),
                new.len()
            )),
            (Some(_), None) => Some(format!("{name} vanished")),
            _ => Some(format!("{name} appeared")),
        })
        .collect::<Vec<_>>();
    assert!(changes.is_empty(), "{case}: {}", changes.join("; "));
}

#[test]
fn after_a_clean_close_the_database_file_alone_is_enough() -> TestResult {
    let dir = tempfile::tempdir()?;
    {
        let engine = open(dir.path())?;
        let Begin::Claimed(claim) = engine.begin(&key(0)?, fingerprint(0)?)? else {
            return Err("not claimed".into());
        };
        engine.complete(claim, Envelope::new(1, 201, body(0)))?;
    }
    std::fs::remove_file(dir.path().join("idem.redb.journal"))?;
    let engine = open(dir.path())?;
    match engine.begin(&key(0)?, fingerprint(0)?)? {
        Begin::Replay(r) => assert_eq!(r.envelope.body, body(0).as_bytes()),
        other => return Err(format!("expected a replay, got {other:?}").into()),
    }
    Ok(())
}

/// A full disk while a journal is first created: the database's meta
/// table already names the journal (marked clean, nothing pending) and the
/// file is sized for its header, but the header's write fails (ENOSPC on a
/// small tmpfs: `ftruncate` extends without allocating, the write
/// allocates). That leaves 4096 zero bytes. Once space is freed the
/// database must open: such a file never held a frame, like a missing
/// journal after a clean close. (It was refused as "not the journal magic"
/// by every later open, writable or read-only, until an operator deleted
/// it.)
#[test]
fn a_journal_whose_header_was_never_written_is_no_journal() -> TestResult {
    let dir = tempfile::tempdir()?;
    {
        let engine = open(dir.path())?;
        let Begin::Claimed(claim) = engine.begin(&key(0)?, fingerprint(0)?)? else {
            return Err("not claimed".into());
        };
        engine.complete(claim, Envelope::new(1, 201, body(0)))?;
    }
    let journal = dir.path().join("idem.redb.journal");
    std::fs::write(&journal, [0_u8; 4096])?;
    let view = Engine::builder().open_read_only(dir.path().join("idem.redb"))?;
    assert!(view.record(&key(0)?)?.is_some());
    drop(view);
    let engine = open(dir.path())?;
    match engine.begin(&key(0)?, fingerprint(0)?)? {
        Begin::Replay(r) => assert_eq!(r.envelope.body, body(0).as_bytes()),
        other => return Err(format!("expected a replay, got {other:?}").into()),
    }
    let Begin::Claimed(claim) = engine.begin(&key(1)?, fingerprint(1)?)? else {
        return Err("not claimed".into());
    };
    engine.complete(claim, Envelope::new(1, 201, body(1)))?;
    drop(engine);
    // The journal was written afresh: it serves the next open.
    assert!(std::fs::read(&journal)?.starts_with(b"idempotency-jrnl"));
    let engine = open(dir.path())?;
    assert!(matches!(
        engine.begin(&key(1)?, fingerprint(1)?)?,
        Begin::Replay(_)
    ));
    Ok(())
}

#[test]
fn another_name_for_the_file_finds_the_same_journal() -> TestResult {
    let dir = tempfile::tempdir()?;
    crashed_journal(dir.path())?;
    let alias = dir.path().join("alias.redb");
    std::os::unix::fs::symlink(dir.path().join("idem.redb"), &alias)?;
    let engine = Engine::builder().sweep_interval(None).open(&alias)?;
    for i in 0..KEYS {
        match engine.begin(&key(i)?, fingerprint(i)?)? {
            Begin::Replay(r) => assert_eq!(r.envelope.body, body(i).as_bytes()),
            other => return Err(format!("key {i}: expected a replay, got {other:?}").into()),
        }
    }
    assert!(!dir.path().join("alias.redb.journal").exists());
    Ok(())
}
