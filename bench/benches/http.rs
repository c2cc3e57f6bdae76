//! The `Idempotency-Key` layer over HTTP (issue 27), against no layer and
//! against the peer crate `axum-idempotent` 0.6, in the same run.
//!
//! One command: `cargo bench -p idempotency-bench --bench http` (options
//! after `--`, see `USAGE`). Every mode serves the same axum 0.8 app
//! (`POST /orders` with a 51-byte JSON body; the handler reads it and
//! answers 201 at once) from its own child process on 127.0.0.1 at a free
//! port, so threads and peak RSS are the mode's own:
//!
//! - `none`: no layer;
//! - `mem`: our `IdempotencyLayer` over an in-memory engine;
//! - `redb`: ours over a redb file (durable: each claim and outcome is
//!   fsynced before the answer);
//! - `pg`: ours over PostgreSQL, when `IDEMPOTENCY_TEST_PG` is set (e.g.
//!   under `scripts/with-postgres`), skipped with a note otherwise;
//! - `peer`: `axum-idempotent` 0.6 keyed by the `Idempotency-Key` header,
//!   over `ruts`' in-memory moka session store (the baseline);
//! - `direct`: no HTTP, the engine itself: durable begin+complete on a
//!   redb file from as many threads as the client has connections (the
//!   workload of `benches/durable.rs`), for ours(redb) / engine.
//!
//! The load client (`http/client.rs`) holds N keep-alive HTTP/1.1
//! connections on hyper 1 (64 by default), each sending its next request
//! when the last answer is read, for a time-bounded and count-bounded slot,
//! in two workloads: a fresh key per request (`unique`), and the same
//! 1,000 keys over and over after a warm-up that completes them
//! (`replay`). Rounds interleave the modes (their order rotates each round);
//! the report gives medians over rounds, per-round ratios (median, min,
//! max), and the server's peak thread count (`Threads` in
//! `/proc/<pid>/status`, sampled every 20 ms during the slot) and peak RSS
//! (`VmHWM`). A last pass at `--many-conns` connections (1,000 by default)
//! gives the thread counts under many connections. It ends with markdown
//! tables for BENCHMARKS.md.
//!
//! Under `cargo test --benches` (criterion's "test mode", no `--bench`
//! argument) it runs one short round at 4 connections as a smoke test.

mod common;

#[path = "http/client.rs"]
mod client;
#[path = "http/report.rs"]
mod report;
#[path = "http/server.rs"]
mod server;
#[path = "http/slot.rs"]
mod slot;

use std::path::PathBuf;
use std::time::Duration;

use client::Workload;

const USAGE: &str = "cargo bench -p idempotency-bench --bench http -- \
[--secs S (10)] [--rounds N (3)] [--conns N (64)] [--many-conns N (1000; 0 skips)] \
[--max-requests N per slot (10000000)] [--modes none,mem,redb,pg,peer,direct (all)]";

/// What a child process serves or runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Mode {
    None,
    Mem,
    Redb,
    Pg,
    Peer,
    Direct,
}

impl Mode {
    const ALL: [Mode; 6] = [
        Mode::None,
        Mode::Mem,
        Mode::Redb,
        Mode::Pg,
        Mode::Peer,
        Mode::Direct,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mode::None => "none",
            Mode::Mem => "mem",
            Mode::Redb => "redb",
            Mode::Pg => "pg",
            Mode::Peer => "peer",
            Mode::Direct => "direct",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Mode::None => "no layer",
            Mode::Mem => "ours, in-memory engine",
            Mode::Redb => "ours, redb file (durable)",
            Mode::Pg => "ours, PostgreSQL",
            Mode::Peer => "peer: axum-idempotent 0.6, moka store",
            Mode::Direct => "engine called directly (redb, no HTTP)",
        }
    }

    fn parse(s: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|m| m.name() == s)
    }
}

/// The run's settings.
pub struct Opts {
    pub secs: Duration,
    pub rounds: usize,
    pub conns: usize,
    pub many_conns: usize,
    pub max_requests: u64,
    pub modes: Vec<Mode>,
    /// The command that reproduces this run, for the report.
    pub command: String,
}

fn value<T: std::str::FromStr>(args: &[String], name: &str) -> Result<Option<T>, String> {
    match args.iter().position(|a| a == name) {
        None => Ok(None),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .map(Some)
            .ok_or_else(|| format!("{name} needs a value\nusage: {USAGE}")),
    }
}

/// The run's settings from the command line; `Ok(None)` if a name filter
/// is given (as for criterion benches, e.g. `cargo bench -p
/// idempotency-bench -- paired`) that does not name this bench: it then
/// does nothing, so such a filter across every bench still works.
fn parse_opts(args: &[String]) -> Result<Option<Opts>, String> {
    const FLAGS: [&str; 6] = [
        "--secs",
        "--rounds",
        "--conns",
        "--many-conns",
        "--max-requests",
        "--modes",
    ];
    let mut i = 0;
    while i < args.len() {
        if FLAGS.contains(&args[i].as_str()) {
            i += 2;
        } else if args[i] == "--bench" {
            i += 1;
        } else if !args[i].starts_with('-') {
            if !args[i].contains("http") && !"http".contains(args[i].as_str()) {
                println!(
                    "http bench skipped: the filter {:?} does not name it",
                    args[i]
                );
                return Ok(None);
            }
            i += 1;
        } else {
            return Err(format!("unknown argument {:?}\nusage: {USAGE}", args[i]));
        }
    }
    let measuring = args.iter().any(|a| a == "--bench");
    let mut opts = if measuring {
        Opts {
            secs: Duration::from_secs(10),
            rounds: 3,
            conns: 64,
            many_conns: 1000,
            max_requests: 10_000_000,
            modes: Mode::ALL.to_vec(),
            command: String::new(),
        }
    } else {
        Opts {
            secs: Duration::from_millis(200),
            rounds: 1,
            conns: 4,
            many_conns: 0,
            max_requests: 10_000,
            modes: Mode::ALL.to_vec(),
            command: String::new(),
        }
    };
    if let Some(s) = value::<f64>(args, "--secs")? {
        opts.secs = Duration::from_secs_f64(s);
    }
    opts.rounds = value(args, "--rounds")?.unwrap_or(opts.rounds).max(1);
    opts.conns = value(args, "--conns")?.unwrap_or(opts.conns).max(1);
    opts.many_conns = value(args, "--many-conns")?.unwrap_or(opts.many_conns);
    opts.max_requests = value(args, "--max-requests")?.unwrap_or(opts.max_requests);
    if let Some(list) = value::<String>(args, "--modes")? {
        opts.modes = list
            .split(',')
            .map(|m| Mode::parse(m).ok_or_else(|| format!("unknown mode {m:?}\nusage: {USAGE}")))
            .collect::<Result<_, _>>()?;
    }
    let mut given: Vec<&str> = Vec::new();
    for (i, a) in args.iter().enumerate() {
        if FLAGS.contains(&a.as_str()) {
            given.extend(args.get(i..i + 2).into_iter().flatten().map(String::as_str));
        }
    }
    let pg = std::env::var_os("IDEMPOTENCY_TEST_PG").is_some();
    opts.command = format!(
        "{}cargo bench -p idempotency-bench --bench http{}{}",
        if pg { "scripts/with-postgres " } else { "" },
        if given.is_empty() { "" } else { " -- " },
        given.join(" ")
    );
    if opts.modes.contains(&Mode::Pg) && std::env::var_os("IDEMPOTENCY_TEST_PG").is_none() {
        println!(
            "NOTE pg mode skipped: IDEMPOTENCY_TEST_PG is not set \
             (run under scripts/with-postgres to include it)"
        );
        opts.modes.retain(|&m| m != Mode::Pg);
    }
    Ok(Some(opts))
}

/// A child's command line: `--serve MODE --dir DIR --pg-prefix P
/// [--threads N --secs S --max-requests M]`.
fn child(args: &[String]) {
    let get = |name: &str| -> &str {
        let i = args.iter().position(|a| a == name).expect(name);
        &args[i + 1]
    };
    let mode = Mode::parse(get("--serve")).expect("a known mode");
    let dir = PathBuf::from(get("--dir"));
    if mode == Mode::Direct {
        server::direct(
            &dir,
            get("--threads").parse().expect("--threads"),
            Duration::from_secs_f64(get("--secs").parse().expect("--secs")),
            get("--max-requests").parse().expect("--max-requests"),
        );
    } else {
        server::serve(mode, &dir, get("--pg-prefix"));
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--serve") {
        child(&args);
        return;
    }
    let opts = match parse_opts(&args) {
        Ok(Some(opts)) => opts,
        Ok(None) => return,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let mut run = report::Run::start(&opts);
    let server_modes: Vec<Mode> = opts
        .modes
        .iter()
        .copied()
        .filter(|&m| m != Mode::Direct)
        .collect();
    for round in 0..opts.rounds {
        for workload in [Workload::Unique, Workload::Replay] {
            let mut order = opts.modes.clone();
            if workload == Workload::Replay {
                order.retain(|&m| m != Mode::Direct);
            }
            let n = order.len().max(1);
            order.rotate_left(round % n);
            for mode in order {
                let s = slot::run(&rt, &opts, mode, workload, opts.conns);
                run.record(round, mode, workload, opts.conns, s);
            }
        }
    }
    if opts.many_conns > 0 {
        for &mode in &server_modes {
            let s = slot::run(&rt, &opts, mode, Workload::Unique, opts.many_conns);
            run.record(0, mode, Workload::Unique, opts.many_conns, s);
        }
    }
    run.finish(&opts);
}
