//! Opening the database from the CLI: guards against a CLI that creates a
//! missing file, panics or prints a multi-line trace on a file that is not a
//! database or is locked by another process. Each must be one `idem: ...`
//! line on stderr and exit code 1.

mod common;

use common::*;

#[test]
fn missing_file_is_one_line_and_not_created() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("absent.redb");
    for cmd in ["inspect", "unknown", "stats", "sweep"] {
        let err = idem_err([cmd.as_ref(), db.as_os_str()])?;
        assert!(err.ends_with("absent.redb: no such database file"), "{err}");
    }
    assert!(!db.exists(), "the CLI must never create a database");
    Ok(())
}

#[test]
fn garbage_file_is_one_line_and_left_untouched() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("garbage.redb");
    let garbage: Vec<u8> = (0..4096u32).map(|i| (i * 7919 % 251) as u8).collect();
    std::fs::write(&db, &garbage)?;
    let err = idem_err(["inspect".as_ref(), db.as_os_str()])?;
    assert!(
        err.contains("garbage.redb: not a usable redb database"),
        "{err}"
    );
    assert_eq!(std::fs::read(&db)?, garbage);
    Ok(())
}

#[test]
fn database_open_elsewhere_is_one_line() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    // The test process holds the file; the CLI is another process.
    let held = engine(&db)?;
    let err = idem_err(["stats".as_ref(), db.as_os_str()])?;
    assert!(err.contains("already open"), "{err}");
    drop(held);
    idem_ok(["stats".as_ref(), db.as_os_str()])?;
    Ok(())
}

#[test]
fn invalid_key_is_one_line() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    drop(engine(&db)?);
    let long = "x".repeat(300);
    let err = idem_err([
        "show".as_ref(),
        db.as_os_str(),
        "scope".as_ref(),
        long.as_ref(),
    ])?;
    assert!(err.contains("invalid idempotency key"), "{err}");
    Ok(())
}
