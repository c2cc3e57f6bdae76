//! A record that does not decode: guards against one bad record hiding the
//! rest of a listing, or crashing the CLI. It must show up as its own row,
//! named by its key, while every other record is still listed. Each test
//! runs on a file of each format (`<name>::format_3`, what the engine
//! creates, and `<name>::format_2`, what earlier releases created).

mod common;

use std::path::{Path, PathBuf};

use common::raw_records::{Format, RawRecords};
use common::*;
use idempotency::{Corrupted, Engine, Envelope};
use serde_json::Value;

/// Each `fn name(format: Format) -> TestResult` becomes the tests
/// `name::format_3` and `name::format_2`.
macro_rules! both_formats {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn format_3() -> super::TestResult {
                super::$name(super::Format::Three)
            }
            #[test]
            fn format_2() -> super::TestResult {
                super::$name(super::Format::Two)
            }
        }
    )*};
}

both_formats!(
    inspect_shows_a_corrupt_record_as_its_own_row,
    show_of_a_corrupt_record_is_one_error_line,
    a_corrupt_record_is_purged_only_with_force,
    verify_finds_undecodable_records_and_moved_keys,
    a_flipped_byte_in_a_value_is_an_error_naming_the_key,
);

/// A new engine on `path`, creating the file in `format`.
fn engine_in(path: &Path, format: Format) -> TestResult<Engine> {
    Ok(format.builder().sweep_interval(None).open(path)?)
}

/// One good record in `shop`, and `shop/broken` holding bytes that are not a
/// record.
fn with_corrupt_record(dir: &Path, format: Format) -> TestResult<PathBuf> {
    let db = db_path(dir);
    let engine = engine_in(&db, format)?;
    let c = claim(&engine, &key("shop", "good")?, fp("{}")?)?;
    engine.complete(c, Envelope::new(1, 200, "ok"))?;
    drop(engine);
    let raw = redb::Database::open(&db)?;
    let txn = raw.begin_write()?;
    {
        let mut records = RawRecords::open(&txn)?;
        // `[scope length][scope][key]`, as the engine lays out record keys.
        let rkey = [&[4u8][..], b"shop", b"broken"].concat();
        records.insert(&rkey, &[0xee_u8, 0xff, 0x00])?;
    }
    txn.commit()?;
    Ok(db)
}

fn inspect_shows_a_corrupt_record_as_its_own_row(format: Format) -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = with_corrupt_record(dir.path(), format)?;
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

fn show_of_a_corrupt_record_is_one_error_line(format: Format) -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = with_corrupt_record(dir.path(), format)?;
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

fn a_corrupt_record_is_purged_only_with_force(format: Format) -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = with_corrupt_record(dir.path(), format)?;
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

/// `idem verify` proves a sound file sound, and on a damaged one lists what
/// is wrong and exits 1: a value that does not decode, and a record whose
/// key bytes changed (its expiry index entry then names a record that is
/// not there, and the moved record fails its checksum, which covers its key
/// bytes).
fn verify_finds_undecodable_records_and_moved_keys(format: Format) -> TestResult {
    let dir = tempfile::tempdir()?;
    let sound = db_path(dir.path());
    {
        let engine = engine_in(&sound, format)?;
        let c = claim(&engine, &key("shop", "good")?, fp("{}")?)?;
        engine.complete(c, Envelope::new(1, 200, "ok"))?;
    }
    let out = idem_ok(["verify".as_ref(), sound.as_os_str()])?;
    assert!(out.contains("sound: 1 records checked"), "{out}");

    let other = tempfile::tempdir()?;
    let db = with_corrupt_record(other.path(), format)?;
    // Move the good record to other key bytes, as a flipped byte would.
    {
        let raw = redb::Database::open(&db)?;
        let txn = raw.begin_write()?;
        {
            let mut records = RawRecords::open(&txn)?;
            let old = [&[4u8][..], b"shop", b"good"].concat();
            let value = records.remove(&old)?.ok_or("no good record")?;
            let moved = [&[4u8][..], b"shop", b"goad"].concat();
            records.insert(&moved, &value)?;
        }
        txn.commit()?;
    }
    let before = std::fs::read(&db)?;
    let out = idem(["verify".as_ref(), db.as_os_str()])?;
    let stderr = String::from_utf8(out.stderr)?;
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim_end(), "idem: 3 problems found in 2 records");
    let listed = String::from_utf8(out.stdout)?;
    assert!(
        listed.contains("record shop/broken does not decode"),
        "{listed}"
    );
    assert!(
        listed.contains("names record shop/good, which is missing"),
        "{listed}"
    );
    assert!(
        listed.contains("record shop/goad does not decode: the stored checksum does not match"),
        "{listed}"
    );
    assert!(std::fs::read(&db)? == before, "verify changed the file");
    Ok(())
}

/// One flipped byte inside a stored record (its response body here): the
/// record fails its checksum, so `idem show` is an error naming the key
/// (never the altered body), a request for the key is an error (never a
/// replay of the altered bytes, never a fresh claim), the other keys still
/// answer, and `idem verify` lists it and exits 1.
fn a_flipped_byte_in_a_value_is_an_error_naming_the_key(format: Format) -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    {
        let engine = engine_in(&db, format)?;
        for (k, body) in [("good", "amount=122"), ("flipped", "amount=122")] {
            let c = claim(&engine, &key("shop", k)?, fp("{}")?)?;
            engine.complete(c, Envelope::new(1, 201, body))?;
        }
    }
    {
        let raw = redb::Database::open(&db)?;
        let txn = raw.begin_write()?;
        {
            let mut records = RawRecords::open(&txn)?;
            let rkey = [&[4u8][..], b"shop", b"flipped"].concat();
            let mut value = records.get(&rkey)?.ok_or("no record")?;
            let at = value
                .windows(10)
                .position(|w| w == b"amount=122")
                .ok_or("body not found")?;
            value[at + 8] = b'0'; // 122 → 102
            records.insert(&rkey, &value)?;
        }
        txn.commit()?;
    }
    let err = idem_err([
        "show".as_ref(),
        db.as_os_str(),
        "shop".as_ref(),
        "flipped".as_ref(),
    ])?;
    assert!(
        err.starts_with(
            "idem: record for shop/flipped is corrupt: the stored checksum does not match"
        ),
        "{err}"
    );
    let out = idem(["verify".as_ref(), db.as_os_str()])?;
    assert_eq!(out.status.code(), Some(1));
    let listed = String::from_utf8(out.stdout)?;
    assert!(
        listed.contains("record shop/flipped does not decode: the stored checksum does not match"),
        "{listed}"
    );
    assert_eq!(listed.lines().count(), 1, "{listed}");

    let engine = engine(&db)?;
    let err = engine
        .begin(&key("shop", "flipped")?, fp("{}")?)
        .err()
        .ok_or("a damaged record answered")?;
    assert!(
        matches!(&err, idempotency::Error::Corrupt { what: Corrupted::Record(key), .. } if key.key() == "flipped"),
        "{err:?}"
    );
    assert!(matches!(
        engine.begin(&key("shop", "good")?, fp("{}")?)?,
        idempotency::Begin::Replay(_)
    ));
    Ok(())
}
