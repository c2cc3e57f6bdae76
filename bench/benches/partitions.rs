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
//!   and "recent" keys from the two newest tables, against the single
//!   table's lookup of the same keys (the raw redb lookup);
//! - file bytes per record and peak RSS;
//! - expiring one interval's records: dropping the oldest table against a
//!   per-record delete through the expiry index (transactions of 512).
//!
//! `IDEMPOTENCY_BENCH_RECORDS` sets the large size (default 1M; test mode
//! 2,000); `IDEMPOTENCY_BENCH_ROUNDS` the rounds (default 5, test mode 1);
//! `IDEMPOTENCY_BENCH_PRELOAD_CACHE_MIB` the preload process's redb cache
//! (default 2048: the preload is a fixture, its memory is not measured);
//! `IDEMPOTENCY_BENCH_SKIP_SINGLE_LARGE=1` leaves out the large single
//! table (its 10M preload takes 12 minutes here) when only the partitioned
//! layout's settings change between runs.

mod common;

use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use criterion::Criterion;
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

fn key_hash(k: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    h.write(k);
    h.finish()
}

/// A blocked Bloom filter: one 512-bit block per key, 8 bits set in it.
/// It answers "absent" or "maybe", never "present".
struct Bloom {
    blocks: Vec<[u64; 8]>,
}

const BLOOM_BITS_PER_KEY: usize = 24;
const BLOOM_PROBES: u64 = 11;

impl Bloom {
    fn with_capacity(keys: usize) -> Bloom {
        Bloom {
            blocks: vec![[0; 8]; (keys * BLOOM_BITS_PER_KEY).div_ceil(512).max(1)],
        }
    }

    fn probes(&self, h: u64) -> (usize, impl Iterator<Item = usize>) {
        let block = ((u128::from(h) * self.blocks.len() as u128) >> 64) as usize;
        let bits = (0..BLOOM_PROBES).map(move |j| (mix(h ^ j) & 511) as usize);
        (block, bits)
    }

    fn insert(&mut self, h: u64) {
        let (b, bits) = self.probes(h);
        for bit in bits {
            self.blocks[b][bit / 64] |= 1 << (bit % 64);
        }
    }

    fn maybe(&self, h: u64) -> bool {
        let (b, mut bits) = self.probes(h);
        let block = &self.blocks[b];
        bits.all(|bit| block[bit / 64] & (1 << (bit % 64)) != 0)
    }

    fn bytes(&self) -> usize {
        self.blocks.len() * 64
    }
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Layout {
    Single,
    Partitioned,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Layout::Single => "single",
            Layout::Partitioned => "partitioned",
        }
    }

    fn parse(s: &str) -> Layout {
        if s == "single" {
            Layout::Single
        } else {
            Layout::Partitioned
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

/// Builds the file: records `0..records` in creation order, in one write
/// transaction per table (per partition, or one for the single table).
fn preload(layout: Layout, path: &Path, records: u64, partitions: u64) {
    let start = Instant::now();
    let mut builder = Database::builder();
    let mib = env_usize("IDEMPOTENCY_BENCH_PRELOAD_CACHE_MIB").unwrap_or(2048);
    builder.set_cache_size(mib << 20);
    let db = builder.create(path).expect("create");
    let done = vec![1u8; COMPLETED_BYTES];
    let mut first = 0;
    for (p, &n) in plan(records, partitions).iter().enumerate() {
        let txn = db.begin_write().expect("txn");
        {
            txn.open_table(LEASES).expect("t");
            let expires = NOW + p as u64 * (TTL_MS / partitions) + TTL_MS;
            match layout {
                Layout::Single => {
                    let mut rec = txn.open_table(RECORDS).expect("t");
                    let mut exp = txn.open_table(EXPIRY).expect("t");
                    for i in first..first + n {
                        let k = key_of(i);
                        rec.insert(k.as_slice(), done.as_slice()).expect("i");
                        exp.insert((expires, k.as_slice()), ()).expect("i");
                    }
                }
                Layout::Partitioned => {
                    let name = part_name(p as u64);
                    let mut rec = txn.open_table(def(&name)).expect("t");
                    for i in first..first + n {
                        rec.insert(key_of(i).as_slice(), done.as_slice())
                            .expect("i");
                    }
                }
            }
        }
        txn.commit().expect("commit");
        first += n;
    }
    eprintln!(
        "preloaded {records} records ({}) in {:.1}s",
        layout.name(),
        start.elapsed().as_secs_f64()
    );
}

/// One store, served in a child process.
struct Store {
    layout: Layout,
    db: Database,
    path: PathBuf,
    /// Record counts per partition, oldest first (one entry for `single`).
    plan: Vec<u64>,
    /// Index of the first record of each partition.
    firsts: Vec<u64>,
    /// Partition table names, oldest first (`partitioned`); the last is hot.
    parts: Vec<String>,
    /// Filters of the cold partitions, same order as `parts` minus the hot.
    filters: Vec<Bloom>,
    hot_filter: Bloom,
    preloaded: u64,
    next: u64,
    pending: Vec<Vec<u8>>,
    cold_reads: u64,
    fresh_begins: u64,
}

impl Store {
    fn open(layout: Layout, path: &Path, records: u64, partitions: u64, cache: usize) -> Store {
        let mut builder = Database::builder();
        builder.set_cache_size(cache);
        let db = builder.open(path).expect("open");
        let plan = plan(records, partitions);
        let mut firsts = Vec::new();
        let mut acc = 0;
        for n in &plan {
            firsts.push(acc);
            acc += n;
        }
        let mut s = Store {
            layout,
            db,
            path: path.to_path_buf(),
            parts: (0..partitions).map(part_name).collect(),
            filters: Vec::new(),
            hot_filter: Bloom::with_capacity((records / partitions) as usize * 2),
            preloaded: records,
            next: records,
            pending: Vec::new(),
            cold_reads: 0,
            fresh_begins: 0,
            plan,
            firsts,
        };
        if layout == Layout::Partitioned {
            let start = Instant::now();
            let txn = s.db.begin_read().expect("txn");
            let (cold, hot) = s.parts.split_at(s.parts.len() - 1);
            for (name, &n) in cold.iter().zip(&s.plan) {
                let t = txn.open_table(def(name)).expect("t");
                let mut f = Bloom::with_capacity(n as usize);
                for e in t.iter().expect("iter") {
                    let (k, _) = e.expect("entry");
                    f.insert(key_hash(k.value()));
                }
                s.filters.push(f);
            }
            let t = txn.open_table(def(&hot[0])).expect("t");
            for e in t.iter().expect("iter") {
                let (k, _) = e.expect("entry");
                s.hot_filter.insert(key_hash(k.value()));
            }
            let bytes: usize = s.filters.iter().map(Bloom::bytes).sum();
            println!(
                "FILTERS rebuilt at open: {} cold partitions, {records} records, {:.2}s, {:.1} MiB",
                s.filters.len(),
                start.elapsed().as_secs_f64(),
                bytes as f64 / (1 << 20) as f64
            );
        }
        s
    }

    fn hot_name(&self) -> &str {
        &self.parts[self.parts.len() - 1]
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
            match self.layout {
                Layout::Single => {
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
                }
                Layout::Partitioned => {
                    let hot = self.hot_name().to_string();
                    let mut rec = txn.open_table(def(&hot)).expect("t");
                    for k in &begins {
                        assert!(rec.get(k.as_slice()).expect("get").is_none());
                        let h = key_hash(k);
                        self.fresh_begins += 1;
                        let cold = &self.parts[..self.parts.len() - 1];
                        for (name, f) in cold.iter().zip(&self.filters).rev() {
                            if f.maybe(h) {
                                self.cold_reads += 1;
                                let t = txn.open_table(def(name)).expect("t");
                                assert!(t.get(k.as_slice()).expect("get").is_none());
                            }
                        }
                        self.hot_filter.insert(h);
                        leases.insert((NOW + 30_000, k.as_slice()), ()).expect("i");
                        rec.insert(k.as_slice(), proc_v.as_slice()).expect("i");
                    }
                    for k in &self.pending {
                        assert!(rec.get(k.as_slice()).expect("get").is_some());
                        leases.remove((NOW + 30_000, k.as_slice())).expect("r");
                        rec.insert(k.as_slice(), done_v.as_slice()).expect("i");
                    }
                }
            }
        }
        txn.commit().expect("commit");
        self.pending = begins;
    }

    /// A replay's read: the stored value of `k`, which must exist.
    fn lookup(&self, k: &[u8]) -> Vec<u8> {
        let txn = self.db.begin_read().expect("txn");
        if self.layout == Layout::Single {
            let t = txn.open_table(RECORDS).expect("t");
            let v = t.get(k).expect("get").expect("present");
            return v.value().to_vec();
        }
        // The hot table's filter is kept as keys land in it, so a replay of
        // an older key skips the hot table too.
        let h = key_hash(k);
        if self.hot_filter.maybe(h) {
            let hot = txn.open_table(def(self.hot_name())).expect("t");
            if let Some(v) = hot.get(k).expect("get") {
                return v.value().to_vec();
            }
        }
        let cold = &self.parts[..self.parts.len() - 1];
        for (name, f) in cold.iter().zip(&self.filters).rev() {
            if f.maybe(h) {
                let t = txn.open_table(def(name)).expect("t");
                if let Some(v) = t.get(k).expect("get") {
                    return v.value().to_vec();
                }
            }
        }
        panic!("a stored key was not found");
    }

    /// A stored preloaded record's index: uniform over all, or from the two
    /// newest partitions (`recent`).
    fn pick(&self, picker: &mut common::Picker, recent: bool) -> u64 {
        if recent {
            let n = self.plan.len();
            let from = self.firsts[n.saturating_sub(2)];
            from + picker.next((self.preloaded - from) as usize) as u64
        } else {
            picker.next(self.preloaded as usize) as u64
        }
    }

    /// Expires the oldest interval; returns (records, seconds, seconds of the
    /// first group commit after it).
    fn expire(&mut self) -> (u64, f64, f64) {
        let start = Instant::now();
        let n = self.plan[0];
        match self.layout {
            Layout::Partitioned => {
                let mut txn = self.db.begin_write().expect("txn");
                txn.set_durability(Durability::Immediate).expect("d");
                assert!(txn.delete_table(def(&self.parts[0])).expect("delete"));
                txn.commit().expect("commit");
                self.parts.remove(0);
                self.filters.remove(0);
            }
            Layout::Single => {
                let cutoff = NOW + TTL_MS;
                let mut left = n;
                while left > 0 {
                    let mut txn = self.db.begin_write().expect("txn");
                    txn.set_durability(Durability::Immediate).expect("d");
                    {
                        let mut exp = txn.open_table(EXPIRY).expect("t");
                        let mut rec = txn.open_table(RECORDS).expect("t");
                        let keys: Vec<(u64, Vec<u8>)> = exp
                            .range(..=(cutoff, &[0xffu8; 64][..]))
                            .expect("range")
                            .take(SWEEP_TXN)
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
                }
            }
        }
        let took = start.elapsed().as_secs_f64();
        let t = Instant::now();
        self.group_commit(Durability::Immediate);
        (n, took, t.elapsed().as_secs_f64())
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

/// The child: build or open one store, then answer the parent's commands,
/// one line each, on stdin/stdout.
fn child(spec: &str) {
    let f: Vec<&str> = spec.split(':').collect();
    let (layout, path) = (Layout::parse(f[0]), PathBuf::from(f[1]));
    let records: u64 = f[2].parse().expect("records");
    let partitions: u64 = f[3].parse().expect("partitions");
    let cache: usize = f[4].parse().expect("cache");
    if f.get(5) == Some(&"preload") {
        preload(layout, &path, records, partitions);
        return;
    }
    let mut s = Store::open(layout, &path, records, partitions, cache);
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
                let (r0, f0) = (s.cold_reads, s.fresh_begins);
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
                    "{} {} {} {} {}",
                    reqs / secs,
                    (b1 - b0) as f64 / reqs,
                    (c1 - c0) as f64 / reqs,
                    s.cold_reads - r0,
                    s.fresh_begins - f0
                )
            }
            ["lookup", ms, mode] => {
                let slice = Duration::from_millis(ms.parse().expect("ms"));
                let recent = *mode == "recent";
                let start = Instant::now();
                let mut n = 0u64;
                let mut bytes = 0usize;
                while start.elapsed() < slice {
                    for _ in 0..64 {
                        bytes += s.lookup(&key_of(s.pick(&mut picker, recent))).len();
                        n += 1;
                    }
                }
                assert!(bytes >= n as usize * COMPLETED_BYTES);
                format!("{}", n as f64 / start.elapsed().as_secs_f64())
            }
            ["stats"] => {
                let size = std::fs::metadata(&s.path).map_or(0, |m| m.len());
                let stored = s.next + s.pending.len() as u64;
                let mut rec = 0u64;
                let txn = s.db.begin_read().expect("txn");
                if s.layout == Layout::Single {
                    rec = txn.open_table(RECORDS).expect("t").len().expect("len");
                } else {
                    for p in &s.parts {
                        rec += txn.open_table(def(p)).expect("t").len().expect("len");
                    }
                }
                let filters: usize = s.filters.iter().map(Bloom::bytes).sum();
                format!("{size} {rec} {stored} {} {filters}", vm_hwm_mib())
            }
            ["expire"] => {
                let (n, took, after) = s.expire();
                format!("{n} {took} {after}")
            }
            _ => break,
        };
        writeln!(out, "{reply}").expect("stdout");
        out.flush().expect("flush");
    }
}

struct Handle {
    name: String,
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

fn spawn(spec: &str, piped: bool) -> Child {
    let exe = std::env::current_exe().expect("exe");
    let mut cmd = Command::new(exe);
    cmd.env(CHILD_ENV, spec).stderr(Stdio::inherit());
    if piped {
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
    }
    cmd.spawn().expect("spawn child")
}

fn start(layout: Layout, dir: &Path, records: u64, partitions: u64, cache: usize) -> Handle {
    let path = dir.join(format!("{}-{records}.redb", layout.name()));
    let spec = format!(
        "{}:{}:{records}:{partitions}:{cache}",
        layout.name(),
        path.display()
    );
    let status = spawn(&format!("{spec}:preload"), false)
        .wait()
        .expect("preload");
    assert!(status.success(), "preload of {spec} failed");
    let mut child = spawn(&spec, true);
    let stdin = child.stdin.take().expect("stdin");
    let stdout = BufReader::new(child.stdout.take().expect("stdout"));
    Handle {
        name: format!("{} {}", layout.name(), label(records)),
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

fn run() {
    let measuring = common::measuring();
    let large =
        env_usize("IDEMPOTENCY_BENCH_RECORDS").unwrap_or(if measuring { 1_000_000 } else { 2_000 })
            as u64;
    let small = if measuring { 10_000 } else { 1_000 };
    let partitions = env_usize("IDEMPOTENCY_BENCH_PARTITIONS").unwrap_or(24) as u64;
    let cache = env_usize("IDEMPOTENCY_BENCH_CACHE_MIB").unwrap_or(256) << 20;
    let r = common::rounds();
    let ms = r.slice.as_millis();
    let lookup_ms = (ms / 3).max(20);
    let dir = common::bench_dir();
    println!(
        "PARTITIONS setup: {small} and {large} records, {partitions} partitions, redb cache {} MiB, {} rounds of {ms} ms",
        cache >> 20,
        r.rounds
    );
    // Skipping the large single table saves its preload (12 min at 10M)
    // when only the partitioned layout's settings change between runs.
    let skip_single = std::env::var("IDEMPOTENCY_BENCH_SKIP_SINGLE_LARGE").is_ok_and(|v| v == "1");
    let mut h: Vec<Option<Handle>> = Vec::new();
    for n in [small, large] {
        for l in [Layout::Single, Layout::Partitioned] {
            let skip = skip_single && n == large && l == Layout::Single;
            h.push((!skip).then(|| start(l, dir.path(), n, partitions, cache)));
        }
    }
    // h: 0 single small, 1 partitioned small, 2 single large, 3 partitioned large.
    for mode in ["immediate", "checkpoint"] {
        let mut rate = vec![vec![]; 4];
        let mut bytes = vec![vec![]; 4];
        let mut wchar = vec![vec![]; 4];
        let (mut cold, mut fresh) = (0.0, 0.0);
        let slice = if mode == "checkpoint" { ms * 2 } else { ms };
        for _ in 0..r.rounds {
            for (i, s) in h.iter_mut().enumerate() {
                let Some(s) = s else { continue };
                let v = s.ask(&format!("commit {slice} {mode}"));
                rate[i].push(v[0]);
                bytes[i].push(v[1]);
                wchar[i].push(v[2]);
                if i == 3 {
                    cold += v[3];
                    fresh += v[4];
                }
            }
        }
        let what = format!("group commit ({mode}) req/s");
        let (sl, ll) = (label(small), label(large));
        report(
            &format!("{what}: single {ll} vs {sl}"),
            "req/s",
            &rate[2],
            &rate[0],
        );
        report(
            &format!("{what}: partitioned {ll} vs {sl}"),
            "req/s",
            &rate[3],
            &rate[1],
        );
        report(
            &format!("{what}: partitioned vs single, {ll}"),
            "req/s",
            &rate[3],
            &rate[2],
        );
        report(
            &format!("{what}: partitioned vs single, {sl}"),
            "req/s",
            &rate[1],
            &rate[0],
        );
        for (i, s) in h.iter().enumerate() {
            let Some(s) = s else { continue };
            let med = |v: &[f64]| common::quantile(&mut v.to_vec(), 0.5);
            println!(
                "WRITES {mode} {}: {:.0} B/req handed to write (wchar), {:.0} B/req write_bytes, {:.0} req/s (medians of {} rounds)",
                s.name,
                med(&wchar[i]),
                med(&bytes[i]),
                med(&rate[i]),
                r.rounds
            );
        }
        report(
            &format!("bytes written per request ({mode}, wchar): partitioned vs single, {ll}"),
            "B/req",
            &wchar[3],
            &wchar[2],
        );
        println!(
            "COLD_READS {mode} partitioned {ll}: {cold} cold-table reads for {fresh} fresh begins ({:.3}%)",
            100.0 * cold / fresh.max(1.0)
        );
    }
    for mode in ["uniform", "recent"] {
        for (base, ours) in [(0usize, 1usize), (2, 3)] {
            let (mut a, mut b) = (vec![], vec![]);
            let (Some(hb), Some(ho)) = (&h[base], &h[ours]) else {
                continue;
            };
            let names = (ho.name.clone(), hb.name.clone());
            for _ in 0..r.rounds {
                let cmd = format!("lookup {lookup_ms} {mode}");
                a.push(h[base].as_mut().map_or(0.0, |s| s.ask(&cmd)[0]));
                b.push(h[ours].as_mut().map_or(0.0, |s| s.ask(&cmd)[0]));
            }
            report(
                &format!("point lookup ({mode} keys): {} vs {}", names.0, names.1),
                "lookups/s",
                &b,
                &a,
            );
        }
    }
    for s in h.iter_mut().flatten() {
        let v = s.ask("stats");
        println!(
            "LAYOUT {}: file {:.0} MiB, {:.0} bytes per record ({} records, encoded value {COMPLETED_BYTES} B + 57 B key), peak RSS {:.0} MiB (VmHWM; redb cache {} MiB), filters {:.1} MiB",
            s.name,
            v[0] / (1 << 20) as f64,
            v[0] / v[1],
            v[1],
            v[3],
            cache >> 20,
            v[4] / (1 << 20) as f64
        );
    }
    for s in h.iter_mut().flatten() {
        let v = s.ask("expire");
        println!(
            "EXPIRE {}: {} records of the oldest interval in {:.3}s ({:.1} µs per record), next group commit {:.1} ms",
            s.name,
            v[0],
            v[1],
            v[1] * 1e6 / v[0].max(1.0),
            v[2] * 1e3
        );
    }
    for mut s in h.into_iter().flatten() {
        drop(s.stdin);
        s.child.wait().expect("child exit");
    }
}

fn criterion_part(c: &mut Criterion) {
    // The measurements are interleaved across child processes (`run`), not
    // criterion samples; this keeps one tiny criterion bench so test mode
    // and filters behave as in the other bench files.
    let mut g = c.benchmark_group("partitions: bloom filter probe");
    let mut f = Bloom::with_capacity(1000);
    for i in 0..1000 {
        f.insert(key_hash(&key_of(i)));
    }
    let h = key_hash(&key_of(5_000));
    g.bench_function("maybe (absent key)", |b| b.iter(|| f.maybe(h)));
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
