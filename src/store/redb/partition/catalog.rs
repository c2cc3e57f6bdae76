//! Format 3's partitions as a lookup sees them: which partitions exist,
//! newest first, each with the key filter that lets a lookup skip it
//! ([`Probes`]); the filters shared by the writer and the readers
//! ([`Filters`]); and the writer's own view, which also knows the hot
//! partition and seals it ([`Catalog`]).
//!
//! # Where the truth is
//!
//! The `idempotency.partitions` rows of a commit say which partitions
//! that commit has. A reader builds its [`Probes`] from the rows of its
//! own snapshot ([`Probes::read`]), never from a list the writer keeps,
//! so a partition opened by a later commit cannot be missing from a
//! lookup in an earlier one, nor the other way round. Filters are
//! immutable once a partition is sealed; [`Filters`] keeps each decoded
//! filter under its partition and the checksum its row names, and a
//! lookup uses a kept filter only when that checksum is the one in its
//! snapshot's row. A partition without a usable filter (hot, or its
//! filter missing, damaged or not loaded yet) is read, never skipped: a
//! filter can cost a read, never an answer.
//!
//! Store layer (layer 2).

use std::sync::Arc;

use parking_lot::RwLock;
use redb::{ReadableTable, Table, TableDefinition};

use super::filter::{
    FilterChecksum, FilterError, FilterHasher, GroupAnswers, KeyHash, PartitionFilter,
};
use super::filter_group::Kept;
use super::merge;
use super::row::{PartitionRow, PartitionState, RowError, FILTERS, PARTITIONS};
use super::slot::{self, BUILT_PARTITIONS, FIRST_PARTITION};

/// Format 3's records: slot key (`slot.rs`) → encoded record.
pub(crate) const RECORDS: TableDefinition<&[u8], &[u8]> =
    TableDefinition::new("idempotency.partitioned.records");
/// Format 3's effect steps: (slot key, step name) → encoded step.
pub(crate) const STEPS: TableDefinition<(&[u8], &str), &[u8]> =
    TableDefinition::new("idempotency.partitioned.steps");
/// Format 3's evidence log: (slot key, seq) → encoded entry.
pub(crate) const HISTORY: TableDefinition<(&[u8], u32), &[u8]> =
    TableDefinition::new("idempotency.partitioned.history");

/// How long a partition takes claims, and how many keys it takes at
/// most, before the writer seals it and opens the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SealRule {
    /// The longest a partition stays hot, ms.
    pub(crate) interval_ms: u64,
    /// The key count that seals it sooner.
    pub(crate) max_keys: u64,
}

impl SealRule {
    /// The keys the filter of partition `partition`, holding `keys`, is
    /// sized for when the writer seals (or rebuilds) it. A partition that
    /// took claims and holds at least half of [`Self::max_keys`]: the
    /// limit and an eighth more, since the writer seals before a group's
    /// jobs and a partition may take a group's keys past the limit. So
    /// the partitions of a busy API, sealed by their key count, share one
    /// block count and their filters are grouped (`filter_group.rs`).
    /// Otherwise exactly its keys: a quiet API's partitions, sealed by
    /// time, keep small filters, and a partition the engine built in key
    /// order holds what it holds.
    pub(crate) fn filter_capacity(&self, partition: u64, keys: u64) -> u64 {
        let busy = keys.saturating_mul(2) >= self.max_keys;
        if partition < BUILT_PARTITIONS && busy {
            keys.max(self.max_keys.saturating_add(self.max_keys / 8))
        } else {
            keys
        }
    }

    /// Ten-minute partitions of at most 32,768 keys: a hot table of that
    /// size kept commits at 1.00–1.04× a 10k store's rate in the
    /// prototype (BENCHMARKS.md, "Scale layouts (issue 26)").
    pub(crate) const DEFAULT: SealRule = SealRule {
        interval_ms: 10 * 60 * 1000,
        max_keys: 32_768,
    };
}

/// Decoded filters of sealed partitions, shared by the writer (which adds
/// one at each seal and at open) and the readers, grouped so that a
/// key's probes read adjacent memory (`filter_group.rs`).
#[derive(Debug)]
pub(crate) struct Filters {
    hasher: FilterHasher,
    kept: RwLock<Kept>,
}

impl Filters {
    /// No filter kept yet; keys hashed with `hasher` (the file's seed).
    pub(crate) fn new(hasher: FilterHasher) -> Filters {
        Filters {
            hasher,
            kept: RwLock::new(Kept::default()),
        }
    }

    /// The file's key hasher.
    pub(crate) fn hasher(&self) -> &FilterHasher {
        &self.hasher
    }

    /// The filter of `partition`, if one is kept under `checksum`.
    pub(crate) fn get(
        &self,
        partition: u64,
        checksum: &FilterChecksum,
    ) -> Option<Arc<PartitionFilter>> {
        self.kept.read().get(partition, checksum)
    }

    /// Keeps `filter` for `partition` under `checksum`, and returns the
    /// filter kept: the same answers, its blocks perhaps moved into a
    /// group. Hold that one, not `filter`, so that `filter`'s own blocks
    /// are freed.
    pub(crate) fn keep(
        &self,
        partition: u64,
        checksum: FilterChecksum,
        filter: Arc<PartitionFilter>,
    ) -> Arc<PartitionFilter> {
        self.kept.write().keep(partition, checksum, filter)
    }

    /// Keeps filters ungrouped until [`Self::group_deferred`]: an open
    /// that keeps every stored filter groups them once, at the end.
    pub(crate) fn defer_grouping(&self) {
        self.kept.write().defer();
    }

    /// Groups the filters kept since [`Self::defer_grouping`]. Probes
    /// built before hold the ungrouped copies: refresh them.
    pub(crate) fn group_deferred(&self) {
        self.kept.write().group_deferred();
    }

    /// Forgets `partition`'s filter (it was dropped).
    pub(crate) fn forget(&self, partition: u64) {
        self.kept.write().forget(partition);
    }
}

/// One partition as a lookup probes it.
#[derive(Debug, Clone)]
pub(crate) struct Probe {
    /// The partition number.
    pub(crate) partition: u64,
    /// Its filter and the checksum its row names; `None`: the partition
    /// is read on every lookup.
    pub(crate) filter: Option<Arc<PartitionFilter>>,
    /// The checksum `filter` is kept under in [`Filters`].
    checksum: Option<FilterChecksum>,
}

/// Partitions in the order a lookup probes them: partitions that took
/// claims, newest (highest number) first, then those the engine built in
/// key order, newest first. A key is in at most one partition, so the
/// order only decides how soon a lookup stops.
#[derive(Debug, Clone, Default)]
pub(crate) struct Probes {
    list: Vec<Probe>,
}

/// The order of [`Probes`]: a sort key, smallest first.
fn probe_order(partition: u64) -> (bool, std::cmp::Reverse<u64>) {
    (partition >= BUILT_PARTITIONS, std::cmp::Reverse(partition))
}

impl Probes {
    /// The probes of the partitions whose rows are in `rows` (a table of a
    /// snapshot or of the writer's transaction), with the filters `filters`
    /// keeps under the checksums those rows name. A row that does not
    /// decode still names a partition: it is probed without a filter.
    ///
    /// # Errors
    ///
    /// The storage error of reading `rows`.
    pub(crate) fn read(
        rows: &impl ReadableTable<u64, &'static [u8]>,
        filters: &Filters,
    ) -> Result<Probes, redb::StorageError> {
        let mut list = Vec::new();
        for entry in rows.iter()? {
            let (k, v) = entry?;
            let partition = k.value();
            let (filter, checksum) = match PartitionRow::decode(partition, v.value()) {
                // Copies being made, or stale once merged (`merge.rs`).
                Ok(row) if !row.is_read() => continue,
                Ok(row) => match row.filter_checksum {
                    Some(sum) => (filters.get(partition, &sum), Some(sum)),
                    None => (None, None),
                },
                Err(e) => {
                    tracing::warn!(error = %e, "reading a damaged partition row as a partition without a filter");
                    (None, None)
                }
            };
            list.push(Probe {
                partition,
                filter,
                checksum,
            });
        }
        list.sort_by_key(|p| probe_order(p.partition));
        Ok(Probes { list })
    }

    /// The probes, in probing order.
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Probe> {
        self.list.iter()
    }

    /// How many partitions there are.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.list.len()
    }

    /// The probes of sealed partitions (partition, its filter's checksum,
    /// its filter), for a bench fixture (`probe_fixture.rs`).
    #[cfg(feature = "bench-fixtures")]
    pub(crate) fn sealed(list: Vec<(u64, FilterChecksum, Arc<PartitionFilter>)>) -> Probes {
        let mut probes = Probes::default();
        for (partition, checksum, filter) in list {
            probes.insert(Probe {
                partition,
                filter: Some(filter),
                checksum: Some(checksum),
            });
        }
        probes
    }

    fn insert(&mut self, probe: Probe) {
        self.list.retain(|p| p.partition != probe.partition);
        let at = self
            .list
            .partition_point(|p| probe_order(p.partition) < probe_order(probe.partition));
        self.list.insert(at, probe);
    }

    fn remove(&mut self, partition: u64) {
        self.list.retain(|p| p.partition != partition);
    }

    /// Takes for each probe with a filter the one `filters` keeps now
    /// under the same checksum (a view into a group formed since), so
    /// that the copy it held is freed.
    fn refresh(&mut self, filters: &Filters) {
        for probe in &mut self.list {
            let (Some(filter), Some(sum)) = (probe.filter.as_mut(), probe.checksum.as_ref()) else {
                continue;
            };
            if let Some(kept) = filters.get(probe.partition, sum) {
                *filter = kept;
            }
        }
    }

    /// The partition holding record key `rkey`, and what `get` read there:
    /// each partition in probing order whose filter may hold the key (or
    /// that has none) is read with `get(partition)` until one has it.
    /// `None`: no partition holds it. The key is hashed at most once.
    ///
    /// # Errors
    ///
    /// The first error of `get`.
    pub(crate) fn locate<V, E>(
        &self,
        hasher: &FilterHasher,
        rkey: &[u8],
        mut get: impl FnMut(u64) -> Result<Option<V>, E>,
    ) -> Result<Option<(u64, V)>, E> {
        let mut hash: Option<KeyHash> = None;
        let mut seen = GroupAnswers::default();
        for probe in &self.list {
            if let Some(filter) = &probe.filter {
                let h = *hash.get_or_insert_with(|| hasher.hash(rkey));
                if !filter.may_contain_seen(&h, &mut seen) {
                    continue;
                }
            }
            if let Some(found) = get(probe.partition)? {
                return Ok(Some((probe.partition, found)));
            }
        }
        Ok(None)
    }
}

/// What the writer knows of the hot partition beyond its row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hot {
    /// Its number.
    pub(crate) partition: u64,
    /// Its row (as stored when it was opened; `keys` counted since, in
    /// memory: the row is written again when it is sealed).
    pub(crate) row: PartitionRow,
}

/// A change to the partition tables, for the journal: (table, partition,
/// `Some(value)` to put, `None` to delete).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CatalogChange {
    /// `idempotency.partitions`.
    Row(u64, Option<Vec<u8>>),
    /// `idempotency.filters`.
    Filter(u64, Option<Vec<u8>>),
}

/// Why the partition tables could not be read or written.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CatalogError {
    /// redb failed.
    #[error(transparent)]
    Storage(#[from] redb::Error),
    /// A row is damaged (or a transition it does not allow).
    #[error(transparent)]
    Row(#[from] RowError),
    /// A filter cannot be built.
    #[error(transparent)]
    Filter(#[from] FilterError),
    /// Keys in a partition's range while its row is missing, or more than
    /// one hot partition: the file is damaged.
    #[error("partition {partition}: {problem}")]
    Damaged {
        /// The partition number.
        partition: u64,
        /// What is wrong.
        problem: &'static str,
    },
}

impl From<redb::StorageError> for CatalogError {
    fn from(e: redb::StorageError) -> CatalogError {
        CatalogError::Storage(e.into())
    }
}

/// The writer's view of the partitions: the probes of its open
/// transaction and the hot partition.
#[derive(Debug)]
pub(crate) struct Catalog {
    filters: Arc<Filters>,
    probes: Probes,
    hot: Hot,
    rule: SealRule,
    /// Sealed partitions → their last claim (ms): when they are due for
    /// draining ([`Self::drain_next`]).
    sealed_at: std::collections::BTreeMap<u64, u64>,
    /// The drain under way: a partition and the last slot key drained
    /// (`None`: from its start).
    draining: Option<(u64, Option<Vec<u8>>)>,
    /// Partitions drained once since the open: left to the per-record
    /// sweep from then on.
    drained: std::collections::BTreeSet<u64>,
    /// The merge under way (`merge.rs`).
    merge: Option<Merging>,
    /// Partitions whose records were merged elsewhere, being emptied.
    dropping: std::collections::BTreeSet<u64>,
}

/// The merge under way (`merge.rs`), as the writer knows it.
#[derive(Debug)]
pub(crate) struct Merging {
    /// The partition it fills.
    pub(crate) target: u64,
    /// The partitions it copies, ascending.
    pub(crate) sources: Vec<u64>,
    /// The last record key copied (`None`: none yet).
    pub(crate) cursor: Option<Vec<u8>>,
    /// The target's row as the switch will seal it.
    row: PartitionRow,
    /// The target's filter, of every key copied; `None` once a key did not
    /// fit (the switch then builds it from the target's range).
    filter: Option<PartitionFilter>,
}

/// The partition tables open in the writer's transaction.
pub(crate) struct CatalogTables<'a, 't> {
    /// Slot key → encoded record.
    pub(crate) records: &'a Table<'t, &'static [u8], &'static [u8]>,
    /// Partition → row.
    pub(crate) rows: &'a mut Table<'t, u64, &'static [u8]>,
    /// Partition → stored filter.
    pub(crate) filters: &'a mut Table<'t, u64, &'static [u8]>,
}

impl Catalog {
    /// The catalog of a writable open, after the journal was applied, at
    /// `now_ms`:
    /// - each sealed partition's stored filter is decoded and checked
    ///   against its row; one that fails is rebuilt from its key range and
    ///   stored again (a warning names it);
    /// - a key range without a row gets one (sealed, its filter built
    ///   from its keys; a warning names it): its records stay found;
    /// - the hot partition (the highest number below
    ///   [`BUILT_PARTITIONS`] not sealed) gets its key count from its range;
    ///   a file without one gets a new hot partition.
    ///
    /// Every change is returned for the journal, in order.
    ///
    /// # Errors
    ///
    /// [`CatalogError`] for a storage error, a row that does not decode,
    /// or two hot partitions.
    pub(crate) fn load(
        t: &mut CatalogTables<'_, '_>,
        filters: Arc<Filters>,
        rule: SealRule,
        now_ms: u64,
        changes: &mut Vec<CatalogChange>,
    ) -> Result<Catalog, CatalogError> {
        // Every stored filter is kept here: group them once, at the end
        // (on an error too, so that later seals group again).
        filters.defer_grouping();
        let shared = filters.clone();
        let loaded = Catalog::load_ungrouped(t, filters, rule, now_ms, changes);
        shared.group_deferred();
        let mut catalog = loaded?;
        catalog.probes.refresh(&shared);
        Ok(catalog)
    }

    /// [`Self::load`] while its filters are kept ungrouped.
    fn load_ungrouped(
        t: &mut CatalogTables<'_, '_>,
        filters: Arc<Filters>,
        rule: SealRule,
        now_ms: u64,
        changes: &mut Vec<CatalogChange>,
    ) -> Result<Catalog, CatalogError> {
        let mut rows: Vec<(u64, PartitionRow)> = Vec::new();
        for entry in t.rows.iter()? {
            let (k, v) = entry?;
            let partition = k.value();
            rows.push((partition, PartitionRow::decode(partition, v.value())?));
        }
        rows_for_ranges(t, &filters, rule, now_ms, &mut rows, changes)?;
        let mut hot: Option<Hot> = None;
        let mut probes = Probes::default();
        let mut sealed_at = std::collections::BTreeMap::new();
        let mut merging: Option<(u64, PartitionRow)> = None;
        let mut sources: Vec<(u64, PartitionRow)> = Vec::new();
        let mut dropping = std::collections::BTreeSet::new();
        for (partition, row) in &rows {
            let (partition, row) = (*partition, *row);
            match row.state {
                PartitionState::Hot => {
                    if let Some(other) = hot {
                        return Err(CatalogError::Damaged {
                            partition: partition.max(other.partition),
                            problem: "a second hot partition",
                        });
                    }
                    let mut row = row;
                    row.keys = count_keys(t.records, partition)?;
                    hot = Some(Hot { partition, row });
                    probes.insert(Probe {
                        partition,
                        filter: None,
                        checksum: None,
                    });
                }
                PartitionState::Merging => {
                    if let Some((other, _)) = merging {
                        return Err(CatalogError::Damaged {
                            partition: partition.max(other),
                            problem: "a second merging partition",
                        });
                    }
                    merging = Some((partition, row));
                }
                PartitionState::Dropping => {
                    dropping.insert(partition);
                }
                PartitionState::Sealed | PartitionState::MergeSource => {
                    if row.state == PartitionState::MergeSource {
                        sources.push((partition, row));
                    }
                    sealed_at.insert(partition, row.last_claim_ms);
                    let stored = stored_filter(t, &filters, partition, &row)?;
                    let (checksum, filter) = if let Some(kept) = stored {
                        kept
                    } else {
                        let mut row = row;
                        let room = |keys| rule.filter_capacity(partition, keys);
                        seal_row(t, &filters, partition, room, &mut row, changes)?
                    };
                    probes.insert(Probe {
                        partition,
                        filter: Some(filter),
                        checksum: Some(checksum),
                    });
                }
            }
        }
        let hot = if let Some(hot) = hot {
            hot
        } else {
            let partition = rows
                .iter()
                .map(|(p, _)| *p)
                .filter(|p| *p < BUILT_PARTITIONS)
                .max()
                .map_or(FIRST_PARTITION, |p| p.saturating_add(1));
            let hot = open_hot(t, partition, now_ms, changes)?;
            probes.insert(Probe {
                partition,
                filter: None,
                checksum: None,
            });
            hot
        };
        let merge = resume_merge(t, &filters, merging, sources, &mut dropping, changes)?;
        Ok(Catalog {
            filters,
            probes,
            hot,
            rule,
            sealed_at,
            draining: None,
            drained: std::collections::BTreeSet::new(),
            merge,
            dropping,
        })
    }

    /// [`Self::load`] with the partition tables opened in `txn`.
    ///
    /// # Errors
    ///
    /// As [`Self::load`], and a table that cannot be opened.
    pub(crate) fn load_in(
        txn: &redb::WriteTransaction,
        filters: Arc<Filters>,
        rule: SealRule,
        now_ms: u64,
        changes: &mut Vec<CatalogChange>,
    ) -> Result<Catalog, CatalogError> {
        let opened = |e: redb::TableError| CatalogError::Storage(e.into());
        let records = txn.open_table(RECORDS).map_err(opened)?;
        let mut rows = txn.open_table(PARTITIONS).map_err(opened)?;
        let mut stored = txn.open_table(FILTERS).map_err(opened)?;
        Catalog::load(
            &mut CatalogTables {
                records: &records,
                rows: &mut rows,
                filters: &mut stored,
            },
            filters,
            rule,
            now_ms,
            changes,
        )
    }

    /// The probes of the writer's transaction.
    pub(crate) fn probes(&self) -> &Probes {
        &self.probes
    }

    /// The shared filters.
    pub(crate) fn filters(&self) -> &Arc<Filters> {
        &self.filters
    }

    /// The hot partition.
    pub(crate) fn hot(&self) -> Hot {
        self.hot
    }

    /// Counts a key new to every partition inserted into the hot one.
    pub(crate) fn inserted_new_key(&mut self, now_ms: u64) {
        self.hot.row.claimed(now_ms, now_ms);
    }

    /// Whether the hot partition is due to be sealed at `now_ms`: it holds
    /// keys, and its interval has passed or it holds [`SealRule::max_keys`].
    pub(crate) fn due_to_seal(&self, now_ms: u64) -> bool {
        let row = &self.hot.row;
        row.keys > 0
            && (row.keys >= self.rule.max_keys
                || now_ms.saturating_sub(row.first_claim_ms) >= self.rule.interval_ms)
    }

    /// Seals the hot partition at `now_ms` (its filter built from its key
    /// range, stored, its row sealed) and opens the next one. Every change
    /// is appended to `changes` for the journal.
    ///
    /// # Errors
    ///
    /// [`CatalogError`] for a storage error or a filter that cannot be
    /// built; the transaction must then not commit.
    pub(crate) fn seal(
        &mut self,
        t: &mut CatalogTables<'_, '_>,
        now_ms: u64,
        changes: &mut Vec<CatalogChange>,
    ) -> Result<(), CatalogError> {
        let Hot { partition, mut row } = self.hot;
        row.last_claim_ms = row.last_claim_ms.max(now_ms).max(row.first_claim_ms);
        let rule = self.rule;
        let room = |keys| rule.filter_capacity(partition, keys);
        let (checksum, filter) = seal_row(t, &self.filters, partition, room, &mut row, changes)?;
        self.probes.insert(Probe {
            partition,
            filter: Some(filter),
            checksum: Some(checksum),
        });
        // The filters grouped with this one moved into a new group.
        self.probes.refresh(&self.filters);
        self.sealed_at.insert(partition, row.last_claim_ms);
        let next = partition
            .checked_add(1)
            .filter(|p| *p < BUILT_PARTITIONS)
            .ok_or(CatalogError::Damaged {
                partition,
                problem: "no partition number left for claims",
            })?;
        self.hot = open_hot(t, next, now_ms, changes)?;
        self.probes.insert(Probe {
            partition: next,
            filter: None,
            checksum: None,
        });
        Ok(())
    }

    /// Forgets partition `partition` (its rows and range are gone).
    pub(crate) fn dropped(&mut self, partition: u64) {
        self.probes.remove(partition);
        self.filters.forget(partition);
        self.sealed_at.remove(&partition);
        self.drained.remove(&partition);
        if self.draining.as_ref().is_some_and(|(p, _)| *p == partition) {
            self.draining = None;
        }
    }

    /// The merge under way.
    pub(crate) fn merging(&self) -> Option<&Merging> {
        self.merge.as_ref()
    }

    /// Where a write to slot key `slot` must be made again while a merge
    /// runs: the copy's slot key when `slot` is in a merge source and its
    /// record key was copied already (at or below the cursor); `None`
    /// otherwise.
    pub(crate) fn mirror_of(&self, slot: &[u8]) -> Option<Vec<u8>> {
        let merge = self.merge.as_ref()?;
        let (p, rkey) = slot::split(slot)?;
        let copied = merge.cursor.as_deref().is_some_and(|c| rkey <= c);
        (copied && merge.sources.binary_search(&p).is_ok())
            .then(|| slot::slot_key(merge.target, rkey))
    }

    /// Where a write to slot key `slot` must be made again after a merge's
    /// switch, while its sources drop: the slot keys of `slot`'s record key
    /// in each dropping source, when `slot` is in a merged (built)
    /// partition. The caller writes a twin only where the record is
    /// present (a merged record's source copy), and deletes it wherever it
    /// is, so that every record of a dropping source stays the byte-equal
    /// twin of its live copy until its drop step, which can then repair a
    /// damaged or lost live copy from it (`twins.rs`). Empty otherwise.
    pub(crate) fn dropped_twins(&self, slot: &[u8]) -> Vec<Vec<u8>> {
        let Some((p, rkey)) = slot::split(slot) else {
            return Vec::new();
        };
        if p < slot::BUILT_PARTITIONS || self.dropping.contains(&p) {
            return Vec::new();
        }
        self.dropping
            .iter()
            .filter(|d| **d < slot::BUILT_PARTITIONS)
            .map(|d| slot::slot_key(*d, rkey))
            .collect()
    }

    /// The newest read partition a merge built (the one the dropping
    /// sources were merged into: one merge at a time, and its drops end
    /// before the next begins); `None`: none is read.
    pub(crate) fn newest_built(&self) -> Option<u64> {
        self.probes
            .list
            .iter()
            .map(|p| p.partition)
            .filter(|p| *p >= slot::BUILT_PARTITIONS && !self.dropping.contains(p))
            .max()
    }

    /// The dropping partitions that were a merge's sources (below
    /// [`slot::BUILT_PARTITIONS`]), ascending.
    pub(crate) fn dropping_sources(&self) -> Vec<u64> {
        self.dropping
            .iter()
            .copied()
            .filter(|d| *d < slot::BUILT_PARTITIONS)
            .collect()
    }

    /// Whether partition `partition` is held by a merge (a source, the
    /// target, or dropping after one): it is not dropped when a delete
    /// empties it.
    pub(crate) fn held_by_merge(&self, partition: u64) -> bool {
        self.dropping.contains(&partition)
            || self.merge.as_ref().is_some_and(|m| {
                m.target == partition || m.sources.binary_search(&partition).is_ok()
            })
    }

    /// The next built partition number, above every one known.
    fn next_built(&self) -> Option<u64> {
        let known = self
            .probes
            .list
            .iter()
            .map(|p| p.partition)
            .chain(self.dropping.iter().copied())
            .chain(self.merge.as_ref().map(|m| m.target));
        merge::next_built(known)
    }

    /// Begins the merge of sealed partitions `sources` (ascending, as
    /// [`merge::due_sources`] picks them): the target's row written
    /// merging, theirs merge sources. Every change is appended to
    /// `changes`.
    ///
    /// # Errors
    ///
    /// [`CatalogError`] for a storage error, a source whose row is not a
    /// sealed one, a merge already under way, or no partition number left.
    pub(crate) fn begin_merge(
        &mut self,
        t: &mut CatalogTables<'_, '_>,
        sources: Vec<u64>,
        changes: &mut Vec<CatalogChange>,
    ) -> Result<(), CatalogError> {
        let Some(&first) = sources.first() else {
            return Ok(());
        };
        if self.merge.is_some() {
            return Err(CatalogError::Damaged {
                partition: first,
                problem: "a merge begun while one is under way",
            });
        }
        let target = self.next_built().ok_or(CatalogError::Damaged {
            partition: first,
            problem: "no partition number left for a merge",
        })?;
        let mut rows = Vec::with_capacity(sources.len());
        for &p in &sources {
            let Some(bytes) = t.rows.get(p)? else {
                return Err(CatalogError::Damaged {
                    partition: p,
                    problem: "a merge source without a row",
                });
            };
            let row = PartitionRow::decode(p, bytes.value())?;
            if row.state != PartitionState::Sealed {
                return Err(CatalogError::Damaged {
                    partition: p,
                    problem: "a merge source that is not sealed",
                });
            }
            rows.push(row);
        }
        let keys: u64 = rows.iter().map(|r| r.keys).fold(0, u64::saturating_add);
        let filter = PartitionFilter::with_capacity(target, keys.max(1), self.filters.hasher())?;
        let row = merge::merging_row(&rows);
        let value = row.encode(target);
        t.rows.insert(target, value.as_slice())?;
        changes.push(CatalogChange::Row(target, Some(value)));
        for (&p, source) in sources.iter().zip(rows) {
            let mut source = source;
            source.state = PartitionState::MergeSource;
            let value = source.encode(p);
            t.rows.insert(p, value.as_slice())?;
            changes.push(CatalogChange::Row(p, Some(value)));
        }
        self.merge = Some(Merging {
            target,
            sources,
            cursor: None,
            row,
            filter: Some(filter),
        });
        Ok(())
    }

    /// Notes record keys `keys` (ascending, after the cursor) copied.
    pub(crate) fn merge_copied(&mut self, keys: Vec<Vec<u8>>) {
        let Some(merge) = self.merge.as_mut() else {
            return;
        };
        for key in &keys {
            merge.row.keys = merge.row.keys.saturating_add(1);
            if let Some(filter) = merge.filter.as_mut() {
                if let Err(e) = filter.insert(key) {
                    tracing::warn!(error = %e, "a merged partition's filter is full: it is built from its records at the switch");
                    merge.filter = None;
                }
            }
        }
        if let Some(last) = keys.into_iter().next_back() {
            merge.cursor = Some(last);
        }
    }

    /// Ends the merge under way: the target sealed with its filter (read
    /// from this commit on), or deleted when its range is empty (every
    /// record copied was deleted since); its sources dropping (skipped from
    /// this commit on) without filters. Every change is appended to
    /// `changes`.
    ///
    /// # Errors
    ///
    /// [`CatalogError`] for a storage error, a source row that does not
    /// decode, or a filter that cannot be built; the transaction must then
    /// not commit.
    pub(crate) fn finish_merge(
        &mut self,
        t: &mut CatalogTables<'_, '_>,
        changes: &mut Vec<CatalogChange>,
    ) -> Result<(), CatalogError> {
        let Some(merge) = self.merge.take() else {
            return Ok(());
        };
        let Merging {
            target,
            sources,
            row,
            filter,
            ..
        } = merge;
        // Every record copied was deleted since: the merged partition goes
        // instead of being sealed empty (nothing would ever drop it).
        let empty = range(t.records, target)?.next().is_none();
        if empty {
            t.rows.remove(target)?;
            t.filters.remove(target)?;
            changes.push(CatalogChange::Row(target, None));
            changes.push(CatalogChange::Filter(target, None));
        }
        let filter = match filter {
            _ if empty => None,
            Some(filter) => Some(filter),
            None => Some(build_filter(
                t.records,
                self.filters.hasher(),
                target,
                |k| k,
            )?),
        };
        let mut sealed = None;
        if let Some(filter) = filter {
            let (bytes, sum) = filter.encode();
            let mut row = row;
            row.state = PartitionState::Sealed;
            row.keys = filter.len();
            row.filter_checksum = Some(sum);
            let value = row.encode(target);
            t.filters.insert(target, bytes.as_slice())?;
            t.rows.insert(target, value.as_slice())?;
            changes.push(CatalogChange::Filter(target, Some(bytes)));
            changes.push(CatalogChange::Row(target, Some(value)));
            sealed = Some((filter, sum, row.last_claim_ms));
        }
        for &p in &sources {
            let mut source = match t.rows.get(p)? {
                Some(bytes) => PartitionRow::decode(p, bytes.value())?,
                None => continue,
            };
            source.state = PartitionState::Dropping;
            source.filter_checksum = None;
            let value = source.encode(p);
            t.rows.insert(p, value.as_slice())?;
            t.filters.remove(p)?;
            changes.push(CatalogChange::Row(p, Some(value)));
            changes.push(CatalogChange::Filter(p, None));
            self.probes.remove(p);
            self.filters.forget(p);
            self.sealed_at.remove(&p);
            self.drained.remove(&p);
            if self.draining.as_ref().is_some_and(|(d, _)| *d == p) {
                self.draining = None;
            }
            self.dropping.insert(p);
        }
        if let Some((filter, sum, last_claim_ms)) = sealed {
            let kept = self.filters.keep(target, sum, std::sync::Arc::new(filter));
            self.probes.insert(Probe {
                partition: target,
                filter: Some(kept),
                checksum: Some(sum),
            });
            self.sealed_at.insert(target, last_claim_ms);
        }
        self.probes.refresh(&self.filters);
        Ok(())
    }

    /// The dropping partition to empty next (the lowest).
    pub(crate) fn next_dropping(&self) -> Option<u64> {
        self.dropping.first().copied()
    }

    /// Forgets dropping partition `partition`: its ranges are empty and its
    /// row deleted.
    pub(crate) fn dropping_done(&mut self, partition: u64) {
        self.dropping.remove(&partition);
        self.filters.forget(partition);
    }

    /// The sealed partition to drain at `now_ms` and where to go on from
    /// (`None`: its start): the one under way, else the oldest whose last
    /// claim is `ttl_ms` or more ago (all its records that completed soon
    /// after their claim have expired) and that was not drained since the
    /// open. `None`: nothing is due.
    pub(crate) fn drain_next(&self, now_ms: u64, ttl_ms: u64) -> Option<(u64, Option<Vec<u8>>)> {
        if let Some(under_way) = &self.draining {
            return Some(under_way.clone());
        }
        self.sealed_at
            .iter()
            .filter(|(p, _)| !self.drained.contains(p))
            .filter(|(_, last)| last.saturating_add(ttl_ms) <= now_ms)
            .min_by_key(|(p, last)| (**last, **p))
            .map(|(p, _)| (*p, None))
    }

    /// Notes a drain step of `partition`: done (`after` is `None`) or to go
    /// on after slot key `after`.
    pub(crate) fn drain_step(&mut self, partition: u64, after: Option<Vec<u8>>) {
        if !self.sealed_at.contains_key(&partition) {
            // Dropped by the step itself.
            self.draining = None;
            return;
        }
        if let Some(key) = after {
            self.draining = Some((partition, Some(key)));
        } else {
            self.draining = None;
            self.drained.insert(partition);
        }
    }
}

/// Gives each key range of `t.records` without a row in `rows` a sealed
/// row and a filter built from its keys (a warning names it): its records
/// stay found. Every change is appended to `changes`.
fn rows_for_ranges(
    t: &mut CatalogTables<'_, '_>,
    filters: &Filters,
    rule: SealRule,
    now_ms: u64,
    rows: &mut Vec<(u64, PartitionRow)>,
    changes: &mut Vec<CatalogChange>,
) -> Result<(), CatalogError> {
    for partition in partitions_in(t.records)? {
        if rows.iter().all(|(p, _)| *p != partition) {
            tracing::warn!(
                partition,
                "records in a partition without a row: giving it a sealed row and a rebuilt filter"
            );
            let mut row = PartitionRow::hot(now_ms, now_ms);
            let room = |keys| rule.filter_capacity(partition, keys);
            seal_row(t, filters, partition, room, &mut row, changes)?;
            rows.push((partition, row));
        }
    }
    Ok(())
}

/// The merge a writable open finds under way (`merging`: the target's
/// row; `sources`: the merge sources' rows), resumed: its cursor is the
/// last record key of the target's range, its filter rebuilt from that
/// range. A target without sources is left to be dropped (its records
/// are copies nobody reads); sources without a target are sealed again
/// (logged in `changes`).
fn resume_merge(
    t: &mut CatalogTables<'_, '_>,
    filters: &Filters,
    merging: Option<(u64, PartitionRow)>,
    mut sources: Vec<(u64, PartitionRow)>,
    dropping: &mut std::collections::BTreeSet<u64>,
    changes: &mut Vec<CatalogChange>,
) -> Result<Option<Merging>, CatalogError> {
    sources.sort_by_key(|(p, _)| *p);
    let Some((target, row)) = merging else {
        for (p, mut row) in sources {
            tracing::warn!(
                partition = p,
                "a merge source without a merge: sealing it again"
            );
            row.state = PartitionState::Sealed;
            let value = row.encode(p);
            t.rows.insert(p, value.as_slice())?;
            changes.push(CatalogChange::Row(p, Some(value)));
        }
        return Ok(None);
    };
    if sources.is_empty() {
        tracing::warn!(
            partition = target,
            "a merging partition without sources: dropping it"
        );
        dropping.insert(target);
        return Ok(None);
    }
    let keys: u64 = sources
        .iter()
        .map(|(_, r)| r.keys)
        .fold(0, u64::saturating_add);
    let copied = count_keys(t.records, target)?;
    let mut filter =
        PartitionFilter::with_capacity(target, keys.max(copied).max(1), filters.hasher())?;
    let mut cursor = None;
    for entry in range(t.records, target)? {
        let (k, _) = entry?;
        if let Some((_, rkey)) = slot::split(k.value()) {
            filter.insert(rkey)?;
            cursor = Some(rkey.to_vec());
        }
    }
    let mut row = row;
    row.keys = copied;
    Ok(Some(Merging {
        target,
        sources: sources.into_iter().map(|(p, _)| p).collect(),
        cursor,
        row,
        filter: Some(filter),
    }))
}

/// Writes the row of a new hot partition `partition`, opened at `now_ms`.
fn open_hot(
    t: &mut CatalogTables<'_, '_>,
    partition: u64,
    now_ms: u64,
    changes: &mut Vec<CatalogChange>,
) -> Result<Hot, CatalogError> {
    let mut row = PartitionRow::hot(now_ms, now_ms);
    row.keys = 0;
    let value = row.encode(partition);
    t.rows.insert(partition, value.as_slice())?;
    changes.push(CatalogChange::Row(partition, Some(value)));
    Ok(Hot { partition, row })
}

/// Builds `partition`'s filter from its key range, sized by `room` (key
/// count → capacity), stores it and its sealed row (`row`, its key count set
/// from the range), keeps the filter in `filters` and returns its checksum
/// and the filter kept.
fn seal_row(
    t: &mut CatalogTables<'_, '_>,
    filters: &Filters,
    partition: u64,
    room: impl Fn(u64) -> u64,
    row: &mut PartitionRow,
    changes: &mut Vec<CatalogChange>,
) -> Result<(FilterChecksum, Arc<PartitionFilter>), CatalogError> {
    let filter = Arc::new(build_filter(t.records, filters.hasher(), partition, room)?);
    let (bytes, sum) = filter.encode();
    row.keys = filter.len();
    if row.state == PartitionState::Hot {
        row.seal(partition, sum)?;
    } else {
        // A sealed (or dropping) row whose filter is rebuilt.
        row.filter_checksum = Some(sum);
    }
    let value = row.encode(partition);
    t.filters.insert(partition, bytes.as_slice())?;
    t.rows.insert(partition, value.as_slice())?;
    changes.push(CatalogChange::Filter(partition, Some(bytes)));
    changes.push(CatalogChange::Row(partition, Some(value)));
    Ok((sum, filters.keep(partition, sum, filter)))
}

/// `partition`'s stored filter checked against its row, kept in
/// `filters`, with the checksum it is kept under; `None` (with a warning
/// naming it) when it is missing or fails a check: the caller rebuilds it.
fn stored_filter(
    t: &CatalogTables<'_, '_>,
    filters: &Filters,
    partition: u64,
    row: &PartitionRow,
) -> Result<Option<(FilterChecksum, Arc<PartitionFilter>)>, CatalogError> {
    let Some(sum) = row.filter_checksum else {
        return Ok(None);
    };
    if let Some(kept) = filters.get(partition, &sum) {
        return Ok(Some((sum, kept)));
    }
    let Some(bytes) = t.filters.get(partition)? else {
        tracing::warn!(
            partition,
            "a sealed partition's filter is missing: rebuilding it"
        );
        return Ok(None);
    };
    match PartitionFilter::decode(partition, bytes.value(), &sum, filters.hasher()) {
        Ok(filter) => Ok(Some((sum, filters.keep(partition, sum, Arc::new(filter))))),
        Err(e) => {
            tracing::warn!(error = %e, "rebuilding a partition's filter from its records");
            Ok(None)
        }
    }
}

/// Keeps in `filters` every stored filter of a sealed row of `rows` that
/// decodes and passes its checksum (a read-only open: nothing is rebuilt;
/// a partition whose filter fails is read on every lookup).
///
/// # Errors
///
/// The storage error of reading the tables.
pub(crate) fn keep_stored_filters(
    rows: &impl ReadableTable<u64, &'static [u8]>,
    stored: &impl ReadableTable<u64, &'static [u8]>,
    filters: &Filters,
) -> Result<(), redb::StorageError> {
    filters.defer_grouping();
    let kept = keep_each_stored_filter(rows, stored, filters);
    filters.group_deferred();
    kept
}

/// [`keep_stored_filters`] while the filters are kept ungrouped.
fn keep_each_stored_filter(
    rows: &impl ReadableTable<u64, &'static [u8]>,
    stored: &impl ReadableTable<u64, &'static [u8]>,
    filters: &Filters,
) -> Result<(), redb::StorageError> {
    for entry in rows.iter()? {
        let (k, v) = entry?;
        let partition = k.value();
        let Ok(row) = PartitionRow::decode(partition, v.value()) else {
            continue;
        };
        let Some(sum) = row.filter_checksum else {
            continue;
        };
        if let Some(bytes) = stored.get(partition)? {
            match PartitionFilter::decode(partition, bytes.value(), &sum, filters.hasher()) {
                Ok(filter) => {
                    filters.keep(partition, sum, Arc::new(filter));
                }
                Err(e) => tracing::warn!(error = %e, "reading a partition without its filter"),
            }
        }
    }
    Ok(())
}

/// The filter of `partition`'s key range in `records`, sized for
/// `room(keys)` keys, or its keys if that is more (`|keys| keys`: exactly
/// its keys).
pub(crate) fn build_filter(
    records: &impl ReadableTable<&'static [u8], &'static [u8]>,
    hasher: &FilterHasher,
    partition: u64,
    room: impl Fn(u64) -> u64,
) -> Result<PartitionFilter, CatalogError> {
    let keys = count_keys(records, partition)?;
    let capacity = room(keys).max(keys).max(1);
    let mut filter = PartitionFilter::with_capacity(partition, capacity, hasher)?;
    for entry in range(records, partition)? {
        let (k, _) = entry?;
        if let Some((_, rkey)) = slot::split(k.value()) {
            filter.insert(rkey)?;
        }
    }
    Ok(filter)
}

/// The keys in `partition`'s range.
pub(crate) fn count_keys(
    records: &impl ReadableTable<&'static [u8], &'static [u8]>,
    partition: u64,
) -> Result<u64, redb::StorageError> {
    let mut n = 0u64;
    for entry in range(records, partition)? {
        entry?;
        n += 1;
    }
    Ok(n)
}

/// `partition`'s key range of `records`.
pub(crate) fn range(
    records: &impl ReadableTable<&'static [u8], &'static [u8]>,
    partition: u64,
) -> Result<redb::Range<'_, &'static [u8], &'static [u8]>, redb::StorageError> {
    let (lo, hi) = slot::range_of(partition);
    match hi {
        Some(hi) => records.range::<&[u8]>(&lo[..]..&hi[..]),
        None => records.range::<&[u8]>(&lo[..]..),
    }
}

/// The partitions that hold keys in `records`, ascending: one seek per
/// partition.
pub(crate) fn partitions_in(
    records: &impl ReadableTable<&'static [u8], &'static [u8]>,
) -> Result<Vec<u64>, redb::StorageError> {
    let mut out = Vec::new();
    let mut from = [0u8; slot::PREFIX_BYTES];
    loop {
        let next = records.range::<&[u8]>(&from[..]..)?.next().transpose()?;
        let Some((k, _)) = next else {
            return Ok(out);
        };
        let Some((partition, _)) = slot::split(k.value()) else {
            // A key shorter than a prefix: skip past it.
            let mut past = k.value().to_vec();
            past.push(0);
            let Some(p) = partition_after(&past) else {
                return Ok(out);
            };
            from = p;
            continue;
        };
        out.push(partition);
        match slot::range_of(partition).1 {
            Some(hi) => from = hi,
            None => return Ok(out),
        }
    }
}

/// The prefix of the first partition at or after `key`'s bytes.
fn partition_after(key: &[u8]) -> Option<[u8; slot::PREFIX_BYTES]> {
    let mut padded = [0u8; slot::PREFIX_BYTES];
    let n = key.len().min(slot::PREFIX_BYTES);
    padded[..n].copy_from_slice(&key[..n]);
    if key.len() <= slot::PREFIX_BYTES {
        Some(padded)
    } else {
        u64::from_be_bytes(padded)
            .checked_add(1)
            .map(u64::to_be_bytes)
    }
}

#[cfg(test)]
#[path = "catalog_tests.rs"]
mod tests;
