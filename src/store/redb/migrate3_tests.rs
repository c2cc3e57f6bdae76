//! The stepped migration's key ranges on raw tables (values are copied
//! as they are, so any bytes do): every record, step and log entry lands
//! once under its slot key, steps and log entries without a record
//! included (before the first record, between two, past the last),
//! whether steps end on the last record or not, and after a stop.

use std::collections::BTreeMap;
use std::path::Path;

use redb::backends::InMemoryBackend;
use redb::{Database, ReadableDatabase, ReadableTable};

use super::*;
use crate::store::redb::meta::{file_format, Format};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// Every entry of format 2's (`false`) or format 3's (`true`) records,
/// steps and history tables, keys in bytes (format 3's: slot keys).
type Entries = BTreeMap<(u8, Vec<u8>, String), Vec<u8>>;

fn rkey(name: &str) -> Vec<u8> {
    name.as_bytes().to_vec()
}

/// A format-2 file of `n` records `key-000`.. with two steps and a log
/// entry for every other record, and steps and log entries of keys with
/// no record: `aaa` (before the first), `key-000x` (between the first
/// two) and `zzz` (past the last).
fn format_2_file(n: usize) -> Result<(Database, Entries), Box<dyn std::error::Error>> {
    let db = redb::Builder::new().create_with_backend(InMemoryBackend::new())?;
    let mut want = Entries::new();
    let txn = db.begin_write()?;
    {
        meta::create(&mut txn.open_table(META)?)?;
        let mut records = txn.open_table(RECORDS)?;
        let mut steps = txn.open_table(STEPS)?;
        let mut history = txn.open_table(HISTORY)?;
        let mut keys: Vec<Vec<u8>> = Vec::new();
        for i in 0..n {
            let k = rkey(&format!("key-{i:03}"));
            let v = format!("record {i}").into_bytes();
            records.insert(k.as_slice(), v.as_slice())?;
            want.insert((0, k.clone(), String::new()), v);
            if i % 2 == 0 {
                keys.push(k);
            }
        }
        keys.extend([rkey("aaa"), rkey("key-000x"), rkey("zzz")]);
        for k in keys {
            for name in ["charge", "receipt"] {
                let v = format!("step {name}").into_bytes();
                steps.insert((k.as_slice(), name), v.as_slice())?;
                want.insert((1, k.clone(), name.to_string()), v);
            }
            history.insert((k.as_slice(), 0), b"log 0".as_slice())?;
            want.insert((2, k.clone(), "0".to_string()), b"log 0".to_vec());
        }
    }
    txn.commit()?;
    Ok((db, want))
}

/// Format 3's three tables, keys back as record keys (each checked to be
/// in the built partition).
fn copied(db: &Database) -> Result<Entries, Box<dyn std::error::Error>> {
    let txn = db.begin_read()?;
    let mut out = Entries::new();
    let rkey_of = |slot: &[u8]| -> Result<Vec<u8>, Box<dyn std::error::Error>> {
        match slot::split(slot) {
            Some((BUILT_PARTITIONS, rkey)) => Ok(rkey.to_vec()),
            other => Err(format!("a slot key outside the built partition: {other:?}").into()),
        }
    };
    match txn.open_table(catalog::RECORDS) {
        Ok(t) => {
            for e in t.iter()? {
                let (k, v) = e?;
                out.insert((0, rkey_of(k.value())?, String::new()), v.value().to_vec());
            }
        }
        Err(TableError::TableDoesNotExist(_)) => return Ok(out),
        Err(e) => return Err(e.into()),
    }
    for e in txn.open_table(catalog::STEPS)?.iter()? {
        let (k, v) = e?;
        let (slot, name) = k.value();
        out.insert((1, rkey_of(slot)?, name.to_string()), v.value().to_vec());
    }
    for e in txn.open_table(catalog::HISTORY)?.iter()? {
        let (k, v) = e?;
        let (slot, seq) = k.value();
        out.insert((2, rkey_of(slot)?, seq.to_string()), v.value().to_vec());
    }
    Ok(out)
}

/// The entries of `all` whose record key is at most `last`.
fn up_to(all: &Entries, last: &str) -> Entries {
    all.iter()
        .filter(|((_, k, _), _)| k.as_slice() <= last.as_bytes())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn steps(records: u64, stop_after: Option<u64>) -> MigrationSteps {
    MigrationSteps {
        records,
        stop_after,
    }
}

const SEED: [u8; 16] = [7; 16];

#[test]
fn a_stopped_migration_resumes_and_copies_everything_once() -> TestResult {
    let (db, want) = format_2_file(10)?;
    let path = Path::new("test.redb");
    // Two steps of 3: key-000..key-005, with `aaa` and `key-000x`.
    let stopped = to_format_3(&db, path, &SEED, 1_000, steps(3, Some(2)));
    assert!(
        matches!(stopped, Err(OpenError::Storage { .. })),
        "{stopped:?}"
    );
    assert_eq!(file_format(&db, path)?, Some(Format::V2));
    assert_eq!(copied(&db)?, up_to(&want, "key-005"));
    assert_eq!(partial_copy(&db)?, Some(6));
    assert_eq!(
        resume_point(&db).map_err(|e| e.open_error(path, WHAT))?,
        Some(rkey("key-005"))
    );

    let m = to_format_3(&db, path, &SEED, 1_000, steps(3, None))?;
    assert!(m.resumed);
    // key-006..key-008, then key-009 (fewer than 3: the last step).
    assert_eq!((m.records, m.transactions), (4, 2));
    assert_eq!(file_format(&db, path)?, Some(Format::V3));
    assert_eq!(copied(&db)?, want);
    let txn = db.begin_read()?;
    assert!(matches!(
        txn.open_table(RECORDS),
        Err(TableError::TableDoesNotExist(_))
    ));
    let row = txn
        .open_table(PARTITIONS)?
        .get(BUILT_PARTITIONS)?
        .ok_or("no row for the built partition")?;
    let row = PartitionRow::decode(BUILT_PARTITIONS, row.value())?;
    assert_eq!(row.keys, 10);
    assert!(row.filter_checksum.is_some());
    Ok(())
}

#[test]
fn steps_that_end_on_the_last_record_finish_with_an_empty_step() -> TestResult {
    for (n, step, transactions) in [(9, 3, 4), (9, 1, 10), (1, 5, 1), (0, 2, 1)] {
        let (db, want) = format_2_file(n)?;
        let path = Path::new("test.redb");
        let m = to_format_3(&db, path, &SEED, 1_000, steps(step, None))?;
        assert_eq!(
            (m.records, m.transactions),
            (n as u64, transactions),
            "{n} by {step}"
        );
        assert!(!m.resumed);
        assert_eq!(copied(&db)?, want, "{n} by {step}");
        assert_eq!(file_format(&db, path)?, Some(Format::V3));
    }
    Ok(())
}

#[test]
fn a_format_2_open_deletes_a_partial_copy_and_nothing_else() -> TestResult {
    let (db, want) = format_2_file(10)?;
    let path = Path::new("test.redb");
    drop_partial_copy(&db, path)?;
    assert_eq!(
        partial_copy(&db)?,
        None,
        "nothing to delete: nothing created"
    );
    assert!(to_format_3(&db, path, &SEED, 1_000, steps(4, Some(1))).is_err());
    assert_eq!(partial_copy(&db)?, Some(4));
    drop_partial_copy(&db, path)?;
    assert_eq!(partial_copy(&db)?, None);
    assert_eq!(file_format(&db, path)?, Some(Format::V2));
    let txn = db.begin_read()?;
    assert_eq!(txn.open_table(RECORDS)?.iter()?.count(), 10);
    drop(txn);
    // Started over: all of it, in one go.
    let m = to_format_3(&db, path, &SEED, 1_000, steps(50, None))?;
    assert_eq!((m.records, m.transactions, m.resumed), (10, 1, false));
    assert_eq!(copied(&db)?, want);
    Ok(())
}
