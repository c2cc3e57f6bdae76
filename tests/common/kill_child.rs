//! The child side of the SIGKILL tests (`kill_loop.rs`, `step_kills.rs`):
//! say "ready" to the parent, guard against outliving it, and run the
//! workers until the kill comes.
//!
//! Include it with `#[path = "common/kill_child.rs"] mod kill_child;`.

use std::error::Error;
use std::io::Write;
use std::time::Duration;

/// What a worker returns; an error ends the child (exit 3).
pub type WorkerResult = Result<(), Box<dyn Error + Send + Sync>>;

/// Prints `ready` (the line the parent waits for) and starts a watchdog
/// that ends this process (exit 4) after `limit`: a child whose parent is
/// gone must not run on.
pub fn announce_ready(ready: &str, limit: Duration) -> std::io::Result<()> {
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{ready}")?;
        out.flush()?;
    }
    std::thread::spawn(move || {
        std::thread::sleep(limit);
        eprintln!("child still running after {limit:?}: the parent is gone");
        std::process::exit(4);
    });
    Ok(())
}

/// Runs `worker(t)` on threads `0..threads` until they stop (they run
/// until the kill); a worker's error is printed and ends the child (exit
/// 3). Returns only if every worker returned `Ok`, which is itself wrong.
pub fn run_workers(
    round: u64,
    threads: u64,
    worker: impl Fn(u64) -> WorkerResult + Sync,
) -> WorkerResult {
    std::thread::scope(|s| {
        for t in 0..threads {
            let worker = &worker;
            s.spawn(move || {
                if let Err(e) = worker(t) {
                    eprintln!("child worker {t} of round {round}: {e}");
                    std::process::exit(3);
                }
            });
        }
    });
    Err("the child's workers stopped".into())
}
