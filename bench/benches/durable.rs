//! Durable request throughput and `begin` latency, engine vs baselines.
//!
//! Workload: one request = durable `begin` (claim) + durable `complete` with a
//! 300-byte response, on a fresh random UUID key, from 1, 8, 64 and 256
//! client threads. Baselines in the same run:
//! - plain redb, one durable write transaction per operation;
//! - SQLite (WAL, synchronous=FULL), insert-first table, one transaction per
//!   operation;
//! - the same SQLite table behind a writer thread that batches up to 512
//!   queued operations per transaction (the engine's default `max_batch`).
//!
//! Latency: p50/p99 of `begin` with 64 clients running the same workload,
//! beside a raw loop of 4 KiB write + fdatasync in the same directory.
//! Percentiles are printed as `LATENCY …` lines (criterion reports means).
//!
//! After the criterion benches, the targets are measured again interleaved
//! (`PAIRED …` lines; see `common::Rounds` and `paired`): throughput at 64
//! threads against the three baselines and at 8 threads against SQLite
//! batched 512, the bytes written to disk per request (Linux task I/O
//! accounting, see `common::DiskWrites`), and `begin` p50/p99 at 64 threads
//! against a raw fsync loop.
//!
//! Only when asked for by name (`-- device`): the bytes the block device
//! wrote per request, engine vs SQLite batched 512, each slice closing its
//! database so checkpoints are counted (`device`; needs an idle machine).

mod common;

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::sync::Mutex;
use std::time::Instant;

use common::{redb_plain, redb_plain::PlainRedb, sqlite, DiskWrites, Latencies};
use criterion::{criterion_group, BenchmarkId, Criterion, SamplingMode, Throughput};
use idempotency::Engine;

const THREADS: [usize; 4] = [1, 8, 64, 256];

fn throughput(c: &mut Criterion) {
    let mut g = c.benchmark_group("durable begin+complete, 300B response, random uuid keys");
    g.sampling_mode(SamplingMode::Flat);
    g.throughput(Throughput::Elements(1));
    let body = vec![b'x'; common::RESPONSE_BYTES];
    let fp = [7u8; 32];

    for threads in THREADS {
        let id = |name| BenchmarkId::new(name, format!("{threads} threads"));

        let dir = common::bench_dir();
        let engine = Engine::builder()
            .open(dir.path().join("engine.redb"))
            .expect("open engine");
        g.bench_function(id("engine"), |b| {
            b.iter_custom(|iters| {
                common::run_clients(threads, iters, |_, _| {
                    common::engine_request(&engine, &common::random_key());
                })
            });
        });
        drop(engine);

        let redb = PlainRedb::create(&dir.path().join("plain.redb"));
        g.bench_function(id("redb 1 txn/op"), |b| {
            b.iter_custom(|iters| {
                common::run_clients(threads, iters, |_, _| {
                    let key =
                        redb_plain::record_key(common::SCOPE, &uuid::Uuid::new_v4().to_string());
                    assert!(redb.begin(&key, &fp));
                    redb.complete(&key, &fp, &body);
                })
            });
        });
        drop(redb);

        let per_op = sqlite::PerOp::create(&dir.path().join("per_op.sqlite"));
        g.bench_function(id("sqlite 1 txn/op"), |b| {
            b.iter_custom(|iters| {
                common::run_clients(threads, iters, |_, _| {
                    let key = sqlite_key();
                    assert!(per_op.begin(&key, &fp));
                    per_op.complete(&key, &body);
                })
            });
        });
        drop(per_op);

        let batched = sqlite::Batched::create(&dir.path().join("batched.sqlite"), 512, 4096);
        g.bench_function(id("sqlite batched 512"), |b| {
            b.iter_custom(|iters| {
                common::run_clients(threads, iters, |_, _| {
                    let key = sqlite_key();
                    assert!(batched.begin(&key, fp));
                    batched.complete(&key, &body);
                })
            });
        });
    }
    g.finish();
}

fn sqlite_key() -> String {
    format!("{}/{}", common::SCOPE, uuid::Uuid::new_v4())
}

fn latency(c: &mut Criterion) {
    let mut g = c.benchmark_group("begin latency");
    g.sampling_mode(SamplingMode::Flat);
    let dir = common::bench_dir();

    let engine = Engine::builder()
        .open(dir.path().join("engine.redb"))
        .expect("open engine");
    let begins = Latencies::default();
    g.bench_function("engine begin, 64 threads of begin+complete", |b| {
        b.iter_custom(|iters| {
            // Time per request (all threads); percentiles of `begin` alone
            // are collected on the side, one vector per thread.
            let local: Vec<Mutex<Vec<u64>>> = (0..64).map(|_| Mutex::default()).collect();
            let elapsed = common::run_clients(64, iters, |t, _| {
                let ns = common::engine_request(&engine, &common::random_key());
                local[t].lock().expect("lock").push(ns);
            });
            for l in local {
                begins.extend(l.into_inner().expect("lock"));
            }
            elapsed
        });
    });
    drop(engine);

    let file = fsync_file(&dir.path().join("fsync.bin"));
    let block = vec![0xA5u8; 4096];
    let syncs = Latencies::default();
    g.bench_function("raw 4KiB write+fdatasync, 1 thread", |b| {
        b.iter_custom(|iters| {
            let mut local = Vec::with_capacity(iters as usize);
            let start = Instant::now();
            for i in 0..iters {
                let t = Instant::now();
                file.write_all_at(&block, (i % 256) * 4096).expect("write");
                file.sync_data().expect("fdatasync");
                local.push(t.elapsed().as_nanos() as u64);
            }
            let elapsed = start.elapsed();
            syncs.extend(local);
            elapsed
        });
    });
    g.finish();

    let engine = begins.report("engine begin, 64 threads of begin+complete");
    let fsync = syncs.report("raw 4KiB write+fdatasync, 1 thread");
    if let (Some((_, e99)), Some((_, f99))) = (engine, fsync) {
        println!(
            "RATIO begin p99 / fsync p99 = {:.2} (target <= 10)",
            e99 / f99
        );
    }
}

/// Name prefix of the engine's own threads (`idempotency-writer`,
/// `idempotency-sweeper`). A thread the engine adds must be named under it
/// for its writes to count as the engine's wherever they fall (see
/// `bytes_per_request`); an unnamed one would be charged to whichever slice
/// it writes in. redb itself starts no threads.
const ENGINE_THREADS: &str = "idempotency";

/// One slice of an interleaved round: one system, one client-thread count.
struct Slice {
    /// An engine slice (see `bytes_per_request`).
    engine: bool,
    requests: u64,
    rate: f64,
    /// Growth of the disk-write counters over the slice; `None` when they
    /// cannot be read.
    io: Option<DiskWrites>,
}

/// Runs `op` on `threads` client threads for one slice. `io` holds the
/// counters read at the end of the previous slice (so consecutive slices
/// split the time between them with no gap) and is moved on to this
/// slice's end.
fn slice<F>(
    engine: bool,
    threads: usize,
    r: &common::Rounds,
    io: &mut Option<DiskWrites>,
    op: F,
) -> Slice
where
    F: Fn(usize) + Sync,
{
    let (requests, elapsed) = common::calls_for(threads, r.slice, op);
    let before = io.take();
    let mut delta = None;
    if let Some(before) = before {
        match DiskWrites::read(ENGINE_THREADS) {
            Ok(now) => {
                delta = Some(now.since(&before));
                *io = Some(now);
            }
            Err(e) => println!("IO_BYTES skipped from here on: /proc/self/io unreadable ({e})"),
        }
    }
    Slice {
        engine,
        requests,
        rate: requests as f64 / elapsed.as_secs_f64(),
        io: delta,
    }
}

/// Bytes written per request for each slice of one round (in time order),
/// `None` if a slice has no counters.
///
/// The counters are per process, so they are split by thread and time:
/// - a slice keeps what every thread other than the engine's wrote during
///   it: its client threads (plain redb and SQLite 1 txn/op write on them),
///   SQLite's batching writer thread (it is idle once the slice's last
///   client has its answer), and SQLite's WAL checkpoints, which run inside
///   a commit;
/// - the engine's threads' writes go to the engine slice that last started,
///   wherever they fall: its group commits, and any work its requests leave
///   behind for later (a journal checkpoint, a sweep) even when that runs
///   during a baseline's slice. A round starts with an engine slice, so work
///   left over from the previous round lands on the first engine slice of
///   the next; what the engine writes after the last slice of the last
///   round is not counted.
///
/// The engine's threads live through all rounds, so their per-thread
/// counters only grow. Opening the databases and creating their tables is
/// outside the rounds.
/// `syscall`: bytes handed to write calls instead of `write_bytes` (see
/// `DiskWrites`).
fn bytes_per_request(slices: &[Slice], syscall: bool) -> Option<Vec<f64>> {
    let mut bytes = vec![0i64; slices.len()];
    let mut last_engine = None;
    for (i, s) in slices.iter().enumerate() {
        let io = s.io.as_ref()?;
        if s.engine {
            last_engine = Some(i);
        }
        let (process, named) = if syscall {
            (io.process_syscall, io.named_syscall)
        } else {
            (io.process, io.named)
        };
        bytes[i] += process - named;
        bytes[last_engine.unwrap_or(i)] += named;
    }
    Some(
        bytes
            .iter()
            .zip(slices)
            .map(|(&b, s)| b.max(0) as f64 / s.requests.max(1) as f64)
            .collect(),
    )
}

/// The targets, interleaved (see `common::Rounds`): each round runs, in
/// this order, one slice each of the engine, plain redb 1 txn/op, SQLite
/// 1 txn/op and SQLite batched 512 at 64 client threads, then the engine
/// and SQLite batched 512 at 8 client threads. Every system keeps one
/// database, opened by path before the first round, for all rounds. Over
/// each slice it also counts the bytes written to disk per request
/// (`DiskWrites`, `bytes_per_request`); then the `begin` latency rounds.
fn paired() {
    let r = common::rounds();
    let dir = common::bench_dir();
    let body = vec![b'x'; common::RESPONSE_BYTES];
    let fp = [7u8; 32];
    // By path, as users open it (a path open is also what gets the
    // engine's files next to the database, such as its journal).
    let engine = Engine::builder()
        .open(dir.path().join("engine.redb"))
        .expect("open engine");
    let redb = PlainRedb::create(&dir.path().join("plain.redb"));
    let per_op = sqlite::PerOp::create(&dir.path().join("per_op.sqlite"));
    let batched = sqlite::Batched::create(&dir.path().join("batched.sqlite"), 512, 4096);
    let engine_op = |_: usize| {
        common::engine_request(&engine, &common::random_key());
    };
    let batched_op = |_: usize| {
        let key = sqlite_key();
        assert!(batched.begin(&key, fp));
        batched.complete(&key, &body);
    };
    let mut io = match DiskWrites::read(ENGINE_THREADS) {
        Ok(now) => Some(now),
        Err(e) => {
            println!("IO_BYTES skipped: /proc/self/io unreadable ({e})");
            None
        }
    };
    // Per round, in slice order: engine 64, redb, sqlite 1 txn/op,
    // sqlite batched 64, engine 8, sqlite batched 8.
    let mut rounds: Vec<Vec<Slice>> = Vec::new();
    for _ in 0..r.rounds {
        let mut round = Vec::new();
        round.push(slice(true, 64, &r, &mut io, engine_op));
        round.push(slice(false, 64, &r, &mut io, |_| {
            let key = redb_plain::record_key(common::SCOPE, &uuid::Uuid::new_v4().to_string());
            assert!(redb.begin(&key, &fp));
            redb.complete(&key, &fp, &body);
        }));
        round.push(slice(false, 64, &r, &mut io, |_| {
            let key = sqlite_key();
            assert!(per_op.begin(&key, &fp));
            per_op.complete(&key, &body);
        }));
        round.push(slice(false, 64, &r, &mut io, batched_op));
        round.push(slice(true, 8, &r, &mut io, engine_op));
        round.push(slice(false, 8, &r, &mut io, batched_op));
        rounds.push(round);
    }
    let series = |i: usize| -> Vec<f64> { rounds.iter().map(|round| round[i].rate).collect() };
    let (ours, plain, lite, lite_b, ours8, lite_b8) = (
        series(0),
        series(1),
        series(2),
        series(3),
        series(4),
        series(5),
    );
    let name = "durable req/s, 64 threads";
    common::report_paired(
        &format!("{name}: engine vs redb 1 txn/op"),
        "req/s",
        &ours,
        &plain,
    );
    common::report_paired(
        &format!("{name}: engine vs sqlite 1 txn/op"),
        "req/s",
        &ours,
        &lite,
    );
    common::report_paired(
        &format!("{name}: engine vs sqlite batched 512"),
        "req/s",
        &ours,
        &lite_b,
    );
    common::report_paired(
        "durable req/s, 8 threads: engine vs sqlite batched 512",
        "req/s",
        &ours8,
        &lite_b8,
    );

    // Bytes written per request, only if every slice of every round had
    // its counters.
    for (syscall, kind) in [(false, ""), (true, " (write calls)")] {
        let bytes: Option<Vec<Vec<f64>>> = rounds
            .iter()
            .map(|round| bytes_per_request(round, syscall))
            .collect();
        if let Some(bytes) = bytes {
            report_bytes(&rounds, &bytes, kind);
        }
    }

    // begin latency under load vs raw fsync latency, alternating.
    let file = fsync_file(&dir.path().join("fsync.bin"));
    let block = vec![0xA5u8; 4096];
    let (mut b50, mut b99, mut f50, mut f99) = (vec![], vec![], vec![], vec![]);
    for _ in 0..r.rounds {
        let local: Vec<Mutex<Vec<f64>>> = (0..64).map(|_| Mutex::default()).collect();
        common::rate_for(64, r.slice, |t| {
            let ns = common::engine_request(&engine, &common::random_key());
            local[t].lock().expect("lock").push(ns as f64 / 1000.0);
        });
        let mut begins: Vec<f64> = local
            .into_iter()
            .flat_map(|l| l.into_inner().expect("lock"))
            .collect();
        b50.push(common::quantile(&mut begins, 0.5));
        b99.push(common::quantile(&mut begins, 0.99));
        let mut syncs = Vec::new();
        let deadline = Instant::now() + r.slice;
        let mut i = 0u64;
        while Instant::now() < deadline {
            let t = Instant::now();
            file.write_all_at(&block, (i % 256) * 4096).expect("write");
            file.sync_data().expect("fdatasync");
            syncs.push(t.elapsed().as_nanos() as f64 / 1000.0);
            i += 1;
        }
        f50.push(common::quantile(&mut syncs, 0.5));
        f99.push(common::quantile(&mut syncs, 0.99));
    }
    common::report_paired("begin p50 at 64 threads vs raw fsync p50", "us", &b50, &f50);
    common::report_paired("begin p99 at 64 threads vs raw fsync p99", "us", &b99, &f99);
}

/// Prints bytes written per request (`kind` names the counter): over the
/// whole run, and paired per round.
fn report_bytes(rounds: &[Vec<Slice>], bytes: &[Vec<f64>], kind: &str) {
    // The whole run too: per-round figures swing with the slice a
    // checkpoint lands in; the sum does not.
    for (i, what) in [
        (0, "engine, 64 threads"),
        (3, "sqlite batched 512, 64 threads"),
        (4, "engine, 8 threads"),
        (5, "sqlite batched 512, 8 threads"),
    ] {
        let total_bytes: f64 = bytes
            .iter()
            .zip(rounds)
            .map(|(b, round)| b[i] * round[i].requests as f64)
            .sum();
        let total_requests: u64 = rounds.iter().map(|round| round[i].requests).sum();
        println!(
            "BYTES{kind} over all rounds, {what}: {:.0} B/req ({total_requests} requests)",
            total_bytes / total_requests.max(1) as f64
        );
    }
    let series = |i: usize| -> Vec<f64> { bytes.iter().map(|round| round[i]).collect() };
    let name = format!("disk bytes written per request{kind}");
    for (threads, ours, base, what) in [
        (64, 0, 3, "sqlite batched 512"),
        (64, 0, 1, "redb 1 txn/op"),
        (64, 0, 2, "sqlite 1 txn/op"),
        (8, 4, 5, "sqlite batched 512"),
    ] {
        common::report_paired(
            &format!("{name}, {threads} threads: engine vs {what}"),
            "B/req",
            &series(ours),
            &series(base),
        );
    }
}

/// Bytes the block device wrote per request (`common::device`), engine vs
/// SQLite batched 512 at 64 threads, alternating, each slice on its own:
/// open the database (each system keeps one file for all rounds), run
/// requests for three slices' time, close it (the engine checkpoints
/// redb and empties its journal; SQLite checkpoints its WAL into the
/// database when its last connection closes), `sync`. So each slice is
/// charged everything its requests cause, deferred work included. Only
/// selected by name (`-- device`), and only meaningful on an otherwise
/// idle machine: the counter is the whole device's.
fn device() {
    let dir = common::bench_dir();
    let Some(device) = common::device::Device::of(dir.path()) else {
        println!(
            "DEVICE skipped: no block-device counter for {}",
            dir.path().display()
        );
        return;
    };
    let r = common::rounds();
    let slice = r.slice * 3;
    let body = vec![b'x'; common::RESPONSE_BYTES];
    let fp = [7u8; 32];
    let engine_path = dir.path().join("engine.redb");
    let sqlite_path = dir.path().join("batched.sqlite");
    let measure = |run: &dyn Fn() -> u64| -> Option<(f64, u64)> {
        let before = device.written_after_sync()?;
        let requests = run();
        let after = device.written_after_sync()?;
        Some(((after - before) as f64 / requests.max(1) as f64, requests))
    };
    let (mut ours, mut base) = (Vec::new(), Vec::new());
    for _ in 0..r.rounds {
        let engine = measure(&|| {
            let engine = Engine::builder().open(&engine_path).expect("open engine");
            let (n, _) = common::calls_for(64, slice, |_| {
                common::engine_request(&engine, &common::random_key());
            });
            drop(engine);
            n
        });
        let sqlite = measure(&|| {
            let batched = sqlite::Batched::create(&sqlite_path, 512, 4096);
            let (n, _) = common::calls_for(64, slice, |_| {
                let key = sqlite_key();
                assert!(batched.begin(&key, fp));
                batched.complete(&key, &body);
            });
            drop(batched);
            n
        });
        let (Some((e, en)), Some((b, bn))) = (engine, sqlite) else {
            println!("DEVICE skipped: `sync` or the device counter failed");
            return;
        };
        println!("DEVICE round: engine {e:.0} B/req ({en} requests), sqlite batched 512 {b:.0} B/req ({bn} requests)");
        ours.push(e);
        base.push(b);
    }
    common::report_paired(
        "device bytes written per request, 64 threads, incl. checkpoints at close: engine vs sqlite batched 512",
        "B/req",
        &ours,
        &base,
    );
}

/// A 1 MiB file, written and synced, for a loop of in-place 4 KiB writes.
fn fsync_file(path: &std::path::Path) -> std::fs::File {
    let file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(path)
        .expect("open fsync file");
    let block = vec![0xA5u8; 4096];
    for i in 0..256u64 {
        file.write_all_at(&block, i * 4096).expect("write");
    }
    file.sync_all().expect("sync");
    file
}

criterion_group! {
    name = benches;
    config = common::durable_criterion();
    targets = throughput, latency
}

fn main() {
    benches();
    if common::paired_selected() {
        paired();
    }
    if common::selected("device") {
        device();
    }
    Criterion::default().configure_from_args().final_summary();
}
