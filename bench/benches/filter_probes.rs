//! A fresh key's filter probes at 10M records (issue 26): 306 sealed
//! partitions of 32,768 keys, the partition count a 10M store has
//! (BENCHMARKS.md, "Format 3 at 10M"), every filter probed for a key none
//! holds. Two layouts of the same filters in the same run: each filter in
//! its own array (`separate`, the layout before grouping) and the filters
//! kept in groups of one block count, a key's blocks in every member
//! adjacent (`grouped`, what the engine keeps;
//! `src/store/redb/partition/filter_group.rs`).
//!
//! `cargo bench -p idempotency-bench --bench filter_probes`: a `BUILD`
//! line (building the filters, then grouping them as an open does: what
//! grouping costs an open), criterion's figure for each
//! layout, then a `PAIRED` line, the measure of
//! BENCHMARKS.md: 9 rounds, each timing 20,000 fresh keys in one layout
//! then the other, the median ns per key of each and the median of the
//! per-round ratios grouped / separate. `IDEMPOTENCY_BENCH_PARTITIONS`
//! sets the partition count. Test mode (`cargo test --benches`) builds 8
//! partitions of 1,000 keys; both modes first check that the layouts
//! answer alike for 10,000 keys.

mod common;

use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use idempotency::bench_fixtures::SealedFilters;

const KEYS: u64 = 32_768;

fn partitions() -> u64 {
    std::env::var("IDEMPOTENCY_BENCH_PARTITIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(306)
}

/// Keys no partition holds: a UUID-like record key each.
fn absent(i: u64) -> Vec<u8> {
    format!(
        "\x04shop/fresh-{:016x}",
        i.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    )
    .into_bytes()
}

fn probes(c: &mut Criterion) {
    let measuring = common::measuring();
    let (partitions, keys) = if measuring {
        (partitions(), KEYS)
    } else {
        (8, 1_000)
    };
    let build = |grouped| match SealedFilters::new(partitions, keys, grouped) {
        Ok(f) => f,
        Err(e) => panic!("building {partitions} filters: {e}"),
    };
    let started = Instant::now();
    let separate = build(false);
    let built_separate = started.elapsed();
    let started = Instant::now();
    let grouped = build(true);
    let built_grouped = started.elapsed();
    if measuring {
        // What grouping adds to an open, which keeps the filters one by one.
        println!(
            "BUILD filter_probes {partitions} partitions: separate {:.2} s, grouped {:.2} s (the same inserts, then grouped as an open groups them)",
            built_separate.as_secs_f64(),
            built_grouped.as_secs_f64()
        );
    }
    for i in 0..10_000 {
        let k = absent(i);
        assert_eq!(
            separate.maybes(&k),
            grouped.maybes(&k),
            "key {i}: the layouts disagree"
        );
    }
    let mut g = c.benchmark_group(format!("filter_probes/{partitions}x{keys}"));
    for (name, filters) in [("separate", &separate), ("grouped", &grouped)] {
        let mut i = 0u64;
        g.bench_function(name, |b| {
            b.iter_batched(
                || {
                    i += 1;
                    absent(i)
                },
                |k| black_box(filters.maybes(&k)),
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
    if measuring {
        paired(&separate, &grouped, partitions);
    }
}

/// Nanoseconds per fresh key over `n` keys from `from` in `filters`.
fn ns_per_key(filters: &SealedFilters, from: u64, n: u64) -> f64 {
    let keys: Vec<Vec<u8>> = (from..from + n).map(absent).collect();
    let start = Instant::now();
    for k in &keys {
        black_box(filters.maybes(k));
    }
    start.elapsed().as_nanos() as f64 / n as f64
}

/// The `PAIRED` line (module docs).
fn paired(separate: &SealedFilters, grouped: &SealedFilters, partitions: u64) {
    const ROUNDS: u64 = 9;
    const N: u64 = 20_000;
    let (mut s, mut g, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let from = 1_000_000 + round * N;
        let a = ns_per_key(separate, from, N);
        let b = ns_per_key(grouped, from, N);
        s.push(a);
        g.push(b);
        ratio.push(b / a);
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (lo, hi) = (
        ratio.iter().copied().fold(f64::INFINITY, f64::min),
        ratio.iter().copied().fold(0.0, f64::max),
    );
    println!(
        "PAIRED filter_probes {partitions} partitions: separate {:.0} ns/key, grouped {:.0} ns/key, grouped/separate {:.2}x [{lo:.2}, {hi:.2}]",
        med(&mut s),
        med(&mut g),
        med(&mut ratio),
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(3))
        .without_plots();
    targets = probes
}
criterion_main!(benches);
