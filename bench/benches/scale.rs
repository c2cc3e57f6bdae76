//! Scale and sweep: durable begin+complete throughput (64 client threads,
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

static SMALL_DB: Mutex<Option<Loaded>> = Mutex::new(None);
static LARGE_DB: Mutex<Option<Loaded>> = Mutex::new(None);

/// Runs `f` on the database of `records`, preloading it on first use.
fn with_db<R>(slot: &Mutex<Option<Loaded>>, records: usize, f: impl FnOnce(&Loaded) -> R) -> R {
    let mut slot = slot.lock().expect("lock");
    f(slot.get_or_insert_with(|| load(records)))
}

fn load(records: usize) -> Loaded {
    let dir = common::bench_dir();
    let path = dir.path().join("engine.redb");
    let clock = ManualClock::new(T0);
    let mut builder = Engine::builder()
        .clock(clock.clone())
        .ttl(TTL)
        .sweep_interval(None);
    if let Some(n) = env_usize("IDEMPOTENCY_BENCH_SWEEP_BATCH") {
        builder = builder.sweep_batch(n);
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
        "PRELOAD {records} records in {:.1}s, file {:.0} MiB, peak RSS so far {:.0} MiB",
        start.elapsed().as_secs_f64(),
        file_mib(&path),
        common::peak_rss_mib().unwrap_or(0.0)
    );
    Loaded {
        engine,
        clock,
        path,
        records,
        _dir: dir,
    }
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
    g.bench_function(format!("{SMALL} records"), |b| {
        with_db(&SMALL_DB, SMALL, |l| {
            b.iter_custom(|iters| common::run_clients(64, iters, |_, _| request(&l.engine)));
        });
    });
    let n = large();
    g.bench_function(format!("{n} records"), |b| {
        with_db(&LARGE_DB, n, |l| {
            b.iter_custom(|iters| common::run_clients(64, iters, |_, _| request(&l.engine)));
        });
    });
    g.finish();
}

/// Interleaved: 10k vs 1M throughput, then sweep vs idle `begin` latency.
fn paired() {
    let r = common::rounds();
    let n = large();
    let (mut small, mut big) = (vec![], vec![]);
    for _ in 0..r.rounds {
        small.push(with_db(&SMALL_DB, SMALL, |l| {
            common::rate_for(64, r.slice, |_| request(&l.engine))
        }));
        big.push(with_db(&LARGE_DB, n, |l| {
            common::rate_for(64, r.slice, |_| request(&l.engine))
        }));
    }
    common::report_paired(
        &format!("durable req/s, 64 threads: {n} records vs {SMALL} records"),
        "req/s",
        &big,
        &small,
    );
    drop(SMALL_DB.lock().expect("lock").take());

    with_db(&LARGE_DB, n, |l| {
        println!(
            "PEAK_RSS with {} records stored: {:.0} MiB (VmHWM), file {:.0} MiB",
            l.records,
            common::peak_rss_mib().unwrap_or(0.0),
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
                idle.push(
                    common::begin_p99_while(&l.engine, || Instant::now() < end).unwrap_or(p99),
                );
            }
        }
        println!(
            "SWEEP deleted {deleted} expired records in {CHUNKS} passes, {:.1}s of sweeping",
            sweep_time.as_secs_f64()
        );
        if !busy.is_empty() {
            common::report_paired(
                &format!("begin p99, 64 threads: while sweeping {n} expired records vs idle"),
                "us",
                &busy,
                &idle,
            );
        }
    });
    drop(LARGE_DB.lock().expect("lock").take());
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
    drop(SMALL_DB.lock().expect("lock").take());
    drop(LARGE_DB.lock().expect("lock").take());
    Criterion::default().configure_from_args().final_summary();
}
