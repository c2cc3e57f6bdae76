//! Format 3's merge of closed partitions, as the writer runs it: one
//! bounded step per sweep step (`sweep.rs`), in this order:
//! - a dropping partition (merged already) loses up to a step's records
//!   (`merge::MERGE_STEP_RECORDS` from a sweep, fewer if the step's time,
//!   `merge::MERGE_STEP_TIME`, runs out while a client waits on the
//!   writer), with their steps and log
//!   entries, and its row once it is empty; a live copy that is missing
//!   or damaged is first repaired from its twin there (`twins.rs`);
//! - else the merge under way copies up to a step's records, and switches
//!   to the merged partition once nothing is left;
//! - else, when the partitions of a closed hour are due
//!   (`merge::due_sources`), a merge begins.
//!
//! What each step writes and why a crash at any point is safe:
//! `partition/merge.rs`.

use std::time::Instant;

use redb::ReadableTable;

use crate::report::SweepCounts;

use super::journal::Change;
use super::partition::catalog::CatalogTables;
use super::partition::merge;
use super::partition::row::{PartitionRow, FILTERS, PARTITIONS};
use super::tables::{catalog_error, table_error, OpError, Tables};

impl Tables<'_> {
    /// Format 3: one step of the merge of closed partitions (module docs),
    /// copying or dropping at most `records` records, fewer once it has
    /// held the writer [`merge::MERGE_STEP_TIME`] while a client waits;
    /// sets `counts.more` while one has work left. Format 2: nothing.
    pub(super) fn merge_step(
        &mut self,
        records: usize,
        counts: &mut SweepCounts,
    ) -> Result<(), OpError> {
        let Some(catalog) = self.partitioned_catalog() else {
            return Ok(());
        };
        if let Some(p) = catalog.next_dropping() {
            let started = Instant::now();
            self.drop_merged(p, records)?;
            metrics::histogram!("idempotency_merge_drop_step_seconds")
                .record(started.elapsed().as_secs_f64());
            counts.more = true;
            return Ok(());
        }
        if catalog.merging().is_some() {
            let started = Instant::now();
            self.copy_merged(records)?;
            metrics::histogram!("idempotency_merge_copy_step_seconds")
                .record(started.elapsed().as_secs_f64());
            counts.more = true;
            return Ok(());
        }
        let (now, ttl) = (self.now, self.cfg.ttl_ms);
        let rows = read_rows(self)?;
        let sources = merge::due_sources(rows, now, ttl);
        if sources.is_empty() {
            return Ok(());
        }
        let mut changes = Vec::new();
        {
            let mut rows = self.txn.open_table(PARTITIONS).map_err(table_error)?;
            let mut filters = self.txn.open_table(FILTERS).map_err(table_error)?;
            let Some((catalog, t)) = self.merge_parts() else {
                return Ok(());
            };
            catalog
                .begin_merge(
                    &mut CatalogTables {
                        records: t.records,
                        rows: &mut rows,
                        filters: &mut filters,
                    },
                    sources,
                    &mut changes,
                )
                .map_err(catalog_error)?;
        }
        for change in changes {
            self.log_change(Change::from(change));
        }
        counts.more = true;
        Ok(())
    }

    /// One copy step of the merge under way, and the switch once nothing is
    /// left to copy.
    fn copy_merged(&mut self, records: usize) -> Result<(), OpError> {
        let spent = self.step_spent(Instant::now() + merge::MERGE_STEP_TIME);
        let mut changes = Vec::new();
        let (target, after, copied, done, bytes) = {
            let mut rows = self.txn.open_table(PARTITIONS).map_err(table_error)?;
            let mut filters = self.txn.open_table(FILTERS).map_err(table_error)?;
            let Some((catalog, mut t)) = self.merge_parts() else {
                return Ok(());
            };
            let Some(m) = catalog.merging() else {
                return Ok(());
            };
            let (target, after) = (m.target, m.cursor.clone());
            let sources = m.sources.clone();
            let step =
                merge::copy_step(&mut t, target, &sources, after.as_deref(), records, &spent)?;
            let copied = step.keys.len() as u64;
            let bytes = step.bytes;
            catalog.merge_copied(step.keys);
            if step.done {
                catalog
                    .finish_merge(
                        &mut CatalogTables {
                            records: t.records,
                            rows: &mut rows,
                            filters: &mut filters,
                        },
                        &mut changes,
                    )
                    .map_err(catalog_error)?;
            }
            (target, after, copied, step.done, bytes)
        };
        self.merge_bytes = self.merge_bytes.saturating_add(bytes);
        if copied > 0 {
            self.log_change(Change::MergeCopy {
                target,
                after,
                copied,
            });
        }
        for change in changes {
            self.log_change(Change::from(change));
        }
        if done {
            // A key located in a source is now in the target.
            self.forget_located();
        }
        Ok(())
    }

    /// One drop step of dropping partition `partition` (at most `records`
    /// records, within [`merge::MERGE_STEP_TIME`] while a client waits:
    /// the first half for the repair from the twins, the rest for the
    /// deletes), and its row once its ranges are empty.
    fn drop_merged(&mut self, partition: u64, records: usize) -> Result<(), OpError> {
        let started = Instant::now();
        let half = self.step_spent(started + merge::MERGE_STEP_TIME / 2);
        let spent = self.step_spent(started + merge::MERGE_STEP_TIME);
        let records = self.rescue_twins(partition, records, &half)?;
        let dropped = {
            let Some((_, mut t)) = self.merge_parts() else {
                return Ok(());
            };
            merge::drop_step(&mut t, partition, records, &spent)?
        };
        self.log_change(Change::MergeDrop {
            partition,
            limit: dropped.limit,
            records: dropped.records,
        });
        if dropped.done {
            self.txn
                .open_table(PARTITIONS)
                .map_err(table_error)?
                .remove(partition)?;
            self.txn
                .open_table(FILTERS)
                .map_err(table_error)?
                .remove(partition)?;
            self.log_change(Change::DelPartition { partition });
            self.log_change(Change::DelFilter { partition });
            if let Some((catalog, _)) = self.merge_parts() {
                catalog.dropping_done(partition);
            }
        }
        Ok(())
    }
}

impl<'t> Tables<'t> {
    /// [`step_spent`] with the writer's `clients_waiting`.
    fn step_spent(&self, until: Instant) -> impl Fn() -> bool + 't {
        step_spent(until, self.clients_waiting)
    }
}

/// Whether a merge step must stop: `until` has passed and a client waits
/// on the writer (`waiting`; `None`: always counted as waiting).
fn step_spent(until: Instant, waiting: Option<&dyn Fn() -> bool>) -> impl Fn() -> bool + '_ {
    move || Instant::now() >= until && waiting.is_none_or(|w| w())
}

/// The partition rows of the writer's transaction that decode (one that
/// does not is `verify`'s to report; it is never merged).
fn read_rows(t: &Tables<'_>) -> Result<Vec<(u64, PartitionRow)>, OpError> {
    let rows = t.txn.open_table(PARTITIONS).map_err(table_error)?;
    let mut out = Vec::new();
    for entry in rows.iter()? {
        let (k, v) = entry?;
        if let Ok(row) = PartitionRow::decode(k.value(), v.value()) {
            out.push((k.value(), row));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::step_spent;

    /// Guards against a merge step that stops while nobody waits (the
    /// merge alone would run in many small steps) or runs on while a
    /// client waits past its time.
    #[test]
    fn a_step_stops_past_its_time_only_while_a_client_waits() {
        let past = Instant::now();
        let future = past + Duration::from_secs(3600);
        let (yes, no) = (|| true, || false);
        assert!(step_spent(past, Some(&yes))());
        assert!(step_spent(past, None)());
        assert!(!step_spent(past, Some(&no))());
        assert!(!step_spent(future, Some(&yes))());
        assert!(!step_spent(future, None)());
    }
}
