//! Guards `Engine::salvage` of a format-3 file (time-partitioned records,
//! issue 26) against what it must never do: copy a state that is not the
//! one stored, lose a key without listing it, let a damaged partition row
//! or filter hide a partition's records, or drop what the journal holds.
//!
//! A format-3 database with partitions of 8 keys is written through the
//! public API (records in every state, a tombstone, effect steps with
//! their log entries, inbox marks, outbox messages, entities). Each test
//! damages a copy (a record's value, a records leaf page, the partition
//! rows and filters, a crash before the checkpoint), salvages it, and
//! reads both files with redb directly: every record in the new file is
//! the original byte for byte, every one missing is listed, the new file
//! is of format 3 (one sealed partition), opens, passes `verify`, and replays every
//! copied record as the old file does. The random byte flips of
//! `tests/salvage.rs` run on a format-3 file there too.

mod common;
#[path = "common/db_files.rs"]
mod db_files;
#[path = "common/fixture_engine.rs"]
mod fixture_engine;
#[path = "common/hex.rs"]
mod hex;
#[path = "common/mixed_workload.rs"]
mod mixed_workload;

use std::collections::{BTreeMap, BTreeSet};
use std::error::Error;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use db_files::{copy_db, journal_of};
use hex::{hex, unhex};
use idempotency::{Engine, EngineBuilder, Fingerprint, Lost, ManualClock, State};
use mixed_workload::{key, Kind, Workload};
use redb::{ReadableDatabase, ReadableTable, TableDefinition};

type TestResult = Result<(), Box<dyn Error>>;

const RECORDS: TableDefinition<&[u8], &[u8]> =
    TableDefinition::new("idempotency.partitioned.records");
const STEPS: TableDefinition<(&[u8], &str), &[u8]> =
    TableDefinition::new("idempotency.partitioned.steps");
const HISTORY: TableDefinition<(&[u8], u32), &[u8]> =
    TableDefinition::new("idempotency.partitioned.history");
const PARTITIONS: TableDefinition<u64, &[u8]> = TableDefinition::new("idempotency.partitions");
const FILTERS: TableDefinition<u64, &[u8]> = TableDefinition::new("idempotency.filters");
const OUTBOX: TableDefinition<u64, &[u8]> = TableDefinition::new("idempotency.outbox");
const ENTITIES: TableDefinition<&str, &[u8]> = TableDefinition::new("idempotency.entities");

/// The partition a salvage (or a migration) builds: 2^63.
const BUILT: u64 = 1 << 63;
const PARTITION_KEYS: u64 = 8;
const T0: u64 = 1_790_000_000_000;
/// Set for the child that writes and exits without closing the engine.
const CRASH_ENV: &str = "IDEMPOTENCY_SALVAGE3_CRASH_FILE";

/// The fixtures' builder, with small partitions.
fn builder(clock: &ManualClock) -> EngineBuilder {
    fixture_engine::builder(clock).partition_limits(PARTITION_KEYS, Duration::from_secs(600))
}

/// The stored record key of `key(i)`: `[scope length][scope][key]`.
fn rkey(i: usize) -> Vec<u8> {
    let scope = b"shop:pay";
    let mut out = vec![8u8];
    out.extend_from_slice(scope);
    out.extend_from_slice(format!("order-{i:04}").as_bytes());
    out
}

fn fp(i: usize) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(format!(r#"{{"order":{i}}}"#).as_bytes(), &[])
}

/// A distinct body of about 300 bytes.
fn body(i: usize) -> Vec<u8> {
    let note: String = (0..250)
        .map(|j| char::from(b'a' + u8::try_from((i * 31 + j * 7) % 26).unwrap_or(0)))
        .collect();
    format!(r#"{{"payment":"pay_{i:04}","note":"{note}"}}"#).into_bytes()
}

/// What key `i` becomes: completed (some after a confirmed effect step,
/// which logs evidence), failed, UNKNOWN, PROCESSING, tombstoned, or an
/// inbox mark or an entity instead.
fn kind(i: usize) -> Kind {
    match i % 10 {
        3 => Kind::Tombstone,
        0 => Kind::Declined("declined".to_string()),
        1 => Kind::Unknown,
        2 => Kind::Processing,
        4 | 8 => Kind::CompletedAfterStep,
        5 => Kind::CompletedWithReceipt { json: false },
        7 => Kind::InboxMark,
        9 => Kind::Entity { paid: false },
        _ => Kind::Completed,
    }
}

/// The keys, inbox marks, outbox messages and entities written.
const WORKLOAD: Workload = Workload {
    key,
    fp,
    body,
    kind,
};

/// A format-3 database of `keys` keys, closed cleanly.
fn build(path: &Path, keys: usize) -> TestResult {
    let clock = ManualClock::new(T0);
    let engine = builder(&clock).open(path)?;
    WORKLOAD.write(&engine, &clock, 0..keys)?;
    drop(engine);
    Ok(())
}

/// The raw contents of a format-3 file's data tables, by record key.
#[derive(Debug, Default, PartialEq, Eq)]
struct Raw {
    records: BTreeMap<Vec<u8>, Vec<u8>>,
    /// Record key → the partitions holding it.
    partition_of: BTreeMap<Vec<u8>, Vec<u64>>,
    steps: BTreeMap<(Vec<u8>, String), Vec<u8>>,
    history: BTreeMap<(Vec<u8>, u32), Vec<u8>>,
    outbox: BTreeMap<u64, Vec<u8>>,
    entities: BTreeMap<String, Vec<u8>>,
    /// Partition numbers with a row.
    rows: BTreeSet<u64>,
}

/// The partition number and record key of a slot key.
fn split(slot: &[u8]) -> Result<(u64, Vec<u8>), Box<dyn Error>> {
    let (p, rkey) = slot.split_first_chunk::<8>().ok_or("a short slot key")?;
    Ok((u64::from_be_bytes(*p), rkey.to_vec()))
}

fn raw(path: &Path) -> Result<Raw, Box<dyn Error>> {
    let db = redb::Builder::new().open_read_only(path)?;
    let txn = db.begin_read()?;
    let mut out = Raw::default();
    for e in txn.open_table(RECORDS)?.iter()? {
        let (k, v) = e?;
        let (p, rkey) = split(k.value())?;
        out.partition_of.entry(rkey.clone()).or_default().push(p);
        out.records.insert(rkey, v.value().to_vec());
    }
    if let Ok(t) = txn.open_table(STEPS) {
        for e in t.iter()? {
            let (k, v) = e?;
            let (slot, name) = k.value();
            out.steps
                .insert((split(slot)?.1, name.to_owned()), v.value().to_vec());
        }
    }
    if let Ok(t) = txn.open_table(HISTORY) {
        for e in t.iter()? {
            let (k, v) = e?;
            let (slot, seq) = k.value();
            out.history
                .insert((split(slot)?.1, seq), v.value().to_vec());
        }
    }
    for e in txn.open_table(OUTBOX)?.iter()? {
        let (k, v) = e?;
        out.outbox.insert(k.value(), v.value().to_vec());
    }
    for e in txn.open_table(ENTITIES)?.iter()? {
        let (k, v) = e?;
        out.entities
            .insert(k.value().to_string(), v.value().to_vec());
    }
    if let Ok(t) = txn.open_table(PARTITIONS) {
        for e in t.iter()? {
            out.rows.insert(e?.0.value());
        }
    }
    Ok(out)
}

/// Whether `lost` lists record key `k` (by key, in a range, or as a
/// journal that could not be read).
fn listed(lost: &[Lost], k: &[u8]) -> bool {
    lost.iter().any(|l| match l {
        Lost::Record { key_hex, .. } => unhex(key_hex) == k,
        Lost::Range {
            table: "records",
            after_hex,
            before_hex,
            ..
        } => {
            after_hex.as_ref().is_none_or(|a| unhex(a).as_slice() < k)
                && before_hex.as_ref().is_none_or(|b| k < unhex(b).as_slice())
        }
        Lost::Journal { .. } => true,
        _ => false,
    })
}

/// Checks the salvaged file `new` against the original contents `old`:
/// every record copied is the original byte for byte, and every one
/// missing is listed in `lost`; the new file is format 3 with one sealed
/// partition, opens, verifies, and replays every copied record as the
/// original does. Returns the record keys not copied.
fn judge(old: &Raw, new: &Path, lost: &[Lost]) -> Result<Vec<Vec<u8>>, Box<dyn Error>> {
    let copied = raw(new)?;
    for (k, v) in &copied.records {
        assert_eq!(old.records.get(k), Some(v), "record {} differs", hex(k));
        assert_eq!(copied.partition_of[k], vec![BUILT], "{}", hex(k));
    }
    let missing: Vec<Vec<u8>> = old
        .records
        .keys()
        .filter(|k| !copied.records.contains_key(*k))
        .cloned()
        .collect();
    for k in &missing {
        assert!(
            listed(lost, k),
            "record {} neither copied nor listed: {lost:?}",
            hex(k)
        );
    }
    for (k, v) in &copied.steps {
        assert_eq!(old.steps.get(k), Some(v), "step {k:?}");
        assert!(
            copied.records.contains_key(&k.0),
            "a step without its record"
        );
    }
    for (k, v) in &copied.history {
        assert_eq!(old.history.get(k), Some(v), "log entry {k:?}");
    }
    assert_eq!(copied.outbox, old.outbox);
    assert_eq!(copied.entities, old.entities);
    let rows: BTreeSet<u64> = if copied.records.is_empty() {
        BTreeSet::new()
    } else {
        [BUILT].into()
    };
    assert_eq!(copied.rows, rows, "one sealed partition");
    let engine = Engine::builder().sweep_interval(None).open_read_only(new)?;
    let check = engine.verify()?;
    assert!(check.is_sound(), "{:?}", check.damage);
    Ok(missing)
}

/// Every key's answer from `a` and `b` (opened at the same instant) is
/// the same, for the keys `0..keys` whose records both files hold.
fn answers_agree(a: &Path, b: &Path, keys: usize, skip: &[Vec<u8>]) -> TestResult {
    let clock = ManualClock::new(T0 + 1_000);
    let (a, b) = (builder(&clock).open(a)?, builder(&clock).open(b)?);
    let mut compared = 0;
    for i in 0..keys {
        let k = key(i)?;
        if skip.contains(&rkey(i)) {
            continue;
        }
        let show = |e: &Engine| -> Result<String, Box<dyn Error>> {
            Ok(format!(
                "{:?}",
                e.begin(&k, fp(i)?).map(|b| format!("{b:?}"))
            ))
        };
        assert_eq!(show(&a)?, show(&b)?, "key {i}");
        compared += 1;
    }
    assert!(compared > 0);
    assert!(b.verify()?.is_sound());
    Ok(())
}

#[test]
fn a_sound_format3_file_is_copied_whole_and_answers_the_same() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("sound.redb");
    build(&path, 80)?;
    let old = raw(&path)?;
    let parts: BTreeSet<u64> = old.partition_of.values().flatten().copied().collect();
    assert!(parts.len() >= 5, "several partitions: {parts:?}");
    assert!(!old.steps.is_empty() && !old.history.is_empty());
    let bytes = std::fs::read(&path)?;
    let new = dir.path().join("new.redb");
    let report = idempotency::Engine::salvage(&path, &new)?;
    assert!(report.is_complete(), "{:?}", report.lost);
    assert_eq!(report.records as usize, old.records.len());
    assert_eq!(
        std::fs::read(&path)?,
        bytes,
        "the damaged file is only read"
    );
    let missing = judge(&old, &new, &report.lost)?;
    assert!(missing.is_empty());
    let copied = raw(&new)?;
    assert_eq!(copied.records, old.records);
    assert_eq!(copied.steps, old.steps);
    assert_eq!(copied.history, old.history);
    // Every state came across: a tombstone, an UNKNOWN record, a
    // PROCESSING one, and a key with its effect step and log.
    {
        let engine = Engine::builder()
            .sweep_interval(None)
            .open_read_only(&new)?;
        let state = |i: usize| -> Result<State, Box<dyn Error>> {
            Ok(engine.record(&key(i)?)?.ok_or("no record")?.state)
        };
        assert_eq!(state(3)?, State::Tombstone);
        assert_eq!(state(11)?, State::Unknown);
        assert_eq!(state(12)?, State::Processing);
        assert_eq!(state(14)?, State::Completed);
        assert_eq!(engine.steps(&key(14)?)?.len(), 1);
        assert!(!engine.history(&key(14)?)?.is_empty());
    }
    answers_agree(&copy_db(&path, dir.path(), "a.redb")?, &new, 80, &[])
}

/// The byte range of redb's page (4 KiB) holding `offset`.
fn page_of(offset: usize) -> (usize, usize) {
    let start = offset / 4096 * 4096;
    (start, start + 4096)
}

/// Offsets where `needle` occurs in `hay`.
fn occurrences(hay: &[u8], needle: &[u8]) -> Vec<usize> {
    hay.windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| i)
        .collect()
}

#[test]
fn damage_in_one_partition_loses_only_what_it_hit_and_lists_it() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("sound.redb");
    build(&path, 120)?;
    let old = raw(&path)?;
    let sound = std::fs::read(&path)?;
    // One byte inside one record's value (in the first partition with a
    // completed record;
    // every copy of the value in the file, old pages too), and the header
    // of each page holding another record's value (in a middle partition):
    // its leaf.
    let by_partition = |p: u64| {
        old.partition_of
            .iter()
            .filter(move |(_, ps)| ps == &&vec![p])
            .map(|(k, _)| k.clone())
            .filter(|k| old.records[k].len() > 200)
    };
    let parts: Vec<u64> = old
        .partition_of
        .values()
        .flatten()
        .copied()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let flipped = parts
        .iter()
        .find_map(|p| by_partition(*p).next())
        .ok_or("no completed record")?;
    let leaf_key = parts[parts.len() / 2..]
        .iter()
        .find_map(|p| by_partition(*p).next())
        .ok_or("no completed record in the later partitions")?;
    let pages: BTreeSet<(usize, usize)> = occurrences(&sound, &old.records[&leaf_key])
        .into_iter()
        .map(page_of)
        .collect();
    assert!(!pages.is_empty());
    let mut bytes = sound.clone();
    for at in occurrences(&sound, &old.records[&flipped]) {
        bytes[at + 40] ^= 0x5a;
    }
    for (start, _) in &pages {
        for b in &mut bytes[*start..start + 16] {
            *b ^= 0xff;
        }
    }
    let damaged = dir.path().join("damaged.redb");
    std::fs::write(&damaged, &bytes)?;
    let new = dir.path().join("new.redb");
    let report = Engine::salvage(&damaged, &new)?;
    for l in &report.lost {
        eprintln!("lost: {l}");
    }
    let missing = judge(&old, &new, &report.lost)?;
    eprintln!(
        "{} of {} records copied, {} pages damaged",
        report.records,
        old.records.len(),
        pages.len()
    );
    // The flipped value fails its checksum: listed by key, not copied.
    assert!(missing.contains(&flipped), "{report:?}");
    assert!(
        report
            .lost
            .iter()
            .any(|l| matches!(l, Lost::Record { key_hex, .. } if *key_hex == hex(&flipped))),
        "{:?}",
        report.lost
    );
    assert!(missing.contains(&leaf_key), "a record on the damaged leaf");
    // Every record whose value lies outside the damaged pages (and is
    // not the flipped one) is copied.
    for (k, v) in &old.records {
        let on_page = occurrences(&sound, v).iter().any(|&at| {
            pages
                .iter()
                .any(|&(start, end)| at < end && at + v.len() > start)
        });
        if !on_page && *k != flipped && v.len() > 200 {
            assert!(
                !missing.contains(k),
                "intact record {} lost: {:?}",
                hex(k),
                report.lost
            );
        }
    }
    Ok(())
}

#[test]
fn damaged_rows_and_filters_hide_no_record() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("sound.redb");
    build(&path, 80)?;
    let old = raw(&path)?;
    assert!(old.rows.len() >= 5, "{:?}", old.rows);
    let sound = copy_db(&path, dir.path(), "a.redb")?;
    // The rows table gone, one stored filter garbled and one gone.
    {
        let db = redb::Database::open(&path)?;
        let txn = db.begin_write()?;
        {
            let mut filters = txn.open_table(FILTERS)?;
            let sealed: Vec<u64> = filters
                .iter()?
                .map(|e| e.map(|(k, _)| k.value()))
                .collect::<Result<_, _>>()?;
            assert!(sealed.len() >= 2, "{sealed:?}");
            filters.insert(sealed[0], b"not a filter".as_slice())?;
            filters.remove(sealed[1])?;
        }
        txn.delete_table(PARTITIONS)?;
        txn.commit()?;
    }
    let new = dir.path().join("new.redb");
    let report = Engine::salvage(&path, &new)?;
    assert!(report.is_complete(), "{:?}", report.lost);
    assert_eq!(report.records as usize, old.records.len());
    let missing = judge(&old, &new, &report.lost)?;
    assert!(missing.is_empty());
    answers_agree(&sound, &new, 80, &[])
}

/// Writes `keys` keys after a clean base, then exits without closing: the
/// later writes are in the journal only. Without the env var it does
/// nothing.
#[test]
fn write_then_crash_in_child_process() -> TestResult {
    let Ok(path) = std::env::var(CRASH_ENV) else {
        return Ok(());
    };
    let clock = ManualClock::new(T0);
    let engine = builder(&clock).open(&path)?;
    WORKLOAD.write(&engine, &clock, 10_000..10_040)?;
    engine.flush()?;
    // A crash: nothing closed, nothing checkpointed.
    std::process::exit(0);
}

#[test]
fn what_the_journal_of_a_crashed_format3_file_holds_is_salvaged() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("crashed.redb");
    build(&path, 24)?;
    let status = Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            // `<file>::write_then_crash_in_child_process` where this file is a module of a test binary.
            concat!(module_path!(), "::write_then_crash_in_child_process")
                .split_once("::")
                .map_or("write_then_crash_in_child_process", |(_, t)| t),
            "--test-threads=1",
        ])
        .env(CRASH_ENV, &path)
        .stdout(std::process::Stdio::null())
        .status()?;
    assert!(status.success(), "the writing child failed");
    let before = std::fs::read(&path)?;
    let journal = std::fs::read(journal_of(&path))?;
    let new = dir.path().join("new.redb");
    let report = Engine::salvage(&path, &new)?;
    assert!(report.is_complete(), "{:?}", report.lost);
    assert!(report.journal_frames > 0, "no frames beyond the checkpoint");
    assert_eq!(std::fs::read(&path)?, before);
    assert_eq!(std::fs::read(journal_of(&path))?, journal);
    // What a writable open recovers is what salvage copied (both opened
    // once at the same instant: an open marks a dead process's claims
    // UNKNOWN, which salvage leaves to the new file's first open).
    let recovered = copy_db(&path, dir.path(), "recovered.redb")?;
    drop(builder(&ManualClock::new(T0)).open(&recovered)?);
    drop(builder(&ManualClock::new(T0)).open(&new)?);
    let (got, want) = (raw(&new)?, raw(&recovered)?);
    assert!(want.records.keys().any(|k| k.ends_with(b"order-10038")));
    assert_eq!(got.records, want.records);
    assert_eq!(got.steps, want.steps);
    assert_eq!(got.history, want.history);
    assert_eq!(got.outbox, want.outbox);
    assert_eq!(got.entities, want.entities);
    Ok(())
}

#[test]
fn a_key_in_two_partitions_is_not_copied_silently() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("sound.redb");
    build(&path, 40)?;
    let old = raw(&path)?;
    // Two copies of two completed keys under other partitions: one the
    // index entries cannot tell from the original (its own bytes), one
    // older (another key's state cannot be under it: its value fails its
    // checksum, so the original is the one copy that decodes and matches).
    let (same, other) = (rkey(6), rkey(16));
    let p_same = old.partition_of[&same][0];
    let p_other = old.partition_of[&other][0];
    {
        let db = redb::Database::open(&path)?;
        let txn = db.begin_write()?;
        {
            let mut records = txn.open_table(RECORDS)?;
            let mut slot = (p_same + 1).to_be_bytes().to_vec();
            slot.extend_from_slice(&same);
            records.insert(slot.as_slice(), old.records[&same].as_slice())?;
            let mut slot = (p_other + 1).to_be_bytes().to_vec();
            slot.extend_from_slice(&other);
            records.insert(slot.as_slice(), old.records[&same].as_slice())?;
        }
        txn.commit()?;
    }
    let new = dir.path().join("new.redb");
    let report = Engine::salvage(&path, &new)?;
    let missing = judge(&old, &new, &report.lost)?;
    assert_eq!(missing, vec![same.clone()], "{:?}", report.lost);
    let reason = report
        .lost
        .iter()
        .find_map(|l| match l {
            Lost::Record { key_hex, reason } if *key_hex == hex(&same) => Some(reason.clone()),
            _ => None,
        })
        .ok_or("the key in two partitions is not listed")?;
    assert!(
        reason.contains(&p_same.to_string()) && reason.contains(&(p_same + 1).to_string()),
        "{reason}"
    );
    Ok(())
}
