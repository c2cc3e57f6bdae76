//! Scale and sweep, per record format: durable begin+complete throughput (64 client threads,
//! 300-byte responses, random UUID keys) with 10k vs 1M records already
//! stored; peak RSS at 1M records; and `begin` latency while the sweeper
//! deletes the 1M records once expired, vs idle.
//!
//! Records are preloaded through the engine itself (512 client threads, so
//! claims are group-committed), in 10 chunks whose expiry instants are a
//! minute apart (a `ManualClock` moves between chunks). The sweep is then
//! measured in 10 rounds: expire one chunk (~100k records), measure `begin`
//! p99 from 64 clients while `sweep_now` deletes it, then the same for an
//! equally long idle window; each round gives a ratio (`PAIRED …` lines).
//! The 10k vs 1M throughput ratio is also measured interleaved.
//! `IDEMPOTENCY_BENCH_RECORDS` overrides the 1M for a quick check;
//! criterion's test mode (`cargo test --benches`) uses 2,000.
//! `IDEMPOTENCY_BENCH_SWEEP_BATCH` sets the engine's `sweep_batch`.
//!
//! Each measure runs for each record format of `IDEMPOTENCY_BENCH_FORMATS`
//! (`2,3` by default: format 2, what earlier releases created, with the
//! hidden `unstable_create_format_2`, and format 3, the time-partitioned
//! records the engine creates). The throughput rounds interleave every store of
//! every format, and also give format 3 vs format 2 at each size; the
//! sweep runs per format, one after the other. Peak RSS is the process's
//! (every store's); `RSS` lines give what each store's preload added.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use criterion::{criterion_group, Criterion, SamplingMode, Throughput};
use idempotency::{Clock, Engine, ManualClock};

const SMALL: usize = 10_000;
const TTL: Duration = Duration::from_secs(3600);
const CHUNKS: u64 = 10;
const CHUNK_STEP: Duration = Duration::from_secs(60);
const T0: u64 = 1_800_000_000_000;

/// A record format measured: 2 (one records table) or 3 (partitions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Two,
    Three,
}

impl Format {
    /// Its index in the stores' statics.
    fn index(self) -> usize {
        match self {
            Format::Two => 0,
            Format::Three => 1,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Format::Two => "format 2",
            Format::Three => "format 3",
        }
    }
}

/// The formats of `IDEMPOTENCY_BENCH_FORMATS` (`2,3` by default).
fn formats() -> Vec<Format> {
    let spec = std::env::var("IDEMPOTENCY_BENCH_FORMATS").unwrap_or_else(|_| "2,3".into());
    let formats: Vec<Format> = spec
        .split(',')
        .map(|f| match f.trim() {
            "2" => Format::Two,
            "3" => Format::Three,
            other => panic!("IDEMPOTENCY_BENCH_FORMATS: {other:?} is not 2 or 3"),
        })
        .collect();
    assert!(
        !formats.is_empty(),
        "IDEMPOTENCY_BENCH_FORMATS names no format"
    );
    formats
}

fn large() -> usize {
    let default = if common::measuring() {
        1_000_000
    } else {
        2_000
    };
    env_usize("IDEMPOTENCY_BENCH_RECORDS").unwrap_or(default)
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

struct Loaded {
    engine: Engine,
    clock: ManualClock,
    path: std::path::PathBuf,
    records: usize,
    _dir: tempfile::TempDir,
}

/// The stores, per format ([`Format::index`]).
static SMALL_DB: [Mutex<Option<Loaded>>; 2] = [Mutex::new(None), Mutex::new(None)];
static LARGE_DB: [Mutex<Option<Loaded>>; 2] = [Mutex::new(None), Mutex::new(None)];

/// Runs `f` on the database of `records` in `format`, preloading it on
/// first use.
fn with_db<R>(
    slots: &[Mutex<Option<Loaded>>; 2],
    format: Format,
    records: usize,
    f: impl FnOnce(&Loaded) -> R,
) -> R {
    let mut slot = slots[format.index()].lock().expect("lock");
    f(slot.get_or_insert_with(|| load(format, records)))
}

/// Closes every store (statics are never dropped).
fn drop_all(slots: &[Mutex<Option<Loaded>>; 2]) {
    for slot in slots {
        drop(slot.lock().expect("lock").take());
    }
}

fn load(format: Format, records: usize) -> Loaded {
    let dir = common::bench_dir();
    let path = dir.path().join("engine.redb");
    let clock = ManualClock::new(T0);
    let rss_before = rss_mib();
    let mut builder = Engine::builder()
        .clock(clock.clone())
        .ttl(TTL)
        .sweep_interval(None);
    if let Some(n) = env_usize("IDEMPOTENCY_BENCH_SWEEP_BATCH") {
        builder = builder.sweep_batch(n);
    }
    if format == Format::Two {
        builder = builder.unstable_create_format_2();
    }
    let engine = builder.open(&path).expect("open engine");
    let start = Instant::now();
    let per_chunk = records.div_ceil(CHUNKS as usize);
    for chunk in 0..CHUNKS {
        let n = per_chunk.min(records - (chunk as usize * per_chunk).min(records));
        let keys: Vec<_> = (0..n).map(|_| common::random_key()).collect();
        let threads = 512.min(n.max(1));
        common::run_clients(threads, n as u64, |t, i| {
            common::engine_request(&engine, &keys[i as usize * threads + t]);
        });
        if chunk + 1 < CHUNKS {
            clock.advance(CHUNK_STEP);
        }
    }
    println!(
        "PRELOAD {} {records} records in {:.1}s, file {:.0} MiB ({:.0} B per record), peak RSS so far {:.0} MiB",
        format.name(),
        start.elapsed().as_secs_f64(),
        file_mib(&path),
        file_mib(&path) * f64::from(1 << 20) / records.max(1) as f64,
        common::peak_rss_mib().unwrap_or(0.0)
    );
    println!(
        "RSS {} {records} records: the preload added {:.0} MiB (VmRSS {:.0} -> {:.0} MiB)",
        format.name(),
        rss_mib() - rss_before,
        rss_before,
        rss_mib()
    );
    Loaded {
        engine,
        clock,
        path,
        records,
        _dir: dir,
    }
}

/// Resident set size now (`VmRSS`), in MiB.
fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}

fn file_mib(path: &std::path::Path) -> f64 {
    std::fs::metadata(path).map_or(0, |m| m.len()) as f64 / (1 << 20) as f64
}

fn request(engine: &Engine) {
    common::engine_request(engine, &common::random_key());
}

fn scale(c: &mut Criterion) {
    let mut g = c.benchmark_group("durable begin+complete, 64 threads, by records stored");
    g.sampling_mode(SamplingMode::Flat);
    g.throughput(Throughput::Elements(1));
    let n = large();
    for format in formats() {
        for (slots, records) in [(&SMALL_DB, SMALL), (&LARGE_DB, n)] {
            g.bench_function(format!("{}, {records} records", format.name()), |b| {
                with_db(slots, format, records, |l| {
                    b.iter_custom(|iters| {
                        common::run_clients(64, iters, |_, _| request(&l.engine))
                    });
                });
            });
        }
    }
    g.finish();
}

/// Interleaved: 10k vs 1M throughput per format (and format 3 vs format
/// 2 at each size), then sweep vs idle `begin` latency per format.
fn paired() {
    let r = common::rounds();
    let n = large();
    let formats = formats();
    // rates[format][0: small, 1: large]
    let mut rates = vec![[Vec::new(), Vec::new()]; formats.len()];
    for _ in 0..r.rounds {
        for (f, &format) in formats.iter().enumerate() {
            for (size, (slots, records)) in
                [(&SMALL_DB, SMALL), (&LARGE_DB, n)].into_iter().enumerate()
            {
                rates[f][size].push(with_db(slots, format, records, |l| {
                    common::rate_for(64, r.slice, |_| request(&l.engine))
                }));
            }
        }
    }
    for (f, format) in formats.iter().enumerate() {
        common::report_paired(
            &format!(
                "{}: durable req/s, 64 threads: {n} records vs {SMALL} records",
                format.name()
            ),
            "req/s",
            &rates[f][1],
            &rates[f][0],
        );
    }
    if let (Some(two), Some(three)) = (
        formats.iter().position(|f| *f == Format::Two),
        formats.iter().position(|f| *f == Format::Three),
    ) {
        for (size, records) in [SMALL, n].into_iter().enumerate() {
            common::report_paired(
                &format!("durable req/s, 64 threads, {records} records: format 3 vs format 2"),
                "req/s",
                &rates[three][size],
                &rates[two][size],
            );
        }
    }
    drop_all(&SMALL_DB);

    for format in formats {
        with_db(&LARGE_DB, format, n, |l| sweep(format, l));
        drop(LARGE_DB[format.index()].lock().expect("lock").take());
    }
}

/// Expires the large store of `format` chunk by chunk, `begin` p99 while
/// each chunk is swept vs idle.
fn sweep(format: Format, l: &Loaded) {
    let n = l.records;
    println!(
        "PEAK_RSS with the {} store of {} records loaded: {:.0} MiB (VmHWM, the process), now {:.0} MiB, file {:.0} MiB",
        format.name(),
        l.records,
        common::peak_rss_mib().unwrap_or(0.0),
        rss_mib(),
        file_mib(&l.path)
    );
    let (mut busy, mut idle) = (vec![], vec![]);
    let (mut deleted, mut sweep_time) = (0, Duration::ZERO);
    for chunk in 0..CHUNKS {
        // Expire chunk `chunk` (the earlier ones are gone already).
        let expire_at = T0 + chunk * CHUNK_STEP.as_millis() as u64 + TTL.as_millis() as u64;
        l.clock.set(expire_at.max(l.clock.now_ms()));
        let active = AtomicBool::new(true);
        let (p99, took, counts) = std::thread::scope(|s| {
            let sweeper = s.spawn(|| {
                let start = Instant::now();
                let counts = l.engine.sweep_now().expect("sweep");
                active.store(false, Ordering::SeqCst);
                (start.elapsed(), counts)
            });
            let p99 = common::begin_p99_while(&l.engine, || active.load(Ordering::SeqCst));
            let (took, counts) = sweeper.join().expect("sweeper");
            (p99, took, counts)
        });
        deleted += counts.deleted;
        sweep_time += took;
        let end = Instant::now() + took.max(Duration::from_millis(200));
        if let Some(p99) = p99 {
            busy.push(p99);
            idle.push(common::begin_p99_while(&l.engine, || Instant::now() < end).unwrap_or(p99));
        }
    }
    println!(
        "SWEEP {} deleted {deleted} expired records in {CHUNKS} passes, {:.1}s of sweeping ({:.1} us each)",
        format.name(),
        sweep_time.as_secs_f64(),
        sweep_time.as_secs_f64() * 1e6 / deleted.max(1) as f64
    );
    if !busy.is_empty() {
        common::report_paired(
            &format!(
                "{}: begin p99, 64 threads: while sweeping {n} expired records vs idle",
                format.name()
            ),
            "us",
            &busy,
            &idle,
        );
    }
}

criterion_group! {
    name = benches;
    config = common::durable_criterion();
    targets = scale
}

fn main() {
    benches();
    if common::paired_selected() {
        paired();
    }
    // Statics are never dropped: close the engines and delete their files.
    drop_all(&SMALL_DB);
    drop_all(&LARGE_DB);
    Criterion::default().configure_from_args().final_summary();
}
