//! Bulk preload of COMPLETED records into a closed format-2 file, for the
//! benches (feature `bench-fixtures`; see `crate::bench_fixtures`).
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

use std::path::Path;

use redb::ReadableTableMetadata;

use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::store::codec;
use crate::store::record::{reference, Completion, Record, StoredResponse};
use crate::Envelope;

use super::meta::{self, Counter};
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
/// with these keys (a key met twice is an error naming it).
pub(crate) fn preload(
    path: &Path,
    plan: &Plan,
    record: &(dyn Fn(u64) -> Preloaded + Sync),
) -> Result<Shape> {
    let what = "preloading bench records";
    let mut builder = redb::Builder::new();
    builder.set_cache_size(plan.cache_bytes);
    let db = builder.open(path).context(what)?;
    let first_token = {
        let txn = db.begin_write().context(what)?;
        let t = txn.open_table(META).context(what)?;
        meta::required_counter(&t, Counter::NextToken).map_err(|e| e.open_error(path, what))?
    };
    let runs = plan.runs.max(1);
    let per_run = plan.count.div_ceil(runs);
    for run in 0..runs {
        let lo = (run * per_run).min(plan.count);
        let hi = ((run + 1) * per_run).min(plan.count);
        let mut order: Vec<(Vec<u8>, u64)> = (lo..hi)
            .map(|i| (record(i).key.record_key().to_vec(), i))
            .collect();
        if plan.runs > 0 {
            order.sort_unstable();
        }
        for chunk in order.chunks(plan.per_txn.max(1)) {
            let txn = db.begin_write().context(what)?;
            {
                let mut records = txn.open_table(RECORDS).context(what)?;
                for (rkey, i) in chunk {
                    let value = encoded(&record(*i), first_token + i, plan);
                    if records
                        .insert(rkey.as_slice(), value.as_slice())
                        .context(what)?
                        .is_some()
                    {
                        return Err(Error::Storage {
                            context: what,
                            source: Box::new(std::io::Error::other(format!(
                                "record key {} given twice",
                                crate::store::record::hex(rkey)
                            ))),
                        });
                    }
                }
            }
            txn.commit().context(what)?;
        }
        drop(order);
        // The expiry index in the caller's order (completion order).
        for lo in (lo..hi).step_by(plan.per_txn.max(1)) {
            let txn = db.begin_write().context(what)?;
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
    let txn = db.begin_write().context(what)?;
    {
        let mut t = txn.open_table(META).context(what)?;
        meta::write_counter(&mut t, Counter::NextToken, first_token + plan.count).context(what)?;
    }
    let stats = txn
        .open_table(RECORDS)
        .context(what)?
        .stats()
        .context(what)?;
    let records = txn.open_table(RECORDS).context(what)?.len().context(what)?;
    txn.commit().context(what)?;
    Ok(Shape {
        records,
        leaf_pages: stats.leaf_pages(),
        branch_pages: stats.branch_pages(),
        stored_bytes: stats.stored_bytes(),
        page_bytes: 4096,
    })
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
