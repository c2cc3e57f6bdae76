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

/// Commands that only read must leave the file byte-identical: a writable
/// open rewrites the header (about 7 KB), and on a suspect file that
/// destroys evidence.
#[test]
fn read_only_commands_leave_the_file_byte_identical() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    {
        let engine = engine(&db)?;
        let done = claim(&engine, &key("shop:pay", "a")?, fp(r#"{"n":1}"#)?)?;
        engine.complete(done, idempotency::Envelope::new(1, 201, "ok"))?;
    }
    let before = std::fs::read(&db)?;
    for args in [
        vec!["inspect"],
        vec!["inspect", "--json"],
        vec!["stats"],
        vec!["unknown"],
        vec!["show", "shop:pay", "a"],
    ] {
        let mut argv: Vec<std::ffi::OsString> = vec![args[0].into(), db.clone().into()];
        argv.extend(args[1..].iter().map(|a| a.into()));
        idem_ok(argv)?;
        assert!(
            std::fs::read(&db)? == before,
            "`idem {}` changed the file",
            args.join(" ")
        );
    }
    Ok(())
}

/// A redb file written by another program is reported, and a command that
/// only reads adds no tables to it.
#[test]
fn foreign_redb_file_is_one_line_and_left_untouched() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("other.redb");
    {
        let other = redb::Database::create(&db)?;
        let txn = other.begin_write()?;
        {
            let table: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("orders");
            txn.open_table(table)?.insert("o-1", 7)?;
        }
        txn.commit()?;
    }
    let before = std::fs::read(&db)?;
    for cmd in ["inspect", "stats", "unknown"] {
        let err = idem_err([cmd.as_ref(), db.as_os_str()])?;
        assert!(err.contains("without idempotency tables"), "{err}");
        assert!(
            std::fs::read(&db)? == before,
            "`idem {cmd}` changed the file"
        );
    }
    Ok(())
}
