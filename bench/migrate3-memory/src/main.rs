//! `fill PATH N`: a format-2 store of N COMPLETED records (the bench
//! fixture's preload, as `bench/benches/scale10m.rs` fills it: UUID-shaped
//! keys, 300-byte bodies, two sorted runs, so its leaves are as full as
//! traffic leaves them).
//!
//! `open PATH format2|format3 [STEP [STOP]]`: opens the store (with
//! `migrate_to_format_3`: migrating a format-2 file; with STEP, in steps of
//! STEP records; with STOP, stopped by the test hook after STOP steps, so
//! that a second open does only what is left: with STOP = the steps that
//! copy every record, only the last transaction, the switch), closes it,
//! and prints the open's wall time and the process's peak RSS (`VmHWM`).
//! Run each open in a fresh process on a fresh copy of the filled file.

use std::path::Path;
use std::time::{Duration, Instant};

use idempotency::bench_fixtures::{self, CompletedRecord, Order, Preload};
use idempotency::{Engine, Envelope, Fingerprint, IdempotencyKey};

const T0: u64 = 1_800_000_000_000;
const TTL: Duration = Duration::from_secs(24 * 3600);

/// splitmix64's finalizer.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE5_E9B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn record(i: u64, n: u64) -> CompletedRecord {
    let (a, b) = (mix(i), mix(i ^ 0x5555_5555_5555_5555));
    let uuid = format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xffff,
        b >> 48,
        b & 0xffff_ffff_ffff
    );
    let ttl_ms = TTL.as_millis() as u64;
    CompletedRecord {
        key: IdempotencyKey::new("bench:create_payment", uuid).expect("a valid key"),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        response: Envelope::new(1, 201, vec![b'x'; 300]),
        at_ms: T0 - ttl_ms + (i + 1) * ttl_ms / n.max(1),
    }
}

fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kib| kib.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}

fn mib(path: &Path) -> f64 {
    std::fs::metadata(path).map_or(0.0, |m| m.len() as f64 / (1 << 20) as f64)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1..).unwrap_or_default() {
        [cmd, path, n] if cmd == "fill" => {
            let n: u64 = n.parse()?;
            let path = Path::new(path);
            let started = Instant::now();
            let plan = Preload {
                count: n,
                order: Order::SortedRuns(2),
                records_per_txn: 250_000,
                lease: Duration::from_secs(30),
                ttl: TTL,
                cache_bytes: 1 << 30,
            };
            let shape = bench_fixtures::preload_completed(path, plan, |i| record(i, n))?;
            println!(
                "FILL {} records in {:.1} s: file {:.0} MiB, {} leaf + {} branch pages",
                shape.records,
                started.elapsed().as_secs_f64(),
                mib(path),
                shape.leaf_pages,
                shape.branch_pages
            );
        }
        [cmd, path, format, steps @ ..] if cmd == "open" => {
            let path = Path::new(path);
            let before = mib(path);
            let builder = Engine::builder()
                .ttl(TTL)
                .sweep_interval(None)
                .recovery_reserve(0);
            let builder = match (format.as_str(), steps) {
                ("format2", []) => builder,
                ("format3", []) => builder.migrate_to_format_3(),
                ("format3", [step]) => builder.unstable_format_3_migration(step.parse()?, None),
                ("format3", [step, stop]) => {
                    builder.unstable_format_3_migration(step.parse()?, Some(stop.parse()?))
                }
                other => {
                    return Err(format!("format2 or format3 [STEP [STOP]], not {other:?}").into())
                }
            };
            let started = Instant::now();
            let result = builder.open(path);
            let opened = started.elapsed();
            let outcome = match result {
                Ok(engine) => {
                    drop(engine);
                    "opened".to_string()
                }
                Err(e) => format!("failed: {e}"),
            };
            println!(
                "OPEN {format} {steps:?} {outcome}: {:.1} s (closed after {:.1} s), peak RSS {:.0} MiB, file {before:.0} -> {:.0} MiB",
                opened.as_secs_f64(),
                started.elapsed().as_secs_f64(),
                peak_rss_mib(),
                mib(path)
            );
        }
        _ => return Err("usage: fill PATH N | open PATH format2|format3".into()),
    }
    Ok(())
}
