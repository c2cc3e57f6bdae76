//! Helpers shared by the benches: where databases live, the client-thread
//! fan-out, latency percentiles, peak RSS, the request workload, and the
//! plain-redb, SQLite and Redis baselines that run beside the engine.
#![allow(dead_code)] // each bench binary uses a different subset

pub mod device;
pub mod pg;
pub mod redb_plain;
pub mod redis_plain;
pub mod sqlite;

use std::path::PathBuf;
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use criterion::Criterion;
use idempotency::{Engine, Envelope, Fingerprint, IdempotencyKey};

/// Scope used by every bench key (`bench:create_payment`, 20 bytes).
pub const SCOPE: &str = "bench:create_payment";
/// Response body size of the request workload, in bytes.
pub const RESPONSE_BYTES: usize = 300;

/// Criterion settings for slow, durable benches: 10 flat samples, short
/// warm-up and measurement, so the whole `cargo bench` stays short.
pub fn durable_criterion() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .without_plots()
        .configure_from_args()
}

/// Whether this is a real measurement (`cargo bench`) rather than criterion's
/// test mode (`cargo test --benches` / `--all-targets`, which runs each bench
/// once): test mode uses small preloads so it stays fast.
pub fn measuring() -> bool {
    let args: Vec<String> = std::env::args().collect();
    args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--test" || a == "--list")
}

/// A fresh temporary directory for databases, on the real disk: under
/// `$IDEMPOTENCY_BENCH_DIR` if set, else under Cargo's per-target temp dir
/// (`target/tmp`), never `/tmp` (often a tmpfs, where fsync is free).
pub fn bench_dir() -> tempfile::TempDir {
    let base = std::env::var_os("IDEMPOTENCY_BENCH_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")), PathBuf::from);
    std::fs::create_dir_all(&base).expect("create the bench base dir");
    let dir = tempfile::tempdir_in(&base).expect("create a bench temp dir");
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        eprintln!(
            "bench databases under {} (filesystem: {})",
            base.display(),
            fs_type(&base)
        );
    });
    dir
}

/// The filesystem type of the mount holding `path` (from /proc/mounts).
pub fn fs_type(path: &std::path::Path) -> String {
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, at, ty) = (f.next()?, f.next()?, f.next()?);
            path.starts_with(at).then(|| (at.len(), ty.to_string()))
        })
        .max()
        .map_or_else(|| "unknown".into(), |(_, ty)| ty)
}

/// Runs `iters` calls of `op` spread over `threads` client threads that
/// start together; returns the wall time from the start signal until the
/// last thread finishes. `op(thread, i)` gets the thread index and the
/// call's index within that thread.
pub fn run_clients<F>(threads: usize, iters: u64, op: F) -> Duration
where
    F: Fn(usize, u64) + Sync,
{
    let barrier = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        for t in 0..threads {
            let n = iters / threads as u64 + u64::from((t as u64) < iters % threads as u64);
            let (barrier, op) = (&barrier, &op);
            s.spawn(move || {
                barrier.wait();
                for i in 0..n {
                    op(t, i);
                }
            });
        }
        barrier.wait();
        Instant::now()
    })
    .elapsed()
}

/// Latency samples collected by client threads, in nanoseconds.
#[derive(Default)]
pub struct Latencies(Mutex<Vec<u64>>);

impl Latencies {
    pub fn extend(&self, samples: Vec<u64>) {
        self.0.lock().expect("latency lock").extend(samples);
    }

    /// (count, p50, p99) in microseconds; `None` if nothing was recorded
    /// (the bench was filtered out).
    pub fn summary(&self) -> Option<(usize, f64, f64)> {
        let mut v = std::mem::take(&mut *self.0.lock().expect("latency lock"));
        if v.is_empty() {
            return None;
        }
        v.sort_unstable();
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize] as f64 / 1000.0;
        Some((v.len(), at(0.50), at(0.99)))
    }

    /// Prints `name: n=…, p50=… µs, p99=… µs` and returns (p50, p99).
    pub fn report(&self, name: &str) -> Option<(f64, f64)> {
        let (n, p50, p99) = self.summary()?;
        println!("LATENCY {name}: n={n} p50={p50:.1}us p99={p99:.1}us");
        Some((p50, p99))
    }
}

/// Peak resident set size of this process (VmHWM), in MiB.
pub fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// A fresh random key (UUID v4), as clients send them.
pub fn random_key() -> IdempotencyKey {
    IdempotencyKey::new(SCOPE, uuid::Uuid::new_v4().to_string()).expect("valid key")
}

/// The response stored by every request: status 201, a 300-byte body.
pub fn response() -> Envelope {
    Envelope::new(1, 201, vec![b'x'; RESPONSE_BYTES])
}

/// A fingerprint; its value does not matter to the store.
pub fn fingerprint() -> Fingerprint {
    Fingerprint::from_bytes([7; 32])
}

/// One request: durable `begin` (a claim) then durable `complete`.
/// Returns the `begin` latency in nanoseconds.
pub fn engine_request(engine: &Engine, key: &IdempotencyKey) -> u64 {
    let start = Instant::now();
    let begin = engine.begin(key, fingerprint()).expect("begin");
    let begin_ns = start.elapsed().as_nanos() as u64;
    match begin {
        idempotency::Begin::Claimed(claim) => engine.complete(claim, response()).expect("complete"),
        other => panic!("a fresh key must be claimed, got {other:?}"),
    }
    begin_ns
}

/// Stores `count` completed records through the engine (64 client threads,
/// so claims are group-committed) and returns their keys.
pub fn preload_engine(engine: &Engine, count: usize) -> Vec<IdempotencyKey> {
    let keys: Vec<IdempotencyKey> = (0..count).map(|_| random_key()).collect();
    let threads = 64.min(count.max(1));
    let chunk = count.div_ceil(threads);
    std::thread::scope(|s| {
        for part in keys.chunks(chunk) {
            s.spawn(move || {
                for key in part {
                    engine_request(engine, key);
                }
            });
        }
    });
    keys
}

/// A cheap deterministic index sequence for point lookups (xorshift).
pub struct Picker(u64);

impl Picker {
    pub fn new(seed: u64) -> Picker {
        Picker(seed | 1)
    }

    pub fn next(&mut self, len: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % len as u64) as usize
    }
}

/// Interleaved ("paired") measurement: the machine these benches run on is
/// shared, and its fsync latency drifts by 10× within minutes, so a ratio of
/// two criterion results taken minutes apart is mostly noise. Each target
/// ratio is therefore also measured in rounds that alternate ours and the
/// baseline in short slices; each round gives a ratio, and the median over
/// rounds is reported (`PAIRED …` lines).
pub struct Rounds {
    pub rounds: usize,
    pub slice: Duration,
}

/// 5 rounds of 1.5 s slices under `cargo bench` (`IDEMPOTENCY_BENCH_ROUNDS`
/// sets the number of rounds); one 50 ms round in test mode.
pub fn rounds() -> Rounds {
    if measuring() {
        let rounds = std::env::var("IDEMPOTENCY_BENCH_ROUNDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n| n > 0)
            .unwrap_or(5);
        Rounds {
            rounds,
            slice: Duration::from_millis(1500),
        }
    } else {
        Rounds {
            rounds: 1,
            slice: Duration::from_millis(50),
        }
    }
}

/// Whether a name filter on the command line contains `name` (a section
/// that runs only when asked for by name).
pub fn selected(name: &str) -> bool {
    std::env::args()
        .skip(1)
        .any(|a| !a.starts_with('-') && a.contains(name))
}

/// Whether the interleaved measurements run: always in test mode, and under
/// `cargo bench` unless a filter is given that does not mention "paired".
pub fn paired_selected() -> bool {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-') && a.parse::<f64>().is_err())
        .collect();
    filters.is_empty() || filters.iter().any(|f| f.contains("paired"))
}

/// Runs `op(thread)` on `threads` client threads until `slice` has passed;
/// returns completed calls per second.
pub fn rate_for<F>(threads: usize, slice: Duration, op: F) -> f64
where
    F: Fn(usize) + Sync,
{
    let (calls, elapsed) = calls_for(threads, slice, op);
    calls as f64 / elapsed.as_secs_f64()
}

/// [`rate_for`], returning the number of completed calls and the wall time
/// from the start signal until the last thread finished its last call.
pub fn calls_for<F>(threads: usize, slice: Duration, op: F) -> (u64, Duration)
where
    F: Fn(usize) + Sync,
{
    let count = std::sync::atomic::AtomicU64::new(0);
    let barrier = Barrier::new(threads + 1);
    let start = std::thread::scope(|s| {
        for t in 0..threads {
            let (barrier, op, count) = (&barrier, &op, &count);
            s.spawn(move || {
                barrier.wait();
                let deadline = Instant::now() + slice;
                let mut n = 0;
                while Instant::now() < deadline {
                    op(t);
                    n += 1;
                }
                count.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            });
        }
        barrier.wait();
        Instant::now()
    });
    let elapsed = start.elapsed();
    (count.into_inner(), elapsed)
}

/// `begin` p99 (µs) of 64 client threads running durable begin+complete
/// on fresh keys while `go()` holds; `None` if none finished.
pub fn begin_p99_while(engine: &Engine, go: impl Fn() -> bool + Sync) -> Option<f64> {
    let local: Vec<Mutex<Vec<f64>>> = (0..64).map(|_| Mutex::default()).collect();
    std::thread::scope(|s| {
        for slot in &local {
            let go = &go;
            s.spawn(move || {
                while go() {
                    let ns = engine_request(engine, &random_key());
                    slot.lock().expect("lock").push(ns as f64 / 1000.0);
                }
            });
        }
    });
    let mut all: Vec<f64> = local
        .into_iter()
        .flat_map(|l| l.into_inner().expect("lock"))
        .collect();
    (!all.is_empty()).then(|| quantile(&mut all, 0.99))
}

/// The value at quantile `q` of `v` (sorted in place).
pub fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// Prints a `PAIRED` line: medians of both series and the median, min and
/// max of the per-round ratios `ours[i] / base[i]`.
pub fn report_paired(name: &str, unit: &str, ours: &[f64], base: &[f64]) {
    let mut ratios: Vec<f64> = ours.iter().zip(base).map(|(o, b)| o / b).collect();
    let (mut o, mut b) = (ours.to_vec(), base.to_vec());
    let (om, bm) = (quantile(&mut o, 0.5), quantile(&mut b, 0.5));
    let rm = quantile(&mut ratios, 0.5);
    println!(
        "PAIRED {name}: ours {om:.1} {unit}, baseline {bm:.1} {unit}, ratio median {rm:.2} (min {:.2}, max {:.2}, {} rounds)",
        ratios[0],
        ratios[ratios.len() - 1],
        ratios.len()
    );
}

/// Prints a `ROUNDS` line: the per-round ratios `ours[i] / base[i]` in
/// measurement order, with both series (the `PAIRED` line has only their
/// medians).
pub fn report_rounds(name: &str, ours: &[f64], base: &[f64]) {
    let list = |v: Vec<String>| v.join(" ");
    println!(
        "ROUNDS {name}: ratios {} | ours {} | baseline {}",
        list(
            ours.iter()
                .zip(base)
                .map(|(o, b)| format!("{:.2}", o / b))
                .collect()
        ),
        list(ours.iter().map(|o| format!("{o:.0}")).collect()),
        list(base.iter().map(|b| format!("{b:.0}")).collect()),
    );
}

/// A reading of Linux's per-task I/O accounting: bytes this process sent
/// toward the disk (`write_bytes` minus `cancelled_write_bytes`), in all and
/// for its live threads whose name starts with a prefix.
///
/// What the kernel counts (`Documentation/filesystems/proc.rst`, "io"):
/// a buffered write is charged when it dirties a page, to the thread that
/// dirties it, one whole page (4 KiB) per page dirtied, whether writeback
/// happens now, at the next fsync or after the measurement. So no flush is
/// needed to see a slice's writes, and a page dirtied again before it is
/// written back counts once (it is written once). Pages dirtied through a
/// shared mapping (SQLite's `-shm` file) count the same way. `O_DIRECT`
/// writes are charged when submitted. `cancelled_write_bytes` are dirty
/// pages dropped by a truncate or unlink before writeback, so never written.
/// Not counted: the filesystem's own journal and metadata blocks (ext4's
/// jbd2 thread writes them), the device's internal write amplification,
/// and anything other processes write. Threads that have exited stay in the
/// process total (`/proc/self/io`); the per-thread figures
/// (`/proc/self/task/<tid>/io`) cover live threads only.
///
/// On this machine's kernel (6.18, ext4 with large folios) `write_bytes`
/// charges a write into a clean page-cache folio with the whole folio,
/// which can be far larger than 4 KiB: in a `paired` run the engine's
/// writer thread passed 0.3 GB to `write` calls (`wchar`) and was charged
/// 4.4 GB of `write_bytes`. Random page writes (redb's B-tree pages)
/// suffer from it, sequential appends (the journal, SQLite's WAL) hardly.
/// So the syscall figure (`*_syscall`: `wchar`, every byte handed to a
/// `write`/`pwrite` call) is kept beside it; it counts a page rewritten
/// twice before writeback twice, and no metadata.
#[derive(Clone, Debug)]
pub struct DiskWrites {
    /// The whole process, exited threads included.
    pub process: i64,
    /// The live threads whose name starts with the prefix given: their
    /// growth since the reading this was taken against (see `since`), or
    /// their totals in a raw reading.
    pub named: i64,
    /// Like `process`, bytes handed to write calls (`wchar`).
    pub process_syscall: i64,
    /// Like `named`, bytes handed to write calls (`wchar`).
    pub named_syscall: i64,
    /// Each named live thread's totals (written, syscall), by thread id,
    /// for the next `since`.
    per_thread: std::collections::HashMap<u64, (i64, i64)>,
}

impl DiskWrites {
    /// Reads the counters now; `named` sums the live threads whose name
    /// (`comm`, at most 15 bytes) starts with `prefix`. An error if
    /// `/proc/self/io` cannot be read (no procfs, no task I/O accounting);
    /// a thread that exits while the list is read is skipped.
    pub fn read(prefix: &str) -> std::io::Result<DiskWrites> {
        let (process, process_syscall) = io_written(&std::fs::read_to_string("/proc/self/io")?)
            .ok_or_else(|| std::io::Error::other("no write_bytes line in /proc/self/io"))?;
        let mut per_thread = std::collections::HashMap::new();
        for task in std::fs::read_dir("/proc/self/task")? {
            let dir = task?.path();
            let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else {
                continue;
            };
            let tid = dir
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.parse::<u64>().ok());
            if let (Some(tid), true) = (tid, comm.trim_end().starts_with(prefix)) {
                let io = std::fs::read_to_string(dir.join("io")).unwrap_or_default();
                per_thread.insert(tid, io_written(&io).unwrap_or((0, 0)));
            }
        }
        Ok(DiskWrites {
            process,
            named: per_thread.values().map(|v| v.0).sum(),
            process_syscall,
            named_syscall: per_thread.values().map(|v| v.1).sum(),
            per_thread,
        })
    }

    /// The counters' growth since `earlier`. A named thread's growth counts
    /// only while it lives in both readings (a new one counts from 0); an
    /// engine thread that exited in between (an engine dropped) would
    /// otherwise take its whole lifetime's writes out of `named` and leave
    /// them in `process`, charged to the wrong slice.
    pub fn since(&self, earlier: &DiskWrites) -> DiskWrites {
        let growth = |pick: fn(&(i64, i64)) -> i64| -> i64 {
            self.per_thread
                .iter()
                .map(|(tid, now)| pick(now) - earlier.per_thread.get(tid).map_or(0, pick))
                .sum()
        };
        DiskWrites {
            process: self.process - earlier.process,
            named: growth(|v| v.0),
            process_syscall: self.process_syscall - earlier.process_syscall,
            named_syscall: growth(|v| v.1),
            per_thread: std::collections::HashMap::new(),
        }
    }
}

/// `write_bytes - cancelled_write_bytes`, and `wchar`, from the text of
/// an `io` file.
fn io_written(text: &str) -> Option<(i64, i64)> {
    let field = |name: &str| {
        text.lines().find_map(|l| {
            l.strip_prefix(name)?
                .strip_prefix(':')?
                .trim()
                .parse::<i64>()
                .ok()
        })
    };
    Some((
        field("write_bytes")? - field("cancelled_write_bytes").unwrap_or(0),
        field("wchar").unwrap_or(0),
    ))
}
