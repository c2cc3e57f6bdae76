//! The scrub behind `Engine::verify`: every stored value decodes and
//! passes its checksum (`store/codec.rs`), every record key is a valid key,
//! every record and entity a walk of its table meets is also found by a
//! lookup of its key (a damaged tree page can send a lookup astray while a
//! walk still meets every entry), and every index entry matches its record
//! and back (each record sits in exactly the index its state names, at the
//! instant it names). Every effect step and log entry decodes and has its
//! record beside it ([`Owners`]). The meta table's values are checked too
//! (`meta.rs`).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use redb::{ReadableDatabase, ReadableTable, TableError};

use crate::error::Result;
use crate::store::codec;
use crate::store::record::hex;
use crate::verify::Damage;

use super::meta::{self, Format, Found, MetaError};
use super::partition::catalog;
use super::partition::filter::{FilterChecksum, FilterHasher, PartitionFilter};
use super::partition::row::{PartitionRow, PartitionState, FILTERS, PARTITIONS};
use super::partition::slot;
use super::tables::{
    Context, DEAD_LETTERS, ENTITIES, EXPIRY, HISTORY, LEASES, META, OUTBOX, RECORDS, RECOVERY,
    STEPS,
};

/// Scrubs the whole database in one read snapshot; returns every problem
/// found (none: the file is sound as far as the engine can tell) and how
/// many records were checked.
pub(super) fn verify(db: &impl ReadableDatabase) -> Result<(Vec<Damage>, u64)> {
    let what = "verifying the database";
    let txn = db.begin_read().context(what)?;
    let mut problems = meta_damage(&txn)?;
    let layout = layout_of(&txn)?;
    let records = match layout {
        Layout::Partitioned { .. } => txn.open_table(catalog::RECORDS),
        Layout::Single => txn.open_table(RECORDS),
    }
    .context(what)?;
    let merges = match layout {
        Layout::Partitioned { .. } => merge_states(&txn)?,
        Layout::Single => Merges::default(),
    };
    let Walked {
        expected,
        undecodable,
        duplicates,
        partition_of,
        unreachable,
        checked,
    } = walk_records(&records, layout, &merges, &mut problems)?;
    missing_copies(&records, &merges, &mut problems)?;
    let mut found = BTreeSet::new();
    for (name, table) in [
        ("leases", LEASES),
        ("recovery", RECOVERY),
        ("expiry", EXPIRY),
    ] {
        let index = txn.open_table(table).context(what)?;
        for entry in index.iter().context(what)? {
            let (k, _) = entry.context(what)?;
            let (at, rkey) = k.value();
            found.insert((name, at, rkey.to_vec()));
        }
    }
    for (index, at, rkey) in found.difference(&expected) {
        // A record that does not decode has no expected entry: its index
        // entry is not a second problem.
        if !undecodable.contains(rkey) {
            problems.push(Damage::StrayIndexEntry {
                index,
                at_ms: *at,
                key_hex: hex(rkey),
            });
        }
    }
    for (index, at, rkey) in expected.difference(&found) {
        problems.push(Damage::MissingIndexEntry {
            index,
            at_ms: *at,
            key_hex: hex(rkey),
        });
    }
    let outbox = txn.open_table(OUTBOX).context(what)?;
    for entry in outbox.iter().context(what)? {
        let (seq, v) = entry.context(what)?;
        if let Err(e) = codec::decode_outbox(seq.value(), v.value()) {
            problems.push(Damage::UndecodableOutboxMessage {
                seq: seq.value(),
                reason: e.to_string(),
            });
        }
    }
    let entities = txn.open_table(ENTITIES).context(what)?;
    for entry in entities.iter().context(what)? {
        let (id, v) = entry.context(what)?;
        let found = entities.get(id.value()).context(what)?;
        if found.is_none_or(|f| f.value() != v.value()) {
            problems.push(Damage::UnreachableEntity {
                entity: id.value().to_string(),
            });
        }
        if let Err(e) = codec::decode_entity(id.value(), v.value()) {
            problems.push(Damage::UndecodableEntity {
                entity: id.value().to_string(),
                reason: e.to_string(),
            });
        }
    }
    let mut owners = Owners {
        records: &records,
        partitioned: matches!(layout, Layout::Partitioned { .. }),
        dropping: &merges.dropping,
        unreachable: &unreachable,
        partition_of: &partition_of,
        last: None,
        without: BTreeMap::new(),
    };
    step_damage(&txn, &mut owners, &mut problems)?;
    problems.extend(owners.report());
    dead_letter_damage(&txn, &mut problems)?;
    for (rkey, partitions) in duplicates {
        problems.push(Damage::DuplicateRecord {
            key_hex: hex(&rkey),
            partitions: partitions.into_iter().collect(),
        });
    }
    if let Layout::Partitioned { seed } = layout {
        problems.extend(partition_damage(&txn, &records, seed.as_ref())?);
    }
    Ok((problems, checked))
}

/// How a file keeps its records, as its meta table says.
#[derive(Clone, Copy)]
enum Layout {
    /// Format 1 or 2 (or a meta table that cannot say): one table keyed
    /// by record key.
    Single,
    /// Format 3: slot keys in partitions, and the seed the filters hash
    /// with (`None`: unreadable, reported with the meta damage; the filters
    /// are then not checked).
    Partitioned { seed: Option<[u8; 16]> },
}

/// The layout of the file in `txn`.
fn layout_of(txn: &redb::ReadTransaction) -> Result<Layout> {
    let what = "verifying the database";
    let table = match txn.open_table(META) {
        Ok(table) => table,
        Err(TableError::TableDoesNotExist(_)) => return Ok(Layout::Single),
        Err(e) => return Err(e).context(what),
    };
    Ok(match meta::read_format(&table) {
        Ok(Some(Found::Format(Format::V3))) => Layout::Partitioned {
            seed: meta::read_filter_seed(&table).ok(),
        },
        _ => Layout::Single,
    })
}

/// What a walk of the records table gathered.
struct Walked {
    /// (index, instant, record key) every sound record expects.
    expected: BTreeSet<(&'static str, u64, Vec<u8>)>,
    /// Keys of records that do not decode.
    undecodable: BTreeSet<Vec<u8>>,
    /// Format 3: record keys met in more than one partition.
    duplicates: BTreeMap<Vec<u8>, BTreeSet<u64>>,
    /// Format 3: a partition read by lookups that holds each record key
    /// met (the last one met).
    partition_of: HashMap<Vec<u8>, u64>,
    /// Stored keys of records a lookup of their key does not find
    /// (reported as unreachable).
    unreachable: BTreeSet<Vec<u8>>,
    /// Records walked.
    checked: u64,
}

/// Format 3's partitions a merge holds (`partition/merge.rs`), from the
/// rows that decode (those that do not are reported by `partition_damage`).
#[derive(Default)]
struct Merges {
    /// The merging partition, whose records are copies of its sources'.
    merging: Option<u64>,
    /// The merge sources, ascending.
    sources: Vec<u64>,
    /// Dropping partitions: copies read by nothing; a merge source's
    /// records are the byte-equal twins of their live copies until dropped
    /// (`twins.rs`).
    dropping: BTreeSet<u64>,
    /// Sealed partitions a merge built, ascending: where a dropping
    /// source's records live.
    built: Vec<u64>,
}

/// The merge under way's copy holds every record its sources hold up to
/// its last key (the merge's cursor, `partition/merge.rs`): a source
/// record there without a twin in the copy would be lost at the switch.
fn missing_copies(
    records: &redb::ReadOnlyTable<&'static [u8], &'static [u8]>,
    merges: &Merges,
    problems: &mut Vec<Damage>,
) -> Result<()> {
    let what = "verifying the database";
    let Some(target) = merges.merging else {
        return Ok(());
    };
    let last = match catalog::range(records, target)
        .context(what)?
        .next_back()
        .transpose()
        .context(what)?
    {
        Some((k, _)) => match slot::split(k.value()) {
            Some((_, rkey)) => rkey.to_vec(),
            None => return Ok(()),
        },
        None => return Ok(()),
    };
    for &q in &merges.sources {
        for entry in catalog::range(records, q).context(what)? {
            let (k, _) = entry.context(what)?;
            let Some((_, rkey)) = slot::split(k.value()) else {
                continue;
            };
            if rkey > last.as_slice() {
                break;
            }
            let copy = records
                .get(slot::slot_key(target, rkey).as_slice())
                .context(what)?;
            // A copy that differs is named by `unread_copy_damage`.
            if copy.is_none() {
                problems.push(Damage::BadPartition {
                    partition: target,
                    reason: format!(
                        "the merge's copy lacks record {} of merge source {q}, below its last \
                         key: the switch would lose it",
                        hex(rkey)
                    ),
                });
            }
        }
    }
    Ok(())
}

fn merge_states(txn: &redb::ReadTransaction) -> Result<Merges> {
    let what = "verifying the partitions";
    let mut out = Merges::default();
    let table = match txn.open_table(PARTITIONS) {
        Ok(table) => table,
        Err(TableError::TableDoesNotExist(_)) => return Ok(out),
        Err(e) => return Err(e).context(what),
    };
    for entry in table.iter().context(what)? {
        let (k, v) = entry.context(what)?;
        let Ok(row) = PartitionRow::decode(k.value(), v.value()) else {
            continue;
        };
        match row.state {
            PartitionState::Merging => out.merging = Some(k.value()),
            PartitionState::MergeSource => out.sources.push(k.value()),
            PartitionState::Dropping => {
                out.dropping.insert(k.value());
            }
            PartitionState::Sealed if k.value() >= slot::BUILT_PARTITIONS => {
                out.built.push(k.value());
            }
            PartitionState::Hot | PartitionState::Sealed => {}
        }
    }
    Ok(out)
}

/// A record of a merging or dropping partition (`merges`): its value must
/// decode; a merging partition's must also be the twin of a merge
/// source's record. These are copies nothing reads: they add no index
/// entry and no duplicate. `None`: `p` is read by lookups (a record like
/// any other).
fn unread_copy_damage(
    records: &redb::ReadOnlyTable<&'static [u8], &'static [u8]>,
    merges: &Merges,
    p: u64,
    rkey: &[u8],
    value: &[u8],
) -> Result<Option<Vec<Damage>>> {
    let what = "verifying the database";
    let merging = merges.merging == Some(p);
    if !merging && !merges.dropping.contains(&p) {
        return Ok(None);
    }
    let mut problems = Vec::new();
    if let Err(e) = codec::decode(rkey, value) {
        problems.push(Damage::Undecodable {
            key_hex: hex(rkey),
            reason: e.to_string(),
        });
    }
    if merging {
        let mut twin = false;
        for &q in &merges.sources {
            if let Some(found) = records
                .get(slot::slot_key(q, rkey).as_slice())
                .context(what)?
            {
                twin |= found.value() == value;
            }
        }
        if !twin {
            problems.push(Damage::BadPartition {
                partition: p,
                reason: format!(
                    "the merge's copy of record {} matches no merge source's record",
                    hex(rkey)
                ),
            });
        }
    } else if p < slot::BUILT_PARTITIONS {
        let mut live = None;
        for &q in merges.built.iter().rev() {
            if let Some(found) = records
                .get(slot::slot_key(q, rkey).as_slice())
                .context(what)?
            {
                live = Some(found.value() == value);
                break;
            }
        }
        let reason = match live {
            Some(true) => None,
            Some(false) => Some("differs from its live copy in the merged partition"),
            None => Some("has no live copy in a merged partition"),
        };
        if let Some(reason) = reason {
            problems.push(Damage::BadPartition {
                partition: p,
                reason: format!(
                    "record {} of this dropping merge source {reason}: its drop step repairs \
                     the live copy from it",
                    hex(rkey)
                ),
            });
        }
    }
    Ok(Some(problems))
}

/// Walks every record: its key, a lookup of it, its value; what it found
/// wrong goes to `problems`.
fn walk_records(
    records: &redb::ReadOnlyTable<&'static [u8], &'static [u8]>,
    layout: Layout,
    merges: &Merges,
    problems: &mut Vec<Damage>,
) -> Result<Walked> {
    let what = "verifying the database";
    let mut w = Walked {
        expected: BTreeSet::new(),
        undecodable: BTreeSet::new(),
        duplicates: BTreeMap::new(),
        partition_of: HashMap::new(),
        unreachable: BTreeSet::new(),
        checked: 0,
    };
    for entry in records.iter().context(what)? {
        let (k, v) = entry.context(what)?;
        w.checked += 1;
        let stored = k.value().to_vec();
        let rkey = if let Layout::Single = layout {
            stored.clone()
        } else if let Some((p, rkey)) = slot::split(&stored) {
            if let Some(found) = unread_copy_damage(records, merges, p, rkey, v.value())? {
                problems.extend(found);
                continue;
            }
            if let Some(first) = w.partition_of.insert(rkey.to_vec(), p) {
                w.duplicates
                    .entry(rkey.to_vec())
                    .or_default()
                    .extend([first, p]);
            }
            rkey.to_vec()
        } else {
            problems.push(Damage::BadKey {
                key_hex: hex(&stored),
            });
            continue;
        };
        if crate::key::IdempotencyKey::from_record_key(&rkey).is_none() {
            problems.push(Damage::BadKey {
                key_hex: hex(&rkey),
            });
        }
        // A lookup must find what the walk met: a request only ever looks
        // its key up.
        let found = records.get(stored.as_slice()).context(what)?;
        if found.is_none_or(|f| f.value() != v.value()) {
            problems.push(Damage::UnreachableRecord {
                key_hex: hex(&rkey),
            });
            w.unreachable.insert(stored.clone());
        }
        match codec::decode(&rkey, v.value()) {
            Ok(rec) => {
                let (index, at) = rec.index();
                w.expected.insert((index, at, rkey));
            }
            Err(e) => {
                problems.push(Damage::Undecodable {
                    key_hex: hex(&rkey),
                    reason: e.to_string(),
                });
                w.undecodable.insert(rkey);
            }
        }
    }
    Ok(w)
}

/// What is wrong with a format-3 file's partitions: rows that do not
/// decode, key ranges without a row, more than one hot partition, and
/// each sealed partition's filter checked against its records (decoded
/// with the checksum its row names, no more records than it counts, and
/// a "maybe" for every key it holds). Without `seed` the filters are not checked.
fn partition_damage(
    txn: &redb::ReadTransaction,
    records: &redb::ReadOnlyTable<&'static [u8], &'static [u8]>,
    seed: Option<&[u8; 16]>,
) -> Result<Vec<Damage>> {
    let what = "verifying the partitions";
    let mut problems = Vec::new();
    let bad = |partition, reason: String| Damage::BadPartition { partition, reason };
    let rows_table = match txn.open_table(PARTITIONS) {
        Ok(table) => Some(table),
        Err(TableError::TableDoesNotExist(_)) => None,
        Err(e) => return Err(e).context(what),
    };
    let mut rows = BTreeMap::new();
    if let Some(table) = &rows_table {
        for entry in table.iter().context(what)? {
            let (k, v) = entry.context(what)?;
            match PartitionRow::decode(k.value(), v.value()) {
                Ok(row) => {
                    rows.insert(k.value(), row);
                }
                Err(e) => problems.push(bad(k.value(), e.to_string())),
            }
        }
    }
    for p in catalog::partitions_in(records).context(what)? {
        if !rows.contains_key(&p)
            && rows_table
                .as_ref()
                .is_none_or(|t| t.get(p).ok().flatten().is_none())
        {
            problems.push(bad(p, "it holds records but has no row".into()));
        }
    }
    let hot: Vec<u64> = rows
        .iter()
        .filter(|(_, row)| row.state == PartitionState::Hot)
        .map(|(p, _)| *p)
        .collect();
    if hot.len() > 1 {
        for p in &hot[1..] {
            problems.push(bad(
                *p,
                format!("a second partition taking new keys (after {})", hot[0]),
            ));
        }
    }
    let merging: Vec<u64> = rows
        .iter()
        .filter(|(_, row)| row.state == PartitionState::Merging)
        .map(|(p, _)| *p)
        .collect();
    let sources = rows
        .values()
        .filter(|row| row.state == PartitionState::MergeSource)
        .count();
    for p in merging.iter().skip(1) {
        problems.push(bad(
            *p,
            format!("a second merging partition (after {})", merging[0]),
        ));
    }
    match (merging.first(), sources) {
        (Some(p), 0) => problems.push(bad(*p, "a merging partition without merge sources".into())),
        (None, n) if n > 0 => {
            for (p, _) in rows
                .iter()
                .filter(|(_, row)| row.state == PartitionState::MergeSource)
            {
                problems.push(bad(*p, "a merge source without a merging partition".into()));
            }
        }
        _ => {}
    }
    let Some(seed) = seed else {
        return Ok(problems);
    };
    let hasher = FilterHasher::new(seed);
    let filters = match txn.open_table(FILTERS) {
        Ok(table) => Some(table),
        Err(TableError::TableDoesNotExist(_)) => None,
        Err(e) => return Err(e).context(what),
    };
    for (p, row) in &rows {
        let Some(sum) = row.filter_checksum else {
            continue;
        };
        let stored = match &filters {
            Some(table) => table.get(*p).context(what)?.map(|v| v.value().to_vec()),
            None => None,
        };
        problems.extend(filter_damage(
            records,
            &hasher,
            *p,
            &sum,
            stored.as_deref(),
        )?);
    }
    Ok(problems)
}

/// Every dead letter decodes and passes its checksum under its seq (a
/// table a file has only once a message was given up).
fn dead_letter_damage(txn: &redb::ReadTransaction, problems: &mut Vec<Damage>) -> Result<()> {
    let what = "verifying the dead letters";
    match txn.open_table(DEAD_LETTERS) {
        Ok(letters) => {
            for entry in letters.iter().context(what)? {
                let (seq, v) = entry.context(what)?;
                if let Err(e) = codec::decode_dead_letter(seq.value(), v.value()) {
                    problems.push(Damage::UndecodableDeadLetter {
                        seq: seq.value(),
                        reason: e.to_string(),
                    });
                }
            }
        }
        Err(redb::TableError::TableDoesNotExist(_)) => {}
        Err(e) => return Err(e).context(what),
    }
    Ok(())
}

/// Every effect step and log entry decodes and passes its checksum under
/// the key it is stored at (tables a format-2 file may not have yet), and
/// has its record beside it (`owners`, which gathers those that have none).
fn step_damage(
    txn: &redb::ReadTransaction,
    owners: &mut Owners<'_>,
    problems: &mut Vec<Damage>,
) -> Result<()> {
    let partitioned = owners.partitioned;
    // Format 3 keys steps and log entries by slot key: their checksums
    // are keyed by the record key after the partition prefix.
    let record_key = |stored: &[u8]| -> Vec<u8> {
        match (partitioned, slot::split(stored)) {
            (true, Some((_, rkey))) => rkey.to_vec(),
            _ => stored.to_vec(),
        }
    };
    let what = "verifying the effect steps";
    let steps = if partitioned {
        txn.open_table(catalog::STEPS)
    } else {
        txn.open_table(STEPS)
    };
    match steps {
        Ok(steps) => {
            for entry in steps.iter().context(what)? {
                let (k, v) = entry.context(what)?;
                let (stored, name) = k.value();
                let rkey = &record_key(stored)[..];
                match codec::decode_step(rkey, name, v.value()) {
                    Ok(_) => owners.step(stored, name)?,
                    Err(e) => problems.push(Damage::UndecodableStep {
                        key_hex: hex(rkey),
                        step: name.to_owned(),
                        reason: e.to_string(),
                    }),
                }
            }
        }
        Err(TableError::TableDoesNotExist(_)) => {}
        Err(e) => return Err(e).context(what),
    }
    let what = "verifying the evidence log";
    let history = if partitioned {
        txn.open_table(catalog::HISTORY)
    } else {
        txn.open_table(HISTORY)
    };
    match history {
        Ok(history) => {
            for entry in history.iter().context(what)? {
                let (k, v) = entry.context(what)?;
                let (stored, seq) = k.value();
                let rkey = &record_key(stored)[..];
                match codec::decode_history(rkey, seq, v.value()) {
                    Ok(_) => owners.log_entry(stored)?,
                    Err(e) => problems.push(Damage::UndecodableHistory {
                        key_hex: hex(rkey),
                        seq,
                        reason: e.to_string(),
                    }),
                }
            }
        }
        Err(TableError::TableDoesNotExist(_)) => {}
        Err(e) => return Err(e).context(what),
    }
    Ok(())
}

/// Whether each effect step and log entry has its record beside it: under
/// the same key of the records table (format 2: the record key; format 3:
/// the slot key, so in the same partition). A read finds a key's steps and
/// log there only (`read.rs`), and every write deletes them with their
/// record (`store/ops.rs`, `step_ops::drop_steps`; a tombstone keeps its
/// record and one summary entry; a merge copies a record with its steps
/// and log, mirrors every later write to both, and deletes both together,
/// `partition/merge.rs`, `twins.rs`). Not checked:
/// - entries in a partition a merge is dropping: nothing reads them, and
///   its drop step deletes every step and log entry of its range, with a
///   record or not, before its row goes (`merge::drop_step`);
/// - entries beside a record a lookup cannot reach (reported as
///   unreachable: the record is there);
/// - entries that do not decode (reported as such: their key bytes may be
///   what was damaged).
struct Owners<'a> {
    /// The records table of the file's layout.
    records: &'a redb::ReadOnlyTable<&'static [u8], &'static [u8]>,
    /// Format 3 (slot keys).
    partitioned: bool,
    /// Format 3: the partitions a merge is dropping.
    dropping: &'a BTreeSet<u64>,
    /// Stored keys of records a lookup does not find.
    unreachable: &'a BTreeSet<Vec<u8>>,
    /// Format 3: a read partition holding each record key.
    partition_of: &'a HashMap<Vec<u8>, u64>,
    /// The last stored key asked about and whether it needs no report
    /// (both tables are in stored-key order: one lookup a key and table).
    last: Option<(Vec<u8>, bool)>,
    /// Stored key → (step names, log entries) kept without a record.
    without: BTreeMap<Vec<u8>, (Vec<String>, u64)>,
}

impl Owners<'_> {
    /// Step `name`, stored under `stored` (it decodes).
    fn step(&mut self, stored: &[u8], name: &str) -> Result<()> {
        if !self.owned(stored)? {
            let entry = self.without.entry(stored.to_vec()).or_default();
            entry.0.push(name.to_owned());
        }
        Ok(())
    }

    /// A log entry stored under `stored` (it decodes).
    fn log_entry(&mut self, stored: &[u8]) -> Result<()> {
        if !self.owned(stored)? {
            let entry = self.without.entry(stored.to_vec()).or_default();
            entry.1 = entry.1.saturating_add(1);
        }
        Ok(())
    }

    /// Whether entries stored under `stored` have their record beside them
    /// (or are not checked: see [`Owners`]).
    fn owned(&mut self, stored: &[u8]) -> Result<bool> {
        if let Some((key, owned)) = &self.last {
            if key.as_slice() == stored {
                return Ok(*owned);
            }
        }
        let dropping = self.partitioned
            && slot::split(stored).is_some_and(|(p, _)| self.dropping.contains(&p));
        let owned = dropping
            || self.unreachable.contains(stored)
            || self
                .records
                .get(stored)
                .context("verifying the effect steps")?
                .is_some();
        self.last = Some((stored.to_vec(), owned));
        Ok(owned)
    }

    /// One report per stored key with entries but no record.
    fn report(self) -> Vec<Damage> {
        let mut out = Vec::with_capacity(self.without.len());
        for (stored, (steps, log_entries)) in self.without {
            let (partition, rkey) = match (self.partitioned, slot::split(&stored)) {
                (true, Some((p, rkey))) => (Some(p), rkey),
                _ => (None, stored.as_slice()),
            };
            let record_in =
                partition.and_then(|p| self.partition_of.get(rkey).copied().filter(|q| *q != p));
            out.push(Damage::StepsWithoutRecord {
                key_hex: hex(rkey),
                partition,
                record_in,
                steps,
                log_entries,
            });
        }
        out
    }
}

/// What is wrong with the meta table in `txn`'s snapshot.
fn meta_damage(txn: &redb::ReadTransaction) -> Result<Vec<Damage>> {
    let what = "verifying the meta table";
    let table = match txn.open_table(META) {
        Ok(table) => table,
        Err(TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
        Err(e) => return Err(e).context(what),
    };
    let bad = |key: &str, reason: String| Damage::BadMetaValue {
        key: key.to_string(),
        reason,
    };
    let format_key = meta::Key::FormatVersion.name();
    let format = match meta::read_format(&table) {
        Ok(Some(Found::Format(format))) => format,
        // No open gets this far with these; a file changed since is
        // reported, and its other values cannot be read without a format.
        Ok(None) => return Ok(vec![bad(format_key, "missing".into())]),
        Ok(Some(other)) => {
            return Ok(vec![bad(
                format_key,
                format!("not a format this build reads ({other:?})"),
            )])
        }
        Err(MetaError::Damaged { key, reason }) => return Ok(vec![bad(key.name(), reason)]),
        Err(MetaError::Storage(e)) => return Err(e).context(what),
    };
    Ok(meta::damage(&table, format)
        .context(what)?
        .into_iter()
        .map(|p| bad(&p.name, p.reason))
        .collect())
}

/// What is wrong with sealed partition `p`'s filter `stored` (checksum
/// `sum` in its row) against its records.
fn filter_damage(
    records: &redb::ReadOnlyTable<&'static [u8], &'static [u8]>,
    hasher: &FilterHasher,
    p: u64,
    sum: &FilterChecksum,
    stored: Option<&[u8]>,
) -> Result<Vec<Damage>> {
    let what = "verifying the partitions";
    let bad = |reason: String| Damage::BadPartition {
        partition: p,
        reason,
    };
    let Some(stored) = stored else {
        return Ok(vec![bad("its key filter is missing".into())]);
    };
    let filter = match PartitionFilter::decode(p, stored, sum, hasher) {
        Ok(filter) => filter,
        Err(e) => return Ok(vec![bad(e.to_string())]),
    };
    let mut problems = Vec::new();
    let mut keys = 0u64;
    let mut missed: Option<(Vec<u8>, u64)> = None;
    for entry in catalog::range(records, p).context(what)? {
        let (k, _) = entry.context(what)?;
        keys += 1;
        if let Some((_, rkey)) = slot::split(k.value()) {
            if !filter.may_contain(rkey) {
                let m = missed.get_or_insert_with(|| (rkey.to_vec(), 0));
                m.1 += 1;
            }
        }
    }
    // Fewer keys than the filter counts is expiry at work (records leave a
    // sealed partition one by one); more is keys added behind its back.
    if keys > filter.len() {
        problems.push(bad(format!(
            "its key filter counts {} keys where its records are {keys}: keys were added after it was sealed",
            filter.len()
        )));
    }
    if let Some((rkey, n)) = missed {
        problems.push(bad(format!(
            "its key filter says \"absent\" for {n} of its records (the first: {})",
            crate::verify::shown(&hex(&rkey))
        )));
    }
    Ok(problems)
}
