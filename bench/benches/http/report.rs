//! The report: a `SLOT` line per slot as it ends, then medians over the
//! rounds, per-round ratios (median, min, max) and the thread counts, as
//! markdown tables for BENCHMARKS.md.

use std::collections::HashMap;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::client::Workload;
use super::slot::Sample;
use super::{Mode, Opts};

type Key = (Mode, Workload, usize);

/// A ratio row: its name, the two series, and the figure compared.
type Row = (String, Key, Key, fn(&Sample) -> f64);

/// The samples of a run, by (mode, workload, connections), in round order.
pub struct Run {
    samples: HashMap<Key, Vec<(usize, Sample)>>,
    started: Instant,
    start_utc: String,
    loads: Vec<f64>,
}

fn load1() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// `YYYY-MM-DD HH:MM` UTC, from the system clock (no date crate needed).
fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60
    )
}

fn commit() -> String {
    std::process::Command::new("git")
        .args([
            "-C",
            env!("CARGO_MANIFEST_DIR"),
            "rev-parse",
            "--short",
            "HEAD",
        ])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or_else(
            || "unknown".into(),
            |o| String::from_utf8_lossy(&o.stdout).trim().to_string(),
        )
}

/// `n` rounded, with thousands separated by commas.
fn grouped(n: f64) -> String {
    if !n.is_finite() {
        return "–".into();
    }
    let digits = format!("{:.0}", n.abs());
    let mut out = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    if n < -0.5 {
        out.insert(0, '-');
    }
    out
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

impl Run {
    pub fn start(opts: &Opts) -> Run {
        let modes: Vec<&str> = opts.modes.iter().map(|m| m.name()).collect();
        println!(
            "HTTP bench: {} rounds, {:.1} s slots, {} connections (then {} for thread counts), \
             at most {} requests per slot, modes {}",
            opts.rounds,
            opts.secs.as_secs_f64(),
            opts.conns,
            opts.many_conns,
            opts.max_requests,
            modes.join(",")
        );
        Run {
            samples: HashMap::new(),
            started: Instant::now(),
            start_utc: utc_now(),
            loads: vec![load1()],
        }
    }

    pub fn record(&mut self, round: usize, mode: Mode, w: Workload, conns: usize, s: Sample) {
        let load = load1();
        self.loads.push(load);
        let runs = s.handler_runs.map_or_else(|| "-".into(), |r| r.to_string());
        println!(
            "SLOT round={} mode={} workload={} conns={conns}: {:.0} req/s, p50 {:.0} us, \
             p99 {:.0} us, peak threads {}, peak RSS {:.1} MiB, ok {}, failed {}, \
             handler runs {runs}, load {load:.1}",
            round + 1,
            mode.name(),
            w.name(),
            s.req_s,
            s.p50_us,
            s.p99_us,
            s.threads,
            s.rss_mib,
            s.ok,
            s.bad,
        );
        self.samples
            .entry((mode, w, conns))
            .or_default()
            .push((round, s));
    }

    fn series(&self, key: Key, f: fn(&Sample) -> f64) -> Option<Vec<(usize, f64)>> {
        self.samples
            .get(&key)
            .map(|v| v.iter().map(|(r, s)| (*r, f(s))).collect())
    }

    fn med(&self, key: Key, f: fn(&Sample) -> f64) -> Option<f64> {
        let v: Vec<f64> = self.series(key, f)?.into_iter().map(|x| x.1).collect();
        Some(median(&v))
    }

    /// Per-round ratios `a / b` (rounds where both were measured).
    fn ratios(&self, a: Key, b: Key, f: fn(&Sample) -> f64) -> Option<Vec<f64>> {
        let (a, b) = (self.series(a, f)?, self.series(b, f)?);
        let v: Vec<f64> = a
            .iter()
            .filter_map(|(r, x)| b.iter().find(|(rb, _)| rb == r).map(|(_, y)| x / y))
            .collect();
        (!v.is_empty()).then_some(v)
    }

    pub fn finish(&self, opts: &Opts) {
        let minutes = self.started.elapsed().as_secs_f64() / 60.0;
        let lo = self.loads.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = self.loads.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let c = opts.conns;
        println!("\n---- markdown for BENCHMARKS.md ----\n");
        println!("```sh\n{}\n```\n", opts.command);
        println!(
            "Run {} UTC on commit {}, {:.1} minutes; 1-minute load average {lo:.1}–{hi:.1} \
             (read at each slot's end); {} round(s) of {:.1} s slots at {c} connections, \
             modes in rotating order; medians over rounds.\n",
            self.start_utc,
            commit(),
            minutes,
            opts.rounds,
            opts.secs.as_secs_f64(),
        );
        println!("| mode | workload | req/s | p50 µs | p99 µs | peak threads | peak RSS MiB | handler runs / request |");
        println!("|---|---|---|---|---|---|---|---|");
        for w in [Workload::Unique, Workload::Replay] {
            for &m in &opts.modes {
                let key = (m, w, c);
                let Some(req) = self.med(key, |s| s.req_s) else {
                    continue;
                };
                let runs = self.med(key, |s| {
                    s.handler_runs
                        .map_or(f64::NAN, |r| r as f64 / s.ok.max(1) as f64)
                });
                let runs = runs
                    .filter(|r| !r.is_nan())
                    .map_or_else(|| "–".into(), |r| format!("{r:.2}"));
                let threads = if m == Mode::Direct {
                    format!(
                        "{:.0} (incl. {c} client threads)",
                        self.med(key, |s| s.threads).unwrap_or(0.0)
                    )
                } else {
                    format!("{:.0}", self.med(key, |s| s.threads).unwrap_or(0.0))
                };
                println!(
                    "| {} | {} | {} | {} | {} | {threads} | {:.1} | {runs} |",
                    m.label(),
                    w.name(),
                    grouped(req),
                    grouped(self.med(key, |s| s.p50_us).unwrap_or(f64::NAN)),
                    grouped(self.med(key, |s| s.p99_us).unwrap_or(f64::NAN)),
                    self.med(key, |s| s.rss_mib).unwrap_or(0.0),
                );
            }
        }

        let u = Workload::Unique;
        let r = Workload::Replay;
        let req: fn(&Sample) -> f64 = |s| s.req_s;
        let p99: fn(&Sample) -> f64 = |s| s.p99_us;
        let rows: Vec<Row> = vec![
            (
                "unique keys, req/s: ours (in-memory) / peer".into(),
                (Mode::Mem, u, c),
                (Mode::Peer, u, c),
                req,
            ),
            (
                "unique keys, req/s: ours (in-memory) / no layer".into(),
                (Mode::Mem, u, c),
                (Mode::None, u, c),
                req,
            ),
            (
                "unique keys, req/s: ours (redb) / no layer".into(),
                (Mode::Redb, u, c),
                (Mode::None, u, c),
                req,
            ),
            (
                "unique keys, req/s: ours (PostgreSQL) / no layer".into(),
                (Mode::Pg, u, c),
                (Mode::None, u, c),
                req,
            ),
            (
                "unique keys, req/s: peer / no layer".into(),
                (Mode::Peer, u, c),
                (Mode::None, u, c),
                req,
            ),
            (
                format!("unique keys, req/s: ours (redb) / engine called directly, {c} threads"),
                (Mode::Redb, u, c),
                (Mode::Direct, u, c),
                req,
            ),
            (
                "replays, req/s: ours (in-memory) / peer".into(),
                (Mode::Mem, r, c),
                (Mode::Peer, r, c),
                req,
            ),
            (
                "replays, req/s: ours (redb) / peer".into(),
                (Mode::Redb, r, c),
                (Mode::Peer, r, c),
                req,
            ),
            (
                "replays, req/s: ours (in-memory) / no layer".into(),
                (Mode::Mem, r, c),
                (Mode::None, r, c),
                req,
            ),
            (
                "unique keys, p99: ours (redb) / no layer".into(),
                (Mode::Redb, u, c),
                (Mode::None, u, c),
                p99,
            ),
            (
                "unique keys, p99: ours (in-memory) / peer".into(),
                (Mode::Mem, u, c),
                (Mode::Peer, u, c),
                p99,
            ),
            (
                "replays, p99: ours (in-memory) / peer".into(),
                (Mode::Mem, r, c),
                (Mode::Peer, r, c),
                p99,
            ),
        ];
        println!("\n| ratio (per round, at {c} connections) | median [min, max] | rounds |");
        println!("|---|---|---|");
        for (name, a, b, f) in rows {
            if let Some(v) = self.ratios(a, b, f) {
                let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                println!(
                    "| {name} | {:.2}× [{lo:.2}, {hi:.2}] | {} |",
                    median(&v),
                    v.len()
                );
            }
        }

        if opts.many_conns > 0 {
            let m = opts.many_conns;
            println!(
                "\n| mode (unique keys) | peak threads at {c} conns | at {m} conns | req/s at {m} | p99 µs at {m} | peak RSS MiB at {m} |"
            );
            println!("|---|---|---|---|---|---|");
            for &mode in opts.modes.iter().filter(|&&x| x != Mode::Direct) {
                let (few, many) = ((mode, u, c), (mode, u, m));
                let Some(threads) = self.med(many, |s| s.threads) else {
                    continue;
                };
                println!(
                    "| {} | {:.0} | {threads:.0} | {} | {} | {:.1} |",
                    mode.label(),
                    self.med(few, |s| s.threads).unwrap_or(f64::NAN),
                    grouped(self.med(many, |s| s.req_s).unwrap_or(f64::NAN)),
                    grouped(self.med(many, |s| s.p99_us).unwrap_or(f64::NAN)),
                    self.med(many, |s| s.rss_mib).unwrap_or(0.0),
                );
            }
        }
        let failed: u64 = self
            .samples
            .values()
            .flat_map(|v| v.iter().map(|(_, s)| s.bad))
            .sum();
        println!("\nRequests failed or answered other than 201, all slots: {failed}.");
    }
}
