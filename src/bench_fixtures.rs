//! Bench fixtures (feature `bench-fixtures`, off by default; only the
//! bench crate turns it on): a store of millions of COMPLETED records
//! written in minutes, where filling it through the engine would take
//! hours. Not part of the API: hidden from the docs, no stability promise.
//!
//! The file it writes is an ordinary store: created by
//! [`Engine::builder`]'s `open` (format 2, unless the file was created
//! before in format 3: an existing file keeps its format), then filled
//! with the records `begin` + `complete` would have stored (the same
//! record code and codec, a fencing token each, an expiry index entry
//! each, `next_token` moved past them), so [`Engine::verify`] accepts it.
//! In format 3 the records are in partitions of at most 32,768 keys in
//! the caller's (claim) order, every one sealed with its key filter but
//! the last, which is hot, as traffic would have left them.

use std::path::Path;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::store::redb::fixture;
use crate::store::redb::fixture::SealedProbes;
use crate::{Engine, Envelope, Fingerprint, IdempotencyKey};

/// One record to preload: a claim of `key` with `fingerprint` at `at_ms`,
/// completed with `response` at the same instant.
#[derive(Clone, Debug)]
pub struct CompletedRecord {
    /// The client's key.
    pub key: IdempotencyKey,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The stored response.
    pub response: Envelope,
    /// Claim and completion instant (ms since the Unix epoch).
    pub at_ms: u64,
}

/// How the records are inserted. Records are numbered `0..count` by the
/// caller, in completion order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// In the caller's order: random keys give the B-tree traffic gives,
    /// slowly (each insert dirties a random leaf of a tree that outgrows
    /// the cache).
    Given,
    /// In `n` runs, each sorted by record key: sequential passes. One run
    /// gives leaves about 90% full, denser than traffic; two give the fill
    /// of random inserts (about 64%, see BENCHMARKS.md).
    SortedRuns(u64),
}

/// What to preload.
#[derive(Clone, Copy, Debug)]
pub struct Preload {
    /// Records to write.
    pub count: u64,
    /// Insertion order.
    pub order: Order,
    /// Records per redb write transaction (each commit durable).
    pub records_per_txn: usize,
    /// The claims' lease (stored in each record, as `begin` would).
    pub lease: Duration,
    /// The records' TTL: each expires `ttl` after its `at_ms`.
    pub ttl: Duration,
    /// redb's cache while preloading, in bytes.
    pub cache_bytes: usize,
}

/// The records table after the preload (redb's table stats).
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Records in the table.
    pub records: u64,
    /// Its leaf pages.
    pub leaf_pages: u64,
    /// Its branch pages.
    pub branch_pages: u64,
    /// Bytes of keys and values stored in its leaves.
    pub stored_bytes: u64,
    /// redb's page size, in bytes.
    pub page_bytes: u64,
}

/// Creates the store at `path` (which must not hold records with these
/// keys) with the engine, closes it, and writes `plan.count` COMPLETED
/// records into it, record `i` given by `record(i)` (called several times
/// per `i`: it must return the same record each time). A new file is of
/// format 2 (the fixture's baseline); for format 3, create it first with
/// `Engine::builder().open(path)` (the default) and drop the engine:
/// the records are then laid out in partitions (module docs).
///
/// # Errors
///
/// The engine's open errors, storage errors, and a key given twice (named
/// in the error).
pub fn preload_completed(
    path: &Path,
    plan: Preload,
    record: impl Fn(u64) -> CompletedRecord + Sync,
) -> Result<Shape> {
    drop(
        Engine::builder()
            .unstable_create_format_2()
            .ttl(plan.ttl)
            .open(path)?,
    );
    let inner = fixture::Plan {
        count: plan.count,
        runs: match plan.order {
            Order::Given => 0,
            Order::SortedRuns(n) => n.max(1),
        },
        per_txn: plan.records_per_txn,
        lease_ms: u64::try_from(plan.lease.as_millis()).unwrap_or(u64::MAX),
        ttl_ms: u64::try_from(plan.ttl.as_millis()).unwrap_or(u64::MAX),
        cache_bytes: plan.cache_bytes,
    };
    let shape = fixture::preload(path, &inner, &|i| {
        let r = record(i);
        fixture::Preloaded {
            key: r.key,
            fingerprint: r.fingerprint,
            response: r.response,
            at_ms: r.at_ms,
        }
    })?;
    Ok(Shape {
        records: shape.records,
        leaf_pages: shape.leaf_pages,
        branch_pages: shape.branch_pages,
        stored_bytes: shape.stored_bytes,
        page_bytes: shape.page_bytes,
    })
}

/// A closed store's space: what its pages hold, beside the file's length.
#[derive(Clone, Copy, Debug)]
pub struct Space {
    /// Bytes of the pages in use (redb's allocated pages × page size);
    /// the rest of the file is free pages that later writes reuse.
    pub allocated_bytes: u64,
    /// Bytes of free pages inside allocated regions (redb's
    /// `fragmented_bytes`).
    pub fragmented_bytes: u64,
    /// The records table (format 3's when the file is format 3).
    pub records: Shape,
}

/// The space of the closed store at `path` (no engine may hold it): redb's
/// database stats and its records table's stats, read in a write
/// transaction that is aborted (nothing is written).
///
/// # Errors
///
/// Storage errors, and a file that does not open cleanly (the engine
/// must have closed it).
pub fn space(path: &Path) -> Result<Space> {
    fixture::space(path).map(|(allocated_bytes, fragmented_bytes, shape)| Space {
        allocated_bytes,
        fragmented_bytes,
        records: Shape {
            records: shape.records,
            leaf_pages: shape.leaf_pages,
            branch_pages: shape.branch_pages,
            stored_bytes: shape.stored_bytes,
            page_bytes: shape.page_bytes,
        },
    })
}

/// Checks that a preloaded store of `count` records serves them as
/// `begin` + `complete` would have stored them: each record `samples`
/// names (`record(i)`) replays its response, and a fresh key gets a
/// fencing token past every preloaded one. For this module's tests and
/// `store/redb/fixture.rs`'s.
#[cfg(test)]
pub(crate) fn assert_served(
    engine: &Engine,
    count: u64,
    samples: &[u64],
    record: impl Fn(u64) -> CompletedRecord,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    for &i in samples {
        let r = record(i);
        match engine.begin(&r.key, r.fingerprint)? {
            crate::Begin::Replay(replay) => assert_eq!(replay.envelope, r.response),
            other => panic!("record {i} must replay, got {other:?}"),
        }
    }
    let fresh = IdempotencyKey::new("fixture", "fresh")?;
    match engine.begin(&fresh, Fingerprint::from_bytes([0; 32]))? {
        crate::Begin::Claimed(claim) => assert!(claim.fencing_token() > count),
        other => panic!("a fresh key must be claimed, got {other:?}"),
    }
    Ok(())
}

/// The key filters of `partitions` sealed format-3 partitions of
/// `keys_per_partition` keys each, as a fresh key's lookup probes them:
/// kept in groups as the engine keeps them (`grouped`), or each in its own
/// array as before grouping, for the probe micro-bench
/// (`bench/benches/filter_probes.rs`). In memory only: no file.
pub struct SealedFilters(SealedProbes);

impl SealedFilters {
    /// Builds them: about 3.4 bytes per key, `partitions ×
    /// keys_per_partition` inserts.
    ///
    /// # Errors
    ///
    /// [`Error::Storage`] when a filter cannot be allocated.
    pub fn new(partitions: u64, keys_per_partition: u64, grouped: bool) -> Result<SealedFilters> {
        SealedProbes::new(partitions, keys_per_partition, grouped)
            .map(SealedFilters)
            .map_err(|e| Error::Storage {
                context: "building bench filters",
                source: Box::new(e),
            })
    }

    /// How many partitions' filters answer "maybe" for record key `key`
    /// (the tables its lookup would read); every filter is probed.
    pub fn maybes(&self, key: &[u8]) -> usize {
        self.0.maybes(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ManualClock;

    type TestResult = std::result::Result<(), Box<dyn std::error::Error>>;

    const T0: u64 = 1_800_000_000_000;

    fn record(i: u64) -> CompletedRecord {
        CompletedRecord {
            key: IdempotencyKey::new("fixture", format!("key-{:08}", i.wrapping_mul(7919) % 1000))
                .unwrap_or_else(|e| panic!("a valid key: {e}")),
            fingerprint: Fingerprint::from_bytes([i as u8; 32]),
            response: Envelope::new(1, 201, format!("body {i}").into_bytes()),
            at_ms: T0 - 1000 + i,
        }
    }

    /// The preloaded file is a sound store the engine serves as if the
    /// records had gone through `begin` + `complete`: each replays, a fresh
    /// claim gets a token past theirs, and each expires at its instant.
    #[test]
    fn a_preloaded_store_verifies_replays_and_expires() -> TestResult {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("fixture.redb");
        let ttl = Duration::from_secs(60);
        for order in [Order::SortedRuns(2), Order::Given] {
            let _ = std::fs::remove_file(&path);
            let plan = Preload {
                count: 1000,
                order,
                records_per_txn: 300,
                lease: Duration::from_secs(30),
                ttl,
                cache_bytes: 1 << 20,
            };
            let shape = preload_completed(&path, plan, record)?;
            assert_eq!(shape.records, 1000);
            let clock = ManualClock::new(T0);
            let engine = Engine::builder()
                .clock(clock.clone())
                .ttl(ttl)
                .sweep_interval(None)
                .open(&path)?;
            let report = engine.verify()?;
            assert!(report.is_sound(), "{:?}", report.damage);
            assert_eq!(report.records, 1000);
            assert_served(&engine, 1000, &[0, 499, 999], record)?;
            // Records 0..=499 completed by T0 - 501 and expire 60 s later.
            clock.set(T0 - 501 + 60_000);
            assert_eq!(engine.sweep_now()?.deleted, 500);
        }
        Ok(())
    }

    #[test]
    fn a_key_given_twice_is_refused_by_name() -> TestResult {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("fixture.redb");
        let plan = Preload {
            count: 2,
            order: Order::SortedRuns(1),
            records_per_txn: 10,
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
            cache_bytes: 1 << 20,
        };
        let same = |_| record(3);
        let err = preload_completed(&path, plan, same)
            .err()
            .ok_or("no error")?;
        assert!(err.to_string().contains("given twice"), "{err}");
        Ok(())
    }
}
