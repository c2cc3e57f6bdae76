//! Scale layouts (issue 26): time-partitioned record tables against today's
//! single record table, on plain redb with the engine's value sizes.
//!
//! - `single` (baseline, format 2's shape): one `records` table keyed
//!   `[scope len][scope][key]` (57 bytes), a `leases` index (claims) and an
//!   `expiry` index (completions), both `(u64, record key)`.
//! - `partitioned`: one record table per creation interval (the TTL split in
//!   `IDEMPOTENCY_BENCH_PARTITIONS`, default 24: an hour of a 24 h TTL).
//!   New keys land in the newest ("hot") table; lookups go newest-first; each
//!   older ("cold") table has an in-memory blocked Bloom filter (24 bits per
//!   key, 11 probes in one 64-byte block), consulted before the table is
//!   read, so a fresh key's absence costs no read of a cold table unless a
//!   filter gives a false "maybe" (counted). The filters are rebuilt at open
//!   by scanning the cold tables' keys (timed). There is no expiry index:
//!   expiry drops the oldest table. The `leases` index stays.
//!
//! - `merged` (issue 26's open questions): the partitioned layout with the
//!   sealed partitions (all but the hot one) merged `IDEMPOTENCY_BENCH_MERGE`
//!   at a time (default 6: ten-minute partitions into hourly tables) into
//!   one table each, written in key order in bounded write transactions
//!   (`partitions/merge.rs`, timed: `MERGE` lines), then the file compacted;
//!   one filter per merged table.
//!   Besides, one combined filter over every cold table's keys is built
//!   and its false "maybe"s for fresh keys counted (it gates nothing).
//! - `prefixed`: the partitioned layout (same partitions, filters, hot
//!   partition, commits and lookups) with every partition in ONE record
//!   table keyed `[p: u64 big-endian][record key]`
//!   (`partitions/prefixed.rs`): a partition is a key range, the hot one
//!   rightmost. Expiry deletes the oldest partition's range in key order,
//!   `SWEEP_TXN` keys per write transaction.
//!
//! Each store lives in its own child process (this binary, re-executed with
//! `IDEMPOTENCY_PARTITIONS_CHILD` set), so peak RSS (`VmHWM`) and
//! `/proc/self/io` are per store. The file is built first by a separate
//! preload process (one write transaction per table, a fixture, not a
//! measured path), so the serving process's peak RSS is what serving costs,
//! with redb's cache set to `IDEMPOTENCY_BENCH_CACHE_MIB` (default 256).
//! The parent then interleaves short slices of each store (`PAIRED` lines,
//! as in the other benches):
//! - group commits shaped like the engine's (32 `begin`s + the previous 32
//!   `complete`s per write transaction), in two modes: `immediate` (every
//!   group a durable commit, as `layout.rs`) and `checkpoint` (groups commit
//!   with `Durability::None` and every 850th, about 32 MiB of the engine's
//!   journal, and the last of a slice are durable: the engine's journal +
//!   checkpoint regime without the journal's own ~1.2 KiB per request);
//! - bytes written per request (`wchar`, bytes handed to `write` calls, and
//!   `write_bytes`, pages charged by the kernel), from `/proc/self/io`;
//! - point lookups (replay): keys drawn uniformly from all stored records,
//!   and "recent" keys from the two newest intervals, against the single
//!   table's lookup of the same keys (the raw redb lookup), each with the
//!   read transaction and tables opened per lookup (`each`) and once per
//!   slice (`cached`, as an engine reader could keep them), and the tables
//!   read per lookup;
//! - file bytes per record, the record tables' pages per record and leaf
//!   fill (redb's table stats), and peak RSS;
//! - expiring one interval's records: dropping the oldest table (prefixed:
//!   deleting its key range, 512 keys a transaction) against a per-record
//!   delete through the expiry index (transactions of 512); three times,
//!   an interval each: durable transactions, non-durable ones with one
//!   durable commit at the end, and the latter with the table emptied in
//!   key order in steps before its drop (`Expiry`).
//!
//! `IDEMPOTENCY_BENCH_RECORDS` sets the large size (default 1M; test mode
//! 2,000); `IDEMPOTENCY_BENCH_ROUNDS` the rounds (default 5, test mode 1);
//! `IDEMPOTENCY_BENCH_PRELOAD_CACHE_MIB` the preload process's redb cache
//! (default 2048: the preload is a fixture, its memory is not measured);
//! `IDEMPOTENCY_BENCH_PRELOAD_KEY_ORDER=1` writes every partition but the
//! hot one in key order (the single table keeps claim order);
//! `IDEMPOTENCY_BENCH_SKIP_SINGLE_LARGE=1` leaves out the large single
//! table (its 10M preload takes 12 minutes here) when only the partitioned
//! layout's settings change between runs; `IDEMPOTENCY_BENCH_LAYOUTS`
//! (comma-separated from `partitioned`, `merged`, `prefixed`; default all
//! three) the layouts beside `single`; `IDEMPOTENCY_BENCH_LOOKUPS_FIRST=1`
//! runs the lookup slices before the commit slices (on the stores as preloaded, so the "10k"
//! stores are still 10k records); `IDEMPOTENCY_BENCH_MERGE` and
//! `IDEMPOTENCY_BENCH_MERGE_TXN` set the merge (partitions per merged
//! table, records per merge transaction), `IDEMPOTENCY_BENCH_MERGE_DURABLE=0`
//! commits its steps without an fsync (one durable commit per merged
//! table).
//!
//! Criterion micro-measures beside them: a filter probe, and the filter
//! hash of one record key (seeded rapidhash v3, the engine's, against
//! BLAKE3 keyed, its first, and seeded xxh3).

#[path = "partitions/bloom.rs"]
mod bloom;
mod common;
#[path = "partitions/merge.rs"]
mod merge;
#[path = "partitions/prefixed.rs"]
mod prefixed;

use std::borrow::Cow;
use std::hint::black_box;
use std::io::{BufRead, BufReader, Write};
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use bloom::{key_hash, Bloom};
use criterion::Criterion;
use merge::{merge_sealed, merged_name};
use prefixed::{bounds, empty_range, prefixed, range_of, record_key, PREFIXED, PREFIXED_NAME};
use redb::{
    Database, Durability, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition,
};

const RECORDS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("records");
const LEASES: TableDefinition<(u64, &[u8]), ()> = TableDefinition::new("leases");
const EXPIRY: TableDefinition<(u64, &[u8]), ()> = TableDefinition::new("expiry");
const BATCH: usize = 32;
const NOW: u64 = 1_800_000_000_000;
const TTL_MS: u64 = 86_400_000;
/// Groups per checkpoint in `checkpoint` mode: 850 × 32 requests × ~1.2 KiB
/// of journal ≈ the engine's 32 MiB checkpoint interval.
const CHECKPOINT_GROUPS: u64 = 850;
const PROCESSING_BYTES: usize = 80;
const COMPLETED_BYTES: usize = 404;
const SWEEP_TXN: usize = 512;
const CHILD_ENV: &str = "IDEMPOTENCY_PARTITIONS_CHILD";

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// A 64-bit mix (splitmix64's finalizer).
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE5_E9B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The record key of request number `i`: a UUID-shaped client key derived
/// from `i`, so keys need not be kept in memory (they would count in RSS).
fn key_of(i: u64) -> Vec<u8> {
    let (a, b) = (mix(i), mix(i ^ 0x5555_5555_5555_5555));
    let uuid = uuid::Uuid::from_u64_pair(a, b).to_string();
    common::redb_plain::record_key(common::SCOPE, &uuid)
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Layout {
    Single,
    Partitioned,
    Merged,
    Prefixed,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Layout::Single => "single",
            Layout::Partitioned => "partitioned",
            Layout::Merged => "merged",
            Layout::Prefixed => "prefixed",
        }
    }

    fn parse(s: &str) -> Option<Layout> {
        match s {
            "single" => Some(Layout::Single),
            "partitioned" => Some(Layout::Partitioned),
            "merged" => Some(Layout::Merged),
            "prefixed" => Some(Layout::Prefixed),
            _ => None,
        }
    }
}

/// How `records` preloaded records split over `partitions` creation
/// intervals: the hot (newest) one is half full (mid-interval), the cold ones
/// share the rest. Returns the record count of each, oldest first.
fn plan(records: u64, partitions: u64) -> Vec<u64> {
    let hot = (records / (2 * partitions)).max(1);
    let cold = partitions - 1;
    let rest = records - hot;
    let mut v: Vec<u64> = (0..cold)
        .map(|p| rest / cold + u64::from(p < rest % cold))
        .collect();
    v.push(hot);
    v
}

fn part_name(p: u64) -> String {
    format!("records_{p:06}")
}

fn def(name: &str) -> TableDefinition<'_, &'static [u8], &'static [u8]> {
    TableDefinition::new(name)
}

/// The record tables a layout serves from, oldest first, the last one hot,
/// with their record counts: `records` alone (single); one per partition
/// (partitioned; prefixed, where they name the key ranges of one table);
/// the sealed partitions merged `group` at a time, oldest first, then the
/// hot partition (merged).
fn tables(layout: Layout, plan: &[u64], group: usize) -> (Vec<String>, Vec<u64>) {
    let hot = plan.len() - 1;
    match layout {
        Layout::Single => (vec!["records".to_string()], vec![plan.iter().sum()]),
        Layout::Partitioned | Layout::Prefixed => {
            ((0..=hot as u64).map(part_name).collect(), plan.to_vec())
        }
        Layout::Merged => {
            let counts: Vec<u64> = plan[..hot].chunks(group).map(|c| c.iter().sum()).collect();
            let mut names: Vec<String> = (0..counts.len()).map(merged_name).collect();
            names.push(part_name(hot as u64));
            let mut counts = counts;
            counts.push(plan[hot]);
            (names, counts)
        }
    }
}

/// Builds the file: records `0..records` in creation order, in one write
/// transaction per table (per partition, or one for the single table; the
/// prefixed layout one per partition too, in ascending `p`, so each
/// partition's range is appended right of the last). Inside a partition
/// the keys come in creation order, which is random key order
/// (`IDEMPOTENCY_BENCH_PRELOAD_KEY_ORDER=1`: key order in every partition
/// but the hot one, except in the single table). The
/// merged layout is preloaded as the partitioned one, then merged
/// (`merge_sealed`) and compacted, so its file holds no pages the merge
/// freed (in service the next partitions would reuse them).
fn preload(layout: Layout, path: &Path, records: u64, partitions: u64, group: usize) {
    let start = Instant::now();
    let mut builder = Database::builder();
    let mib = env_usize("IDEMPOTENCY_BENCH_PRELOAD_CACHE_MIB").unwrap_or(2048);
    builder.set_cache_size(mib << 20);
    let mut db = builder.create(path).expect("create");
    let done = vec![1u8; COMPLETED_BYTES];
    let mut first = 0;
    let plan = plan(records, partitions);
    // Sealed partitions written in key order, as a rewrite at sealing
    // would leave them (the hot one stays in claim order).
    let key_order = std::env::var("IDEMPOTENCY_BENCH_PRELOAD_KEY_ORDER").is_ok_and(|v| v == "1");
    for (p, &n) in plan.iter().enumerate() {
        let txn = db.begin_write().expect("txn");
        {
            txn.open_table(LEASES).expect("t");
            let expires = NOW + p as u64 * (TTL_MS / partitions) + TTL_MS;
            if layout == Layout::Single {
                let mut rec = txn.open_table(RECORDS).expect("t");
                let mut exp = txn.open_table(EXPIRY).expect("t");
                for i in first..first + n {
                    let k = key_of(i);
                    rec.insert(k.as_slice(), done.as_slice()).expect("i");
                    exp.insert((expires, k.as_slice()), ()).expect("i");
                }
            } else {
                let mut keys: Vec<Vec<u8>> = (first..first + n).map(key_of).collect();
                if key_order && p + 1 < plan.len() {
                    keys.sort_unstable();
                }
                if layout == Layout::Prefixed {
                    let mut rec = txn.open_table(PREFIXED).expect("t");
                    for k in &keys {
                        rec.insert(prefixed(p as u64, k).as_slice(), done.as_slice())
                            .expect("i");
                    }
                } else {
                    let name = part_name(p as u64);
                    let mut rec = txn.open_table(def(&name)).expect("t");
                    for k in &keys {
                        rec.insert(k.as_slice(), done.as_slice()).expect("i");
                    }
                }
            }
        }
        txn.commit().expect("commit");
        first += n;
    }
    println!(
        "PRELOAD {} {records}: {:.1}s, file {:.0} MiB, {:.0} bytes per record",
        layout.name(),
        start.elapsed().as_secs_f64(),
        std::fs::metadata(path).map_or(0, |m| m.len()) as f64 / (1 << 20) as f64,
        std::fs::metadata(path).map_or(0, |m| m.len()) as f64 / records as f64
    );
    preload_fill(&db, layout, plan.len() as u64, records);
    if layout == Layout::Merged {
        merge_sealed(&db, &plan, group);
        let before = std::fs::metadata(path).map_or(0, |m| m.len());
        let t0 = Instant::now();
        while db.compact().expect("compact") {}
        println!(
            "MERGE compaction: file {:.0} → {:.0} MiB ({:.0} bytes per record) in {:.1}s",
            before as f64 / (1 << 20) as f64,
            std::fs::metadata(path).map_or(0, |m| m.len()) as f64 / (1 << 20) as f64,
            std::fs::metadata(path).map_or(0, |m| m.len()) as f64 / records as f64,
            t0.elapsed().as_secs_f64()
        );
    }
}

/// Prints the record tables' pages per record and leaf fill right after
/// the preload (before any merge), from redb's table stats.
fn preload_fill(db: &Database, layout: Layout, partitions: u64, records: u64) {
    let txn = db.begin_read().expect("txn");
    let names: Vec<String> = match layout {
        Layout::Single => vec!["records".to_string()],
        Layout::Prefixed => vec![PREFIXED_NAME.to_string()],
        Layout::Partitioned | Layout::Merged => (0..partitions).map(part_name).collect(),
    };
    let (mut pages, mut leaves, mut used, mut height) = (0, 0, 0, 0);
    for name in &names {
        let st = txn
            .open_table(def(name))
            .expect("t")
            .stats()
            .expect("stats");
        pages += st.leaf_pages() + st.branch_pages();
        leaves += st.leaf_pages();
        used += st.stored_bytes();
        height = height.max(st.tree_height());
    }
    println!(
        "PRELOAD_FILL {} {records}: {} record tables, pages {:.0} B per record, leaves {:.1}% full ({leaves} leaf pages), tree height ≤ {height}",
        layout.name(),
        names.len(),
        pages as f64 * 4096.0 / records as f64,
        100.0 * used as f64 / (leaves as f64 * 4096.0).max(1.0)
    );
}

/// How `Store::expire` commits.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Expiry {
    Durable,
    Lazy,
    Stepped,
}

impl Expiry {
    fn parse(s: &str) -> Option<Expiry> {
        match s {
            "durable" => Some(Expiry::Durable),
            "lazy" => Some(Expiry::Lazy),
            "stepped" => Some(Expiry::Stepped),
            _ => None,
        }
    }
}

/// A read transaction with every record table open, newest last: what an
/// engine reader could keep for a while instead of opening a table by name
/// per lookup.
struct Reader {
    _txn: redb::ReadTransaction,
    tables: Vec<redb::ReadOnlyTable<&'static [u8], &'static [u8]>>,
}

/// One store, served in a child process.
struct Store {
    layout: Layout,
    db: Database,
    path: PathBuf,
    /// Record counts per creation interval, oldest first (the preload's).
    plan: Vec<u64>,
    /// Index of the first record of each interval.
    firsts: Vec<u64>,
    /// Record table names, oldest first; the last is hot (`records` alone
    /// for `single`).
    parts: Vec<String>,
    /// Their record counts at open.
    counts: Vec<u64>,
    /// The partition number of each (`prefixed`: its key prefix).
    ids: Vec<u64>,
    /// Intervals expired so far (`single`: where the next expiry's cutoff
    /// lies).
    expired: usize,
    /// Filters of the cold tables, same order as `parts` minus the hot.
    filters: Vec<Bloom>,
    /// One filter over every cold table's keys (`merged` only): how often a
    /// fresh key would pass it is counted, it gates nothing.
    combined: Option<Bloom>,
    hot_filter: Bloom,
    /// Keys in the hot table (its filter's load) and the filter's capacity.
    hot_keys: u64,
    hot_capacity: u64,
    preloaded: u64,
    next: u64,
    pending: Vec<Vec<u8>>,
    cold_reads: u64,
    combined_maybes: u64,
    fresh_begins: u64,
}

impl Store {
    fn open(spec: &Spec) -> Store {
        let mut builder = Database::builder();
        builder.set_cache_size(spec.cache);
        let db = builder.open(&spec.path).expect("open");
        let plan = plan(spec.records, spec.partitions);
        let mut firsts = Vec::new();
        let mut acc = 0;
        for n in &plan {
            firsts.push(acc);
            acc += n;
        }
        let (parts, counts) = tables(spec.layout, &plan, spec.group);
        let mut s = Store {
            layout: spec.layout,
            db,
            path: spec.path.clone(),
            ids: (0..parts.len() as u64).collect(),
            expired: 0,
            parts,
            counts,
            filters: Vec::new(),
            combined: None,
            hot_filter: Bloom::with_capacity(0),
            hot_keys: 0,
            hot_capacity: 0,
            preloaded: spec.records,
            next: spec.records,
            pending: Vec::new(),
            cold_reads: 0,
            combined_maybes: 0,
            fresh_begins: 0,
            plan,
            firsts,
        };
        if s.layout != Layout::Single {
            let start = Instant::now();
            let txn = s.db.begin_read().expect("txn");
            let cold = s.parts.len() - 1;
            let all: u64 = s.counts[..cold].iter().sum();
            let mut combined =
                (s.layout == Layout::Merged).then(|| Bloom::with_capacity(all as usize));
            for i in 0..cold {
                let mut f = Bloom::with_capacity(s.counts[i] as usize);
                s.scan_keys(&txn, i, |k| {
                    let h = key_hash(k);
                    f.insert(h);
                    if let Some(c) = &mut combined {
                        c.insert(h);
                    }
                });
                s.filters.push(f);
            }
            s.combined = combined;
            drop(txn);
            s.rebuild_hot_filter((spec.records / spec.partitions) * 2);
            let bytes: usize = s.filters.iter().map(Bloom::bytes).sum();
            println!(
                "FILTERS rebuilt at open ({}): {} cold tables, {} records, {:.2}s, {:.1} MiB{}",
                s.layout.name(),
                s.filters.len(),
                spec.records,
                start.elapsed().as_secs_f64(),
                bytes as f64 / (1 << 20) as f64,
                s.combined.as_ref().map_or(String::new(), |c| format!(
                    " (+ {:.1} MiB combined filter)",
                    c.bytes() as f64 / (1 << 20) as f64
                ))
            );
        }
        s
    }

    /// Rebuilds the hot table's filter for `capacity` keys from the table.
    /// The bench never seals the hot table, so it grows by 100–400k keys
    /// over the commit slices; an engine would seal it at its filter's
    /// size instead. Without this, the overloaded filter says "maybe" for
    /// every older key and each replay reads the hot table first.
    fn rebuild_hot_filter(&mut self, capacity: u64) {
        let txn = self.db.begin_read().expect("txn");
        let mut f = Bloom::with_capacity(capacity as usize);
        let mut n = 0;
        self.scan_keys(&txn, self.parts.len() - 1, |k| {
            f.insert(key_hash(k));
            n += 1;
        });
        (self.hot_filter, self.hot_keys, self.hot_capacity) = (f, n, capacity);
    }

    /// Calls `f` with every record key of partition (or table) `parts[i]`,
    /// in key order: a table's keys, or (`prefixed`) its key range's keys
    /// with the prefix stripped.
    fn scan_keys(&self, txn: &redb::ReadTransaction, i: usize, mut f: impl FnMut(&[u8])) {
        let t = txn.open_table(def(self.table_of(i))).expect("t");
        let iter = if self.layout == Layout::Prefixed {
            let (lo, hi) = range_of(self.ids[i]);
            t.range(lo.as_slice()..hi.as_slice()).expect("range")
        } else {
            t.iter().expect("iter")
        };
        for e in iter {
            let (k, _) = e.expect("entry");
            f(self.record_key_of(k.value()));
        }
    }

    /// The table that holds partition (or table) `parts[i]`.
    fn table_of(&self, i: usize) -> &str {
        if self.layout == Layout::Prefixed {
            PREFIXED_NAME
        } else {
            &self.parts[i]
        }
    }

    /// The key record key `k` is stored under in `parts[i]`'s table.
    fn stored_key<'k>(&self, i: usize, k: &'k [u8]) -> Cow<'k, [u8]> {
        if self.layout == Layout::Prefixed {
            Cow::Owned(prefixed(self.ids[i], k))
        } else {
            Cow::Borrowed(k)
        }
    }

    /// The record key of a key stored in a record table.
    fn record_key_of<'k>(&self, stored: &'k [u8]) -> &'k [u8] {
        if self.layout == Layout::Prefixed {
            record_key(stored)
        } else {
            stored
        }
    }

    /// One group commit: BATCH begins and the previous BATCH completes.
    fn group_commit(&mut self, durability: Durability) {
        let proc_v = [0u8; PROCESSING_BYTES];
        let done_v = [1u8; COMPLETED_BYTES];
        let begins: Vec<Vec<u8>> = (0..BATCH)
            .map(|_| {
                self.next += 1;
                key_of(self.next)
            })
            .collect();
        let mut txn = self.db.begin_write().expect("txn");
        txn.set_durability(durability).expect("durability");
        {
            let mut leases = txn.open_table(LEASES).expect("t");
            if self.layout == Layout::Single {
                let mut rec = txn.open_table(RECORDS).expect("t");
                let mut exp = txn.open_table(EXPIRY).expect("t");
                for k in &begins {
                    assert!(rec.get(k.as_slice()).expect("get").is_none());
                    leases.insert((NOW + 30_000, k.as_slice()), ()).expect("i");
                    rec.insert(k.as_slice(), proc_v.as_slice()).expect("i");
                }
                for k in &self.pending {
                    assert!(rec.get(k.as_slice()).expect("get").is_some());
                    leases.remove((NOW + 30_000, k.as_slice())).expect("r");
                    exp.insert((NOW + 2 * TTL_MS, k.as_slice()), ()).expect("i");
                    rec.insert(k.as_slice(), done_v.as_slice()).expect("i");
                }
            } else {
                let hot = self.parts.len() - 1;
                let hot_table = self.table_of(hot).to_string();
                let mut rec = txn.open_table(def(&hot_table)).expect("t");
                for k in &begins {
                    let hk = self.stored_key(hot, k);
                    assert!(rec.get(&*hk).expect("get").is_none());
                    let h = key_hash(k);
                    self.fresh_begins += 1;
                    if self.combined.as_ref().is_some_and(|c| c.maybe(h)) {
                        self.combined_maybes += 1;
                    }
                    for (i, f) in self.filters.iter().enumerate().rev() {
                        if f.maybe(h) {
                            self.cold_reads += 1;
                            let ck = self.stored_key(i, k);
                            // Prefixed: the same table, already open.
                            let absent = if self.layout == Layout::Prefixed {
                                rec.get(&*ck).expect("get").is_none()
                            } else {
                                let t = txn.open_table(def(self.table_of(i))).expect("t");
                                // Bound first: the guard must drop before `t`.
                                let absent = t.get(&*ck).expect("get").is_none();
                                absent
                            };
                            assert!(absent);
                        }
                    }
                    self.hot_filter.insert(h);
                    self.hot_keys += 1;
                    leases.insert((NOW + 30_000, k.as_slice()), ()).expect("i");
                    rec.insert(&*hk, proc_v.as_slice()).expect("i");
                }
                for k in &self.pending {
                    let hk = self.stored_key(hot, k);
                    assert!(rec.get(&*hk).expect("get").is_some());
                    leases.remove((NOW + 30_000, k.as_slice())).expect("r");
                    rec.insert(&*hk, done_v.as_slice()).expect("i");
                }
            }
        }
        txn.commit().expect("commit");
        self.pending = begins;
    }

    /// Where a replay of `k` looks, newest first: `get(i)` reads table
    /// `parts[i]`. Returns the stored value and the tables read. The hot
    /// table's filter is kept as keys land in it, so a replay of an older
    /// key skips the hot table too.
    fn find(&self, k: &[u8], mut get: impl FnMut(usize) -> Option<Vec<u8>>) -> (Vec<u8>, u32) {
        if self.layout == Layout::Single {
            return (get(0).expect("present"), 1);
        }
        let h = key_hash(k);
        let hot = self.parts.len() - 1;
        let mut reads = 0;
        if self.hot_filter.maybe(h) {
            reads += 1;
            if let Some(v) = get(hot) {
                return (v, reads);
            }
        }
        for (i, f) in self.filters.iter().enumerate().rev() {
            if f.maybe(h) {
                reads += 1;
                if let Some(v) = get(i) {
                    return (v, reads);
                }
            }
        }
        panic!("a stored key was not found");
    }

    /// A replay's read, as the prototype did it: a read transaction and a
    /// table opened by name per table read.
    /// (Prefixed: its one table opened once per lookup, before the
    /// first read.)
    fn lookup(&self, k: &[u8]) -> (Vec<u8>, u32) {
        let txn = self.db.begin_read().expect("txn");
        if self.layout == Layout::Prefixed {
            let t = txn.open_table(PREFIXED).expect("t");
            return self.find(k, |i| {
                let sk = self.stored_key(i, k);
                t.get(&*sk).expect("get").map(|v| v.value().to_vec())
            });
        }
        self.find(k, |i| {
            let t = txn.open_table(def(&self.parts[i])).expect("t");
            t.get(k).expect("get").map(|v| v.value().to_vec())
        })
    }

    fn reader(&self) -> Reader {
        let txn = self.db.begin_read().expect("txn");
        let tables = if self.layout == Layout::Prefixed {
            vec![txn.open_table(PREFIXED).expect("t")]
        } else {
            self.parts
                .iter()
                .map(|p| txn.open_table(def(p)).expect("t"))
                .collect()
        };
        Reader { _txn: txn, tables }
    }

    /// A replay's read through tables already open (`reader`).
    fn lookup_in(&self, r: &Reader, k: &[u8]) -> (Vec<u8>, u32) {
        let one = self.layout == Layout::Prefixed;
        self.find(k, |i| {
            let sk = self.stored_key(i, k);
            r.tables[if one { 0 } else { i }]
                .get(&*sk)
                .expect("get")
                .map(|v| v.value().to_vec())
        })
    }

    /// A stored preloaded record's index: uniform over all, or from the two
    /// newest intervals (`recent`).
    fn pick(&self, picker: &mut common::Picker, recent: bool) -> u64 {
        if recent {
            let n = self.plan.len();
            let from = self.firsts[n.saturating_sub(2)];
            from + picker.next((self.preloaded - from) as usize) as u64
        } else {
            picker.next(self.preloaded as usize) as u64
        }
    }

    /// Expires the oldest interval (for `merged`, the oldest merged table:
    /// `group` intervals); returns (records, seconds, seconds of the first
    /// group commit after it, write transactions, seconds of the longest).
    /// `Durable`: every transaction a durable commit (the single table's
    /// sweep of 512, the drop, the prefixed range's steps of 512); `Lazy`:
    /// the same with `Durability::None` and one durable commit at the end
    /// (counted in the time), the engine's journal regime; `Stepped`: as
    /// `Lazy`, but a table is emptied in key order in steps of 512 before
    /// its (then empty) drop, as format 3 plans to bound a drop's stall.
    fn expire(&mut self, mode: Expiry) -> (u64, f64, f64, u64, f64) {
        let durable = mode == Expiry::Durable;
        let durability = if durable {
            Durability::Immediate
        } else {
            Durability::None
        };
        let start = Instant::now();
        let n = if self.layout == Layout::Single {
            self.plan[self.expired]
        } else {
            self.counts[0]
        };
        let (mut steps, mut longest) = (0u64, Duration::ZERO);
        match self.layout {
            Layout::Single => {
                let interval = TTL_MS / self.plan.len() as u64;
                let cutoff = NOW + self.expired as u64 * interval + TTL_MS;
                let mut left = n;
                while left > 0 {
                    let t0 = Instant::now();
                    let mut txn = self.db.begin_write().expect("txn");
                    txn.set_durability(durability).expect("d");
                    {
                        let mut exp = txn.open_table(EXPIRY).expect("t");
                        let mut rec = txn.open_table(RECORDS).expect("t");
                        let keys: Vec<(u64, Vec<u8>)> = exp
                            .range(..=(cutoff, &[0xffu8; 64][..]))
                            .expect("range")
                            .take(SWEEP_TXN.min(left as usize))
                            .map(|e| {
                                let (k, _) = e.expect("entry");
                                let (t, rk) = k.value();
                                (t, rk.to_vec())
                            })
                            .collect();
                        assert!(!keys.is_empty(), "expiry index ran out");
                        for (t, rk) in &keys {
                            exp.remove((*t, rk.as_slice())).expect("r");
                            rec.remove(rk.as_slice()).expect("r");
                        }
                        left -= keys.len() as u64;
                    }
                    txn.commit().expect("commit");
                    steps += 1;
                    longest = longest.max(t0.elapsed());
                }
            }
            Layout::Prefixed => {
                let (lo, hi) = range_of(self.ids[0]);
                let e = empty_range(
                    &self.db,
                    PREFIXED_NAME,
                    bounds(&lo, &hi),
                    n,
                    SWEEP_TXN,
                    durable,
                );
                assert_eq!(e.records, n);
                (steps, longest) = (e.transactions, e.longest);
            }
            Layout::Partitioned | Layout::Merged => {
                if mode == Expiry::Stepped {
                    let all = (Bound::Unbounded, Bound::Unbounded);
                    let e = empty_range(&self.db, &self.parts[0], all, n, SWEEP_TXN, false);
                    assert_eq!(e.records, n);
                    (steps, longest) = (e.transactions, e.longest);
                }
                let t0 = Instant::now();
                let mut txn = self.db.begin_write().expect("txn");
                txn.set_durability(durability).expect("d");
                assert!(txn.delete_table(def(&self.parts[0])).expect("delete"));
                txn.commit().expect("commit");
                steps += 1;
                longest = longest.max(t0.elapsed());
            }
        }
        if !durable {
            self.db
                .begin_write()
                .expect("txn")
                .commit()
                .expect("commit");
        }
        if self.layout != Layout::Single {
            self.parts.remove(0);
            self.counts.remove(0);
            self.filters.remove(0);
            self.ids.remove(0);
        }
        self.expired += 1;
        let took = start.elapsed().as_secs_f64();
        let t = Instant::now();
        self.group_commit(Durability::Immediate);
        (
            n,
            took,
            t.elapsed().as_secs_f64(),
            steps,
            longest.as_secs_f64(),
        )
    }

    /// File size, records, stored count, peak RSS MiB, filter bytes, and
    /// the record tables' pages (leaf + branch, 4 KiB each) and leaf bytes
    /// in use (redb's `stored_bytes`).
    fn stats(&self) -> String {
        let size = std::fs::metadata(&self.path).map_or(0, |m| m.len());
        let stored = self.next + self.pending.len() as u64;
        // [all tables, cold tables only]: records, pages, leaf pages, bytes
        // stored in leaves.
        // Prefixed: one table, whose sealed ranges redb's stats cannot
        // tell apart, so its "cold" columns are the whole table (as single).
        let mut acc = [[0u64; 4]; 2];
        let mut height = 0;
        let txn = self.db.begin_read().expect("txn");
        let one = [PREFIXED_NAME.to_string()];
        let names = if self.layout == Layout::Prefixed {
            &one[..]
        } else {
            &self.parts[..]
        };
        let hot = names.len() - 1;
        for (i, p) in names.iter().enumerate() {
            let t = txn.open_table(def(p)).expect("t");
            let st = t.stats().expect("stats");
            height = height.max(st.tree_height());
            let row = [
                t.len().expect("len"),
                st.leaf_pages() + st.branch_pages(),
                st.leaf_pages(),
                st.stored_bytes(),
            ];
            for (w, a) in acc.iter_mut().enumerate() {
                if w == 0 || i < hot || matches!(self.layout, Layout::Single | Layout::Prefixed) {
                    a.iter_mut().zip(row).for_each(|(a, r)| *a += r);
                }
            }
        }
        let filters: usize = self.filters.iter().map(Bloom::bytes).sum();
        let [[rec, pages, leaf_pages, used], [crec, cpages, cleaf, cused]] = acc;
        format!(
            "{size} {rec} {stored} {} {filters} {pages} {leaf_pages} {used} {crec} {cpages} {cleaf} {cused} {height}",
            vm_hwm_mib()
        )
    }
}

fn io() -> (i64, i64) {
    common::DiskWrites::read("none")
        .map(|d| (d.process, d.process_syscall))
        .unwrap_or((0, 0))
}

fn vm_hwm_mib() -> f64 {
    common::peak_rss_mib().unwrap_or(0.0)
}

/// What a child serves: `layout:path:records:partitions:cache:group`.
struct Spec {
    layout: Layout,
    path: PathBuf,
    records: u64,
    partitions: u64,
    cache: usize,
    group: usize,
}

impl Spec {
    fn parse(spec: &str) -> (Spec, bool) {
        let f: Vec<&str> = spec.split(':').collect();
        let s = Spec {
            layout: Layout::parse(f[0]).expect("layout"),
            path: PathBuf::from(f[1]),
            records: f[2].parse().expect("records"),
            partitions: f[3].parse().expect("partitions"),
            cache: f[4].parse().expect("cache"),
            group: f[5].parse().expect("group"),
        };
        (s, f.get(6) == Some(&"preload"))
    }

    fn to_arg(&self) -> String {
        format!(
            "{}:{}:{}:{}:{}:{}",
            self.layout.name(),
            self.path.display(),
            self.records,
            self.partitions,
            self.cache,
            self.group
        )
    }
}

/// The child: build or open one store, then answer the parent's commands,
/// one line each, on stdin/stdout.
fn child(arg: &str) {
    let (spec, preloading) = Spec::parse(arg);
    if preloading {
        preload(
            spec.layout,
            &spec.path,
            spec.records,
            spec.partitions,
            spec.group,
        );
        return;
    }
    let mut s = Store::open(&spec);
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    let mut picker = common::Picker::new(7);
    for line in stdin.lock().lines() {
        let line = line.expect("stdin");
        let w: Vec<&str> = line.split_whitespace().collect();
        let reply = match w.as_slice() {
            ["commit", ms, mode] => {
                let slice = Duration::from_millis(ms.parse().expect("ms"));
                let checkpoint = *mode == "checkpoint";
                let (b0, c0) = io();
                let (r0, f0, m0) = (s.cold_reads, s.fresh_begins, s.combined_maybes);
                let start = Instant::now();
                let mut groups = 0u64;
                while start.elapsed() < slice {
                    groups += 1;
                    let d = if !checkpoint || groups.is_multiple_of(CHECKPOINT_GROUPS) {
                        Durability::Immediate
                    } else {
                        Durability::None
                    };
                    s.group_commit(d);
                }
                if checkpoint && !groups.is_multiple_of(CHECKPOINT_GROUPS) {
                    // The slice's last checkpoint, so its pages are counted.
                    let mut txn = s.db.begin_write().expect("txn");
                    txn.set_durability(Durability::Immediate).expect("d");
                    txn.commit().expect("commit");
                }
                let secs = start.elapsed().as_secs_f64();
                let (b1, c1) = io();
                let reqs = (groups * BATCH as u64) as f64;
                format!(
                    "{} {} {} {} {} {}",
                    reqs / secs,
                    (b1 - b0) as f64 / reqs,
                    (c1 - c0) as f64 / reqs,
                    s.cold_reads - r0,
                    s.fresh_begins - f0,
                    s.combined_maybes - m0
                )
            }
            ["lookup", ms, mode, open] => {
                let slice = Duration::from_millis(ms.parse().expect("ms"));
                let recent = *mode == "recent";
                // `cached`: one read transaction with every table open for
                // the slice; `each`: both per lookup.
                if s.layout != Layout::Single && s.hot_keys > s.hot_capacity {
                    s.rebuild_hot_filter(s.hot_keys * 2);
                }
                let reader = (*open == "cached").then(|| s.reader());
                let start = Instant::now();
                let (mut n, mut reads) = (0u64, 0u64);
                let mut bytes = 0usize;
                while start.elapsed() < slice {
                    for _ in 0..64 {
                        let k = key_of(s.pick(&mut picker, recent));
                        let (v, r) = match &reader {
                            Some(rd) => s.lookup_in(rd, &k),
                            None => s.lookup(&k),
                        };
                        bytes += v.len();
                        reads += u64::from(r);
                        n += 1;
                    }
                }
                assert!(bytes >= n as usize * COMPLETED_BYTES);
                format!(
                    "{} {}",
                    n as f64 / start.elapsed().as_secs_f64(),
                    reads as f64 / n as f64
                )
            }
            ["stats"] => s.stats(),
            ["expire", mode] => {
                let mode = Expiry::parse(mode).expect("expiry mode");
                let (n, took, after, steps, longest) = s.expire(mode);
                format!("{n} {took} {after} {steps} {longest}")
            }
            _ => break,
        };
        writeln!(out, "{reply}").expect("stdout");
        out.flush().expect("flush");
    }
}

struct Handle {
    name: String,
    layout: Layout,
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Handle {
    fn ask(&mut self, cmd: &str) -> Vec<f64> {
        writeln!(self.stdin, "{cmd}").expect("to child");
        self.stdin.flush().expect("flush");
        // Tagged report lines (`FILTERS …`) pass through; the reply is the
        // first line of numbers.
        loop {
            let mut line = String::new();
            let n = self.stdout.read_line(&mut line).expect("from child");
            assert!(n > 0, "{} exited", self.name);
            let nums: Result<Vec<f64>, _> = line.split_whitespace().map(str::parse).collect();
            match nums {
                Ok(v) if !v.is_empty() => return v,
                _ => print!("{line}"),
            }
        }
    }
}

fn spawn(arg: &str, piped: bool) -> Child {
    let exe = std::env::current_exe().expect("exe");
    let mut cmd = Command::new(exe);
    cmd.env(CHILD_ENV, arg).stderr(Stdio::inherit());
    if piped {
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
    }
    cmd.spawn().expect("spawn child")
}

fn start(spec: Spec) -> Handle {
    let arg = spec.to_arg();
    let status = spawn(&format!("{arg}:preload"), false)
        .wait()
        .expect("preload");
    assert!(status.success(), "preload of {arg} failed");
    let mut child = spawn(&arg, true);
    let stdin = child.stdin.take().expect("stdin");
    let stdout = BufReader::new(child.stdout.take().expect("stdout"));
    Handle {
        name: format!("{} {}", spec.layout.name(), label(spec.records)),
        layout: spec.layout,
        child,
        stdin,
        stdout,
    }
}

fn label(n: u64) -> String {
    match n {
        n if n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n % 1_000 == 0 => format!("{}k", n / 1_000),
        n => n.to_string(),
    }
}

/// A `PAIRED` line, unless a side was skipped (no samples).
fn report(name: &str, unit: &str, ours: &[f64], base: &[f64]) {
    if !ours.is_empty() && !base.is_empty() {
        common::report_paired(name, unit, ours, base);
    }
}

fn med(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    common::quantile(&mut v.to_vec(), 0.5)
}

/// The indexes of `partitioned` and `prefixed` in `layouts`, if both run.
fn pair(layouts: &[Layout]) -> Option<(usize, usize)> {
    let at = |l| layouts.iter().position(|&x| x == l);
    Some((at(Layout::Partitioned)?, at(Layout::Prefixed)?))
}

/// The layouts to run (`IDEMPOTENCY_BENCH_LAYOUTS`, comma-separated:
/// `partitioned`, `merged`, `prefixed`; all three by default). `single` is
/// always kept: it is every ratio's base.
fn layouts() -> Vec<Layout> {
    let mut v = vec![Layout::Single];
    match std::env::var("IDEMPOTENCY_BENCH_LAYOUTS") {
        Ok(list) => v.extend(
            list.split(',')
                .filter_map(Layout::parse)
                .filter(|&l| l != Layout::Single),
        ),
        Err(_) => v.extend([Layout::Partitioned, Layout::Merged, Layout::Prefixed]),
    }
    v
}

fn run() {
    let measuring = common::measuring();
    let large =
        env_usize("IDEMPOTENCY_BENCH_RECORDS").unwrap_or(if measuring { 1_000_000 } else { 2_000 })
            as u64;
    let small = if measuring { 10_000 } else { 1_000 };
    let partitions = env_usize("IDEMPOTENCY_BENCH_PARTITIONS").unwrap_or(24) as u64;
    let group = env_usize("IDEMPOTENCY_BENCH_MERGE")
        .unwrap_or(6)
        .clamp(1, partitions as usize - 1);
    let cache = env_usize("IDEMPOTENCY_BENCH_CACHE_MIB").unwrap_or(256) << 20;
    let r = common::rounds();
    let ms = r.slice.as_millis();
    let lookup_ms = (ms / 3).max(20);
    let dir = common::bench_dir();
    let layouts = layouts();
    println!(
        "PARTITIONS setup: {small} and {large} records, {partitions} partitions, sealed ones merged {group} per table, layouts {:?}, redb cache {} MiB, {} rounds of {ms} ms",
        layouts.iter().map(|l| l.name()).collect::<Vec<_>>(),
        cache >> 20,
        r.rounds
    );
    // Skipping the large single table saves its preload (12 min at 10M)
    // when only the partitioned layouts' settings change between runs.
    let skip_single = std::env::var("IDEMPOTENCY_BENCH_SKIP_SINGLE_LARGE").is_ok_and(|v| v == "1");
    // h[size][layout]: size 0 small, 1 large; layouts in `layouts` order.
    let sizes = [small, large];
    let mut h: Vec<Vec<Option<Handle>>> = Vec::new();
    for (z, &n) in sizes.iter().enumerate() {
        let row = layouts
            .iter()
            .map(|&l| {
                let skip = skip_single && z == 1 && l == Layout::Single;
                (!skip).then(|| {
                    start(Spec {
                        layout: l,
                        path: dir.path().join(format!("{}-{n}.redb", l.name())),
                        records: n,
                        partitions,
                        cache,
                        group,
                    })
                })
            })
            .collect();
        h.push(row);
    }
    let (sl, ll) = (label(small), label(large));
    let nl = layouts.len();
    // Lookups first (`IDEMPOTENCY_BENCH_LOOKUPS_FIRST=1`) read the stores as
    // preloaded; after the commit slices (the default, as before) the 10k
    // stores hold 300–450k records and every hot table has grown.
    let lookups_first = std::env::var("IDEMPOTENCY_BENCH_LOOKUPS_FIRST").is_ok_and(|v| v == "1");
    if lookups_first {
        lookups(&mut h, &layouts, sizes, r.rounds, lookup_ms);
    }
    for mode in ["immediate", "checkpoint"] {
        // Per [size][layout]: rates, write_bytes, wchar; cold reads, fresh
        // begins and combined-filter maybes summed over rounds.
        let mut rate = vec![vec![vec![]; nl]; 2];
        let mut bytes = vec![vec![vec![]; nl]; 2];
        let mut wchar = vec![vec![vec![]; nl]; 2];
        let mut cold = vec![[0.0f64; 3]; nl];
        let slice = if mode == "checkpoint" { ms * 2 } else { ms };
        for _ in 0..r.rounds {
            for z in 0..2 {
                for (i, s) in h[z].iter_mut().enumerate() {
                    let Some(s) = s else { continue };
                    let v = s.ask(&format!("commit {slice} {mode}"));
                    rate[z][i].push(v[0]);
                    bytes[z][i].push(v[1]);
                    wchar[z][i].push(v[2]);
                    if z == 1 {
                        cold[i][0] += v[3];
                        cold[i][1] += v[4];
                        cold[i][2] += v[5];
                    }
                }
            }
        }
        let what = format!("group commit ({mode}) req/s");
        for (i, l) in layouts.iter().enumerate() {
            let name = l.name();
            report(
                &format!("{what}: {name} {ll} vs {sl}"),
                "req/s",
                &rate[1][i],
                &rate[0][i],
            );
            if *l != Layout::Single {
                for (z, lab) in [(1, &ll), (0, &sl)] {
                    report(
                        &format!("{what}: {name} vs single, {lab}"),
                        "req/s",
                        &rate[z][i],
                        &rate[z][0],
                    );
                }
            }
        }
        // The prefixed layout against the partitioned one, when both run.
        if let Some((pi, xi)) = pair(&layouts) {
            for (z, lab) in [(1, &ll), (0, &sl)] {
                report(
                    &format!("{what}: prefixed vs partitioned, {lab}"),
                    "req/s",
                    &rate[z][xi],
                    &rate[z][pi],
                );
            }
            report(
                &format!(
                    "bytes written per request ({mode}, wchar): prefixed vs partitioned, {ll}"
                ),
                "B/req",
                &wchar[1][xi],
                &wchar[1][pi],
            );
        }
        for z in 0..2 {
            for (i, s) in h[z].iter().enumerate() {
                let Some(s) = s else { continue };
                println!(
                    "WRITES {mode} {}: {:.0} B/req handed to write (wchar), {:.0} B/req write_bytes, {:.0} req/s (medians of {} rounds)",
                    s.name,
                    med(&wchar[z][i]),
                    med(&bytes[z][i]),
                    med(&rate[z][i]),
                    r.rounds
                );
            }
        }
        for (i, l) in layouts.iter().enumerate().skip(1) {
            report(
                &format!(
                    "bytes written per request ({mode}, wchar): {} vs single, {ll}",
                    l.name()
                ),
                "B/req",
                &wchar[1][i],
                &wchar[1][0],
            );
            let [reads, fresh, maybes] = cold[i];
            println!(
                "COLD_READS {mode} {} {ll}: {reads} cold-table reads for {fresh} fresh begins ({:.3}%){}",
                l.name(),
                100.0 * reads / fresh.max(1.0),
                if *l == Layout::Merged {
                    format!(
                        "; one combined filter over all cold tables said maybe for {maybes} ({:.4}%)",
                        100.0 * maybes / fresh.max(1.0)
                    )
                } else {
                    String::new()
                }
            );
        }
    }
    if !lookups_first {
        lookups(&mut h, &layouts, sizes, r.rounds, lookup_ms);
    }
    for s in h.iter_mut().flatten().flatten() {
        let v = s.ask("stats");
        println!(
            "LAYOUT {}: file {:.0} MiB, {:.0} bytes per record ({} records, encoded value {COMPLETED_BYTES} B + 57 B key); record tables' pages {:.0} B per record, leaves {:.0}% full, tree height ≤ {}; of which cold tables (sealed, not written since the preload; single and prefixed: the whole table) {:.0} B per record, leaves {:.0}% full ({} records); peak RSS {:.0} MiB (VmHWM; redb cache {} MiB), filters {:.1} MiB",
            s.name,
            v[0] / (1 << 20) as f64,
            v[0] / v[1],
            v[1],
            v[5] * 4096.0 / v[1],
            100.0 * v[7] / (v[6] * 4096.0).max(1.0),
            v[12],
            v[9] * 4096.0 / v[8].max(1.0),
            100.0 * v[11] / (v[10] * 4096.0).max(1.0),
            v[8],
            v[3],
            cache >> 20,
            v[4] / (1 << 20) as f64
        );
    }
    // Three times, an interval each (`Expiry`).
    for mode in ["durable", "lazy", "stepped"] {
        for s in h.iter_mut().flatten().flatten() {
            let v = s.ask(&format!("expire {mode}"));
            let what = match s.layout {
                Layout::Merged => format!("the oldest merged table ({group} intervals)"),
                _ => "the oldest interval".to_string(),
            };
            let how = match (s.layout, mode) {
                (Layout::Single, _) => "per record through the expiry index",
                (Layout::Prefixed, _) => "its key range deleted in key order",
                (_, "stepped") => "its table emptied in key order, then dropped",
                _ => "one table dropped",
            };
            println!(
                "EXPIRE {mode} {}: {} records of {what}, {how}, in {:.3}s ({:.1} µs per record), {} write transactions, longest {:.1} ms; next group commit {:.1} ms",
                s.name,
                v[0],
                v[1],
                v[1] * 1e6 / v[0].max(1.0),
                v[3],
                v[4] * 1e3,
                v[2] * 1e3
            );
        }
    }
    for mut s in h.into_iter().flatten().flatten() {
        drop(s.stdin);
        s.child.wait().expect("child exit");
    }
}

/// The lookup slices: every layout with tables opened per lookup (`each`,
/// the prototype's way) and kept open for the slice (`cached`), all against
/// the single table's per-lookup read (the raw redb lookup).
fn lookups(
    h: &mut [Vec<Option<Handle>>],
    layouts: &[Layout],
    sizes: [u64; 2],
    rounds: usize,
    lookup_ms: u128,
) {
    let nl = layouts.len();
    for mode in ["uniform", "recent"] {
        for z in 0..2 {
            // The base: the single table, or (large single skipped) the
            // first layout present.
            let Some(b) = h[z].iter().position(Option::is_some) else {
                continue;
            };
            let base = layouts[b].name();
            let mut got = vec![[vec![], vec![]]; nl];
            let mut reads = vec![[vec![], vec![]]; nl];
            for _ in 0..rounds {
                for (i, s) in h[z].iter_mut().enumerate() {
                    let Some(s) = s else { continue };
                    for (c, open) in ["each", "cached"].iter().enumerate() {
                        let v = s.ask(&format!("lookup {lookup_ms} {mode} {open}"));
                        got[i][c].push(v[0]);
                        reads[i][c].push(v[1]);
                    }
                }
            }
            let size = label(sizes[z]);
            if let Some((pi, xi)) = pair(layouts) {
                for (c, open) in ["each", "cached"].iter().enumerate() {
                    report(
                        &format!(
                            "point lookup ({mode} keys): prefixed vs partitioned {size}, both with tables opened {open}"
                        ),
                        "lookups/s",
                        &got[xi][c],
                        &got[pi][c],
                    );
                }
            }
            for (i, l) in layouts.iter().enumerate() {
                for (c, open) in ["each", "cached"].iter().enumerate() {
                    if i == b && c == 0 {
                        continue;
                    }
                    report(
                        &format!(
                            "point lookup ({mode} keys): {} {size} (tables opened {open}) vs {base} {size} (opened each)",
                            l.name()
                        ),
                        "lookups/s",
                        &got[i][c],
                        &got[b][0],
                    );
                }
                if i != b {
                    report(
                        &format!(
                            "point lookup ({mode} keys): {} {size} vs {base} {size}, both with tables opened cached",
                            l.name()
                        ),
                        "lookups/s",
                        &got[i][1],
                        &got[b][1],
                    );
                }
                if *l != Layout::Single {
                    println!(
                        "LOOKUP_READS {mode} {} {size}: {:.3} tables read per lookup",
                        l.name(),
                        med(&reads[i][0])
                    );
                }
            }
        }
    }
}

fn criterion_part(c: &mut Criterion) {
    // The measurements are interleaved across child processes (`run`), not
    // criterion samples; these are the micro-measures beside them.
    let mut g = c.benchmark_group("partitions: bloom filter probe");
    let mut f = Bloom::with_capacity(1000);
    for i in 0..1000 {
        f.insert(key_hash(&key_of(i)));
    }
    let h = key_hash(&key_of(5_000));
    g.bench_function("maybe (absent key)", |b| b.iter(|| f.maybe(h)));
    g.finish();
    // The filter hash of one 57-byte record key: the engine's choice
    // (src/store/redb/partition/filter.rs: rapidhash v3 with secrets
    // derived from the file's seed; BLAKE3 keyed before) against another
    // seeded non-cryptographic hash already in the lock file, and std's
    // SipHash (this prototype's).
    let mut g = c.benchmark_group("partitions: filter hash of a 57-byte key");
    let k = key_of(1);
    let seed = 0x0123_4567_89ab_cdef_u64;
    let probe_key = blake3::derive_key("idempotency bench filter probe key", &seed.to_le_bytes());
    g.bench_function("blake3 keyed (the engine's first)", |b| {
        b.iter(|| blake3::keyed_hash(&probe_key, black_box(&k)))
    });
    g.bench_function("xxh3 64 seeded", |b| {
        b.iter(|| xxhash_rust::xxh3::xxh3_64_with_seed(black_box(&k), seed))
    });
    g.bench_function("xxh3 128 seeded", |b| {
        b.iter(|| xxhash_rust::xxh3::xxh3_128_with_seed(black_box(&k), seed))
    });
    let secrets = rapidhash::v3::RapidSecrets::seed(seed);
    g.bench_function("rapidhash v3 seeded (the engine's)", |b| {
        b.iter(|| rapidhash::v3::rapidhash_v3_seeded(black_box(&k), &secrets))
    });
    g.bench_function("std SipHash-1-3 (the prototype's)", |b| {
        b.iter(|| key_hash(black_box(&k)))
    });
    g.finish();
}

fn main() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        child(&spec);
        return;
    }
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(100))
        .measurement_time(Duration::from_millis(500))
        .without_plots()
        .configure_from_args();
    criterion_part(&mut c);
    if common::paired_selected() {
        run();
    }
    c.final_summary();
}
