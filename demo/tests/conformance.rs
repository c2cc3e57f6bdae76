//! The conformance kit (conformance/) against `payments serve`: every
//! check of the kit must pass on our own layer, a crash mid-request
//! included, so a change to the HTTP layer or the demo that breaks the
//! `Idempotency-Key` contract as seen from outside (a second execution, a
//! replay that differs, a missing marker, a stored 5xx, a key replayed past
//! its TTL) fails here. `payments serve` answers a reused key with a
//! different body 422 (the draft's SHOULD; `--mismatch-status`), so no
//! check is excused.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_conformance::{Config, Restart, Verdict};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The server's settings: a TTL short enough to wait out, and a lease that
/// outlasts a slow request (1 s plus the provider's 150 ms) with room for a
/// loaded machine, yet is short enough for the crash check to wait out.
const SERVE_ARGS: [&str; 4] = ["--ttl", "2s", "--lease-ms", "3000"];

/// A `payments serve` child; killed when dropped. It also exits when its
/// stdin closes (`--exit-on-stdin-eof`), so a test process killed before
/// its drops ran (an interrupted `cargo test`) leaves no server behind.
struct Server {
    child: Child,
    _stdin: ChildStdin,
    // Kept open: the server must never write to a closed pipe.
    _stdout: BufReader<ChildStdout>,
    addr: SocketAddr,
}

impl Server {
    /// Starts a server on `addr` (port 0: any free loopback port).
    fn start(db: &Path, addr: SocketAddr) -> Result<Server> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_payments"))
            .args(["serve", "--addr", &addr.to_string(), "--store"])
            .arg(db)
            .args(SERVE_ARGS)
            .arg("--exit-on-stdin-eof")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let mut stdout = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        let mut first = String::new();
        stdout.read_line(&mut first)?;
        let addr = match first.trim().strip_prefix("listening on http://") {
            Some(addr) => addr.parse()?,
            None => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("unexpected first line {first:?}").into());
            }
        };
        Ok(Server {
            child,
            _stdin: stdin,
            _stdout: stdout,
            addr,
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_check_passes_on_the_payments_demo() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let db: PathBuf = dir.path().join("payments.redb");
    let server = Server::start(&db, ([127, 0, 0, 1], 0).into())?;
    let addr = server.addr;
    let base = format!("http://{addr}");
    let server = Arc::new(Mutex::new(Some(server)));

    let mut config = Config::new(&base);
    config.key_required = true;
    config.slow_header = Some(("x-simulate-fault".into(), "slow".into()));
    config.status_header = Some("x-simulate-status".into());
    config.count_url = Some(format!("{base}/charges?key={{key}}"));
    config.ttl = Some(Duration::from_secs(2));
    // SIGKILL while a slow payment holds its key, then the same binary on
    // the same port and database.
    let restarting = server.clone();
    let db_again = db.clone();
    config.restart = Some(Restart::from_fn(move || {
        let (server, db) = (restarting.clone(), db_again.clone());
        async move {
            tokio::task::spawn_blocking(move || {
                let mut slot = server.lock().map_err(|_| "server lock poisoned")?;
                drop(slot.take());
                *slot = Some(Server::start(&db, addr).map_err(|e| e.to_string())?);
                Ok::<(), String>(())
            })
            .await
            .map_err(|e| e.to_string())?
        }
    }));

    let report = idem_conformance::run(&config).await?;
    let table = report.table();
    println!("{table}");
    // `payments serve` answers a reused key with a different body 422, the
    // draft's status (its `--mismatch-status` default), so every check passes.
    for check in &report.checks {
        assert_eq!(
            check.verdict,
            Verdict::Pass,
            "{}: {}\n{table}",
            check.id,
            check.detail
        );
    }
    assert_eq!(report.checks.len(), 21, "{table}");
    drop(server.lock().map_err(|_| "server lock poisoned")?.take());
    Ok(())
}
