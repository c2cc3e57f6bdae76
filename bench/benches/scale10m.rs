//! Scale at 10M records (issue 26): format 2 and format 3 (time-partitioned
//! records) with 10k, 1M and 10M COMPLETED records stored, each store
//! served by the engine in its own child process (so peak RSS and
//! `/proc/self/io` are per store). `IDEMPOTENCY_BENCH_FORMATS` picks the
//! formats (`2,3` by default; `2` alone is the baseline run of
//! BENCHMARKS.md); a format-3 store is created by the engine's default
//! open before the preload fills it, in partitions of
//! 32,768 keys in claim order, all sealed but the last.
//!
//! The stores are filled by `idempotency::bench_fixtures` (feature
//! `bench-fixtures`): records written straight into the engine's tables
//! with the real codec, in two runs each sorted by key (the leaf fill of
//! random inserts, in sequential passes; `IDEMPOTENCY_BENCH_PRELOAD_ORDER`
//! = `given` inserts in random key order, `runs:N` in N sorted runs), one
//! durable transaction per million records, in a child process of its own
//! (its memory is not the server's). Records complete evenly over the day
//! before the bench's clock (a `ManualClock` at `T0`), with the default
//! 24 h TTL, so record `i` of `n` expires at `T0 + (i + 1) × 24 h / n`.
//! Each server's clock starts at `T0` and runs with real time (so the
//! traffic's index entries are written in time order, as in production;
//! the day's first minutes of records expire during a run, a few hundred
//! a second at 10M, and are left to the sweep).
//! Traffic: `begin` + `complete`, durable, 300-byte responses, random
//! UUID keys, 64 client threads.
//!
//! Measured, in this order (lines `PRELOAD`, `OPEN`, `MERGE`, `STEPS`,
//! `COLD`, `PAIRED`, `ROUNDS`, `WRITES`, `FILE`, `SWEEP`, `RSS`):
//! - format 3: the merge of each closed hour's partitions (the sweep, run
//!   once right after the open until it has nothing left, its first 15 s
//!   beside 64 clients): `begin` p99 of the clients while it runs vs
//!   alone, its time, the bytes written per stored record (the clients'
//!   included), the file's bytes per record after it, and (the engine closed for the look, `bench_fixtures::space`) the
//!   bytes of pages in use per record and the records table's leaf fill
//!   (redb keeps the file's length and reuses its free pages); `STEPS`:
//!   the writer's time in one copy step and one drop step of the merge,
//!   in one checkpoint during it, and in one group commit beside it vs
//!   alone after it (the engine's histograms, `docs/metrics.md`, kept by a
//!   recorder the server installs);
//! - a fresh key's request with a cold OS page cache, per store, right
//!   after the open (`sync; echo 3 > /proc/sys/vm/drop_caches` first, as
//!   root, under `cargo bench` only): `read_bytes` of the server per
//!   request (`begin` + `complete`), and the `begin` latency; at the end
//!   the same at 10M with the engine's cache warm from the traffic;
//! - req/s at 64 threads, interleaved: 10k, 1M, 10M of every format each
//!   round (5 rounds of 1.5 s, `IDEMPOTENCY_BENCH_ROUNDS`), ratios 10M / 10k
//!   and 1M / 10k per format, and format 3 / format 2 at each size;
//! - bytes written per request by each 10M store: the block device's sector
//!   counter around each 10M slice (with `sync`), plus the store's closing
//!   checkpoint, over the requests of all its slices; beside it the
//!   server's `write_bytes` and `wchar`;
//! - file bytes per record after the preload and after the traffic;
//! - `begin` p99 while `sweep_now` deletes expired records vs idle, at 10M
//!   (per format):
//!   the oldest `IDEMPOTENCY_BENCH_SWEEP_MINUTES` (20) of the day's
//!   records, in 3 passes (a day does not fit the budget: the line gives
//!   the day's time at the measured rate). Each pass runs beside the
//!   clients for at most 20 s, then alone to its end, as the merge does.
//!   The store's clock stood near T0 at the merge above, so the day's
//!   last hour (claims in `[T0 - 1 h, T0)`) is merged in the pass that
//!   passes `T0 + 15 min` (the merge's grace), the third: its line counts
//!   the merge steps in it;
//! - peak RSS (`VmHWM`) of each server, with redb's default 1 GiB cache
//!   (the engine sets none), or `IDEMPOTENCY_BENCH_CACHE_MIB` MiB
//!   (`EngineBuilder::cache_size`) for every server.
//!
//! `IDEMPOTENCY_BENCH_RECORDS` sets the large store (10M). Test mode
//! (`cargo test --benches`) uses 200, 1,000 and 2,000 records, one 50 ms
//! round, and checks each preloaded store with `Engine::verify`.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency::bench_fixtures::{self, CompletedRecord, Order, Preload};
use idempotency::{Clock, Engine, IdempotencyKey, ManualClock};
use metrics::{
    Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};

const CHILD_ENV: &str = "IDEMPOTENCY_SCALE10M_CHILD";
const TTL: Duration = Duration::from_secs(24 * 3600);
const LEASE: Duration = Duration::from_secs(30);
const T0: u64 = 1_800_000_000_000;
const THREADS: usize = 64;

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn ttl_ms() -> u64 {
    TTL.as_millis() as u64
}

/// splitmix64's finalizer.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE5_E9B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Preloaded record `i` of `n`: a UUID-shaped key derived from `i`,
/// completed at `T0 - 24 h + (i + 1) × 24 h / n`.
fn record_of(i: u64, n: u64) -> CompletedRecord {
    let uuid = uuid::Uuid::from_u64_pair(mix(i), mix(i ^ 0x5555_5555_5555_5555));
    let key = IdempotencyKey::new(common::SCOPE, uuid.to_string()).expect("valid key");
    CompletedRecord {
        key,
        fingerprint: common::fingerprint(),
        response: common::response(),
        at_ms: T0 - ttl_ms() + (i + 1) * ttl_ms() / n.max(1),
    }
}

fn order() -> Order {
    match std::env::var("IDEMPOTENCY_BENCH_PRELOAD_ORDER").as_deref() {
        Ok("given") => Order::Given,
        Ok(s) => Order::SortedRuns(
            s.strip_prefix("runs:")
                .and_then(|n| n.parse().ok())
                .unwrap_or(2),
        ),
        Err(_) => Order::SortedRuns(2),
    }
}

/// `/proc/self/io`: (`write_bytes` - `cancelled_write_bytes`, `wchar`,
/// `read_bytes`). `read_bytes` counts reads that reached the block layer
/// (page-cache misses), `wchar` bytes handed to write calls.
fn proc_io() -> (i64, i64, i64) {
    let text = std::fs::read_to_string("/proc/self/io").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.trim().parse().ok())
            .unwrap_or(0i64)
    };
    (
        field("write_bytes") - field("cancelled_write_bytes"),
        field("wchar"),
        field("read_bytes"),
    )
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

fn file_bytes(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

fn mib(bytes: f64) -> f64 {
    bytes / (1u64 << 20) as f64
}

// ---------------------------------------------------------------- child

/// A child: `preload:<format>:<records>:<path>` writes the store in
/// format 2 or 3 and exits; `serve:<format>:<records>:<path>` opens it (an
/// existing file keeps its format) and answers commands on stdin, one line
/// of numbers each on stdout.
fn child(arg: &str) {
    let mut f = arg.splitn(4, ':');
    let (mode, format, n, path) = (
        f.next().expect("mode"),
        f.next().and_then(|s| s.parse::<u8>().ok()).expect("format"),
        f.next()
            .and_then(|s| s.parse::<u64>().ok())
            .expect("records"),
        PathBuf::from(f.next().expect("path")),
    );
    if mode == "preload" {
        preload(format, n, path.as_path());
    } else {
        serve(n, &path);
    }
}

/// The formats of `IDEMPOTENCY_BENCH_FORMATS` (`2,3` by default).
fn formats() -> Vec<u8> {
    let spec = std::env::var("IDEMPOTENCY_BENCH_FORMATS").unwrap_or_else(|_| "2,3".into());
    let formats: Vec<u8> = spec
        .split(',')
        .map(|f| match f.trim() {
            "2" => 2,
            "3" => 3,
            other => panic!("IDEMPOTENCY_BENCH_FORMATS: {other:?} is not 2 or 3"),
        })
        .collect();
    assert!(
        !formats.is_empty(),
        "IDEMPOTENCY_BENCH_FORMATS names no format"
    );
    formats
}

fn preload(format: u8, n: u64, path: &Path) {
    let start = Instant::now();
    if format == 3 {
        // A new file in format 3; the preload keeps the file's format.
        drop(
            Engine::builder()
                .ttl(TTL)
                .open(path)
                .expect("create a format-3 file"),
        );
    }
    let order = order();
    let plan = Preload {
        count: n,
        order,
        records_per_txn: 1_000_000,
        lease: LEASE,
        ttl: TTL,
        cache_bytes: 1 << 30,
    };
    let shape =
        bench_fixtures::preload_completed(path, plan, |i| record_of(i, n)).expect("preload");
    assert_eq!(shape.records, n, "records in the preloaded table");
    let size = file_bytes(path);
    println!(
        "PRELOAD format {format} {n} records ({order:?}) in {:.1}s: file {:.0} MiB, {:.0} B per record; records table: leaves {:.0}% full, {:.0} B of pages per record, {} leaf + {} branch pages; preload peak RSS {:.0} MiB",
        start.elapsed().as_secs_f64(),
        mib(size as f64),
        size as f64 / n as f64,
        100.0 * shape.stored_bytes as f64 / (shape.leaf_pages * shape.page_bytes) as f64,
        ((shape.leaf_pages + shape.branch_pages) * shape.page_bytes) as f64 / n as f64,
        shape.leaf_pages,
        shape.branch_pages,
        common::peak_rss_mib().unwrap_or(0.0),
    );
}

/// redb's page cache for the servers: `IDEMPOTENCY_BENCH_CACHE_MIB`, or
/// redb's default (1 GiB) when unset.
fn cache_mib() -> Option<usize> {
    env_usize("IDEMPOTENCY_BENCH_CACHE_MIB")
}

/// How the RSS lines name the cache setting.
fn cache_label() -> String {
    match cache_mib() {
        Some(mib) => format!("{mib} MiB (IDEMPOTENCY_BENCH_CACHE_MIB)"),
        None => "the default 1 GiB".into(),
    }
}

fn open(path: &Path, clock: &ManualClock) -> Engine {
    let mut builder = Engine::builder()
        .clock(clock.clone())
        .ttl(TTL)
        .lease(LEASE)
        .sweep_interval(None);
    if let Some(mib) = cache_mib() {
        builder = builder.cache_size(mib << 20);
    }
    builder.open(path).expect("open engine")
}

fn request(engine: &Engine) -> u64 {
    common::engine_request(engine, &common::random_key())
}

/// The writer times a `MERGE` line reports (`docs/metrics.md`), in this
/// order: one merge copy step, one drop step, one group commit, one
/// checkpoint (each in seconds).
const TIMED: [&str; 4] = [
    "idempotency_merge_copy_step_seconds",
    "idempotency_merge_drop_step_seconds",
    "idempotency_group_commit_seconds",
    "idempotency_checkpoint_seconds",
];

/// A `metrics` recorder that keeps the samples of the [`TIMED`] histograms
/// while switched on (the merge), and nothing else.
struct StepTimes {
    on: Arc<AtomicBool>,
    samples: [Arc<Samples>; 4],
}

/// One histogram's samples, kept while `on`.
struct Samples {
    on: Arc<AtomicBool>,
    values: Mutex<Vec<f64>>,
}

impl HistogramFn for Samples {
    fn record(&self, value: f64) {
        if self.on.load(Ordering::Relaxed) {
            self.values.lock().expect("lock").push(value);
        }
    }
}

impl StepTimes {
    /// Installs it as the process's recorder; `None` if one is installed.
    fn install() -> Option<&'static StepTimes> {
        let on = Arc::new(AtomicBool::new(false));
        let samples = std::array::from_fn(|_| {
            Arc::new(Samples {
                on: on.clone(),
                values: Mutex::default(),
            })
        });
        let times: &'static StepTimes = Box::leak(Box::new(StepTimes { on, samples }));
        metrics::set_global_recorder(Forward(times)).ok()?;
        Some(times)
    }

    /// Starts (`true`, dropping the samples kept before) or stops keeping
    /// samples.
    fn keep(&self, on: bool) {
        if on {
            for s in &self.samples {
                s.values.lock().expect("lock").clear();
            }
        }
        self.on.store(on, Ordering::SeqCst);
    }

    /// Per [`TIMED`] histogram: samples, p50, p99 and max in ms (zeros for
    /// none).
    fn summary(&self) -> Vec<f64> {
        let mut out = Vec::new();
        for s in &self.samples {
            let mut v = s.values.lock().expect("lock").clone();
            if v.is_empty() {
                out.extend([0.0; 4]);
                continue;
            }
            let n = v.len() as f64;
            let p50 = common::quantile(&mut v, 0.5) * 1e3;
            let p99 = common::quantile(&mut v, 0.99) * 1e3;
            let max = v[v.len() - 1] * 1e3;
            out.extend([n, p50, p99, max]);
        }
        out
    }
}

/// The installed recorder.
struct Forward(&'static StepTimes);

impl Recorder for Forward {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
        Counter::noop()
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        match TIMED.iter().position(|n| *n == key.name()) {
            Some(i) => Histogram::from_arc(self.0.samples[i].clone()),
            None => Histogram::noop(),
        }
    }
}

fn serve(n: u64, path: &Path) {
    let times = StepTimes::install();
    let clock = ManualClock::new(T0);
    run_with_real_time(clock.clone());
    let start = Instant::now();
    let mut engine = Some(open(path, &clock));
    let open_s = start.elapsed().as_secs_f64();
    if !common::measuring() {
        // The fixture is a valid store: every record decodes, every index
        // entry matches (test mode only: the scrub holds every key).
        let report = engine.as_ref().expect("engine").verify().expect("verify");
        assert!(report.is_sound(), "preloaded store: {:?}", report.damage);
        assert_eq!(report.records, n, "records verified");
    }
    let mut out = std::io::stdout();
    writeln!(out, "{open_s}").expect("stdout");
    out.flush().expect("flush");
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("stdin");
        let w: Vec<&str> = line.split_whitespace().collect();
        let reply = match w.as_slice() {
            ["rate", ms] => {
                let e = engine.as_ref().expect("open");
                let slice = Duration::from_millis(ms.parse().expect("ms"));
                let (w0, c0, r0) = proc_io();
                let (calls, took) = common::calls_for(THREADS, slice, |_| {
                    request(e);
                });
                let (w1, c1, r1) = proc_io();
                format!(
                    "{} {calls} {} {} {}",
                    calls as f64 / took.as_secs_f64(),
                    w1 - w0,
                    c1 - c0,
                    r1 - r0
                )
            }
            ["fresh", count] => {
                let e = engine.as_ref().expect("open");
                let count: u64 = count.parse().expect("count");
                let (_, _, r0) = proc_io();
                let mut lat: Vec<f64> = (0..count).map(|_| request(e) as f64 / 1e3).collect();
                let (_, _, r1) = proc_io();
                let p50 = common::quantile(&mut lat, 0.5);
                let p99 = common::quantile(&mut lat, 0.99);
                format!("{} {p50} {p99}", (r1 - r0) as f64 / count as f64)
            }
            ["close"] => {
                let (w0, c0, _) = proc_io();
                let t = Instant::now();
                drop(engine.take());
                let (w1, c1, _) = proc_io();
                format!("{} {} {}", t.elapsed().as_secs_f64(), w1 - w0, c1 - c0)
            }
            ["open"] => {
                let t = Instant::now();
                engine = Some(open(path, &clock));
                format!("{}", t.elapsed().as_secs_f64())
            }
            ["sweep", at, cap_ms] => {
                let e = engine.as_ref().expect("open");
                clock.set(at.parse::<u64>().expect("at").max(clock.now_ms()));
                let cap = Duration::from_millis(cap_ms.parse().expect("cap"));
                let w = sweep_pair(e, cap, times);
                format!(
                    "{} {} {} {} {} {} {}",
                    w.deleted,
                    w.took.as_secs_f64(),
                    w.busy_p99,
                    w.idle_p99,
                    w.busy_for.as_secs_f64(),
                    w.merge_steps.0,
                    w.merge_steps.1
                )
            }
            ["merge", window_ms] => {
                // Format 3: the sweep merges each closed hour's partitions
                // (nothing has expired at T0, so that is all it does).
                let e = engine.as_ref().expect("open");
                let window = Duration::from_millis(window_ms.parse().expect("window"));
                let (w0, c0, _) = proc_io();
                let m = merge_pair(e, window, times);
                let (w1, c1, _) = proc_io();
                let steps: Vec<String> = m.times.iter().map(f64::to_string).collect();
                format!(
                    "{} {} {} {} {} {} {} {} {}",
                    m.took.as_secs_f64(),
                    w1 - w0,
                    c1 - c0,
                    m.passes,
                    m.busy_p99,
                    m.idle_p99,
                    m.requests,
                    m.busy_for.as_secs_f64(),
                    steps.join(" ")
                )
            }
            ["stats"] => format!(
                "{} {} {}",
                file_bytes(path),
                common::peak_rss_mib().unwrap_or(0.0),
                rss_mib()
            ),
            _ => break,
        };
        writeln!(out, "{reply}").expect("stdout");
        out.flush().expect("flush");
    }
}

/// Moves `clock` forward with real time, in whole milliseconds, from a
/// thread of its own (for the life of the server). A clock that stood
/// still would give every request's index entries one instant (each
/// completion's expiry at `T0 + 24 h`), so they would land at random
/// places among each other, each in a leaf of its own, where in
/// production they land at the end of the index. A `sweep` command's
/// jump forward is kept: the thread only adds what passed.
fn run_with_real_time(clock: ManualClock) {
    std::thread::spawn(move || {
        let start = Instant::now();
        let mut added = 0u128;
        loop {
            std::thread::sleep(Duration::from_millis(1));
            let passed = start.elapsed().as_millis();
            if passed > added {
                let step = u64::try_from(passed - added).unwrap_or(u64::MAX);
                clock.advance(Duration::from_millis(step));
                added = passed;
            }
        }
    });
}

/// What [`sweep_pair`] saw.
struct Swept {
    /// Records the sweep deleted.
    deleted: u64,
    /// The sweep's time (one `sweep_now`, to its end).
    took: Duration,
    /// How long the clients ran beside it (at most the cap).
    busy_for: Duration,
    /// `begin` p99 µs of the clients beside it (NaN: none ran).
    busy_p99: f64,
    /// `begin` p99 µs of the clients alone, as long as the busy window.
    idle_p99: f64,
    /// Merge copy and drop steps the sweep ran (`(0, 0)` without the
    /// recorder): an hour that closed by the sweep's time merges in it.
    merge_steps: (u64, u64),
}

/// `sweep_now` beside 64 clients for at most `cap` (the clients add
/// records: the cap bounds how many, as [`merge_pair`]'s window does),
/// then alone to its end; then the clients alone for as long as they ran
/// beside it (at least 200 ms).
fn sweep_pair(engine: &Engine, cap: Duration, times: Option<&StepTimes>) -> Swept {
    if let Some(t) = times {
        t.keep(true);
    }
    let active = AtomicBool::new(true);
    let (busy_p99, busy_for, took, counts) = std::thread::scope(|s| {
        let sweeper = s.spawn(|| {
            let start = Instant::now();
            let counts = engine.sweep_now().expect("sweep");
            active.store(false, Ordering::SeqCst);
            (start.elapsed(), counts)
        });
        let started = Instant::now();
        let stop = started + cap;
        let p99 = common::begin_p99_while(engine, || {
            active.load(Ordering::SeqCst) && Instant::now() < stop
        });
        let busy_for = started.elapsed();
        let (took, counts) = sweeper.join().expect("sweeper");
        (p99, busy_for, took, counts)
    });
    let merge_steps = times.map_or((0, 0), |t| {
        let s = t.summary();
        (s[0] as u64, s[4] as u64)
    });
    if let Some(t) = times {
        t.keep(false);
    }
    let end = Instant::now() + busy_for.max(Duration::from_millis(200));
    let idle = common::begin_p99_while(engine, || Instant::now() < end);
    Swept {
        deleted: counts.deleted,
        took,
        busy_for,
        busy_p99: busy_p99.unwrap_or(f64::NAN),
        idle_p99: idle.unwrap_or(f64::NAN),
        merge_steps,
    }
}

/// What [`merge_pair`] saw.
struct Merged {
    /// The merge's time (`sweep_now` until nothing is left).
    took: Duration,
    /// Sweep passes it took.
    passes: u64,
    /// `begin` p99 µs of the clients while it ran (at most the window).
    busy_p99: f64,
    /// `begin` p99 µs of the clients alone, as long as the busy window.
    idle_p99: f64,
    /// Requests the clients made while it ran (records they added).
    requests: u64,
    /// How long the clients ran beside it.
    busy_for: Duration,
    /// [`StepTimes::summary`] three times (48 numbers; zeros without the
    /// recorder): while the clients ran beside the merge, over the whole
    /// merge, and of the clients alone after it.
    times: Vec<f64>,
}

/// The merge (`sweep_now` until nothing is left) beside 64 clients for
/// at most `window` (the clients add records: the window bounds how many),
/// then alone to its end; then the clients alone for as long as they ran
/// beside it.
fn merge_pair(engine: &Engine, window: Duration, times: Option<&StepTimes>) -> Merged {
    let summary = || times.map_or(vec![0.0; 16], StepTimes::summary);
    if let Some(t) = times {
        t.keep(true);
    }
    let active = AtomicBool::new(true);
    let requests = std::sync::atomic::AtomicU64::new(0);
    let busy_p99 = std::thread::scope(|s| {
        let merger = s.spawn(|| {
            let start = Instant::now();
            let mut passes = 0u64;
            while passes < 10_000 {
                passes += 1;
                if !engine.sweep_now().expect("sweep").more {
                    break;
                }
            }
            active.store(false, Ordering::SeqCst);
            (start.elapsed(), passes)
        });
        let started = Instant::now();
        let stop = started + window;
        let p99 = common::begin_p99_while(engine, || {
            let go = active.load(Ordering::SeqCst) && Instant::now() < stop;
            if go {
                requests.fetch_add(1, Ordering::Relaxed);
            }
            go
        });
        let busy_for = started.elapsed();
        let beside = summary();
        let (took, passes) = merger.join().expect("merger");
        (p99, busy_for, took, passes, beside)
    });
    let (busy_p99, busy_for, took, passes, mut summaries) = busy_p99;
    summaries.extend(summary());
    if let Some(t) = times {
        t.keep(true);
    }
    let end = Instant::now() + busy_for.max(Duration::from_millis(200));
    let idle = common::begin_p99_while(engine, || Instant::now() < end);
    summaries.extend(summary());
    if let Some(t) = times {
        t.keep(false);
    }
    Merged {
        took,
        passes,
        busy_p99: busy_p99.unwrap_or(f64::NAN),
        idle_p99: idle.unwrap_or(f64::NAN),
        requests: requests.load(Ordering::Relaxed),
        busy_for,
        times: summaries,
    }
}

// --------------------------------------------------------------- parent

struct Server {
    /// `format <f> <size>`.
    name: String,
    format: u8,
    records: u64,
    path: PathBuf,
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// Requests served so far (they add records).
    requests: u64,
}

impl Server {
    fn reply(&mut self) -> Vec<f64> {
        loop {
            let mut line = String::new();
            let n = self.stdout.read_line(&mut line).expect("from child");
            assert!(n > 0, "the {} server exited", self.name);
            let nums: Result<Vec<f64>, _> = line.split_whitespace().map(str::parse).collect();
            match nums {
                Ok(v) if !v.is_empty() => return v,
                _ => print!("{line}"),
            }
        }
    }

    fn ask(&mut self, cmd: &str) -> Vec<f64> {
        writeln!(self.stdin, "{cmd}").expect("to child");
        self.stdin.flush().expect("flush");
        self.reply()
    }
}

fn spawn(arg: &str, piped: bool) -> Child {
    let exe = std::env::current_exe().expect("exe");
    let mut cmd = Command::new(exe);
    // The same arguments, so the child knows `cargo bench` from test mode.
    cmd.args(std::env::args().skip(1))
        .env(CHILD_ENV, arg)
        .stderr(Stdio::inherit());
    if piped {
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
    }
    cmd.spawn().expect("spawn child")
}

fn label(n: u64) -> String {
    match n {
        n if n >= 1_000_000 && n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n >= 1_000 && n % 1_000 == 0 => format!("{}k", n / 1_000),
        n => n.to_string(),
    }
}

fn start(dir: &Path, format: u8, records: u64) -> Server {
    let path = dir.join(format!("engine-f{format}-{records}.redb"));
    let name = format!("format {format} {}", label(records));
    let t = Instant::now();
    let status = spawn(
        &format!("preload:{format}:{records}:{}", path.display()),
        false,
    )
    .wait()
    .expect("preload");
    assert!(status.success(), "preload of {name} failed");
    println!(
        "PRELOAD {name} took {:.1}s in all (engine create included)",
        t.elapsed().as_secs_f64()
    );
    let mut child = spawn(
        &format!("serve:{format}:{records}:{}", path.display()),
        true,
    );
    let stdin = child.stdin.take().expect("stdin");
    let stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let mut s = Server {
        name,
        format,
        records,
        path,
        child,
        stdin,
        stdout,
        requests: 0,
    };
    let open_s = s.reply()[0];
    println!(
        "OPEN {}: {open_s:.1}s (the engine's open checks every page)",
        s.name
    );
    s
}

/// Prints the large server's peak and current RSS after a phase.
fn rss_after(s: &mut Server, phase: &str) {
    let v = s.ask("stats");
    println!(
        "RSS {} after {phase}: peak {:.0} MiB, now {:.0} MiB",
        s.name, v[1], v[2]
    );
}

/// Empties the OS page cache (`sync`, then `drop_caches` = 3); false if
/// this process may not (not root, no procfs).
fn drop_page_cache() -> bool {
    let synced = Command::new("sync").status().is_ok_and(|s| s.success());
    synced && std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn run() {
    let measuring = common::measuring();
    let (small, mid, large) = if measuring {
        (
            10_000,
            1_000_000,
            env_usize("IDEMPOTENCY_BENCH_RECORDS").unwrap_or(10_000_000) as u64,
        )
    } else {
        (200, 1_000, 2_000)
    };
    let begun = Instant::now();
    println!("LOAD at start: {}", load_average());
    let dir = common::bench_dir();
    let device = common::device::Device::of(dir.path());
    // One set of stores per format: small, mid, large.
    let mut sets: Vec<Vec<Server>> = formats()
        .into_iter()
        .map(|f| {
            [small, mid, large]
                .into_iter()
                .map(|n| start(dir.path(), f, n))
                .collect()
        })
        .collect();
    for s in sets.iter().flatten() {
        let bytes = file_bytes(&s.path);
        println!(
            "FILE {} after the preload: {:.0} MiB, {:.0} B per record",
            s.name,
            mib(bytes as f64),
            bytes as f64 / s.records as f64
        );
    }

    // Format 3: each closed hour's partitions merged into one, before
    // anything is measured (a store a day old has merged its hours as
    // they closed; the traffic below never closes one).
    for s in sets.iter_mut().flatten().filter(|s| s.format == 3) {
        let before = device
            .as_ref()
            .filter(|_| measuring)
            .and_then(|d| d.written_after_sync());
        let window_ms = if measuring { 15_000 } else { 50 };
        let v = s.ask(&format!("merge {window_ms}"));
        s.requests += v[6] as u64;
        let after = device
            .as_ref()
            .filter(|_| measuring)
            .and_then(|d| d.written_after_sync());
        let device_per_record = match (before, after) {
            (Some(b), Some(a)) => format!("{:.0} B", (a - b) as f64 / s.records as f64),
            _ => "not measured".into(),
        };
        let bytes = file_bytes(&s.path);
        println!(
            "MERGE {}: {:.1}s in {} sweep passes, the first {:.1}s beside 64 clients ({} requests); per stored record: server write_bytes {:.0} B, wchar {:.0} B, device {device_per_record} (the clients' writes included); file after it {:.0} MiB, {:.0} B per record",
            s.name,
            v[0],
            v[3],
            v[7],
            v[6],
            v[1] / s.records as f64,
            v[2] / s.records as f64,
            mib(bytes as f64),
            bytes as f64 / s.records as f64
        );
        // Writer times (ms): [n, p50, p99, max] of copy step, drop step,
        // group commit, checkpoint; beside the clients, whole merge, idle.
        let t = |part: usize, which: usize| &v[8 + part * 16 + which * 4..][..4];
        println!(
            "STEPS {}: writer time of one merge copy step: {:.0} steps, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms (beside the clients: {:.0}, p99 {:.2} ms, max {:.2} ms); one drop step: {:.0} steps, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; checkpoints during the merge: {:.0}, p50 {:.1} ms, max {:.1} ms; one group commit beside the merge: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({:.0}), alone after it: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({:.0})",
            s.name,
            t(1, 0)[0], t(1, 0)[1], t(1, 0)[2], t(1, 0)[3],
            t(0, 0)[0], t(0, 0)[2], t(0, 0)[3],
            t(1, 1)[0], t(1, 1)[1], t(1, 1)[2], t(1, 1)[3],
            t(1, 3)[0], t(1, 3)[1], t(1, 3)[3],
            t(0, 2)[1], t(0, 2)[2], t(0, 2)[3], t(0, 2)[0],
            t(2, 2)[1], t(2, 2)[2], t(2, 2)[3], t(2, 2)[0],
        );
        println!(
            "PAIRED {}: begin p99, 64 threads: while merging vs idle: ours {:.1} us, baseline {:.1} us, ratio {:.2}",
            s.name,
            v[4],
            v[5],
            v[4] / v[5]
        );
        // The pages in use once it is done (the engine closed for the
        // look): redb does not shrink the file, it reuses the free pages.
        s.ask("close");
        let space = bench_fixtures::space(&s.path).expect("space");
        s.ask("open");
        let t = space.records;
        let n = s.records as f64;
        println!(
            "MERGE {} space: pages in use {:.0} MiB, {:.0} B per record (free pages in the file: {:.0} MiB; fragmented {:.0} MiB); records table: leaves {:.0}% full, {:.0} B of pages per record",
            s.name,
            mib(space.allocated_bytes as f64),
            space.allocated_bytes as f64 / n,
            mib(bytes.saturating_sub(space.allocated_bytes) as f64),
            mib(space.fragmented_bytes as f64),
            100.0 * t.stored_bytes as f64 / (t.leaf_pages * t.page_bytes).max(1) as f64,
            ((t.leaf_pages + t.branch_pages) * t.page_bytes) as f64 / n,
        );
    }
    for set in &mut sets {
        rss_after(&mut set[2], "the open");
    }
    // A fresh key with a cold OS page cache, largest store first.
    let fresh = if measuring { 2_000 } else { 20 };
    'cold: for set in &mut sets {
        for s in set.iter_mut().rev() {
            if measuring && !drop_page_cache() {
                println!("COLD not measured: cannot drop the page cache (needs root)");
                break 'cold;
            }
            let v = s.ask(&format!("fresh {fresh}"));
            s.requests += fresh;
            println!(
                "COLD {}: {fresh} fresh-key requests one at a time (page cache dropped first: {measuring}): {:.0} B read from the device per request, begin p50 {:.0} us, p99 {:.0} us",
                s.name, v[0], v[1], v[2]
            );
        }
    }

    for set in &mut sets {
        rss_after(&mut set[2], "the cold requests");
    }
    // Throughput, interleaved over every store of every format.
    let r = common::rounds();
    let ms = r.slice.as_millis();
    // Per set: rates per size, and the large store's writes.
    let mut rates = vec![vec![Vec::new(); 3]; sets.len()];
    let mut writes = vec![Writes::new(device.is_some()); sets.len()];
    for _ in 0..r.rounds {
        for (k, set) in sets.iter_mut().enumerate() {
            for (i, s) in set.iter_mut().enumerate() {
                let is_large = i == 2;
                let before = device
                    .as_ref()
                    .filter(|_| is_large && measuring)
                    .and_then(|d| d.written_after_sync());
                let v = s.ask(&format!("rate {ms}"));
                let after = device
                    .as_ref()
                    .filter(|_| is_large && measuring)
                    .and_then(|d| d.written_after_sync());
                rates[k][i].push(v[0]);
                s.requests += v[1] as u64;
                if is_large {
                    let w = &mut writes[k];
                    w.reqs += v[1] as u64;
                    w.wb += v[2] as i64;
                    w.wc += v[3] as i64;
                    w.rb += v[4] as i64;
                    w.device(before, after);
                }
            }
        }
    }
    for (k, set) in sets.iter().enumerate() {
        let f = set[0].format;
        for i in [2, 1] {
            common::report_paired(
                &format!(
                    "format {f}: durable req/s, {THREADS} threads: {} records vs {} records",
                    label(set[i].records),
                    label(small)
                ),
                "req/s",
                &rates[k][i],
                &rates[k][0],
            );
        }
        for i in [2, 1] {
            common::report_rounds(
                &format!("{} vs {}", set[i].name, set[0].name),
                &rates[k][i],
                &rates[k][0],
            );
        }
    }
    let of = |f: u8| sets.iter().position(|set| set[0].format == f);
    if let (Some(two), Some(three)) = (of(2), of(3)) {
        for i in 0..3 {
            common::report_paired(
                &format!(
                    "durable req/s, {THREADS} threads, {} records: format 3 vs format 2",
                    label(sets[two][i].records)
                ),
                "req/s",
                &rates[three][i],
                &rates[two][i],
            );
        }
    }

    for (k, set) in sets.iter_mut().enumerate() {
        rss_after(&mut set[2], "the rounds");
        // The large store's closing checkpoint belongs to its traffic.
        let large_s = &mut set[2];
        let before = device
            .as_ref()
            .filter(|_| measuring)
            .and_then(|d| d.written_after_sync());
        let close = large_s.ask("close");
        let after = device
            .as_ref()
            .filter(|_| measuring)
            .and_then(|d| d.written_after_sync());
        let w = &mut writes[k];
        w.device(before, after);
        w.wb += close[1] as i64;
        w.wc += close[2] as i64;
        let per = |b: f64| b / w.reqs.max(1) as f64;
        println!(
            "WRITES {}: {} requests over {} slices, closing checkpoint {:.1}s: block device {} B per request; server write_bytes {:.0} B, wchar {:.0} B, read_bytes {:.0} B per request",
            large_s.name,
            w.reqs,
            r.rounds,
            close[0],
            if w.dev_ok && measuring {
                format!("{:.0}", per(w.dev_bytes as f64))
            } else {
                "not measured".to_string()
            },
            per(w.wb as f64),
            per(w.wc as f64),
            per(w.rb as f64)
        );
        let reopen = large_s.ask("open")[0];
        println!("OPEN {} again: {reopen:.1}s", large_s.name);
        rss_after(large_s, "its close and reopen");
    }

    for s in sets.iter_mut().flatten() {
        let v = s.ask("stats");
        let stored = s.records + s.requests;
        println!(
            "FILE {} after {} requests: {:.0} MiB, {:.0} B per stored record ({stored} records)",
            s.name,
            s.requests,
            mib(v[0]),
            v[0] / stored as f64
        );
    }

    for set in &mut sets {
        sweep(&mut set[2], measuring);
        rss_after(&mut set[2], "the sweep");
    }

    // Again at the large size, now that traffic and the sweep have warmed
    // the engine's own cache (redb's, in the server): the steady state of
    // a store larger than that cache, whose file left the OS page cache.
    for set in &mut sets {
        let large_s = &mut set[2];
        if !measuring || drop_page_cache() {
            let v = large_s.ask(&format!("fresh {fresh}"));
            large_s.requests += fresh;
            println!(
                "COLD {} after the traffic (engine cache warm, page cache dropped first: {measuring}): {fresh} fresh-key requests one at a time: {:.0} B read from the device per request, begin p50 {:.0} us, p99 {:.0} us",
                large_s.name, v[0], v[1], v[2]
            );
        }
    }

    for s in sets.iter_mut().flatten() {
        let v = s.ask("stats");
        println!(
            "RSS {}: peak {:.0} MiB, now {:.0} MiB (VmHWM and VmRSS of its server; redb cache: {}), file {:.0} MiB",
            s.name,
            v[1],
            v[2],
            cache_label(),
            mib(v[0])
        );
    }
    for s in sets.into_iter().flatten() {
        drop(s.stdin);
        let mut child = s.child;
        child.wait().expect("server exit");
    }
    println!(
        "LOAD at end: {}; whole run {:.0}s",
        load_average(),
        begun.elapsed().as_secs_f64()
    );
}

/// What a large store wrote over its traffic.
#[derive(Clone)]
struct Writes {
    /// Block-device bytes around its slices and its close.
    dev_bytes: u64,
    /// Whether every device reading was taken.
    dev_ok: bool,
    /// Server `write_bytes`, `wchar`, `read_bytes`.
    wb: i64,
    wc: i64,
    rb: i64,
    /// Requests served in the slices.
    reqs: u64,
}

impl Writes {
    fn new(device: bool) -> Writes {
        Writes {
            dev_bytes: 0,
            dev_ok: device,
            wb: 0,
            wc: 0,
            rb: 0,
            reqs: 0,
        }
    }

    /// Adds the device bytes between two readings (either missing: not
    /// measured).
    fn device(&mut self, before: Option<u64>, after: Option<u64>) {
        match (before, after) {
            (Some(b), Some(a)) => self.dev_bytes += a - b,
            _ => self.dev_ok = false,
        }
    }
}

/// Expiry at the large size: the oldest minutes of the day, in passes.
fn sweep(large_s: &mut Server, measuring: bool) {
    let large = large_s.records;
    let minutes = env_usize("IDEMPOTENCY_BENCH_SWEEP_MINUTES").unwrap_or(20) as u64;
    let passes = 3u64;
    let cap_ms = if measuring { 20_000 } else { 200 };
    let (mut busy, mut idle) = (vec![], vec![]);
    let (mut deleted, mut took) = (0u64, 0.0);
    for p in 1..=passes {
        let at = T0 + p * minutes * 60_000 / passes;
        let v = large_s.ask(&format!("sweep {at} {cap_ms}"));
        deleted += v[0] as u64;
        took += v[1];
        if v[2].is_finite() && v[3].is_finite() {
            busy.push(v[2]);
            idle.push(v[3]);
        }
        println!(
            "SWEEP {} pass {p}: {} records in {:.2}s ({:.1} us each), the first {:.1}s beside 64 clients; merge steps in it: {} copy, {} drop; begin p99 {:.0} us sweeping vs {:.0} us idle",
            large_s.name,
            v[0],
            v[1],
            v[1] * 1e6 / v[0].max(1.0),
            v[4],
            v[5],
            v[6],
            v[2],
            v[3]
        );
    }
    println!(
        "SWEEP {}: the oldest {minutes} minutes of the day, {deleted} records in {took:.1}s ({:.1} us each; a whole day at that rate: {:.0}s)",
        large_s.name,
        took * 1e6 / deleted.max(1) as f64,
        took / deleted.max(1) as f64 * large as f64
    );
    if !busy.is_empty() {
        common::report_paired(
            &format!(
                "format {}: begin p99, {THREADS} threads: while sweeping {} expired records at {} vs idle",
                large_s.format,
                label(deleted),
                label(large)
            ),
            "us",
            &busy,
            &idle,
        );
    }
}

fn main() {
    if let Ok(arg) = std::env::var(CHILD_ENV) {
        child(&arg);
        return;
    }
    // `cargo bench` / `cargo test --benches` pass criterion flags; a name
    // filter that does not mention this bench skips it.
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    if filters.is_empty() || filters.iter().any(|f| "scale10m".contains(f.as_str())) {
        run();
    }
}
