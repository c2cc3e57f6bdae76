//! Where a read finds a record, its steps and its evidence log: format 2
//! keys them by record key in `idempotency.records`, `.steps` and
//! `.history` ([`Layout::Single`]); format 3 keys them by slot key
//! (`partition/slot.rs`) in the `idempotency.partitioned.*` tables
//! ([`Layout::Partitioned`]), and a lookup finds a key's partition
//! through the probes of its own read transaction ([`Lookup`]). Values,
//! and the checksums inside them, are keyed by the record key in both.
//!
//! Index tables (leases, recovery, expiry), the outbox, entities and
//! dead letters are the same in both layouts.
//!
//! Store layer (layer 2).

use std::borrow::Cow;
use std::sync::Arc;

use redb::{AccessGuard, ReadOnlyTable, ReadTransaction, TableDefinition};

use super::partition::catalog::{self, Filters, Probes};
use super::partition::row::PARTITIONS;
use super::partition::slot;
use super::tables::{HISTORY, RECORDS, STEPS};

/// Record (or slot) key bytes → encoded record.
pub(super) type RecordsDef = TableDefinition<'static, &'static [u8], &'static [u8]>;
/// (Record or slot key, step name) → encoded step.
pub(super) type StepsDef = TableDefinition<'static, (&'static [u8], &'static str), &'static [u8]>;
/// (Record or slot key, seq) → encoded evidence log entry.
pub(super) type HistoryDef = TableDefinition<'static, (&'static [u8], u32), &'static [u8]>;

/// How a file keeps its records: cheap to clone (an `Arc` at most).
#[derive(Debug, Clone, Default)]
pub(super) enum Layout {
    /// Format 2: one table each for records, steps and log, keyed by
    /// record key.
    #[default]
    Single,
    /// Format 3: every partition in one table each, keyed by slot key;
    /// the filters the writer keeps, shared. (Until an open creates
    /// format-3 files, only tests build it.)
    Partitioned(Arc<Filters>),
}

impl Layout {
    /// The records table of this layout.
    pub(super) fn records(&self) -> RecordsDef {
        match self {
            Layout::Single => RECORDS,
            Layout::Partitioned(_) => catalog::RECORDS,
        }
    }

    /// The steps table of this layout.
    pub(super) fn steps(&self) -> StepsDef {
        match self {
            Layout::Single => STEPS,
            Layout::Partitioned(_) => catalog::STEPS,
        }
    }

    /// The evidence-log table of this layout.
    pub(super) fn history(&self) -> HistoryDef {
        match self {
            Layout::Single => HISTORY,
            Layout::Partitioned(_) => catalog::HISTORY,
        }
    }

    /// Bytes before the record key in a key of the records table: none in
    /// format 2, the partition number in format 3.
    pub(super) fn prefix_bytes(&self) -> usize {
        match self {
            Layout::Single => 0,
            Layout::Partitioned(_) => slot::PREFIX_BYTES,
        }
    }

    /// How `txn` finds a record key: in format 3, through the partitions
    /// whose rows are in `txn` (a file without the rows' table has none),
    /// never through a list the writer keeps (see `partition/catalog.rs`).
    ///
    /// # Errors
    ///
    /// The redb error of opening or reading the rows' table.
    pub(super) fn lookup(&self, txn: &ReadTransaction) -> Result<Lookup, redb::Error> {
        match self {
            Layout::Single => Ok(Lookup::Single),
            Layout::Partitioned(filters) => {
                let probes = match txn.open_table(PARTITIONS) {
                    Ok(rows) => Probes::read(&rows, filters)?,
                    Err(redb::TableError::TableDoesNotExist(_)) => Probes::default(),
                    Err(e) => return Err(e.into()),
                };
                Ok(Lookup::Partitioned {
                    probes,
                    filters: filters.clone(),
                })
            }
        }
    }
}

/// How one read transaction finds a record key's record ([`Layout::lookup`]).
#[derive(Debug, Clone)]
pub(super) enum Lookup {
    /// Format 2: under the record key itself.
    Single,
    /// Format 3: under its slot key in the first partition, in probing
    /// order, that holds it.
    Partitioned {
        /// The partitions of the transaction, with the filters kept for
        /// them.
        probes: Probes,
        /// The file's hasher (and the filters).
        filters: Arc<Filters>,
    },
}

/// A record found by [`Lookup::find`]: the key it is stored under (and its
/// steps and log with it) and its stored bytes.
pub(super) struct Found<'k> {
    /// The record key in format 2, the slot key in format 3.
    pub(super) slot: Cow<'k, [u8]>,
    /// The encoded record.
    pub(super) value: AccessGuard<'static, &'static [u8]>,
}

impl Lookup {
    /// Record key `rkey`'s stored record in `records` (this lookup's
    /// layout's records table, of the same transaction), or `None`.
    ///
    /// # Errors
    ///
    /// The storage error of a read.
    pub(super) fn find<'k>(
        &self,
        records: &ReadOnlyTable<&'static [u8], &'static [u8]>,
        rkey: &'k [u8],
    ) -> Result<Option<Found<'k>>, redb::StorageError> {
        match self {
            Lookup::Single => Ok(records.get(rkey)?.map(|value| Found {
                slot: Cow::Borrowed(rkey),
                value,
            })),
            Lookup::Partitioned { probes, filters } => {
                // One buffer for every probe: only its prefix changes.
                let mut slot = slot::slot_key(0, rkey);
                let found = probes.locate(filters.hasher(), rkey, |p| {
                    slot[..slot::PREFIX_BYTES].copy_from_slice(&p.to_be_bytes());
                    records.get(slot.as_slice())
                })?;
                Ok(found.map(|(p, value)| {
                    slot[..slot::PREFIX_BYTES].copy_from_slice(&p.to_be_bytes());
                    Found {
                        slot: Cow::Owned(slot),
                        value,
                    }
                }))
            }
        }
    }

    /// The key `rkey`'s steps and log are under while it has no record:
    /// the record key itself in format 2 (its steps may outlive it there);
    /// `None` in format 3, where they are under the slot key of the record's
    /// partition, and no record names one.
    pub(super) fn slot_without_record<'k>(&self, rkey: &'k [u8]) -> Option<Cow<'k, [u8]>> {
        match self {
            Lookup::Single => Some(Cow::Borrowed(rkey)),
            Lookup::Partitioned { .. } => None,
        }
    }

    /// How many partitions a lookup may read (format 2: one table).
    #[cfg(test)]
    pub(super) fn partitions(&self) -> usize {
        match self {
            Lookup::Single => 1,
            Lookup::Partitioned { probes, .. } => probes.len(),
        }
    }
}
