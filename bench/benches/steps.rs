//! What effect steps cost (issue 22): a request with two durable steps
//! against the plain request, in the same run.
//!
//! Workloads, on a fresh random UUID key each, 300-byte response:
//! - `begin+complete`: durable claim + durable completion (2 commit waits),
//!   the baseline;
//! - `begin+2 steps+complete`: claim, then for "charge" and "receipt"
//!   `effect` (durable reservation) + `confirm` with 64 bytes of evidence
//!   (durable), then completion: 6 commit waits, 2 per step;
//! - `begin+2 deferred steps+complete`: the same with `confirm_deferred`,
//!   whose answers ride the next write: 4 commit waits, the 2 extra ones
//!   issue 22 allows;
//! - `3x begin+complete`: three plain requests in a row (also 6 commit
//!   waits), to tell what a step write costs beyond a commit wait.
//!
//! Systems: the engine on redb (a file on the local disk) at 8 and 64
//! client threads, and on PostgreSQL at 64 (`pool_size(64)`), when
//! `IDEMPOTENCY_BENCH_PG` or `IDEMPOTENCY_TEST_PG` names a server (run it
//! under `scripts/with-postgres`); without one the PostgreSQL part prints
//! how to get one and is skipped.
//!
//! Issue 22's bound: no more than 2 extra commit waits per request, so
//! a request with two steps waits for at most 4 commits against the plain
//! request's 2: requests per second at least 2/4 = 0.5 of plain (more
//! where group commit shares the waits). Deferred confirmations meet it by
//! construction; durable ones (`confirm`, 6 writes) pay 2 more waits for
//! evidence on disk before going on. After the criterion benches each
//! system is measured again interleaved (`PAIRED` / `ROUNDS` lines, see
//! `common::Rounds`), and `STEPS` lines give the commit waits per request
//! each ratio implies (2 / ratio).

mod common;

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use idempotency::postgres::{Client, NoTls};
use idempotency::{Begin, EffectStep, Engine, IdempotencyKey};

const REDB_THREADS: [usize; 2] = [8, 64];
const PG_THREADS: usize = 64;
const STEPS: [&str; 2] = ["charge", "receipt"];
/// A provider's answer: 64 bytes of evidence per confirmed step.
const EVIDENCE: [u8; 64] = [b'e'; 64];

/// One request with two effect steps: `begin`, then `effect` + `confirm`
/// per step, then `complete`; 6 durable writes.
fn steps_request(engine: &Engine, key: &IdempotencyKey) {
    let claim = match engine.begin(key, common::fingerprint()).expect("begin") {
        Begin::Claimed(claim) => claim,
        other => panic!("a fresh key must be claimed, got {other:?}"),
    };
    for step in STEPS {
        match claim.effect(step).expect("effect") {
            EffectStep::Run { .. } => claim.confirm(step, &EVIDENCE).expect("confirm"),
            other => panic!("a fresh claim's step must run, got {other:?}"),
        }
    }
    engine
        .complete(claim, common::response())
        .expect("complete");
}

/// The same request with deferred confirmations: each `confirm_deferred`
/// rides the next write (the receipt's reservation, the completion), so
/// `begin` + 2 `effect`s + `complete`: 4 durable writes, 2 more than the
/// plain request.
fn deferred_request(engine: &Engine, key: &IdempotencyKey) {
    let claim = match engine.begin(key, common::fingerprint()).expect("begin") {
        Begin::Claimed(claim) => claim,
        other => panic!("a fresh key must be claimed, got {other:?}"),
    };
    for step in STEPS {
        match claim.effect(step).expect("effect") {
            EffectStep::Run { .. } => claim
                .confirm_deferred(step, &EVIDENCE)
                .expect("confirm_deferred"),
            other => panic!("a fresh claim's step must run, got {other:?}"),
        }
    }
    engine
        .complete(claim, common::response())
        .expect("complete");
}

/// A workload: its name and one call of it.
type Workload = (&'static str, fn(&Engine));

/// The three workloads.
fn workloads() -> [Workload; 4] {
    [
        ("begin+complete", |e| {
            common::engine_request(e, &common::random_key());
        }),
        ("begin+2 steps+complete", |e| {
            steps_request(e, &common::random_key());
        }),
        ("begin+2 deferred steps+complete", |e| {
            deferred_request(e, &common::random_key());
        }),
        ("3x begin+complete", |e| {
            for _ in 0..3 {
                common::engine_request(e, &common::random_key());
            }
        }),
    ]
}

fn criterion_benches(c: &mut Criterion, system: &str, threads: usize, engine: &Engine) {
    let mut g = c.benchmark_group(format!(
        "steps: {system}, {threads} threads, 300B, uuid keys"
    ));
    g.sampling_mode(SamplingMode::Flat);
    g.throughput(Throughput::Elements(1));
    for (name, op) in workloads().into_iter().take(3) {
        g.bench_function(BenchmarkId::new(name, format!("{threads} threads")), |b| {
            b.iter_custom(|iters| common::run_clients(threads, iters, |_, _| op(engine)));
        });
    }
    g.finish();
}

/// The interleaved rounds: one slice of each workload per round.
fn paired(system: &str, threads: usize, engine: &Engine) {
    let r = common::rounds();
    let mut rates: [Vec<f64>; 4] = Default::default();
    for _ in 0..r.rounds {
        for (i, (_, op)) in workloads().into_iter().enumerate() {
            rates[i].push(common::rate_for(threads, r.slice, |_| op(engine)));
        }
    }
    let [plain, steps, deferred, triple] = rates;
    let name = format!("steps {system} req/s, {threads} threads");
    let vs_plain = format!("{name}: begin+2 steps+complete vs begin+complete");
    common::report_paired(&vs_plain, "req/s", &steps, &plain);
    common::report_rounds(&vs_plain, &steps, &plain);
    let vs_triple = format!("{name}: begin+2 steps+complete vs 3x begin+complete (6 writes each)");
    common::report_paired(&vs_triple, "calls/s", &steps, &triple);
    common::report_rounds(&vs_triple, &steps, &triple);
    let vs_deferred = format!("{name}: begin+2 deferred steps+complete vs begin+complete");
    common::report_paired(&vs_deferred, "req/s", &deferred, &plain);
    common::report_rounds(&vs_deferred, &deferred, &plain);
    for (what, rates, bound) in [
        ("durable confirms", &steps, 6.0),
        ("deferred confirms", &deferred, 4.0),
    ] {
        let mut ratios: Vec<f64> = rates.iter().zip(&plain).map(|(s, p)| s / p).collect();
        let ratio = common::quantile(&mut ratios, 0.5);
        println!(
            "STEPS {name}, {what}: ratio {ratio:.2} (its writes alone: >= {:.2}), implied commit \
             waits per request {:.1} (plain request = 2; its writes: {bound}; issue 22's bound: 4)",
            2.0 / bound,
            2.0 / ratio
        );
    }
}

/// The server's connection string, or `None` after saying how to get one.
fn server() -> Option<String> {
    let url = ["IDEMPOTENCY_BENCH_PG", "IDEMPOTENCY_TEST_PG"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()));
    if url.is_none() {
        eprintln!(
            "steps bench: PostgreSQL part skipped: IDEMPOTENCY_BENCH_PG is not set. Run \
             `scripts/with-postgres cargo bench -p idempotency-bench --bench steps`"
        );
    }
    url
}

/// Drops every table and sequence whose name starts with `prefix`: the
/// server may outlive the bench.
fn drop_prefix(url: &str, prefix: &str) {
    let mut admin = Client::connect(url, NoTls).expect("connect to PostgreSQL");
    let rows = admin
        .query(
            "SELECT c.relname, c.relkind::text FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'S') \
             AND starts_with(c.relname, $1)",
            &[&prefix],
        )
        .expect("list the bench's tables");
    for row in rows {
        let (name, kind): (String, String) = (row.get(0), row.get(1));
        let what = if kind == "S" { "SEQUENCE" } else { "TABLE" };
        admin
            .batch_execute(&format!("DROP {what} IF EXISTS \"{name}\" CASCADE"))
            .expect("drop a bench table");
    }
}

fn main() {
    let mut c = common::durable_criterion();
    let paired_on = common::paired_selected();

    for threads in REDB_THREADS {
        let dir = common::bench_dir();
        let engine = Engine::builder()
            .open(dir.path().join("engine.redb"))
            .expect("open the redb engine");
        criterion_benches(&mut c, "redb", threads, &engine);
        if paired_on {
            paired("redb", threads, &engine);
        }
    }

    if let Some(url) = server() {
        let prefix = format!("bench_steps_{}_", std::process::id());
        let engine = Engine::builder()
            .table_prefix(&prefix)
            .pool_size(PG_THREADS as u32)
            .connect_timeout(Duration::from_secs(5))
            .open_postgres(&url)
            .expect("open the engine on PostgreSQL");
        criterion_benches(&mut c, "postgres", PG_THREADS, &engine);
        if paired_on {
            paired("postgres", PG_THREADS, &engine);
        }
        drop(engine);
        drop_prefix(&url, &prefix);
    }
    c.final_summary();
}
