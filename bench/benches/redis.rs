//! Durable request throughput on Redis: the engine's Redis backend vs a
//! hand-written baseline on the same server, with the embedded (redb)
//! engine beside for scale.
//!
//! Workload, as in `postgres.rs`: one request = durable claim + durable
//! completion with a 300-byte response, on a fresh random UUID key, from 8
//! and from 64 client threads. The systems:
//! - the engine on Redis, `redis_pool_size(64)` (a connection per client
//!   thread at 64, as the baseline has);
//! - the hand-written baseline (`common::redis_plain`): a Lua claim script
//!   (SET-if-absent of a small PROCESSING value with a token from `INCR`,
//!   a fingerprint compare when the key is present) and a completion `SET
//!   … PX`, one connection per client thread;
//! - the engine on redb (a file on the local disk), for scale.
//!
//! The server's durability is printed (`appendonly`, `appendfsync`);
//! `scripts/with-redis` starts one with `appendfsync always`, so every
//! write is fsynced before its reply. After the criterion benches the
//! ratios are measured again interleaved, one slice per system per round
//! (`PAIRED` and `ROUNDS` lines; see `common::Rounds`).
//!
//! With `IDEMPOTENCY_BENCH_COMMANDS=N` it only counts: N requests of the
//! engine, then N of the baseline, one at a time, each after `CONFIG
//! RESETSTAT`, and prints the server's `INFO commandstats` per request
//! (commands a script runs included) and the script time (`EVALSHA`
//! `usec`) per request: the server-side work, which machine load barely
//! changes. The engine's background sweeper is off for the count.
//!
//! Needs a server: `IDEMPOTENCY_BENCH_REDIS` (or `IDEMPOTENCY_TEST_REDIS`)
//! holds its URL. Without one the bench prints how to start one and does
//! nothing, so `cargo test --benches` passes without a server.

mod common;

use common::redis_plain::Baseline;
use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use idempotency::Engine;

/// Client thread counts measured.
const THREADS: [usize; 2] = [8, 64];
/// Connections the baseline opens: one per client thread at the most.
const MAX_THREADS: usize = 64;

/// The server's URL, or `None` after saying how to get one.
fn server() -> Option<String> {
    let url = ["IDEMPOTENCY_BENCH_REDIS", "IDEMPOTENCY_TEST_REDIS"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()));
    if url.is_none() {
        eprintln!(
            "redis bench skipped: IDEMPOTENCY_BENCH_REDIS is not set. Start a throwaway server \
             (redis-server on PATH) and run the bench against it with\n    \
             scripts/with-redis cargo bench -p idempotency-bench --bench redis"
        );
    }
    url
}

/// One `CONFIG GET` value.
fn config(conn: &mut redis::Connection, name: &str) -> String {
    let pair: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg(name)
        .query(conn)
        .expect("CONFIG GET");
    pair.get(1).cloned().unwrap_or_default()
}

/// What the run compares, opened once and shared by criterion and the
/// interleaved rounds.
struct Systems {
    url: String,
    prefix: String,
    engine: Engine,
    baseline: Baseline,
    redb: Engine,
    _dir: tempfile::TempDir,
}

impl Systems {
    fn open(url: String) -> Systems {
        let client = redis::Client::open(url.as_str()).expect("a Redis URL");
        let mut admin = client.get_connection().expect("connect to Redis");
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query(&mut admin)
            .expect("INFO");
        let version = info
            .lines()
            .find_map(|l| l.strip_prefix("redis_version:"))
            .unwrap_or("?")
            .trim()
            .to_string();
        let (aof, fsync) = (
            config(&mut admin, "appendonly"),
            config(&mut admin, "appendfsync"),
        );
        println!("Redis server {version}: appendonly={aof} appendfsync={fsync}");
        if aof != "yes" || fsync != "always" {
            eprintln!(
                "warning: the server does not fsync every write; the figures are not comparable"
            );
        }
        let prefix = format!("bench{}:", std::process::id());
        let engine = Engine::builder()
            .redis_key_prefix(format!("{prefix}engine:"))
            .redis_pool_size(MAX_THREADS as u32)
            .open_redis(&url)
            .expect("open the engine on Redis");
        let baseline = Baseline::open(&url, &format!("{prefix}base:"), MAX_THREADS);
        let dir = common::bench_dir();
        let redb = Engine::builder()
            .open(dir.path().join("engine.redb"))
            .expect("open the redb engine");
        Systems {
            url,
            prefix,
            engine,
            baseline,
            redb,
            _dir: dir,
        }
    }

    fn baseline_request(&self, t: usize) {
        let key = uuid::Uuid::new_v4().to_string();
        self.baseline.request(
            t,
            common::SCOPE,
            &key,
            &[7u8; 32],
            &[b'x'; common::RESPONSE_BYTES],
        );
    }

    /// Deletes what the bench wrote: the server may outlive it.
    fn close(self) {
        let Systems {
            url,
            prefix,
            engine,
            baseline,
            redb,
            _dir,
        } = self;
        drop((engine, redb));
        baseline.clear();
        drop(baseline);
        let client = redis::Client::open(url.as_str()).expect("a Redis URL");
        let mut admin = client.get_connection().expect("connect to Redis");
        common::redis_plain::delete_prefix(&mut admin, &prefix);
    }
}

fn throughput(c: &mut Criterion, s: &Systems) {
    for threads in THREADS {
        let mut g = c.benchmark_group(format!(
            "redis: durable begin+complete, 300B, uuid keys, {threads} threads"
        ));
        g.sampling_mode(SamplingMode::Flat);
        g.throughput(Throughput::Elements(1));
        g.bench_function(BenchmarkId::new("engine", "pool 64"), |b| {
            b.iter_custom(|iters| {
                common::run_clients(threads, iters, |_, _| {
                    common::engine_request(&s.engine, &common::random_key());
                })
            });
        });
        g.bench_function(BenchmarkId::new("hand-written", "Lua claim + SET"), |b| {
            b.iter_custom(|iters| {
                common::run_clients(threads, iters, |t, _| s.baseline_request(t))
            });
        });
        g.bench_function(BenchmarkId::new("redb engine", "local file"), |b| {
            b.iter_custom(|iters| {
                common::run_clients(threads, iters, |_, _| {
                    common::engine_request(&s.redb, &common::random_key());
                })
            });
        });
        g.finish();
    }
}

/// The ratios, interleaved: engine, baseline, redb engine, one slice each
/// per round.
fn paired(s: &Systems) {
    let r = common::rounds();
    for threads in THREADS {
        let (mut ours, mut base, mut redb) = (vec![], vec![], vec![]);
        for _ in 0..r.rounds {
            ours.push(common::rate_for(threads, r.slice, |_| {
                common::engine_request(&s.engine, &common::random_key());
            }));
            base.push(common::rate_for(threads, r.slice, |t| {
                s.baseline_request(t)
            }));
            redb.push(common::rate_for(threads, r.slice, |_| {
                common::engine_request(&s.redb, &common::random_key());
            }));
        }
        let name = format!("redis durable req/s, {threads} threads");
        let vs_base = format!("{name}: engine (pool 64) vs hand-written baseline");
        common::report_paired(&vs_base, "req/s", &ours, &base);
        common::report_rounds(&vs_base, &ours, &base);
        let redb_vs = format!("{name}: redb engine vs hand-written redis baseline");
        common::report_paired(&redb_vs, "req/s", &redb, &base);
        common::report_rounds(&redb_vs, &redb, &base);
    }
}

/// `INFO commandstats` as command name → (calls, usec).
fn commandstats(conn: &mut redis::Connection) -> std::collections::BTreeMap<String, (u64, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(conn)
        .expect("INFO commandstats");
    let field = |stats: &str, name: &str| -> u64 {
        stats
            .split(',')
            .find_map(|kv| kv.strip_prefix(name))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    info.lines()
        .filter_map(|l| l.strip_prefix("cmdstat_"))
        .filter_map(|l| l.split_once(':'))
        .filter(|(name, _)| !matches!(*name, "info" | "config|resetstat"))
        .map(|(name, stats)| {
            (
                name.to_string(),
                (field(stats, "calls="), field(stats, "usec=")),
            )
        })
        .collect()
}

/// Prints the commands and script time per request of `n` requests of
/// `request`, run alone after `CONFIG RESETSTAT`.
fn count_one(admin: &mut redis::Connection, name: &str, n: u64, request: impl Fn()) {
    request(); // warm: connection made, script loaded
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .exec(admin)
        .expect("CONFIG RESETSTAT");
    for _ in 0..n {
        request();
    }
    print_commands(admin, name, n);
}

/// Prints `INFO commandstats` per request of `n` requests (see
/// [`count_one`]); `CONFIG RESETSTAT` came before them.
fn print_commands(admin: &mut redis::Connection, name: &str, n: u64) {
    let stats = commandstats(admin);
    let total: u64 = stats.values().map(|(calls, _)| calls).sum();
    let per = |x: u64| x as f64 / n as f64;
    let each: Vec<String> = stats
        .iter()
        .map(|(cmd, (calls, usec))| {
            format!(
                "{cmd} {:.2} at {:.1} us",
                per(*calls),
                *usec as f64 / (*calls).max(1) as f64
            )
        })
        .collect();
    let (scripts, script_usec) = stats.get("evalsha").copied().unwrap_or_default();
    println!(
        "COMMANDS {name}: {:.2} commands per request ({}); script time {:.1} us per request, \
         {:.1} us per EVALSHA",
        per(total),
        each.join(", "),
        per(script_usec),
        script_usec as f64 / scripts.max(1) as f64,
    );
}

/// The `IDEMPOTENCY_BENCH_COMMANDS` mode: server-side work per request.
fn count_commands(url: &str, n: u64) {
    let client = redis::Client::open(url).expect("a Redis URL");
    let mut admin = client.get_connection().expect("connect to Redis");
    let prefix = format!("benchcount{}:", std::process::id());
    let engine = Engine::builder()
        .sweep_interval(None)
        .redis_key_prefix(format!("{prefix}engine:"))
        .open_redis(url)
        .expect("open the engine on Redis");
    count_one(&mut admin, "engine", n, || {
        common::engine_request(&engine, &common::random_key());
    });
    drop(engine);
    let baseline = Baseline::open(url, &format!("{prefix}base:"), 1);
    count_one(&mut admin, "hand-written", n, || {
        let key = uuid::Uuid::new_v4().to_string();
        baseline.request(
            0,
            common::SCOPE,
            &key,
            &[7u8; 32],
            &[b'x'; common::RESPONSE_BYTES],
        );
    });
    baseline.clear();
    common::redis_plain::delete_prefix(&mut admin, &prefix);
}

/// This process's CPU time so far (user + system), from `/proc/self/stat`
/// (clock ticks of 10 ms).
fn process_cpu() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces) in parentheses.
    let tail = stat.rsplit_once(')').map_or("", |(_, t)| t);
    let f: Vec<f64> = tail
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 here.
    (f.get(11).copied().unwrap_or(0.0) + f.get(12).copied().unwrap_or(0.0)) / 100.0
}

/// The server's CPU time so far (`INFO cpu`: user + system), in seconds.
fn server_cpu(conn: &mut redis::Connection) -> f64 {
    let info: String = redis::cmd("INFO").arg("cpu").query(conn).expect("INFO cpu");
    info.lines()
        .filter_map(|l| {
            l.strip_prefix("used_cpu_sys:")
                .or_else(|| l.strip_prefix("used_cpu_user:"))
        })
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum()
}

/// The `IDEMPOTENCY_BENCH_CPU=SECONDS` mode: each system alone at 64
/// client threads for SECONDS, three times in turn; prints its rate and
/// the CPU time per request of this process (the clients) and of the
/// server. On 2 cores shared by clients and server, both bound the rate.
/// `IDEMPOTENCY_BENCH_CPU_SYSTEM=engine` (or `hand-written`) runs only one.
fn cpu_use(url: String, secs: u64) {
    let s = Systems::open(url);
    let client = redis::Client::open(s.url.as_str()).expect("a Redis URL");
    let mut admin = client.get_connection().expect("connect to Redis");
    let slice = std::time::Duration::from_secs(secs);
    let threads = MAX_THREADS;
    // `IDEMPOTENCY_BENCH_CPU_SYSTEM=engine` (or `hand-written`): that one
    // alone, e.g. under a profiler.
    let only = std::env::var("IDEMPOTENCY_BENCH_CPU_SYSTEM").unwrap_or_default();
    for _ in 0..3 {
        for name in ["engine", "hand-written"] {
            if !only.is_empty() && only != name {
                continue;
            }
            redis::cmd("CONFIG")
                .arg("RESETSTAT")
                .exec(&mut admin)
                .expect("CONFIG RESETSTAT");
            let (c0, s0) = (process_cpu(), server_cpu(&mut admin));
            let (calls, elapsed) = common::calls_for(threads, slice, |t| {
                if name == "engine" {
                    common::engine_request(&s.engine, &common::random_key());
                } else {
                    s.baseline_request(t);
                }
            });
            let (c1, s1) = (process_cpu(), server_cpu(&mut admin));
            let n = calls.max(1) as f64;
            println!(
                "CPU {name}, {threads} threads: {:.0} req/s; client {:.1} us/req, server {:.1} us/req",
                n / elapsed.as_secs_f64(),
                (c1 - c0) * 1e6 / n,
                (s1 - s0) * 1e6 / n,
            );
            print_commands(&mut admin, name, calls.max(1));
        }
    }
    s.close();
}

fn main() {
    let Some(url) = server() else { return };
    if let Some(secs) = std::env::var("IDEMPOTENCY_BENCH_CPU")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&n| n > 0)
    {
        cpu_use(url, secs);
        return;
    }
    if let Some(n) = std::env::var("IDEMPOTENCY_BENCH_COMMANDS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&n| n > 0)
    {
        count_commands(&url, n);
        return;
    }
    let systems = Systems::open(url);
    let mut c = common::durable_criterion();
    throughput(&mut c, &systems);
    if common::paired_selected() {
        paired(&systems);
    }
    systems.close();
    c.final_summary();
}
