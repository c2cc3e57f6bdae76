//! A record that does not decode: guards against one bad record hiding the
//! rest of a listing, or crashing the CLI. It must show up as its own row,
//! named by its key, while every other record is still listed.

mod common;

use common::*;
use idempotency::Envelope;
use redb::TableDefinition;
use serde_json::Value;

/// The engine's records table (see `src/tables.rs`): record key → encoding.
const RECORDS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("idempotency.records");

/// One good record in `shop`, and `shop/broken` holding bytes that are not a
/// record.
fn with_corrupt_record(dir: &std::path::Path) -> TestResult<std::path::PathBuf> {
    let db = db_path(dir);
    let engine = engine(&db)?;
    let c = claim(&engine, &key("shop", "good")?, fp("{}")?)?;
    engine.complete(c, Envelope::new(1, 200, "ok"))?;
    drop(engine);
    let raw = redb::Database::open(&db)?;
    let txn = raw.begin_write()?;
    {
        let mut records = txn.open_table(RECORDS)?;
        // `[scope length][scope][key]`, as the engine lays out record keys.
        let rkey = [&[4u8][..], b"shop", b"broken"].concat();
        records.insert(rkey.as_slice(), [0xee_u8, 0xff, 0x00].as_slice())?;
    }
    txn.commit()?;
    Ok(db)
}

#[test]
fn inspect_shows_a_corrupt_record_as_its_own_row() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = with_corrupt_record(dir.path())?;
    let out = idem_ok(["inspect".as_ref(), db.as_os_str()])?;
    assert_eq!(out.lines().count(), 3, "{out}");
    let broken = out
        .lines()
        .find(|l| l.contains("shop/broken"))
        .ok_or("no corrupt row")?;
    assert!(
        broken.contains("CORRUPT") && broken.contains("is corrupt"),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.contains("good") && l.contains("COMPLETED")),
        "{out}"
    );

    let rows: Vec<Value> = serde_json::from_str(&idem_ok([
        "inspect".as_ref(),
        db.as_os_str(),
        "--json".as_ref(),
    ])?)?;
    assert_eq!(rows.len(), 2);
    let bad = rows
        .iter()
        .find(|r| r["state"] == "CORRUPT")
        .ok_or("no corrupt object")?;
    assert_eq!(bad["key"], "shop/broken");
    assert!(bad["error"].is_string());

    let stats: Value = serde_json::from_str(&idem_ok([
        "stats".as_ref(),
        db.as_os_str(),
        "--json".as_ref(),
    ])?)?;
    assert_eq!(
        (stats["corrupt"].as_u64(), stats["completed"].as_u64()),
        (Some(1), Some(1))
    );
    Ok(())
}

#[test]
fn show_of_a_corrupt_record_is_one_error_line() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = with_corrupt_record(dir.path())?;
    let err = idem_err([
        "show".as_ref(),
        db.as_os_str(),
        "shop".as_ref(),
        "broken".as_ref(),
    ])?;
    assert!(
        err.starts_with("idem: record for shop/broken is corrupt"),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_corrupt_record_is_purged_only_with_force() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = with_corrupt_record(dir.path())?;
    let args = |force: bool| {
        let mut a = vec![
            "purge".as_ref(),
            db.as_os_str(),
            "shop".as_ref(),
            "broken".as_ref(),
        ];
        if force {
            a.push("--force".as_ref());
        }
        a
    };
    let err = idem_err(args(false))?;
    assert!(
        err.contains("is corrupt") && err.contains("--force"),
        "{err}"
    );
    let out = idem_ok(args(true))?;
    assert!(out.contains("purged corrupt record shop/broken"), "{out}");
    // The key is usable again; the good record is untouched.
    let engine = engine(&db)?;
    assert!(matches!(
        engine.begin(&key("shop", "broken")?, fp("{}")?)?,
        idempotency::Begin::Claimed(_)
    ));
    assert!(matches!(
        engine.begin(&key("shop", "good")?, fp("{}")?)?,
        idempotency::Begin::Replay(_)
    ));
    Ok(())
}
