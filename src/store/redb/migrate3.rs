//! Migrating a format-2 redb file to format 3 (partitioned records,
//! docs/format3-plan.md), on a writable open that asks for format 3
//! (`EngineBuilder::unstable_format_3`, while format 3 is built), after
//! the journal's frames were applied and checkpointed.
//!
//! One durable write transaction:
//! 1. every record is copied, in record-key order, under its slot key in
//!    one partition numbered [`BUILT_PARTITIONS`] (above every partition
//!    that takes claims, so the copy appends past the table's last key and
//!    redb packs its leaves); its value is copied as it is (a value's
//!    checksum is keyed by its record key, which does not change), a value
//!    that does not decode too (it stays an error naming its key, and
//!    `verify` lists it);
//! 2. every effect step and evidence-log entry goes beside its record;
//! 3. the partition is sealed: its filter built from its keys, stored, and
//!    its row written;
//! 4. format 2's three tables are deleted, and the meta table gets the
//!    filters' seed and `format_version` = 3, last.
//!
//! The index tables (leases, recovery, expiry), the outbox, the entities
//! and the dead letters are keyed by record key or their own ids: they
//! are not touched. A crash or a failure part way leaves the file as it
//! was (format 2), and the next open that asks for format 3 migrates it
//! again. The price of one transaction: memory and time grow with the
//! file (a bounded, resumable copy is left for when format 3 becomes the
//! default).

use std::path::Path;

use redb::{Database, Durability, ReadableTable, WriteTransaction};

use crate::error::OpenError;

use crate::store::redb::meta::{self, MetaError};
use crate::store::redb::partition::catalog::{self, build_filter};
use crate::store::redb::partition::filter::FilterHasher;
use crate::store::redb::partition::row::{PartitionRow, FILTERS, PARTITIONS};
use crate::store::redb::partition::slot::{self, BUILT_PARTITIONS};
use crate::store::redb::tables::{HISTORY, META, RECORDS, STEPS};

/// Values copied per read of a format-2 table: bounds what the copy holds
/// at once (all of it is still one transaction).
const BATCH: usize = 4_096;

/// What a migration copied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Migrated {
    pub(super) records: u64,
    pub(super) steps: u64,
    pub(super) history: u64,
}

/// Migrates the format-2 database `db` to format 3 with the filters' seed
/// `seed` (see the module docs); `path` names it in errors; `now_ms` is
/// the sealed partition's row time.
///
/// # Errors
///
/// [`OpenError::Storage`] (or `Corrupt` for a damaged meta value) when a
/// read or write fails: nothing is then written.
pub(super) fn to_format_3(
    db: &Database,
    path: &Path,
    seed: &[u8; 16],
    now_ms: u64,
) -> Result<Migrated, OpenError> {
    let what = "migrating the database from format 2 to format 3";
    let fail = |e: MetaError| e.open_error(path, what);
    let mut txn = db.begin_write().map_err(|e| fail(e.into()))?;
    txn.set_durability(Durability::Immediate)
        .map_err(|e| fail(e.into()))?;
    // On an error the transaction is dropped: nothing is written.
    let migrated = migrate(&txn, seed, now_ms).map_err(fail)?;
    txn.commit().map_err(|e| fail(e.into()))?;
    tracing::info!(
        records = migrated.records,
        steps = migrated.steps,
        history = migrated.history,
        "database migrated from format 2 to format 3"
    );
    Ok(migrated)
}

fn migrate(txn: &WriteTransaction, seed: &[u8; 16], now_ms: u64) -> Result<Migrated, MetaError> {
    let p = BUILT_PARTITIONS;
    let mut m = Migrated::default();
    {
        let from = txn.open_table(RECORDS)?;
        let mut to = txn.open_table(catalog::RECORDS)?;
        copy_batched(&from, |k: &[u8], v: &[u8]| {
            to.insert(slot::slot_key(p, k).as_slice(), v)?;
            m.records += 1;
            Ok(())
        })?;
    }
    // In a write transaction a missing table opens empty (format 2
    // creates steps and history on first use); deleted below either way.
    {
        let from = txn.open_table(STEPS)?;
        let mut to = txn.open_table(catalog::STEPS)?;
        for entry in from.iter()? {
            let (k, v) = entry?;
            let (rkey, name) = k.value();
            to.insert((slot::slot_key(p, rkey).as_slice(), name), v.value())?;
            m.steps += 1;
        }
    }
    {
        let from = txn.open_table(HISTORY)?;
        let mut to = txn.open_table(catalog::HISTORY)?;
        for entry in from.iter()? {
            let (k, v) = entry?;
            let (rkey, seq) = k.value();
            to.insert((slot::slot_key(p, rkey).as_slice(), seq), v.value())?;
            m.history += 1;
        }
    }
    seal_built_partition(txn, seed, now_ms)?;
    txn.delete_table(RECORDS)?;
    txn.delete_table(STEPS)?;
    txn.delete_table(HISTORY)?;
    meta::migrate_to_format_3(&mut txn.open_table(META)?, seed)?;
    Ok(m)
}

/// Seals partition [`BUILT_PARTITIONS`] of format 3's records in `txn`,
/// once its records were inserted in key order: its filter built from its
/// range (hashed with the file's filter seed `seed`) and stored, and its
/// row written, sealed, with `now_ms` as its first and last claim time.
/// Nothing is written for an empty partition. Shared by the migration
/// from format 2 and by salvage of a format-3 file (`salvage/write.rs`).
///
/// # Errors
///
/// [`MetaError::Storage`] when redb fails; [`MetaError::Damaged`] (under
/// `format_version`) when the filter cannot be built.
pub(in crate::store::redb) fn seal_built_partition(
    txn: &WriteTransaction,
    seed: &[u8; 16],
    now_ms: u64,
) -> Result<(), MetaError> {
    let p = BUILT_PARTITIONS;
    let hasher = FilterHasher::new(seed);
    let records = txn.open_table(catalog::RECORDS)?;
    if catalog::range(&records, p)?.next().is_none() {
        return Ok(());
    }
    let mut rows = txn.open_table(PARTITIONS)?;
    let mut filters = txn.open_table(FILTERS)?;
    let filter = build_filter(&records, &hasher, p).map_err(|e| MetaError::Damaged {
        key: meta::Key::FormatVersion,
        reason: format!("building the built partition's filter: {e}"),
    })?;
    let (bytes, sum) = filter.encode();
    let mut row = PartitionRow::hot(now_ms, now_ms);
    row.keys = filter.len();
    row.seal(p, sum).map_err(|e| MetaError::Damaged {
        key: meta::Key::FormatVersion,
        reason: e.to_string(),
    })?;
    filters.insert(p, bytes.as_slice())?;
    rows.insert(p, row.encode(p).as_slice())?;
    Ok(())
}

/// Calls `copy` on every entry of `from` in key order, reading
/// [`BATCH`] entries at a time.
fn copy_batched(
    from: &redb::Table<'_, &'static [u8], &'static [u8]>,
    mut copy: impl FnMut(&[u8], &[u8]) -> Result<(), redb::Error>,
) -> Result<(), redb::Error> {
    let mut after: Option<Vec<u8>> = None;
    loop {
        let batch: Vec<(Vec<u8>, Vec<u8>)> = {
            let range = match &after {
                Some(last) => from.range::<&[u8]>((
                    std::ops::Bound::Excluded(last.as_slice()),
                    std::ops::Bound::Unbounded,
                ))?,
                None => from.range::<&[u8]>(..)?,
            };
            let mut batch = Vec::with_capacity(BATCH);
            for entry in range.take(BATCH) {
                let (k, v) = entry?;
                batch.push((k.value().to_vec(), v.value().to_vec()));
            }
            batch
        };
        let Some((last, _)) = batch.last() else {
            return Ok(());
        };
        after = Some(last.clone());
        for (k, v) in &batch {
            copy(k, v)?;
        }
    }
}
