//! Guards against issue 28's tools harming or misjudging files when an
//! operator gets something slightly wrong: a second open of a file another
//! engine holds must not give back that engine's recovery reserve (it did:
//! `idem sweep` on a served file deleted the server's 64 MiB reserve, then
//! said "already open"); `salvage x.salvaging x` must not delete the
//! damaged input (it removed `NEW.salvaging` as an earlier salvage's
//! leftover, and that was the damaged file); and `verify` must not call
//! sound a cleanly closed file whose journal header is damaged, which the
//! writable open refuses; salvage of a file redb cannot open must not
//! answer "`idem salvage` copies every record" (it sent the operator in a
//! circle), and the read-only open (`idem verify`) must not call such a
//! file one that "needs recovery: run `idem sweep`" (which refuses it as
//! corrupt, pointing back to verify); and a first start on a full disk must not leave a file that
//! is not a database (it left 72 KiB of zeros, and every later start, with
//! space freed, failed "not a redb database" until someone deleted it; on
//! a tmpfs, skipped where mounting is not allowed).

#[path = "common/small_fs.rs"]
mod small_fs;

use std::error::Error;
use std::path::{Path, PathBuf};

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey, OpenError};

type TestResult = Result<(), Box<dyn Error>>;

/// A database at `path` with `n` completed records, closed cleanly.
fn database(path: &Path, n: u32) -> TestResult {
    let engine = Engine::builder()
        .sweep_interval(None)
        .recovery_reserve(1 << 20)
        .open(path)?;
    for i in 0..n {
        let key = IdempotencyKey::new("s", format!("k{i}"))?;
        match engine.begin(&key, Fingerprint::from_bytes([7; 32]))? {
            Begin::Claimed(claim) => {
                engine.complete(claim, Envelope::new(1, 201, format!("b{i}")))?
            }
            _ => return Err(format!("k{i} was not claimed").into()),
        }
    }
    Ok(())
}

fn beside(path: &Path, suffix: &str) -> PathBuf {
    PathBuf::from(format!("{}{suffix}", path.display()))
}

#[test]
fn a_refused_second_open_keeps_the_running_engines_reserve() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("db.redb");
    let engine = Engine::builder()
        .sweep_interval(None)
        .recovery_reserve(1 << 20)
        .open(&path)?;
    let reserve = beside(&path, ".reserve");
    let held = std::fs::metadata(&reserve)?.len();
    assert!(held > 0, "no reserve taken");
    let second = Engine::builder().sweep_interval(None).open(&path);
    assert!(
        matches!(second, Err(OpenError::AlreadyOpen { .. })),
        "a second open of a held file: {:?}",
        second.err()
    );
    assert_eq!(
        std::fs::metadata(&reserve).map(|m| m.len()).ok(),
        Some(held),
        "the refused open gave back the running engine's reserve"
    );
    drop(engine);
    Ok(())
}

#[test]
fn salvage_never_removes_a_damaged_file_named_like_its_temporary_file() -> TestResult {
    let dir = tempfile::tempdir()?;
    let damaged = dir.path().join("x.salvaging");
    database(&damaged, 20)?;
    let before = std::fs::read(&damaged)?;
    let new = dir.path().join("x");
    let salvaged = Engine::salvage(&damaged, &new);
    assert!(
        matches!(salvaged, Err(OpenError::SalvageTargetExists { .. })),
        "salvage through the damaged file itself: {salvaged:?}"
    );
    assert_eq!(
        std::fs::read(&damaged).ok(),
        Some(before),
        "salvage removed or changed the damaged file"
    );
    assert!(!new.exists(), "a new file was written");
    Ok(())
}

#[test]
fn verify_is_not_sound_when_the_open_refuses_a_damaged_journal_header() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("db.redb");
    database(&path, 20)?;
    let journal = beside(&path, ".journal");
    let mut bytes = std::fs::read(&journal)?;
    // Inside the header's checksummed bytes (its first 40).
    bytes[30] ^= 0x40;
    std::fs::write(&journal, &bytes)?;
    let refused = Engine::builder().sweep_interval(None).open(&path);
    assert!(
        matches!(refused, Err(OpenError::Journal { .. })),
        "the writable open took a damaged journal: {:?}",
        refused.err()
    );
    let reader = Engine::builder()
        .sweep_interval(None)
        .open_read_only(&path)?;
    let report = reader.verify()?;
    assert!(
        !report.is_sound()
            && report
                .damage
                .iter()
                .any(|d| d.to_string().contains("journal")),
        "verify says {:?} of a file the open refuses",
        report.damage
    );
    Ok(())
}

#[test]
fn salvage_of_a_file_redb_cannot_open_does_not_send_the_operator_back_to_salvage() -> TestResult {
    let dir = tempfile::tempdir()?;
    let whole = dir.path().join("whole.redb");
    database(&whole, 20)?;
    // A copy cut short (a full disk during `cp`): redb refuses its header.
    let cut = dir.path().join("cut.redb");
    let bytes = std::fs::read(&whole)?;
    std::fs::write(&cut, &bytes[..4096])?;
    let new = dir.path().join("new.redb");
    match Engine::salvage(&cut, &new) {
        Err(OpenError::Corrupt { reason, .. }) => assert!(
            !reason.contains("idem salvage"),
            "salvage's own error says to run salvage: {reason}"
        ),
        other => return Err(format!("salvage of a cut file: {other:?}").into()),
    }
    assert!(!new.exists(), "a new file was written");
    // verify's read-only open names the damage, as the writable open does.
    let read = Engine::builder().sweep_interval(None).open_read_only(&cut);
    assert!(
        matches!(read, Err(OpenError::Corrupt { .. })),
        "read-only open of a cut file: {:?}",
        read.err()
    );
    Ok(())
}

#[test]
fn a_create_refused_by_a_full_disk_leaves_no_file_behind() -> TestResult {
    let Some(fs) = small_fs::SmallFs::mount(1024).map_err(|e| e.to_string())? else {
        return Ok(());
    };
    let filler = fs.mnt.join("filler");
    let free = usize::try_from(fs.free_bytes().map_err(|e| e.to_string())?)?;
    std::fs::write(&filler, vec![1_u8; free])?;
    let path = fs.db();
    let refused = Engine::builder().sweep_interval(None).open(&path);
    assert!(refused.is_err(), "a database created on a full disk");
    assert!(
        !path.exists(),
        "a refused create left {} bytes behind",
        std::fs::metadata(&path).map_or(0, |m| m.len())
    );
    // Space freed: the next start creates the database.
    std::fs::remove_file(&filler)?;
    drop(Engine::builder().sweep_interval(None).open(&path)?);
    Ok(())
}
