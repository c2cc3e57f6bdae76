//! Bulk preload of COMPLETED records into a closed format-2 or format-3
//! file, for the benches (feature `bench-fixtures`; see
//! `crate::bench_fixtures`).
//!
//! It writes what `begin` + `complete` would have written, through the same
//! code: `Record::processing` then `Record::completed`, the real codec
//! (checksummed values), a fencing token per record from the file's
//! `next_token` (advanced past them at the end) and an expiry index entry
//! per record. It skips the writer, the journal and the group commits (one
//! durable redb commit per `per_txn` records): it is a fixture, not a
//! measured path.
//!
//! Order matters to the B-tree that results. Records go in sorted runs:
//! the records are split into `runs` runs in the caller's order, each run is
//! sorted by record key and inserted in that order. One run gives leaves
//! about 90% full (redb keeps the full rightmost leaf on an ascending
//! insert), denser than traffic of random keys makes them (about 64%): a
//! second run of the same size splits the first run's leaves and brings
//! them to the fill random inserts give, at the cost of sequential passes
//! only. `runs == 0` inserts in the caller's order. The expiry index is
//! written in the caller's order, which is completion order when the
//! caller numbers records by time, as traffic appends to it.
//!
//! Format 3 (the file's `format_version` says which): the records go under
//! slot keys into partitions as the writer's hot partition would have
//! taken them, `SealRule::DEFAULT.max_keys` records each in the caller's
//! (claim) order, numbered from `slot::FIRST_PARTITION`, in ascending
//! number; within a partition, the same runs as above. Every partition but
//! the last is sealed (its filter built from its range and stored, its row
//! sealed with the filter's checksum); the last is hot (a row without a
//! filter). A key given twice is refused before anything is written (in
//! two partitions it would be two slot keys, which no insert refuses).

use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::path::Path;

use redb::ReadableTableMetadata;

use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::store::codec;
use crate::store::record::{reference, Completion, Record, StoredResponse};
use crate::Envelope;

use super::meta::{self, Counter, Format, Found};
use super::partition::catalog::{self, SealRule};
use super::partition::filter::FilterHasher;
use super::partition::row::{PartitionRow, PartitionState, FILTERS, PARTITIONS};
use super::partition::slot;

/// The filter-probe fixture (`partition/probe_fixture.rs`).
pub(crate) use super::partition::probe_fixture::SealedProbes;
use super::tables::{Context, EXPIRY, META, RECORDS};

/// One record to preload, as a claim made at `at_ms` and completed at the
/// same instant.
pub(crate) struct Preloaded {
    pub(crate) key: IdempotencyKey,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) response: Envelope,
    pub(crate) at_ms: u64,
}

/// How to preload.
pub(crate) struct Plan {
    pub(crate) count: u64,
    pub(crate) runs: u64,
    pub(crate) per_txn: usize,
    pub(crate) lease_ms: u64,
    pub(crate) ttl_ms: u64,
    pub(crate) cache_bytes: usize,
}

/// The records table as the preload left it (redb's table stats).
pub(crate) struct Shape {
    pub(crate) records: u64,
    pub(crate) leaf_pages: u64,
    pub(crate) branch_pages: u64,
    pub(crate) stored_bytes: u64,
    pub(crate) page_bytes: u64,
}

/// Writes `plan.count` records, record `i` given by `record(i)`, into the
/// engine file at `path`, which must exist, be closed and hold no record
/// with these keys (a key met twice is an error naming it). The file's
/// format decides the layout: format 2 keys records by record key;
/// format 3 puts them in partitions as traffic would have (module docs).
pub(crate) fn preload(
    path: &Path,
    plan: &Plan,
    record: &(dyn Fn(u64) -> Preloaded + Sync),
) -> Result<Shape> {
    let what = "preloading bench records";
    let mut builder = redb::Builder::new();
    builder.set_cache_size(plan.cache_bytes);
    let db = builder.open(path).context(what)?;
    let (first_token, seed) = {
        let txn = db.begin_write().context(what)?;
        let t = txn.open_table(META).context(what)?;
        let token =
            meta::required_counter(&t, Counter::NextToken).map_err(|e| e.open_error(path, what))?;
        let seed = match meta::read_format(&t).map_err(|e| e.open_error(path, what))? {
            Some(Found::Format(Format::V2)) => None,
            Some(Found::Format(Format::V3)) => {
                Some(meta::read_filter_seed(&t).map_err(|e| e.open_error(path, what))?)
            }
            other => {
                return Err(failed(format!(
                    "{} holds a file of format {other:?}, neither 2 nor 3",
                    path.display()
                )))
            }
        };
        (token, seed)
    };
    let fill = Fill {
        db: &db,
        plan,
        record,
        first_token,
    };
    let table = match &seed {
        None => {
            fill.insert_range(0, plan.count, None)?;
            RECORDS
        }
        Some(seed) => {
            fill.partitioned(&FilterHasher::new(seed), SealRule::DEFAULT.max_keys)?;
            catalog::RECORDS
        }
    };
    let txn = db.begin_write().context(what)?;
    {
        let mut t = txn.open_table(META).context(what)?;
        meta::write_counter(&mut t, Counter::NextToken, first_token + plan.count).context(what)?;
    }
    let stats = txn.open_table(table).context(what)?.stats().context(what)?;
    let records = txn.open_table(table).context(what)?.len().context(what)?;
    txn.commit().context(what)?;
    Ok(Shape {
        records,
        leaf_pages: stats.leaf_pages(),
        branch_pages: stats.branch_pages(),
        stored_bytes: stats.stored_bytes(),
        page_bytes: 4096,
    })
}

/// The space of the closed store at `path`: (bytes of allocated pages,
/// fragmented bytes, the records table's shape), read in an aborted
/// write transaction.
pub(crate) fn space(path: &Path) -> Result<(u64, u64, Shape)> {
    let what = "reading a store's space";
    let db = redb::Builder::new().open(path).context(what)?;
    let txn = db.begin_write().context(what)?;
    let stats = txn.stats().context(what)?;
    let format3 = {
        let meta = txn.open_table(META).context(what)?;
        matches!(
            meta::read_format(&meta),
            Ok(Some(Found::Format(Format::V3)))
        )
    };
    let table = if format3 { catalog::RECORDS } else { RECORDS };
    let (t, records) = {
        let records = txn.open_table(table).context(what)?;
        (records.stats().context(what)?, records.len().context(what)?)
    };
    txn.abort().context(what)?;
    let page = stats.page_size() as u64;
    Ok((
        stats.allocated_pages() * page,
        stats.fragmented_bytes(),
        Shape {
            records,
            leaf_pages: t.leaf_pages(),
            branch_pages: t.branch_pages(),
            stored_bytes: t.stored_bytes(),
            page_bytes: page,
        },
    ))
}

/// A storage error of the preload saying `message`.
fn failed(message: String) -> Error {
    Error::Storage {
        context: "preloading bench records",
        source: Box::new(std::io::Error::other(message)),
    }
}

/// One preload under way.
struct Fill<'a> {
    db: &'a redb::Database,
    plan: &'a Plan,
    record: &'a (dyn Fn(u64) -> Preloaded + Sync),
    first_token: u64,
}

/// What a range of records told the row of its partition.
struct Span {
    first_claim_ms: u64,
    last_claim_ms: u64,
    max_expires_at_ms: u64,
}

impl Fill<'_> {
    /// Format 3: records `0..count` in partitions of `max_keys` records
    /// each, numbered from [`slot::FIRST_PARTITION`] in the caller's
    /// order (claim order, as the hot partition takes them); each
    /// partition but the last sealed (filter built from its range and
    /// stored, sealed row), the last one hot.
    fn partitioned(&self, hasher: &FilterHasher, max_keys: u64) -> Result<()> {
        let what = "preloading bench records";
        self.refuse_duplicates()?;
        let count = self.plan.count;
        let mut lo = 0;
        let mut partition = slot::FIRST_PARTITION;
        while lo < count {
            let hi = lo.saturating_add(max_keys).min(count);
            let span = self.insert_range(lo, hi, Some(partition))?;
            let txn = self.db.begin_write().context(what)?;
            {
                let records = txn.open_table(catalog::RECORDS).context(what)?;
                let mut rows = txn.open_table(PARTITIONS).context(what)?;
                let mut row = PartitionRow {
                    state: PartitionState::Hot,
                    keys: hi - lo,
                    first_claim_ms: span.first_claim_ms,
                    last_claim_ms: span.last_claim_ms,
                    max_expires_at_ms: span.max_expires_at_ms,
                    filter_checksum: None,
                };
                if hi < count {
                    // Sized as the writer sizes a partition it seals.
                    let room = |keys| SealRule::DEFAULT.filter_capacity(partition, keys);
                    let filter = catalog::build_filter(&records, hasher, partition, room)
                        .map_err(|e| failed(format!("partition {partition}: {e}")))?;
                    let (bytes, sum) = filter.encode();
                    row.keys = filter.len();
                    row.seal(partition, sum)
                        .map_err(|e| failed(e.to_string()))?;
                    txn.open_table(FILTERS)
                        .context(what)?
                        .insert(partition, bytes.as_slice())
                        .context(what)?;
                }
                rows.insert(partition, row.encode(partition).as_slice())
                    .context(what)?;
            }
            txn.commit().context(what)?;
            lo = hi;
            partition += 1;
        }
        Ok(())
    }

    /// Refuses a record key given twice, before anything is written: in
    /// format 3 a key in two partitions is two slot keys, which an insert
    /// does not catch. One 64-bit hash per record, sorted; keys are
    /// compared only where two hashes are equal.
    fn refuse_duplicates(&self) -> Result<()> {
        let hash = |i: u64| {
            let mut h = std::hash::DefaultHasher::new();
            (self.record)(i).key.record_key().hash(&mut h);
            h.finish()
        };
        let mut hashes: Vec<u64> = (0..self.plan.count).map(hash).collect();
        hashes.sort_unstable();
        let mut same: Vec<u64> = hashes
            .windows(2)
            .filter(|w| w[0] == w[1])
            .map(|w| w[0])
            .collect();
        drop(hashes);
        same.dedup();
        if same.is_empty() {
            return Ok(());
        }
        let mut seen: HashSet<Vec<u8>> = HashSet::new();
        for i in 0..self.plan.count {
            if same.binary_search(&hash(i)).is_ok() {
                let rkey = (self.record)(i).key.record_key().to_vec();
                if !seen.insert(rkey.clone()) {
                    return Err(given_twice(&rkey));
                }
            }
        }
        Ok(())
    }

    /// Inserts records `lo..hi` (under their slot keys in `partition`, or
    /// their record keys without one) in the plan's runs, and their
    /// expiry index entries in the caller's order.
    fn insert_range(&self, lo: u64, hi: u64, partition: Option<u64>) -> Result<Span> {
        let what = "preloading bench records";
        let (plan, record) = (self.plan, self.record);
        let table = match partition {
            Some(_) => catalog::RECORDS,
            None => RECORDS,
        };
        let mut span = Span {
            first_claim_ms: u64::MAX,
            last_claim_ms: 0,
            max_expires_at_ms: 0,
        };
        let runs = plan.runs.max(1);
        let per_run = (hi - lo).div_ceil(runs);
        for run in 0..runs {
            let lo = lo.saturating_add(run * per_run).min(hi);
            let hi = lo.saturating_add(per_run).min(hi);
            let mut order: Vec<(Vec<u8>, u64)> = (lo..hi)
                .map(|i| {
                    let r = record(i);
                    span.first_claim_ms = span.first_claim_ms.min(r.at_ms);
                    span.last_claim_ms = span.last_claim_ms.max(r.at_ms);
                    span.max_expires_at_ms = span
                        .max_expires_at_ms
                        .max(r.at_ms.saturating_add(plan.ttl_ms));
                    let rkey = r.key.record_key();
                    let stored = match partition {
                        Some(p) => slot::slot_key(p, rkey),
                        None => rkey.to_vec(),
                    };
                    (stored, i)
                })
                .collect();
            if plan.runs > 0 {
                order.sort_unstable();
            }
            for chunk in order.chunks(plan.per_txn.max(1)) {
                let txn = self.db.begin_write().context(what)?;
                {
                    let mut records = txn.open_table(table).context(what)?;
                    for (stored, i) in chunk {
                        let value = encoded(&record(*i), self.first_token + i, plan);
                        if records
                            .insert(stored.as_slice(), value.as_slice())
                            .context(what)?
                            .is_some()
                        {
                            return Err(given_twice(record(*i).key.record_key()));
                        }
                    }
                }
                txn.commit().context(what)?;
            }
            drop(order);
            // The expiry index in the caller's order (completion order).
            for lo in (lo..hi).step_by(plan.per_txn.max(1)) {
                let txn = self.db.begin_write().context(what)?;
                {
                    let mut expiry = txn.open_table(EXPIRY).context(what)?;
                    for i in lo..lo.saturating_add(plan.per_txn.max(1) as u64).min(hi) {
                        let r = record(i);
                        let at = r.at_ms.saturating_add(plan.ttl_ms);
                        expiry.insert((at, r.key.record_key()), ()).context(what)?;
                    }
                }
                txn.commit().context(what)?;
            }
        }
        Ok(span)
    }
}

/// The error of record key `rkey` given twice.
fn given_twice(rkey: &[u8]) -> Error {
    failed(format!(
        "record key {} given twice",
        crate::store::record::hex(rkey)
    ))
}

/// The value `begin` + `complete` would store for `r` with `token`.
fn encoded(r: &Preloaded, token: u64, plan: &Plan) -> Vec<u8> {
    let rkey = r.key.record_key();
    let claim = Record::processing(
        r.fingerprint,
        token,
        reference(rkey, token),
        r.at_ms,
        r.at_ms.saturating_add(plan.lease_ms.max(1)),
    );
    let response = StoredResponse::new(r.response.clone(), None);
    let done = claim.completed(Completion::Success, response, r.at_ms, plan.ttl_ms);
    codec::encode(rkey, &done)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use redb::{ReadableDatabase, ReadableTable};

    use super::*;
    use crate::bench_fixtures::{
        assert_served, preload_completed, CompletedRecord, Order, Preload,
    };
    use crate::{Engine, Fingerprint, ManualClock};

    type TestResult = std::result::Result<(), Box<dyn std::error::Error>>;

    const T0: u64 = 1_800_000_000_000;
    /// Two sealed partitions and a hot one of 4,464 keys.
    const COUNT: u64 = 2 * 32_768 + 4_464;

    fn record(i: u64) -> CompletedRecord {
        // 7919 and 100,003 (a prime) are coprime: distinct keys for
        // i < 100,003, not in claim order.
        CompletedRecord {
            key: IdempotencyKey::new("fixture", format!("key-{:08}", i * 7919 % 100_003))
                .unwrap_or_else(|e| panic!("a valid key: {e}")),
            fingerprint: Fingerprint::from_bytes([i as u8; 32]),
            response: Envelope::new(1, 201, format!("body {i}").into_bytes()),
            at_ms: T0 - 100_000 + i,
        }
    }

    fn plan(count: u64) -> Preload {
        Preload {
            count,
            order: Order::SortedRuns(2),
            records_per_txn: 20_000,
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
            cache_bytes: 4 << 20,
        }
    }

    fn format_3_file(path: &Path) -> Result<()> {
        drop(
            Engine::builder()
                .ttl(Duration::from_secs(3600))
                .open(path)?,
        );
        Ok(())
    }

    /// A format-3 file filled by the preload has the partitions traffic
    /// would have left: full ones sealed with their filters, in claim
    /// order, the last one hot; and `verify` finds it sound.
    #[test]
    fn a_format_3_preload_fills_partitions_in_claim_order() -> TestResult {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("fixture3.redb");
        format_3_file(&path)?;
        let shape = preload_completed(&path, plan(COUNT), record)?;
        assert_eq!(shape.records, COUNT);

        {
            let db = redb::Database::open(&path)?;
            let txn = db.begin_read()?;
            let rows = txn.open_table(PARTITIONS)?;
            let filters = txn.open_table(FILTERS)?;
            let records = txn.open_table(catalog::RECORDS)?;
            let mut seen = Vec::new();
            for entry in rows.iter()? {
                let (p, v) = entry?;
                let row = PartitionRow::decode(p.value(), v.value())?;
                seen.push((p.value(), row.state, row.keys));
                let lo = (p.value() - slot::FIRST_PARTITION) * 32_768;
                let hi = (lo + 32_768).min(COUNT);
                assert_eq!(row.first_claim_ms, T0 - 100_000 + lo);
                assert_eq!(row.last_claim_ms, T0 - 100_000 + hi - 1);
                assert_eq!(
                    filters.get(p.value())?.is_some(),
                    row.state == PartitionState::Sealed
                );
                // Claim order: record `i` is in the partition its turn gave it.
                for i in [lo, hi - 1] {
                    let slot = slot::slot_key(p.value(), record(i).key.record_key());
                    assert!(records.get(slot.as_slice())?.is_some(), "record {i}");
                }
            }
            let sealed = PartitionState::Sealed;
            assert_eq!(
                seen,
                vec![
                    (1, sealed, 32_768),
                    (2, sealed, 32_768),
                    (3, PartitionState::Hot, 4_464)
                ]
            );
        }
        let clock = ManualClock::new(T0);
        let engine = Engine::builder()
            .clock(clock.clone())
            .ttl(Duration::from_secs(3600))
            .sweep_interval(None)
            .open(&path)?;
        let report = engine.verify()?;
        assert!(report.is_sound(), "{:?}", report.damage);
        assert_eq!(report.records, COUNT);
        // Served as if `begin` + `complete` had stored them, from sealed
        // partitions and the hot one alike.
        assert_served(
            &engine,
            COUNT,
            &[0, 32_767, 32_768, 50_000, COUNT - 1],
            record,
        )?;
        // Partition 1 (records 0..32,768) expires whole.
        clock.set(T0 - 100_000 + 32_767 + 3_600_000);
        assert_eq!(engine.sweep_now()?.deleted, 32_768);
        let report = engine.verify()?;
        assert!(report.is_sound(), "{:?}", report.damage);
        assert_eq!(report.records, COUNT - 32_768 + 1);
        drop(engine);
        Ok(())
    }

    /// A key given in two partitions is refused by name before anything
    /// is written (an insert would not see it: two slot keys).
    #[test]
    fn a_key_in_two_partitions_is_refused_by_name() -> TestResult {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("fixture3.redb");
        format_3_file(&path)?;
        let twice = |i: u64| record(if i == 33_000 { 5 } else { i });
        let err = preload_completed(&path, plan(33_001), twice)
            .err()
            .ok_or("no error")?;
        let rkey = crate::store::record::hex(record(5).key.record_key());
        assert!(err.to_string().contains("given twice"), "{err}");
        assert!(format!("{err:?}").contains(&rkey), "{err:?}");
        let db = redb::Database::open(&path)?;
        let txn = db.begin_read()?;
        assert!(matches!(
            txn.open_table(catalog::RECORDS).map(|t| t.len()),
            Err(redb::TableError::TableDoesNotExist(_)) | Ok(Ok(0))
        ));
        Ok(())
    }
}
