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
//! After the criterion benches, the target ratios at 64 threads are measured
//! again interleaved (`PAIRED …` lines; see `common::Rounds`).

mod common;

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::sync::Mutex;
use std::time::Instant;

use common::{redb_plain, redb_plain::PlainRedb, sqlite, Latencies};
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
            "RATIO begin p99 / fsync p99 = {:.2} (target <= 5)",
            e99 / f99
        );
    }
}

/// The target ratios, interleaved (see `common::Rounds`): 64 client
/// threads, each system for one slice per round.
fn paired() {
    let r = common::rounds();
    let dir = common::bench_dir();
    let body = vec![b'x'; common::RESPONSE_BYTES];
    let fp = [7u8; 32];
    let engine = Engine::builder()
        .open(dir.path().join("engine.redb"))
        .expect("open engine");
    let redb = PlainRedb::create(&dir.path().join("plain.redb"));
    let per_op = sqlite::PerOp::create(&dir.path().join("per_op.sqlite"));
    let batched = sqlite::Batched::create(&dir.path().join("batched.sqlite"), 512, 4096);
    let (mut ours, mut plain, mut lite, mut lite_b) = (vec![], vec![], vec![], vec![]);
    for _ in 0..r.rounds {
        ours.push(common::rate_for(64, r.slice, |_| {
            common::engine_request(&engine, &common::random_key());
        }));
        plain.push(common::rate_for(64, r.slice, |_| {
            let key = redb_plain::record_key(common::SCOPE, &uuid::Uuid::new_v4().to_string());
            assert!(redb.begin(&key, &fp));
            redb.complete(&key, &fp, &body);
        }));
        lite.push(common::rate_for(64, r.slice, |_| {
            let key = sqlite_key();
            assert!(per_op.begin(&key, &fp));
            per_op.complete(&key, &body);
        }));
        lite_b.push(common::rate_for(64, r.slice, |_| {
            let key = sqlite_key();
            assert!(batched.begin(&key, fp));
            batched.complete(&key, &body);
        }));
    }
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
    Criterion::default().configure_from_args().final_summary();
}
