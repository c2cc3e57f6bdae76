//! `idem salvage`: guards against an operator misreading its result. Its
//! exit code must tell "everything copied" (0) from "keys lost" (3, each
//! listed by key, in text and JSON) from an error (1, nothing written), and
//! it must never write over an existing file.

mod common;

use common::raw_records::RawRecords;
use common::*;
use idempotency::Envelope;
use serde_json::Value;

/// One completed record, `shop/good`.
fn sound(dir: &std::path::Path) -> TestResult<std::path::PathBuf> {
    let db = db_path(dir);
    let engine = engine(&db)?;
    let c = claim(&engine, &key("shop", "good")?, fp("{}")?)?;
    engine.complete(c, Envelope::new(1, 200, "ok"))?;
    drop(engine);
    Ok(db)
}

#[test]
fn a_sound_file_is_salvaged_whole_with_exit_0() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = sound(dir.path())?;
    let new = dir.path().join("new.redb");
    let out = idem_ok(["salvage".as_ref(), db.as_os_str(), new.as_os_str()])?;
    assert!(
        out.contains("1 records") && out.contains("not copied: 0"),
        "{out}"
    );
    let out = idem_ok([
        "show".as_ref(),
        new.as_os_str(),
        "shop".as_ref(),
        "good".as_ref(),
    ])?;
    assert!(out.contains("COMPLETED"), "{out}");
    Ok(())
}

#[test]
fn lost_keys_are_listed_with_exit_3() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = sound(dir.path())?;
    let raw = redb::Database::open(&db)?;
    let txn = raw.begin_write()?;
    {
        let mut records = RawRecords::open(&txn)?;
        let rkey = [&[4u8][..], b"shop", b"broken"].concat();
        records.insert(&rkey, &[0xee_u8, 0xff, 0x00])?;
    }
    txn.commit()?;
    drop(raw);

    let new = dir.path().join("new.redb");
    let out = idem(["salvage".as_ref(), db.as_os_str(), new.as_os_str()])?;
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let stdout = String::from_utf8(out.stdout)?;
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("lost: record shop/broken not copied")),
        "{stdout}"
    );
    assert!(String::from_utf8(out.stderr)?.contains("could not be copied"));

    let again = dir.path().join("again.redb");
    let out = idem([
        "salvage".as_ref(),
        db.as_os_str(),
        again.as_os_str(),
        "--json".as_ref(),
    ])?;
    assert_eq!(out.status.code(), Some(3));
    let report: Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(report["records"], 1);
    assert_eq!(report["complete"], false);
    assert_eq!(report["lost"][0]["kind"], "record");
    assert_eq!(report["lost"][0]["key_hex"], "0473686f7062726f6b656e");
    Ok(())
}

#[test]
fn an_existing_new_file_is_refused_with_exit_1() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = sound(dir.path())?;
    let new = dir.path().join("new.redb");
    std::fs::write(&new, b"keep me")?;
    let line = idem_err(["salvage".as_ref(), db.as_os_str(), new.as_os_str()])?;
    assert!(line.contains("already exists and is not empty"), "{line}");
    assert_eq!(std::fs::read(&new)?, b"keep me");
    Ok(())
}
