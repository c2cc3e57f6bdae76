//! The two tables effect steps added to a redb file (`idempotency.steps`,
//! `idempotency.history`), end to end through the file: they survive a
//! reopen and a crash whose writes live only in the journal, `verify`
//! names a damaged step and a damaged log entry, salvage copies both, and
//! a format-2 file (the committed fixtures, written before steps existed)
//! opens unchanged and takes steps afterwards.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use redb::{ReadableDatabase, ReadableTable};

use crate::clock::ManualClock;
use crate::error::{Corrupted, Error};
use crate::key::IdempotencyKey;
use crate::policy::ExpiryPolicy;
use crate::store::config::StoreConfig;
use crate::store::step::StepStatus;
use crate::store::{Backend, FinishStepRequest, HistoryRecord, StepRecord, StepRequest};
use crate::verify::Damage;

use super::journal::JournalStorage;
use super::tables::{HISTORY, STEPS};
use super::test_requests::{claim, paid, R};
use super::{prepare, Opened, RedbStore, Sizes};

const T0: u64 = 1_796_000_000_000;
const DAY_MS: u64 = 24 * 60 * 60 * 1000;

/// Opens the store at `path` as the fixtures' writer had it (30-day TTL,
/// tombstones kept 10 days), taking the stored settings when there are.
fn open(path: &Path, clock: &ManualClock) -> R<RedbStore> {
    let cfg = StoreConfig {
        ttl_ms: 30 * DAY_MS,
        expiry: ExpiryPolicy::Tombstone {
            keep: std::time::Duration::from_millis(10 * DAY_MS),
        },
        max_response_bytes: 1 << 20,
    };
    let opened = Opened::path(path, None)?;
    let cfg = prepare(&opened.db, path, cfg, true)?;
    Ok(RedbStore::start(
        opened,
        cfg,
        Arc::new(clock.clone()),
        Sizes {
            max_batch: 16,
            max_group_bytes: 1 << 20,
            queue_capacity: 64,
            recovery_reserve: 0,
            seal_rule: crate::store::redb::PartitionSealRule::DEFAULT,
            migration: None,
        },
        None,
    )?)
}

/// A claim of `key` that charges and sends a receipt, then completes.
fn two_calls(store: &RedbStore, key: &IdempotencyKey) -> R<()> {
    let c = claim(store, key)?;
    for (name, evidence) in [("charge", &b"ch_1"[..]), ("receipt", &b"rc_1"[..])] {
        store.reserve_step(StepRequest {
            key: key.clone(),
            token: c.token,
            name: name.into(),
            finished: Vec::new(),
        })?;
        store.finish_step(FinishStepRequest {
            key: key.clone(),
            token: c.token,
            name: name.into(),
            confirmed: true,
            evidence: evidence.to_vec(),
        })?;
    }
    store.complete(paid(key, c.token))?;
    Ok(())
}

fn steps_and_log(
    store: &RedbStore,
    key: &IdempotencyKey,
) -> R<(Vec<StepRecord>, Vec<HistoryRecord>)> {
    Ok((store.steps(key)?, store.history(key)?))
}

fn key(k: &str) -> R<IdempotencyKey> {
    Ok(IdempotencyKey::new("shop:pay", k)?)
}

/// Copies the database at `from` and its journal to `dir`, as a crash
/// would leave them (taken while the store still runs, after its last
/// write was acknowledged and before any checkpoint).
fn crash_image(from: &Path, dir: &Path) -> R<PathBuf> {
    let to = dir.join("crashed.redb");
    std::fs::copy(from, &to)?;
    std::fs::copy(JournalStorage::path_of(from), JournalStorage::path_of(&to))?;
    Ok(to)
}

#[test]
fn steps_and_log_survive_a_reopen_and_a_journal_replay() -> R<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("steps.redb");
    let clock = ManualClock::new(T0);
    let k = key("pay-1")?;
    let store = open(&path, &clock)?;
    two_calls(&store, &k)?;
    let written = steps_and_log(&store, &k)?;
    assert_eq!(written.0.len(), 2);
    assert_eq!(written.1.len(), 5);
    // A crash: the image has the acknowledged writes in its journal only.
    let crash_dir = tempfile::tempdir()?;
    let crashed = crash_image(&path, crash_dir.path())?;
    drop(store);
    let reopened = open(&path, &clock)?;
    assert_eq!(
        steps_and_log(&reopened, &k)?,
        written,
        "after a clean reopen"
    );
    drop(reopened);
    let replayed = open(&crashed, &clock)?;
    assert_eq!(
        steps_and_log(&replayed, &k)?,
        written,
        "after the journal's replay"
    );
    let (damage, _) = replayed.verify()?;
    assert!(damage.is_empty(), "{damage:?}");
    Ok(())
}

/// Rewrites the value stored under `(rkey, name)` in the steps table, or
/// under `(rkey, seq)` in the log, with one byte flipped.
fn flip(path: &Path, rkey: &[u8], step: Option<&str>, seq: Option<u32>) -> R<()> {
    let db = redb::Database::open(path)?;
    let txn = db.begin_write()?;
    {
        if let Some(name) = step {
            let mut t = txn.open_table(STEPS)?;
            let mut v = t.get((rkey, name))?.ok_or("no such step")?.value().to_vec();
            v[3] ^= 0x10;
            t.insert((rkey, name), v.as_slice())?;
        }
        if let Some(seq) = seq {
            let mut t = txn.open_table(HISTORY)?;
            let mut v = t.get((rkey, seq))?.ok_or("no such entry")?.value().to_vec();
            v[2] ^= 0x01;
            t.insert((rkey, seq), v.as_slice())?;
        }
    }
    txn.commit()?;
    Ok(())
}

#[test]
fn verify_names_a_flipped_byte_in_a_step_and_in_a_log_entry() -> R<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("steps.redb");
    let clock = ManualClock::new(T0);
    let (k, other) = (key("pay-1")?, key("pay-2")?);
    {
        let store = open(&path, &clock)?;
        two_calls(&store, &k)?;
    }
    flip(&path, k.record_key(), Some("receipt"), Some(1))?;
    let store = open(&path, &clock)?;
    let (damage, _) = store.verify()?;
    let hex = crate::store::record::hex(k.record_key());
    assert!(
        damage.contains(&Damage::UndecodableStep {
            key_hex: hex.clone(),
            step: "receipt".into(),
            reason: "the stored checksum does not match: the value or its key was damaged".into(),
        }),
        "{damage:?}"
    );
    assert!(
        damage.iter().any(
            |d| matches!(d, Damage::UndecodableHistory { key_hex, seq: 1, .. } if *key_hex == hex)
        ),
        "{damage:?}"
    );
    assert_eq!(damage.len(), 2, "{damage:?}");
    // A read of the key names the step; other keys keep working.
    match store.steps(&k) {
        Err(Error::Corrupt {
            what: Corrupted::Step { step, .. },
            ..
        }) => assert_eq!(step, "receipt"),
        other => return Err(format!("expected a corrupt step, got {other:?}").into()),
    }
    two_calls(&store, &other)?;
    assert_eq!(store.steps(&other)?.len(), 2);
    Ok(())
}

#[test]
fn salvage_copies_steps_and_log_and_lists_a_damaged_step() -> R<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("steps.redb");
    let clock = ManualClock::new(T0);
    let (k, other) = (key("pay-1")?, key("pay-2")?);
    let written = {
        let store = open(&path, &clock)?;
        two_calls(&store, &k)?;
        two_calls(&store, &other)?;
        steps_and_log(&store, &k)?
    };
    let copy = dir.path().join("copy.redb");
    let report = super::salvage(&path, &copy)?;
    assert!(report.is_complete(), "{:?}", report.lost);
    {
        let store = open(&copy, &clock)?;
        assert_eq!(steps_and_log(&store, &k)?, written);
        assert_eq!(store.steps(&other)?.len(), 2);
    }
    flip(&path, other.record_key(), Some("charge"), None)?;
    let second = dir.path().join("second.redb");
    let report = super::salvage(&path, &second)?;
    let lost: Vec<String> = report.lost.iter().map(ToString::to_string).collect();
    assert_eq!(lost.len(), 1, "{lost:?}");
    assert!(
        lost[0].contains("effect step \"charge\" of shop:pay/pay-2"),
        "{lost:?}"
    );
    let store = open(&second, &clock)?;
    assert_eq!(steps_and_log(&store, &k)?, written);
    let left: Vec<_> = store.steps(&other)?.into_iter().map(|s| s.name).collect();
    assert_eq!(left, ["receipt"]);
    Ok(())
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Whether the file has the steps table (without creating it).
fn has_steps_table(path: &Path) -> R<bool> {
    let db = redb::Database::open(path)?;
    let txn = db.begin_read()?;
    let found = match txn.open_table(STEPS) {
        Ok(_) => true,
        Err(redb::TableError::TableDoesNotExist(_)) => false,
        Err(e) => return Err(e.into()),
    };
    Ok(found)
}

#[test]
fn format_2_files_open_unchanged_and_then_take_steps() -> R<()> {
    for name in ["format2.redb", "format2-crashed.redb"] {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join(name);
        std::fs::copy(fixture(name), &path)?;
        std::fs::copy(
            JournalStorage::path_of(&fixture(name)),
            JournalStorage::path_of(&path),
        )?;
        let clock = ManualClock::new(1_795_000_000_000 + DAY_MS);
        let k = key("steps-after-upgrade")?;
        {
            let store = open(&path, &clock)?;
            assert!(store.steps(&k)?.is_empty());
            assert!(store.history(&k)?.is_empty());
            let (damage, records) = store.verify()?;
            assert!(damage.is_empty(), "{name}: {damage:?}");
            assert!(records > 0, "{name}: the fixture's records are there");
            two_calls(&store, &k)?;
            let (steps, log) = steps_and_log(&store, &k)?;
            assert_eq!(
                steps.iter().map(|s| s.status).collect::<Vec<_>>(),
                [StepStatus::Confirmed, StepStatus::Confirmed]
            );
            assert_eq!(log.len(), 5);
        }
        assert!(has_steps_table(&path)?, "{name}: created on first use");
        let store = open(&path, &clock)?;
        assert_eq!(store.steps(&k)?.len(), 2, "{name}: after a reopen");
        let (damage, _) = store.verify()?;
        assert!(damage.is_empty(), "{name}: {damage:?}");
    }
    Ok(())
}

#[test]
fn a_format_2_file_opened_without_steps_gets_no_new_tables() -> R<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("format2.redb");
    std::fs::copy(fixture("format2.redb"), &path)?;
    std::fs::copy(
        JournalStorage::path_of(&fixture("format2.redb")),
        JournalStorage::path_of(&path),
    )?;
    let clock = ManualClock::new(1_795_000_000_000 + DAY_MS);
    {
        let store = open(&path, &clock)?;
        assert!(store.steps(&key("pay-1")?)?.is_empty());
        assert!(store.history(&key("pay-1")?)?.is_empty());
    }
    assert!(!has_steps_table(&path)?, "reads create no table");
    // A read-only open of the format-2 file reads no steps, and works.
    {
        let reader = super::RedbReader::open(&path)?;
        assert!(reader.steps(&key("pay-1")?)?.is_empty());
        assert!(reader.history(&key("pay-1")?)?.is_empty());
    }
    let db = redb::Database::open(&path)?;
    let txn = db.begin_read()?;
    assert!(txn.open_table(HISTORY).is_err());
    Ok(())
}

#[test]
fn a_read_only_open_reads_steps_and_log() -> R<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("steps.redb");
    let clock = ManualClock::new(T0);
    let k = key("pay-1")?;
    let written = {
        let store = open(&path, &clock)?;
        two_calls(&store, &k)?;
        steps_and_log(&store, &k)?
    };
    {
        let reader = super::RedbReader::open(&path)?;
        assert_eq!(reader.steps(&k)?, written.0);
        assert_eq!(reader.history(&k)?, written.1);
    }
    let db = redb::Database::open(&path)?;
    let txn = db.begin_read()?;
    let steps = txn.open_table(STEPS)?;
    assert_eq!(steps.iter()?.count(), 2);
    Ok(())
}

/// A format-2 file whose keys have steps and log entries is sound, a
/// tombstone's summary entry included (it keeps its record); a record row
/// deleted behind the engine's back (a bug, or a lost page) leaves its
/// key's steps and log without a record, and verify names them beside the
/// index entry left stray. `idem purge --force` then deletes them.
#[test]
fn verify_names_steps_and_log_whose_record_row_is_gone() -> R<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("steps.redb");
    let clock = ManualClock::new(T0);
    let (old, k, other) = (key("pay-0")?, key("pay-1")?, key("pay-2")?);
    {
        let store = open(&path, &clock)?;
        two_calls(&store, &old)?;
        clock.set(T0 + 30 * DAY_MS + 1);
        two_calls(&store, &k)?;
        two_calls(&store, &other)?;
        assert_eq!(store.sweep(100)?.tombstoned, 1);
        let (steps, log) = steps_and_log(&store, &old)?;
        assert!(steps.is_empty(), "a tombstone keeps no steps: {steps:?}");
        assert_eq!(log.len(), 1, "one summary entry in place of its log");
        let (damage, records) = store.verify()?;
        assert_eq!((damage, records), (Vec::new(), 3));
    }
    let at_ms = {
        let db = redb::Database::open(&path)?;
        let txn = db.begin_write()?;
        let rkey = k.record_key();
        let at = {
            let mut records = txn.open_table(super::tables::RECORDS)?;
            let value = records.remove(rkey)?.ok_or("pay-1's record")?;
            crate::store::codec::decode(rkey, value.value())
                .map_err(|e| e.to_string())?
                .expires_at_ms
        };
        txn.commit()?;
        at
    };
    let store = open(&path, &clock)?;
    let (damage, _) = store.verify()?;
    let key_hex = crate::store::record::hex(k.record_key());
    let without = Damage::StepsWithoutRecord {
        key_hex: key_hex.clone(),
        partition: None,
        record_in: None,
        steps: vec!["charge".into(), "receipt".into()],
        log_entries: 5,
    };
    assert_eq!(
        damage,
        [
            Damage::StrayIndexEntry {
                index: "expiry",
                at_ms,
                key_hex,
            },
            without.clone(),
        ]
    );
    assert_eq!(
        without.to_string(),
        "effect steps [\"charge\", \"receipt\"] and 5 evidence log entries of shop:pay/pay-1 \
         are stored without a record of the key"
    );
    assert_eq!(store.purge(k.clone(), crate::PurgeMode::Force)?, None);
    let (damage, _) = store.verify()?;
    assert!(!damage.contains(&without), "purged: {damage:?}");
    Ok(())
}
