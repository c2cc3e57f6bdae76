//! A format-3 store filled from empty through the engine, as a day of
//! traffic fills it (issue 26: "bytes on disk per stored record" and
//! "bytes the block device writes per request", with the hourly merge
//! and expiry paid for, not left out).
//!
//! No preload: 64 client threads send `begin` + `complete` (durable,
//! 300-byte responses, random UUID keys) to one engine whose clock is the
//! request count: request `i` is made at `T0 + i × 24 h / N`, so `N`
//! requests (`IDEMPOTENCY_BENCH_RECORDS`, 1,000,000 by default) are a day
//! and the store holds about `N` records once the first ones expire. The
//! engine's own sweeper runs every 50 ms of real time with the default
//! TTL (24 h): it seals the partitions every ten simulated minutes, merges
//! each closed hour 75 minutes after it ends, and deletes what expired,
//! as it would in production, only faster.
//!
//! The run lasts `IDEMPOTENCY_BENCH_HOURS` simulated hours (30): the first
//! 24 fill the store, the rest are the steady state (a day's records
//! stored, each new hour's claims merged as an old hour expires). Lines:
//! - `FILL`: every six simulated hours, the real time, req/s and the
//!   file's length;
//! - `STEADY`: over the hours after the first day: req/s, and the bytes
//!   written per request by the block device (its sector counter, with
//!   `sync` at both ends; `n/a` on a tmpfs or overlay) and by the process
//!   (`write_bytes`): traffic, checkpoints, merges and expiry together;
//! - `SPACE`: once the sweeper has nothing left and the engine is closed:
//!   the file's bytes per stored record and the bytes of pages in use per
//!   record, each as a ratio to the records table's keys and values per
//!   record (the encoded record, measured in the same run: the target is
//!   ≤ 1.5×), and the records table's leaf fill;
//! - `DISK`: the same for every file of the store (the redb file, its
//!   journal, the recovery reserve), by length and by the blocks the file
//!   system allocated (`du`);
//! - `COMPACT`: the same after `EngineBuilder::compact` (`idem compact`)
//!   of the closed file, and how long it took (its recovery reserve is
//!   given back while it runs: the next open takes it again);
//! - `WRITES`: the bytes each engine thread handed to write calls per
//!   request over the steady state.
//!
//! Run: `cargo bench -p idempotency-bench --bench steady`. Test mode
//! (`cargo test --benches`): 3,000 requests a day, 27 hours, 8 threads,
//! and the closed store checked with `Engine::verify`.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency::bench_fixtures;
use idempotency::{Clock, Engine};

const T0: u64 = 1_800_000_000_000;
const DAY_MS: u64 = 24 * 3_600_000;

/// The engine's clock: `T0` plus request count × the day's share of one
/// request.
#[derive(Clone, Debug)]
struct Ticks {
    made: Arc<AtomicU64>,
    per_day: u64,
}

impl Clock for Ticks {
    fn now_ms(&self) -> u64 {
        T0 + self.made.load(Ordering::Relaxed) * DAY_MS / self.per_day
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn file_bytes(path: &std::path::Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// Every file of the store (the redb file, its journal, anything beside
/// them in the store's directory): their lengths, and the bytes the file
/// system has allocated to them (`st_blocks` × 512, what `du` counts: a
/// range a file was extended over but never written takes none).
fn store_bytes(dir: &std::path::Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let mut sum = (0, 0);
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if let Ok(m) = entry.metadata() {
            if m.is_file() {
                sum.0 += m.len();
                sum.1 += m.blocks() * 512;
            }
        }
    }
    sum
}

fn mib(bytes: f64) -> f64 {
    bytes / (1024.0 * 1024.0)
}

/// Sends requests until the clock reads hour `until_hour`, on `threads`
/// client threads; returns how many were sent.
fn send(engine: &Engine, ticks: &Ticks, threads: usize, until_hour: u64) -> u64 {
    let last = until_hour * ticks.per_day / 24;
    let sent = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                // The request takes its instant: the clock moves on before
                // it is made, so every request of an hour is in that hour.
                let i = ticks.made.fetch_add(1, Ordering::Relaxed);
                if i >= last {
                    ticks.made.fetch_sub(1, Ordering::Relaxed);
                    return;
                }
                common::engine_request(engine, &common::random_key());
                sent.fetch_add(1, Ordering::Relaxed);
            });
        }
    });
    sent.into_inner()
}

/// Bytes written so far by this process (`write_bytes` less
/// `cancelled_write_bytes` of `/proc/self/io`).
fn process_written() -> i64 {
    let text = std::fs::read_to_string("/proc/self/io").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.trim().parse().ok())
            .unwrap_or(0i64)
    };
    field("write_bytes") - field("cancelled_write_bytes")
}

fn main() {
    let measuring = common::measuring();
    let per_day = if measuring {
        env_u64("IDEMPOTENCY_BENCH_RECORDS").unwrap_or(1_000_000)
    } else {
        3_000
    };
    let hours = if measuring {
        env_u64("IDEMPOTENCY_BENCH_HOURS").unwrap_or(30).max(25)
    } else {
        27
    };
    let threads = if measuring { 64 } else { 8 };
    let dir = common::bench_dir();
    let path = dir.path().join("steady.redb");
    let ticks = Ticks {
        made: Arc::new(AtomicU64::new(0)),
        per_day,
    };
    let engine = Engine::builder()
        .clock(ticks.clone())
        .ttl(Duration::from_secs(24 * 3600))
        .lease(Duration::from_secs(30))
        .sweep_interval(Some(Duration::from_millis(50)))
        .open(&path)
        .expect("create the store");
    let device = common::device::Device::of(dir.path());
    let started = Instant::now();
    let mut total = 0u64;
    let fill = |until: u64, total: &mut u64| {
        let slice = Instant::now();
        let sent = send(&engine, &ticks, threads, until);
        *total += sent;
        let (length, allocated) = store_bytes(dir.path());
        println!(
            "FILL hour {until}: {total} requests in {:.1}s ({:.0} req/s this slice); file {:.0} MiB; store's files {:.0} MiB long, {:.0} MiB allocated",
            started.elapsed().as_secs_f64(),
            sent as f64 / slice.elapsed().as_secs_f64().max(1e-9),
            mib(file_bytes(&path) as f64),
            mib(length as f64),
            mib(allocated as f64)
        );
    };
    for hour in [6, 12, 18, 24] {
        fill(hour, &mut total);
    }
    // The steady state: a day's records stored from here on.
    let since = Instant::now();
    let before_total = total;
    let before_device = device.as_ref().and_then(|d| d.written_after_sync());
    let before_process = process_written();
    // Bytes handed to write calls, by the engine thread that made them:
    // the writer (journal frames, and redb pages it writes), the syncer
    // (checkpoints), the sweeper.
    let by_thread = |prefix: &str| common::DiskWrites::read(prefix).ok();
    const THREADS: [&str; 3] = ["idempotency-wri", "idempotency-syn", "idempotency-swe"];
    let before_threads: Vec<_> = THREADS.iter().map(|t| by_thread(t)).collect();
    let mut hour = 24;
    while hour < hours {
        hour = (hour + 6).min(hours);
        fill(hour, &mut total);
    }
    let steady = total - before_total;
    let seconds = since.elapsed().as_secs_f64();
    // What the sweeper still owes (an hour's merge, expiry) is part of
    // the steady state's writes: done before the counters are read.
    engine.sweep_now().expect("sweep");
    engine.flush().expect("flush");
    let device_bytes = match (
        before_device,
        device.as_ref().and_then(|d| d.written_after_sync()),
    ) {
        (Some(a), Some(b)) => format!("{:.0} B", b.saturating_sub(a) as f64 / steady as f64),
        _ => "n/a (no block device counter)".to_string(),
    };
    let process_bytes = (process_written() - before_process) as f64 / steady as f64;
    let mut split = Vec::new();
    for (name, before) in THREADS.iter().zip(&before_threads) {
        if let (Some(before), Some(now)) = (before, by_thread(name)) {
            let grown = now.since(before);
            split.push(format!(
                "{name} {:.0} B",
                grown.named_syscall as f64 / steady as f64
            ));
            if *name == THREADS[0] {
                split.push(format!(
                    "process {:.0} B",
                    grown.process_syscall as f64 / steady as f64
                ));
            }
        }
    }
    println!(
        "WRITES per request over the steady state, bytes handed to write calls (wchar), by thread: {}",
        split.join(", ")
    );
    println!(
        "STEADY {per_day} requests a day, hours 24..{hours}: {steady} requests in {seconds:.1}s, {:.0} req/s at {threads} threads; written per request: device {device_bytes}, process write_bytes {process_bytes:.0} B (traffic, checkpoints, merges and expiry)",
        steady as f64 / seconds.max(1e-9)
    );
    drop(engine);
    let space = bench_fixtures::space(&path).expect("space");
    let t = space.records;
    let n = t.records.max(1) as f64;
    let encoded = t.stored_bytes as f64 / n;
    let file = file_bytes(&path) as f64 / n;
    let pages = space.allocated_bytes as f64 / n;
    println!(
        "SPACE after {hours} hours: {} records stored; file {:.0} MiB, {file:.0} B per record = {:.2}x the encoded record ({encoded:.0} B of key and value); pages in use {pages:.0} B per record = {:.2}x; records table leaves {:.0}% full; free pages {:.0} MiB",
        t.records,
        mib(file_bytes(&path) as f64),
        file / encoded,
        pages / encoded,
        100.0 * t.stored_bytes as f64 / (t.leaf_pages * t.page_bytes).max(1) as f64,
        mib(file_bytes(&path).saturating_sub(space.allocated_bytes) as f64),
    );
    // `bytes` as MiB, bytes per record and the ratio to the encoded record.
    let per_record = |bytes: u64| {
        let b = bytes as f64;
        format!(
            "{:.0} MiB, {:.0} B per record = {:.2}x",
            mib(b),
            b / n,
            b / n / encoded
        )
    };
    // On disk: every file of the store (the journal too), as `du` counts.
    let (length, allocated) = store_bytes(dir.path());
    println!(
        "DISK after {hours} hours: the store's files (redb file, journal, reserve) {} long; allocated on disk {} the encoded record",
        per_record(length),
        per_record(allocated),
    );
    // What an operator's `idem compact` gives back of the closed file.
    let compacting = Instant::now();
    let compaction = Engine::builder()
        .sweep_interval(None)
        .compact(&path)
        .expect("compact");
    let (length, allocated) = store_bytes(dir.path());
    println!(
        "COMPACT after {hours} hours, in {:.1}s: file {:.0} MiB -> {}; the store's files {} long; allocated {} the encoded record",
        compacting.elapsed().as_secs_f64(),
        mib(compaction.bytes_before as f64),
        per_record(compaction.bytes_after),
        per_record(length),
        per_record(allocated),
    );
    if !measuring {
        let engine = Engine::builder()
            .sweep_interval(None)
            .open_existing(&path)
            .expect("reopen");
        let report = engine.verify().expect("verify");
        assert!(report.is_sound(), "{:?}", report.damage);
        assert!(t.records > 0);
    }
}
