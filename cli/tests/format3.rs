//! The operator's commands on a redb file of format 3 (time-partitioned
//! records, what the engine creates): `idem inspect`, `idem unknown`, `idem resolve`,
//! `idem show` and `idem verify` see and settle records in sealed
//! partitions as in the hot one, and `idem salvage` copies a format-3
//! file into a new format-3 file that verifies and answers as the old one.

mod common;

use std::ffi::OsString;
use std::path::Path;
use std::time::Duration;

use common::*;
use idempotency::{Begin, Engine, Envelope, Failure};

const SCOPE: &str = "tenant-1:create_payment";
const BODY: &str = r#"{"amount":10}"#;

fn args(parts: &[&str], db: &Path) -> Vec<OsString> {
    let mut v: Vec<OsString> = vec![parts[0].into(), db.into()];
    v.extend(parts[1..].iter().map(OsString::from));
    v
}

/// A format-3 file with partitions of 4 keys: 10 completed keys and one
/// UNKNOWN one (`stuck`) in the oldest partition, so most live in sealed
/// partitions.
fn format3_file(path: &Path) -> TestResult {
    let engine = Engine::builder()
        .sweep_interval(None)
        .migrate_to_format_3()
        .partition_limits(4, Duration::from_secs(600))
        .open(path)?;
    write_records(&engine)
}

/// One UNKNOWN key (`stuck`) then 10 completed ones (`paid-0` … `paid-9`).
fn write_records(engine: &Engine) -> TestResult {
    let stuck = claim(engine, &key(SCOPE, "stuck")?, fp(BODY)?)?;
    engine.fail(
        stuck,
        Failure::InDoubt {
            reason: "provider timed out".into(),
        },
    )?;
    for i in 0..10 {
        let c = claim(engine, &key(SCOPE, &format!("paid-{i}"))?, fp(BODY)?)?;
        engine.complete(c, Envelope::new(1, 201, format!("receipt {i}")))?;
    }
    Ok(())
}

#[test]
fn operators_list_resolve_and_verify_a_format3_file() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    format3_file(&db)?;

    let listed = idem_ok(args(&["inspect"], &db))?;
    for i in 0..10 {
        assert!(
            listed.contains(&format!("paid-{i}")),
            "paid-{i} in {listed}"
        );
    }
    assert!(listed.contains("stuck"), "{listed}");
    let unknown = idem_ok(args(&["unknown"], &db))?;
    assert!(
        unknown.contains("stuck") && unknown.contains("provider timed out"),
        "{unknown}"
    );
    let shown = idem_ok(args(&["show", SCOPE, "paid-3"], &db))?;
    assert!(shown.contains("COMPLETED"), "{shown}");
    let verified = idem_ok(args(&["verify"], &db))?;
    assert!(verified.contains("sound: 11 records checked"), "{verified}");

    // Settled from the shell: a retry replays the operator's envelope.
    let file = dir.path().join("envelope.json");
    std::fs::write(
        &file,
        r#"{"schema_version":1,"status":201,"headers":[],"body":{"payment":"ch_9"}}"#,
    )?;
    let mut a = args(
        &[
            "resolve",
            SCOPE,
            "stuck",
            "--reason",
            "ch_9 at the provider",
            "--completed",
        ],
        &db,
    );
    a.push(file.into());
    let out = idem_ok(a)?;
    assert!(out.contains("status 201"), "{out}");
    let engine = engine(&db)?;
    match engine.begin(&key(SCOPE, "stuck")?, fp(BODY)?)? {
        Begin::Replay(r) => assert_eq!(r.envelope.body, br#"{"payment":"ch_9"}"#),
        other => return Err(format!("not a replay: {other:?}").into()),
    }
    drop(engine);
    let verified = idem_ok(args(&["verify"], &db))?;
    assert!(verified.contains("sound: 11 records checked"), "{verified}");
    Ok(())
}

#[test]
fn salvage_copies_a_format3_file_into_a_format3_file() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    format3_file(&db)?;
    let to = dir.path().join("copy.redb");
    let out = idem_ok([OsString::from("salvage"), db.into(), to.clone().into()])?;
    assert!(out.contains("11 records"), "{out}");
    let verified = idem_ok(args(&["verify"], &to))?;
    assert!(verified.contains("sound: 11 records checked"), "{verified}");
    // The new file is of format 3: a format-3 open takes it as it is.
    let engine = Engine::builder()
        .sweep_interval(None)
        .migrate_to_format_3()
        .open(&to)?;
    match engine.begin(&key(SCOPE, "paid-3")?, fp(BODY)?)? {
        Begin::Replay(r) => assert_eq!(r.envelope.body, b"receipt 3"),
        other => return Err(format!("not a replay: {other:?}").into()),
    }
    match engine.begin(&key(SCOPE, "stuck")?, fp(BODY)?)? {
        Begin::InDoubt(_) => {}
        other => return Err(format!("stuck is not in doubt: {other:?}").into()),
    }
    Ok(())
}

/// A format-2 file (as an earlier release wrote it) with 10 completed keys
/// and one UNKNOWN one.
fn format2_file(path: &Path) -> TestResult {
    let engine = Engine::builder()
        .sweep_interval(None)
        .unstable_create_format_2()
        .open(path)?;
    assert_eq!(engine.redb_format(), Some(2));
    write_records(&engine)
}

#[test]
fn migrate_turns_a_format2_file_into_format3_and_says_so() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    format2_file(&db)?;

    let out = idem_ok(args(&["migrate"], &db))?;
    assert!(out.contains(": format 2 -> 3 in "), "{out}");
    assert!(out.contains("keep your copy"), "{out}");
    // A format-3 file is left as it is.
    let again = idem_ok(args(&["migrate"], &db))?;
    assert!(
        again.contains(": format 3 already; nothing to migrate"),
        "{again}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&idem_ok(args(&["migrate", "--json"], &db))?)?;
    assert_eq!(json["format_before"], 3, "{json}");
    assert_eq!(json["format_after"], 3, "{json}");
    assert_eq!(json["migrated"], false, "{json}");

    let verified = idem_ok(args(&["verify"], &db))?;
    assert!(verified.contains("sound: 11 records checked"), "{verified}");
    // An open without the migration call finds format 3 and every answer.
    let engine = Engine::builder().sweep_interval(None).open(&db)?;
    assert_eq!(engine.redb_format(), Some(3));
    for i in 0..10 {
        match engine.begin(&key(SCOPE, &format!("paid-{i}"))?, fp(BODY)?)? {
            Begin::Replay(r) => assert_eq!(r.envelope.body, format!("receipt {i}").as_bytes()),
            other => return Err(format!("paid-{i} is not a replay: {other:?}").into()),
        }
    }
    match engine.begin(&key(SCOPE, "stuck")?, fp(BODY)?)? {
        Begin::InDoubt(_) => {}
        other => return Err(format!("stuck is not in doubt: {other:?}").into()),
    }
    Ok(())
}

#[test]
fn migrate_reports_json_and_refuses_what_is_not_a_file() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    format2_file(&db)?;
    let json: serde_json::Value =
        serde_json::from_str(&idem_ok(args(&["migrate", "--json"], &db))?)?;
    assert_eq!(json["file"], db.to_string_lossy().as_ref(), "{json}");
    assert_eq!(json["format_before"], 2, "{json}");
    assert_eq!(json["format_after"], 3, "{json}");
    assert_eq!(json["migrated"], true, "{json}");

    // No file at all: the open's error, nothing created.
    let missing = dir.path().join("missing.redb");
    let err = idem_err(args(&["migrate"], &missing))?;
    assert!(err.contains("missing.redb"), "{err}");
    assert!(!missing.exists());

    // A database server has no format to migrate: a usage error (exit 2).
    for url in ["postgres://localhost/app", "redis://localhost:6379"] {
        let out = idem(["migrate", url])?;
        let stderr = String::from_utf8(out.stderr)?;
        assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
        assert!(stderr.contains("migrate works on redb files"), "{stderr}");
    }
    Ok(())
}

/// Another program's redb file: the read-only probe finds no idempotency
/// tables, and `idem migrate` must not go on to add them and report
/// "format unknown -> 3".
#[test]
fn migrate_refuses_another_programs_redb_file_and_leaves_it_unchanged() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("other.redb");
    {
        let other = redb::Database::create(&db)?;
        let txn = other.begin_write()?;
        {
            let def: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("app.stuff");
            txn.open_table(def)?.insert("x", 1)?;
        }
        txn.commit()?;
    }
    let before = std::fs::read(&db)?;
    let out = idem(args(&["migrate"], &db))?;
    let stderr = String::from_utf8(out.stderr)?;
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert!(stderr.contains("other.redb"), "{stderr}");
    assert!(stderr.contains("without idempotency tables"), "{stderr}");
    assert!(String::from_utf8(out.stdout)?.is_empty());
    assert_eq!(std::fs::read(&db)?, before, "the file was written");
    Ok(())
}

/// A format-2 file whose journal holds frames the file lacks (a process
/// killed after writes): the read-only probe cannot read its format, yet
/// `idem migrate` must report the format it migrated from, not "unknown".
#[test]
fn migrate_after_a_crash_recovers_first_and_reports_format_2() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    format2_file(&db)?;
    // A crash image: the file and journal as a killed process leaves them
    // (copied while the engine is open, after its last durable write).
    let crashed = dir.path().join("crashed.redb");
    {
        let engine = Engine::builder().sweep_interval(None).open(&db)?;
        let c = claim(&engine, &key(SCOPE, "late")?, fp(BODY)?)?;
        engine.complete(c, Envelope::new(1, 201, "late receipt"))?;
        std::fs::copy(&db, &crashed)?;
        let mut journal = crashed.clone().into_os_string();
        journal.push(".journal");
        let mut from = db.clone().into_os_string();
        from.push(".journal");
        std::fs::copy(from, journal)?;
    }
    let probe = idem_err(args(&["inspect"], &crashed))?;
    assert!(probe.contains("needs recovery"), "{probe}");

    let out = idem_ok(args(&["migrate"], &crashed))?;
    assert!(out.contains(": format 2 -> 3 in "), "{out}");
    assert!(!out.contains("unknown"), "{out}");
    let verified = idem_ok(args(&["verify"], &crashed))?;
    assert!(verified.contains("sound: 12 records checked"), "{verified}");
    Ok(())
}
