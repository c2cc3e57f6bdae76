//! The merged layout's builder: sealed partitions merged in key order
//! into fewer tables (issue 26's open questions 1 and 2).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use redb::{Database, Durability, ReadableDatabase, ReadableTable};

use super::{def, env_usize, part_name};

pub(crate) fn merged_name(m: usize) -> String {
    format!("merged_{m:06}")
}

/// Records per write transaction of the merge (default; the knob is
/// `IDEMPOTENCY_BENCH_MERGE_TXN`): bounds how long one merge step holds the
/// writer.
pub(crate) const MERGE_TXN: usize = 4096;

/// Merges the sealed partitions (all but the newest), `group` at a time
/// and oldest first, into one table each (`merged_N`): a k-way merge of the
/// sources' key-ordered iterators, written in key order (redb 4.6 leaves a
/// full rightmost leaf packed on an ascending insert, so the pages fill) in
/// write transactions of at most `MERGE_TXN` records (durable, unless
/// `IDEMPOTENCY_BENCH_MERGE_DURABLE=0`), then the sources dropped, one
/// transaction each. Prints a `MERGE`
/// line: total time, transactions and the longest one (a stall of the
/// engine's writer if it ran there).
pub(crate) fn merge_sealed(db: &Database, plan: &[u64], group: usize) {
    let start = Instant::now();
    let (mut steps, mut longest, mut longest_drop) = (0u64, Duration::ZERO, Duration::ZERO);
    let mut longest_sync = Duration::ZERO;
    let step = env_usize("IDEMPOTENCY_BENCH_MERGE_TXN")
        .unwrap_or(MERGE_TXN)
        .max(1);
    // `IDEMPOTENCY_BENCH_MERGE_DURABLE=0`: steps and drops commit with
    // `Durability::None` and one durable commit per merged table follows
    // (the engine's journal + checkpoint regime, where a step is not an
    // fsync of its own); default: every step durable.
    let durable = std::env::var("IDEMPOTENCY_BENCH_MERGE_DURABLE").map_or(true, |v| v != "0");
    let begin = || {
        let mut txn = db.begin_write().expect("txn");
        if !durable {
            txn.set_durability(Durability::None).expect("durability");
        }
        txn
    };
    let sealed: Vec<u64> = (0..plan.len() as u64 - 1).collect();
    let mut merged = 0;
    for (m, chunk) in sealed.chunks(group).enumerate() {
        let read = db.begin_read().expect("txn");
        let sources: Vec<_> = chunk
            .iter()
            .map(|&p| read.open_table(def(&part_name(p))).expect("t"))
            .collect();
        let mut iters: Vec<_> = sources.iter().map(|t| t.iter().expect("iter")).collect();
        let mut heap = BinaryHeap::new();
        let pull = |i: usize, iters: &mut [redb::Range<'_, &[u8], &[u8]>]| {
            iters[i].next().map(|e| {
                let (k, v) = e.expect("entry");
                Reverse((k.value().to_vec(), v.value().to_vec(), i))
            })
        };
        for i in 0..iters.len() {
            heap.extend(pull(i, &mut iters));
        }
        while !heap.is_empty() {
            let t0 = Instant::now();
            let txn = begin();
            {
                let mut out = txn.open_table(def(&merged_name(m))).expect("t");
                for _ in 0..step {
                    let Some(Reverse((k, v, i))) = heap.pop() else {
                        break;
                    };
                    out.insert(k.as_slice(), v.as_slice()).expect("i");
                    merged += 1;
                    heap.extend(pull(i, &mut iters));
                }
            }
            txn.commit().expect("commit");
            steps += 1;
            longest = longest.max(t0.elapsed());
        }
        drop(iters);
        drop(sources);
        drop(read);
        // One source per transaction: redb frees a dropped table's pages
        // inside the dropping transaction.
        for &p in chunk {
            let t0 = Instant::now();
            let txn = begin();
            assert!(txn.delete_table(def(&part_name(p))).expect("delete"));
            txn.commit().expect("commit");
            longest_drop = longest_drop.max(t0.elapsed());
        }
        if !durable {
            let t0 = Instant::now();
            db.begin_write().expect("txn").commit().expect("commit");
            longest_sync = longest_sync.max(t0.elapsed());
        }
    }
    println!(
        "MERGE {} sealed partitions into {} tables ({group} per table): {merged} records in {:.2}s ({:.1} µs per record), {steps} {} write transactions of ≤ {step} records, longest {:.1} ms; longest drop of one source {:.1} ms{}",
        sealed.len(),
        sealed.len().div_ceil(group),
        start.elapsed().as_secs_f64(),
        start.elapsed().as_secs_f64() * 1e6 / merged.max(1) as f64,
        if durable { "durable" } else { "non-durable" },
        longest.as_secs_f64() * 1e3,
        longest_drop.as_secs_f64() * 1e3,
        if durable {
            String::new()
        } else {
            format!(
                "; longest durable commit after a merged table {:.1} ms",
                longest_sync.as_secs_f64() * 1e3
            )
        }
    );
}
