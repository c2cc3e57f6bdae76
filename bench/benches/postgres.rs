//! Durable request throughput on PostgreSQL: the engine's PostgreSQL
//! backend vs a hand-written baseline on the same server, with the embedded
//! (redb) engine beside.
//!
//! Workload, as in `durable.rs`: one request = durable `begin` (claim) +
//! durable `complete` with a 300-byte response, on a fresh random UUID key,
//! from 64 client threads. The systems:
//! - the engine on PostgreSQL, `pool_size(64)` (one connection per client
//!   thread, as the baseline has);
//! - the hand-written baseline (`common::pg`): `INSERT … ON CONFLICT DO
//!   NOTHING RETURNING token` + `UPDATE … WHERE key AND token`, prepared,
//!   one connection per thread;
//! - the engine on redb (a file on the local disk), for scale.
//!
//! Both PostgreSQL systems commit with the server's settings (the bench
//! prints `fsync` and `synchronous_commit`; `scripts/with-postgres` starts
//! a server with both on). After the criterion benches the ratios are
//! measured again interleaved, engine / baseline / redb engine in each
//! round (`PAIRED` and `ROUNDS` lines; see `common::Rounds`).
//!
//! Needs a server: `IDEMPOTENCY_BENCH_PG` (or `IDEMPOTENCY_TEST_PG`) holds
//! its connection string. Without one the bench prints how to start one
//! and does nothing, so `cargo test --benches` passes without a server.

mod common;

use common::pg::Baseline;
use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use idempotency::postgres::{Client, NoTls};
use idempotency::Engine;

const THREADS: usize = 64;

/// The server's connection string, or `None` after saying how to get one.
fn server() -> Option<String> {
    let url = ["IDEMPOTENCY_BENCH_PG", "IDEMPOTENCY_TEST_PG"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()));
    if url.is_none() {
        eprintln!(
            "postgres bench skipped: IDEMPOTENCY_BENCH_PG is not set. Start a throwaway server \
             (initdb, pg_ctl and postgres on PATH) and run the bench against it with\n    \
             scripts/with-postgres cargo bench -p idempotency-bench --bench postgres"
        );
    }
    url
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
        let mut admin = Client::connect(&url, NoTls).expect("connect to PostgreSQL");
        let show = |admin: &mut Client, name: &str| -> String {
            admin
                .query_one(&format!("SHOW {name}"), &[])
                .expect("SHOW")
                .get(0)
        };
        let (fsync, sync_commit) = (
            show(&mut admin, "fsync"),
            show(&mut admin, "synchronous_commit"),
        );
        let max: usize = show(&mut admin, "max_connections")
            .parse()
            .expect("a number");
        let reserved: usize = show(&mut admin, "superuser_reserved_connections")
            .parse()
            .expect("a number");
        let version = show(&mut admin, "server_version");
        let in_use: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'",
                &[],
            )
            .expect("count connections")
            .get(0);
        drop(admin);
        println!(
            "PG server {version}: fsync={fsync} synchronous_commit={sync_commit} \
             max_connections={max} (in use {in_use})"
        );
        if fsync != "on" || sync_commit != "on" {
            eprintln!(
                "warning: the server does not commit durably; the figures are not comparable"
            );
        }
        // The engine's pool and the baseline's connections are open at once.
        let needed = 2 * THREADS + 1;
        assert!(
            max.saturating_sub(reserved) >= needed + in_use as usize,
            "the server allows {max} connections ({reserved} reserved, {in_use} in use); \
             this bench needs {needed}: start it with max_connections >= 200 \
             (scripts/with-postgres sets 300)"
        );

        let prefix = format!("bench_{}_", std::process::id());
        let engine = Engine::builder()
            .table_prefix(&prefix)
            .pool_size(THREADS as u32)
            .open_postgres(&url)
            .expect("open the engine on PostgreSQL");
        let baseline = Baseline::create(&url, &prefix, THREADS);
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

    /// Drops the engine's and the baseline's tables: the server may be one
    /// that outlives the bench.
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
        baseline.drop_schema(&url);
        let mut admin = Client::connect(&url, NoTls).expect("connect to PostgreSQL");
        admin
            .batch_execute(&format!(
                "DROP TABLE IF EXISTS {prefix}records, {prefix}outbox, {prefix}entities, {prefix}meta;
                 DROP SEQUENCE IF EXISTS {prefix}tokens, {prefix}outbox_seq;"
            ))
            .expect("drop the engine's tables");
    }
}

fn throughput(c: &mut Criterion, s: &Systems) {
    let mut g = c.benchmark_group("postgres: durable begin+complete, 300B, uuid keys, 64 threads");
    g.sampling_mode(SamplingMode::Flat);
    g.throughput(Throughput::Elements(1));
    g.bench_function(BenchmarkId::new("engine", "pool 64"), |b| {
        b.iter_custom(|iters| {
            common::run_clients(THREADS, iters, |_, _| {
                common::engine_request(&s.engine, &common::random_key());
            })
        });
    });
    g.bench_function(BenchmarkId::new("hand-written", "1 conn per thread"), |b| {
        b.iter_custom(|iters| common::run_clients(THREADS, iters, |t, _| s.baseline_request(t)));
    });
    g.bench_function(BenchmarkId::new("redb engine", "local file"), |b| {
        b.iter_custom(|iters| {
            common::run_clients(THREADS, iters, |_, _| {
                common::engine_request(&s.redb, &common::random_key());
            })
        });
    });
    g.finish();
}

/// The ratios, interleaved: engine, baseline, redb engine, one slice each
/// per round.
fn paired(s: &Systems) {
    let r = common::rounds();
    let (mut ours, mut base, mut redb) = (vec![], vec![], vec![]);
    for _ in 0..r.rounds {
        ours.push(common::rate_for(THREADS, r.slice, |_| {
            common::engine_request(&s.engine, &common::random_key());
        }));
        base.push(common::rate_for(THREADS, r.slice, |t| {
            s.baseline_request(t)
        }));
        redb.push(common::rate_for(THREADS, r.slice, |_| {
            common::engine_request(&s.redb, &common::random_key());
        }));
    }
    let name = "postgres durable req/s, 64 threads";
    let vs_base = format!("{name}: engine (pool 64) vs hand-written baseline");
    common::report_paired(&vs_base, "req/s", &ours, &base);
    common::report_rounds(&vs_base, &ours, &base);
    let redb_vs = format!("{name}: redb engine vs hand-written postgres baseline");
    common::report_paired(&redb_vs, "req/s", &redb, &base);
    common::report_rounds(&redb_vs, &redb, &base);
}

fn main() {
    let Some(url) = server() else { return };
    let systems = Systems::open(url);
    let mut c = common::durable_criterion();
    throughput(&mut c, &systems);
    if common::paired_selected() {
        paired(&systems);
    }
    systems.close();
    c.final_summary();
}
