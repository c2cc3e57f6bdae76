//! One slot: a fresh child process for one mode, the load against it, and
//! its thread count and peak RSS read from `/proc/<pid>/status`.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::client::{self, Workload, REPLAY_KEYS};
use super::{Mode, Opts};

/// What one slot measured.
#[derive(Clone, Debug)]
pub struct Sample {
    pub req_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// Peak `Threads` of the server process during the slot.
    pub threads: f64,
    /// `VmHWM` of the server process at the slot's end, MiB.
    pub rss_mib: f64,
    /// Requests answered 201.
    pub ok: u64,
    /// Requests failed or answered otherwise.
    pub bad: u64,
    /// Times the handler ran during the measured part (after the warm-up);
    /// `None` for the direct mode or if the child did not say.
    pub handler_runs: Option<u64>,
}

/// A field of `/proc/<pid>/status` (`Threads`, `VmHWM` in kB).
fn status_field(pid: u32, name: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Samples `Threads` every 20 ms while `on` is set, until `stop`.
fn sampler(pid: u32, on: Arc<AtomicBool>, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut peak = 0;
        while !stop.load(Ordering::Relaxed) {
            if on.load(Ordering::Relaxed) {
                peak = peak.max(status_field(pid, "Threads").unwrap_or(0));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        peak.max(status_field(pid, "Threads").unwrap_or(0))
    })
}

fn line(out: &mut BufReader<ChildStdout>, prefix: &str) -> String {
    let mut l = String::new();
    loop {
        l.clear();
        let n = out.read_line(&mut l).expect("read the child's stdout");
        assert!(n > 0, "the child exited before printing {prefix}");
        if let Some(rest) = l.trim_end().strip_prefix(prefix) {
            return rest.trim().to_string();
        }
    }
}

/// Closes the child's stdin (it prints `RUNS` and exits); the handler's
/// run count. Kills it if it has not exited within 10 s.
fn stop(mut child: Child, out: &mut BufReader<ChildStdout>) -> Option<u64> {
    drop(child.stdin.take());
    let runs = {
        let mut l = String::new();
        let mut runs = None;
        while out.read_line(&mut l).is_ok_and(|n| n > 0) {
            if let Some(r) = l.trim_end().strip_prefix("RUNS ") {
                runs = r.parse().ok();
            }
            l.clear();
        }
        runs
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return runs;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    runs
}

static SLOTS: AtomicU64 = AtomicU64::new(0);

/// Runs `mode` under `workload` at `conns` connections in a fresh child.
pub fn run(
    rt: &tokio::runtime::Runtime,
    opts: &Opts,
    mode: Mode,
    workload: Workload,
    conns: usize,
) -> Sample {
    let n = SLOTS.fetch_add(1, Ordering::Relaxed);
    let nonce = (u64::from(std::process::id()) << 20) + n * 100_000;
    let dir = super::common::bench_dir();
    let exe = std::env::current_exe().expect("the bench's own path");
    let mut child = Command::new(exe)
        .args(["--serve", mode.name(), "--dir"])
        .arg(dir.path())
        .args(["--pg-prefix", &format!("hb{}_", std::process::id())])
        .args(["--threads", &conns.to_string()])
        .args(["--secs", &opts.secs.as_secs_f64().to_string()])
        .args(["--max-requests", &opts.max_requests.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the child");
    let pid = child.id();
    let mut out = BufReader::new(child.stdout.take().expect("piped stdout"));
    let port: u16 = line(&mut out, "PORT ").parse().expect("a port");
    let (on, halt) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let peak = sampler(pid, on.clone(), halt.clone());
    let mut sample = if mode == Mode::Direct {
        on.store(true, Ordering::Relaxed);
        let result = line(&mut out, "RESULT ");
        let f: Vec<f64> = result
            .split_whitespace()
            .map(|v| v.parse().expect("a number"))
            .collect();
        Sample {
            req_s: f[0] / f[1],
            p50_us: f[2],
            p99_us: f[3],
            threads: 0.0,
            rss_mib: 0.0,
            ok: f[0] as u64,
            bad: 0,
            handler_runs: None,
        }
    } else {
        let go = on.clone();
        let load = rt.block_on(client::run(
            port,
            conns,
            workload,
            opts.secs,
            opts.max_requests,
            nonce,
            move || go.store(true, Ordering::Relaxed),
        ));
        if let Some(e) = &load.first_bad {
            eprintln!("  first unexpected answer ({} of them): {e}", load.bad);
        }
        Sample {
            req_s: load.ok as f64 / load.elapsed,
            p50_us: load.p50_us as f64,
            p99_us: load.p99_us as f64,
            threads: 0.0,
            rss_mib: 0.0,
            ok: load.ok,
            bad: load.bad,
            handler_runs: None,
        }
    };
    halt.store(true, Ordering::Relaxed);
    sample.threads = peak.join().expect("sampler") as f64;
    sample.rss_mib = status_field(pid, "VmHWM").unwrap_or(0) as f64 / 1024.0;
    let runs = stop(child, &mut out);
    if mode != Mode::Direct {
        let warm = if workload == Workload::Replay {
            REPLAY_KEYS as u64
        } else {
            0
        };
        sample.handler_runs = runs.map(|r| r.saturating_sub(warm));
    }
    drop(dir);
    sample
}
