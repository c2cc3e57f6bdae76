//! Format 3's writer side through [`Tables`] (not reachable from an open
//! yet): claims, completions, steps and releases over partitions sealed
//! between groups land in the right key ranges, every key stays found
//! through the catalog's probes after its partition is sealed, a released
//! key claimed again moves to the hot partition (never two copies), and
//! the journal's changes applied to an empty file rebuild the same
//! tables.

use redb::{Database, ReadableDatabase, ReadableTable};

use crate::key::IdempotencyKey;
use crate::store::ops::{Ops, Txn};
use crate::store::{FinishStepRequest, StepRequest};

use super::overlay::{Overlay, Seen};
use super::partition::catalog;
use super::partition::catalog::SealRule;
use super::partition::row::{FILTERS, PARTITIONS};
use super::partition::slot;
use super::recover::apply;
use super::tables::Tables;
use super::test_requests::{claim_in, complete_in};
use super::test_writer::{dump, key, mem, Writer, R};

const RULE: SealRule = SealRule {
    interval_ms: 60_000,
    max_keys: 8,
};

fn claimed(t: &mut Tables<'_>, k: &IdempotencyKey) -> R<u64> {
    claim_in(t, k, 30_000)
}

fn complete(t: &mut Tables<'_>, k: &IdempotencyKey, token: u64) -> R<()> {
    complete_in(t, k, token)
}

#[test]
fn records_and_steps_stay_found_across_seals_and_the_journal_rebuilds_them() -> R<()> {
    let mut w = Writer::new(RULE)?;
    let mut tokens = Vec::new();
    // 30 keys, 4 per group: the hot partition is sealed every 8 keys.
    for group in 0..8u32 {
        w.now += 1_000;
        let got = w.group(|t| {
            let mut got = Vec::new();
            for i in group * 4..(group * 4 + 4).min(30) {
                let k = key(i)?;
                got.push((i, claimed(t, &k)?));
            }
            Ok(got)
        })?;
        tokens.extend(got);
    }
    // Complete every key (most now in sealed partitions), with a step on
    // the first.
    w.now += 1_000;
    w.group(|t| {
        let k0 = key(0)?;
        let token = tokens[0].1;
        t.reserve_step(StepRequest {
            key: k0.clone(),
            token,
            name: "charge".into(),
            finished: Vec::new(),
        })
        .map_err(|e| format!("{e:?}"))?;
        t.finish_step(FinishStepRequest {
            key: k0.clone(),
            token,
            name: "charge".into(),
            confirmed: true,
            evidence: b"ch_1".to_vec(),
        })
        .map_err(|e| format!("{e:?}"))?;
        for (i, token) in &tokens {
            complete(t, &key(*i)?, *token)?;
        }
        Ok(())
    })?;
    // Partitions: 1..=3 sealed (8 keys each), 4 hot (6 keys).
    let txn = w.db.begin_read()?;
    let records = txn.open_table(catalog::RECORDS)?;
    assert_eq!(catalog::partitions_in(&records)?, [1, 2, 3, 4]);
    for p in 1..=3 {
        assert_eq!(catalog::count_keys(&records, p)?, 8, "partition {p}");
    }
    assert_eq!(w.catalog.hot().partition, 4);
    drop(records);
    drop(txn);
    // Every key is found and completed; the step sits beside key 0.
    w.group(|t| {
        for i in 0..30 {
            let k = key(i)?;
            let rec = t
                .raw(k.record_key())?
                .ok_or(format!("{k} lost"))?
                .map_err(|e| format!("{k}: {e}"))?;
            assert_eq!(
                rec.state,
                crate::store::record::RecordState::Completed,
                "{k}"
            );
        }
        let steps = t.load_steps(&key(0)?)?;
        assert_eq!(steps.len(), 1);
        Ok(())
    })?;
    // A key released and claimed again lives in the hot partition only.
    w.now += 1_000;
    let k = key(100)?;
    let token = w.group(|t| claimed(t, &k))?;
    w.group(|t| {
        t.release(&k, token).map_err(|e| format!("{e:?}"))?;
        Ok(())
    })?;
    w.now += 120_000;
    let again = w.group(|t| claimed(t, &k))?;
    assert!(again > token, "a fresh fencing token");
    let txn = w.db.begin_read()?;
    let records = txn.open_table(catalog::RECORDS)?;
    let copies: Vec<u64> = catalog::partitions_in(&records)?
        .into_iter()
        .filter(|p| {
            records
                .get(slot::slot_key(*p, k.record_key()).as_slice())
                .is_ok_and(|v| v.is_some())
        })
        .collect();
    assert_eq!(
        copies,
        [w.catalog.hot().partition],
        "one copy, in the hot partition"
    );
    drop(records);
    drop(txn);
    // The frames, applied to an empty file, give the same tables.
    let replayed = mem()?;
    let txn = replayed.begin_write()?;
    {
        let mut meta = txn.open_table(super::tables::META)?;
        super::meta::create(&mut meta)?;
    }
    for frame in &w.frames {
        apply(&txn, frame, true).map_err(|e| format!("{e:?}"))?;
    }
    txn.commit()?;
    assert_eq!(
        dump(&replayed, catalog::RECORDS)?,
        dump(&w.db, catalog::RECORDS)?
    );
    assert_eq!(dump(&replayed, PARTITIONS)?, dump(&w.db, PARTITIONS)?);
    assert_eq!(dump(&replayed, FILTERS)?, dump(&w.db, FILTERS)?);
    assert_eq!(
        dump(&replayed, catalog::STEPS)?,
        dump(&w.db, catalog::STEPS)?
    );
    // And a format-3 overlay keeps the frames' records under record keys.
    let overlay = Overlay::partitioned();
    for frame in &w.frames {
        overlay.apply(frame.changes.clone());
    }
    assert!(matches!(
        overlay.record(key(5)?.record_key()),
        Seen::Value(_)
    ));
    assert!(matches!(overlay.record(k.record_key()), Seen::Value(_)));
    Ok(())
}

/// 20 claims completed over three partitions (8 keys each, the last hot).
fn twenty() -> R<Writer> {
    let mut w = Writer::new(RULE)?;
    for group in 0..5u32 {
        w.now += 1_000;
        w.group(|t| {
            for i in group * 4..group * 4 + 4 {
                let k = key(i)?;
                let token = claimed(t, &k)?;
                complete(t, &k, token)?;
            }
            Ok(())
        })?;
    }
    Ok(w)
}

fn damage(db: &Database) -> R<Vec<crate::verify::Damage>> {
    let (damage, checked) = super::verify::verify(db)?;
    assert_eq!(checked, 20);
    Ok(damage)
}

#[test]
fn verify_finds_a_sound_format_3_file_sound() -> R<()> {
    let w = twenty()?;
    assert_eq!(damage(&w.db)?, []);
    Ok(())
}

#[test]
fn verify_names_a_key_in_two_partitions_and_partitions_without_rows_or_filters() -> R<()> {
    let w = twenty()?;
    let k = key(3)?;
    let txn = w.db.begin_write()?;
    {
        let mut records = txn.open_table(catalog::RECORDS)?;
        let value = records
            .get(slot::slot_key(1, k.record_key()).as_slice())?
            .map(|v| v.value().to_vec())
            .ok_or("key 3 in partition 1")?;
        records.insert(
            slot::slot_key(3, k.record_key()).as_slice(),
            value.as_slice(),
        )?;
        records.remove(slot::slot_key(1, key(4)?.record_key()).as_slice())?;
        txn.open_table(FILTERS)?.remove(2)?;
    }
    txn.commit()?;
    let text: Vec<String> = damage(&w.db)?.iter().map(ToString::to_string).collect();
    let has = |needle: &str| text.iter().any(|t| t.contains(needle));
    assert!(has("is stored in partitions [1, 3]"), "{text:?}");
    // A record gone from a sealed partition is expiry at work, not damage.
    assert!(!has("partition 1 is damaged"), "{text:?}");
    assert!(
        has("partition 2 is damaged: its key filter is missing"),
        "{text:?}"
    );
    let txn = w.db.begin_write()?;
    txn.open_table(PARTITIONS)?.remove(1)?;
    txn.commit()?;
    let text: Vec<String> = damage(&w.db)?.iter().map(ToString::to_string).collect();
    assert!(
        text.iter()
            .any(|t| t.contains("partition 1 is damaged: it holds records but has no row")),
        "{text:?}"
    );
    Ok(())
}

#[test]
fn verify_names_a_filter_that_passes_its_checks_but_misses_a_key() -> R<()> {
    let w = twenty()?;
    // A record inserted behind the filter's back (as a bug would): the
    // filter still checks out by checksum, but no longer by count, and it
    // may say "absent" for the new key.
    let txn = w.db.begin_write()?;
    {
        let mut records = txn.open_table(catalog::RECORDS)?;
        for i in 100..140 {
            records.insert(
                slot::slot_key(1, key(i)?.record_key()).as_slice(),
                b"x".as_slice(),
            )?;
        }
    }
    txn.commit()?;
    let (found, _) = super::verify::verify(&w.db)?;
    let text: Vec<String> = found.iter().map(ToString::to_string).collect();
    assert!(
        text.iter().any(|t| t.contains("says \"absent\" for")),
        "{text:?}"
    );
    Ok(())
}

#[test]
fn a_sealed_partition_is_dropped_with_its_last_record() -> R<()> {
    let mut w = twenty()?;
    w.now += 86_400_000 + 1;
    let swept = w.group(|t| Ok(t.sweep(100).map_err(|e| format!("{e:?}"))?))?;
    assert_eq!(swept.deleted, 20);
    // The hot partition (3) was sealed before the sweep, as it was due;
    // every sealed partition lost its last record: only the new hot one
    // is left, in the file, the catalog and the journal's replay.
    let txn = w.db.begin_read()?;
    let rows: Vec<u64> = txn
        .open_table(PARTITIONS)?
        .iter()?
        .map(|e| e.map(|(k, _)| k.value()))
        .collect::<Result<_, _>>()?;
    assert_eq!(rows, [4]);
    assert_eq!(txn.open_table(FILTERS)?.iter()?.count(), 0);
    drop(txn);
    let live: Vec<u64> = w.catalog.probes().iter().map(|p| p.partition).collect();
    assert_eq!(live, [4]);
    assert_eq!(damage_of(&w.db)?, []);
    let replayed = w.replayed()?;
    assert_eq!(dump(&replayed, PARTITIONS)?, dump(&w.db, PARTITIONS)?);
    assert_eq!(
        dump(&replayed, catalog::RECORDS)?,
        dump(&w.db, catalog::RECORDS)?
    );
    Ok(())
}

fn damage_of(db: &Database) -> R<Vec<crate::verify::Damage>> {
    Ok(super::verify::verify(db)?.0)
}

/// The slot keys of partition `p`, in order.
fn range_keys(db: &Database, p: u64) -> R<Vec<Vec<u8>>> {
    let txn = db.begin_read()?;
    let records = txn.open_table(catalog::RECORDS)?;
    let mut out = Vec::new();
    for entry in catalog::range(&records, p)? {
        out.push(entry?.0.value().to_vec());
    }
    Ok(out)
}

#[test]
fn expired_partitions_are_drained_in_key_order_oldest_first() -> R<()> {
    let mut w = twenty()?;
    let p1 = range_keys(&w.db, 1)?;
    assert_eq!(p1.len(), 8);
    // Nothing is due before the TTL since the partition's last claim.
    w.now += 60_000;
    let mut counts = crate::report::SweepCounts::default();
    w.group(|t| Ok(t.drain(4, &mut counts).map_err(|e| format!("{e:?}"))?))?;
    assert_eq!(counts.deleted, 0);
    w.now += 86_400_000;
    w.group(|t| Ok(t.drain(5, &mut counts).map_err(|e| format!("{e:?}"))?))?;
    assert_eq!((counts.deleted, counts.more), (5, true));
    assert_eq!(
        range_keys(&w.db, 1)?,
        p1[5..],
        "the first five in key order"
    );
    w.group(|t| Ok(t.drain(5, &mut counts).map_err(|e| format!("{e:?}"))?))?;
    assert_eq!(counts.deleted, 8);
    assert!(range_keys(&w.db, 1)?.is_empty());
    let live: Vec<u64> = w.catalog.probes().iter().map(|p| p.partition).collect();
    assert!(!live.contains(&1), "partition 1 dropped: {live:?}");
    // Then the next oldest.
    w.group(|t| Ok(t.drain(100, &mut counts).map_err(|e| format!("{e:?}"))?))?;
    assert_eq!(counts.deleted, 16);
    assert!(range_keys(&w.db, 2)?.is_empty());
    assert_eq!(damage_of(&w.db)?, []);
    Ok(())
}

/// Leases of the merge tests' claims: past every merge step.
const MERGE_LEASE_MS: u64 = 10 * super::partition::merge::MERGE_SPAN_MS;

/// The steps-without-record reports among `db`'s damage.
fn without_record(db: &Database) -> R<Vec<crate::verify::Damage>> {
    Ok(damage_of(db)?
        .into_iter()
        .filter(|d| matches!(d, crate::verify::Damage::StepsWithoutRecord { .. }))
        .collect())
}

/// How many log entries partition `p` keeps for `k`.
fn log_len(db: &Database, p: u64, k: &IdempotencyKey) -> R<u64> {
    let at = slot::slot_key(p, k.record_key());
    let rows = super::test_writer::dump_history(db)?;
    Ok(rows.iter().filter(|(s, _, _)| *s == at).count() as u64)
}

/// Steps and log entries beside their records are sound in format 3
/// wherever a record is: in sealed partitions, in a merge's copy while it
/// runs, in dropping sources (their twins) after its switch, once the
/// sources are dropped, and after every record expired with its steps.
#[test]
fn verify_finds_steps_beside_their_records_sound_through_a_merge_and_expiry() -> R<()> {
    use super::partition::row::PartitionState;
    let mut w = Writer::new(RULE)?;
    let keys = w.completed(40, MERGE_LEASE_MS, &[2, 9, 17, 30, 39])?;
    assert!(!super::test_writer::dump_steps(&w.db)?.is_empty());
    assert_eq!(damage_of(&w.db)?, []);
    w.now += 2 * super::partition::merge::MERGE_SPAN_MS;
    let mut seen = std::collections::BTreeSet::new();
    for step in 0..100 {
        let more = w.merge_step(7)?.more;
        for row in super::test_writer::rows(&w.db)?.values() {
            seen.insert(format!("{:?}", row.state));
        }
        assert_eq!(damage_of(&w.db)?, [], "merge step {step}");
        if !more {
            break;
        }
    }
    for state in [PartitionState::Merging, PartitionState::Dropping] {
        assert!(seen.contains(&format!("{state:?}")), "{seen:?}");
    }
    // The keys with steps still show them, now from the merged partition.
    let steps = w.group(|t| Ok(t.load_steps(&keys[9])?))?;
    assert_eq!(steps.len(), 1);
    w.now += 86_400_000 + 1;
    while w
        .group(|t| Ok(t.sweep(100).map_err(|e| format!("{e:?}"))?))?
        .more
    {}
    assert_eq!(damage_of(&w.db)?, []);
    assert_eq!(super::test_writer::dump_steps(&w.db)?, []);
    Ok(())
}

/// A record row deleted behind the engine's back (a bug, or a lost
/// page) leaves its key's steps and log without a record: verify names
/// the key, its partition, the steps and how many log entries.
#[test]
fn verify_names_steps_and_log_whose_record_row_is_gone() -> R<()> {
    let mut w = Writer::new(RULE)?;
    let keys = w.completed(40, MERGE_LEASE_MS, &[2, 9])?;
    let k = &keys[9];
    let p = w
        .group(|t| Ok(t.locate(k.record_key())?))?
        .ok_or("key 9 has a record")?;
    let log_entries = log_len(&w.db, p, k)?;
    assert!(log_entries > 0);
    let txn = w.db.begin_write()?;
    txn.open_table(catalog::RECORDS)?
        .remove(slot::slot_key(p, k.record_key()).as_slice())?;
    txn.commit()?;
    let found = without_record(&w.db)?;
    assert_eq!(
        found,
        [crate::verify::Damage::StepsWithoutRecord {
            key_hex: crate::store::record::hex(k.record_key()),
            partition: Some(p),
            record_in: None,
            steps: vec!["charge".to_owned()],
            log_entries,
        }]
    );
    let text = found[0].to_string();
    assert!(
        text.contains(&format!(
            "effect step \"charge\" and {log_entries} evidence log entries of {k} are stored in \
             partition {p}, and the key has no record"
        )),
        "{text}"
    );
    Ok(())
}

/// A step stored under another partition's slot key than its record's is
/// never read (a read finds steps beside the record): verify names it,
/// with the partition holding it and the one holding the record.
#[test]
fn verify_names_a_step_under_another_partition_than_its_record() -> R<()> {
    let mut w = Writer::new(RULE)?;
    let keys = w.completed(40, MERGE_LEASE_MS, &[2])?;
    let k = &keys[2];
    let p = w
        .group(|t| Ok(t.locate(k.record_key())?))?
        .ok_or("key 2 has a record")?;
    let q = w.catalog.hot().partition;
    assert_ne!(p, q, "key 2 is in a sealed partition");
    let txn = w.db.begin_write()?;
    {
        let mut steps = txn.open_table(catalog::STEPS)?;
        let from = slot::slot_key(p, k.record_key());
        let value = steps
            .remove((from.as_slice(), "charge"))?
            .map(|v| v.value().to_vec())
            .ok_or("key 2's step")?;
        let to = slot::slot_key(q, k.record_key());
        steps.insert((to.as_slice(), "charge"), value.as_slice())?;
    }
    txn.commit()?;
    let found = without_record(&w.db)?;
    assert_eq!(
        found,
        [crate::verify::Damage::StepsWithoutRecord {
            key_hex: crate::store::record::hex(k.record_key()),
            partition: Some(q),
            record_in: Some(p),
            steps: vec!["charge".to_owned()],
            log_entries: 0,
        }]
    );
    assert!(
        found[0].to_string().contains(&format!(
            "its record in partition {p}: a read of the key never sees them"
        )),
        "{}",
        found[0]
    );
    Ok(())
}

/// A merge source being dropped may hold steps and log entries whose twin
/// record is gone: nothing reads them and its drop step deletes them with
/// the rest of its range, so verify does not report them.
#[test]
fn steps_left_in_a_dropping_source_are_the_drop_steps_to_delete() -> R<()> {
    use super::partition::row::PartitionState;
    let mut w = Writer::new(RULE)?;
    let keys = w.completed(40, MERGE_LEASE_MS, &[2])?;
    let k = &keys[2];
    w.now += 2 * super::partition::merge::MERGE_SPAN_MS;
    while w.catalog.merging().is_none() {
        w.merge_step(7)?;
    }
    while w.catalog.merging().is_some() {
        w.merge_step(7)?;
    }
    let rows = super::test_writer::rows(&w.db)?;
    let twin = rows
        .iter()
        .filter(|(_, row)| row.state == PartitionState::Dropping)
        .map(|(p, _)| slot::slot_key(*p, k.record_key()))
        .find(|s| {
            super::test_writer::dump_steps(&w.db)
                .is_ok_and(|steps| steps.iter().any(|(at, _, _)| at == s))
        })
        .ok_or("key 2's twin step in a dropping source")?;
    let txn = w.db.begin_write()?;
    txn.open_table(catalog::RECORDS)?.remove(twin.as_slice())?;
    txn.commit()?;
    assert_eq!(damage_of(&w.db)?, []);
    while w.merge_step(7)?.more {}
    let left: Vec<_> = super::test_writer::dump_steps(&w.db)?
        .into_iter()
        .filter(|(at, _, _)| *at == twin)
        .collect();
    assert_eq!(left, [], "the drop step deleted them");
    assert_eq!(damage_of(&w.db)?, []);
    Ok(())
}
