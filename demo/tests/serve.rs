//! `payments serve` as an operator runs it: the safe expiry default (a key
//! reused after its TTL is never charged again), the mismatch status it is
//! given (422 by default, as the IETF draft says), a header-read timeout that
//! cuts off clients sending their request head too slowly (a slowloris
//! holds a connection forever otherwise), and a start that fails without
//! leaving files behind.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::time::{Duration, Instant};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// A `payments serve` child on an ephemeral loopback port, stopped (stdin
/// closed, then killed if need be) when dropped.
struct Server {
    child: Child,
    stdin: Option<ChildStdin>,
    addr: SocketAddr,
}

impl Server {
    fn start(db: &Path, extra: &[&str]) -> Result<Server> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_payments"))
            .args(["serve", "--addr", "127.0.0.1:0", "--exit-on-stdin-eof"])
            .arg("--store")
            .arg(db)
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut first = String::new();
        BufReader::new(stdout).read_line(&mut first)?;
        let addr = first
            .trim()
            .strip_prefix("listening on http://")
            .ok_or_else(|| format!("unexpected first line {first:?}"))?
            .parse()?;
        let stdin = child.stdin.take();
        Ok(Server { child, stdin, addr })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One POST /payments with `Connection: close`; the status code.
fn pay(addr: SocketAddr, key: &str, amount: u64) -> Result<u16> {
    let body = format!(r#"{{"amount": {amount}, "currency": "EUR", "customer": "cus_1"}}"#);
    let request = format!(
        "POST /payments HTTP/1.1\r\nHost: {addr}\r\nIdempotency-Key: \"{key}\"\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(request.as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response
        .split(' ')
        .nth(1)
        .ok_or_else(|| format!("no status line in {response:?}"))?;
    Ok(status.parse()?)
}

fn ledger_lines(dir: &Path) -> Result<usize> {
    Ok(
        std::fs::read_to_string(dir.join("payments.provider.jsonl"))?
            .lines()
            .count(),
    )
}

/// Receipts sent: the receipt provider's ledger, beside the card ledger.
fn receipt_lines(dir: &Path) -> Result<usize> {
    Ok(
        std::fs::read_to_string(dir.join("payments.receipts.jsonl"))?
            .lines()
            .count(),
    )
}

#[test]
fn a_key_reused_after_its_ttl_is_not_charged_again_by_default() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let server = Server::start(&dir.path().join("payments.redb"), &["--ttl", "1s"])?;
    assert_eq!(pay(server.addr, "order-1", 500)?, 201);
    std::thread::sleep(Duration::from_millis(1_500));
    // Expired and tombstoned: 409, never a second charge or receipt.
    assert_eq!(pay(server.addr, "order-1", 500)?, 409);
    drop(server);
    assert_eq!(ledger_lines(dir.path())?, 1);
    assert_eq!(receipt_lines(dir.path())?, 1);
    Ok(())
}

#[test]
fn the_forget_policy_is_there_when_asked_for() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let server = Server::start(
        &dir.path().join("payments.redb"),
        &["--ttl", "1s", "--expiry", "forget"],
    )?;
    assert_eq!(pay(server.addr, "order-1", 500)?, 201);
    std::thread::sleep(Duration::from_millis(1_500));
    // Forgotten: the same key is a new payment, charged again. This is
    // why it is not the default.
    assert_eq!(pay(server.addr, "order-1", 500)?, 201);
    drop(server);
    assert_eq!(ledger_lines(dir.path())?, 2);
    assert_eq!(receipt_lines(dir.path())?, 2);
    Ok(())
}

#[test]
fn a_request_head_sent_too_slowly_is_cut_off() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let server = Server::start(
        &dir.path().join("payments.redb"),
        &["--header-read-timeout", "1s"],
    )?;
    let head = format!(
        "POST /payments HTTP/1.1\r\nHost: {}\r\nIdempotency-Key: \"slow\"\r\n\
         Content-Type: application/json\r\nContent-Length: 2\r\n\r\n",
        server.addr
    );
    let mut stream = TcpStream::connect(server.addr)?;
    stream.set_read_timeout(Some(Duration::from_millis(200)))?;
    let started = Instant::now();
    let mut sent = 0;
    let mut closed_after = None;
    // One byte every 200 ms: the whole head would take about 25 s.
    for byte in head.as_bytes() {
        if stream.write_all(&[*byte]).is_err() {
            closed_after = Some(started.elapsed());
            break;
        }
        sent += 1;
        let mut buf = [0; 512];
        match stream.read(&mut buf) {
            // Still open, waiting for the rest of the head.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            // Closed (Ok(0), a reset), or answered (a 408) before the head
            // was complete: either way the server gave up on this client.
            _ => {
                closed_after = Some(started.elapsed());
                break;
            }
        }
        if started.elapsed() > Duration::from_secs(8) {
            break;
        }
    }
    let closed_after = closed_after.ok_or("the server kept a slow connection open for 8 s")?;
    assert!(sent < head.len(), "the whole head went through");
    assert!(
        closed_after < Duration::from_secs(4),
        "closed only after {closed_after:?}"
    );
    // Other clients are still served.
    assert_eq!(pay(server.addr, "fast", 500)?, 201);
    Ok(())
}

#[test]
fn a_changed_request_gets_the_mismatch_status_asked_for() -> Result<()> {
    for (args, status) in [(&[][..], 422), (&["--mismatch-status", "409"][..], 409)] {
        let dir = tempfile::tempdir()?;
        let server = Server::start(&dir.path().join("payments.redb"), args)?;
        assert_eq!(pay(server.addr, "order-1", 500)?, 201);
        // Same key, another amount: refused, never charged.
        assert_eq!(pay(server.addr, "order-1", 900)?, status, "{args:?}");
        drop(server);
        assert_eq!(ledger_lines(dir.path())?, 1);
    }
    Ok(())
}

#[test]
fn an_unknown_mismatch_status_is_refused_at_start() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let output = Command::new(env!("CARGO_BIN_EXE_payments"))
        .args(["serve", "--mismatch-status", "500", "--store"])
        .arg(dir.path().join("payments.redb"))
        .stdin(Stdio::null())
        .output()?;
    assert!(!output.status.success(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--mismatch-status"), "{stderr}");
    Ok(())
}

/// Runs `payments serve` expecting it to fail at start, within 20 s.
fn failed_start(db: &Path, addr: &str) -> Result<Output> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_payments"))
        .args(["serve", "--addr", addr, "--exit-on-stdin-eof"])
        .arg("--store")
        .arg(db)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait()?.is_none() {
        if Instant::now() > deadline {
            child.kill()?;
            return Err("the server started although it should not have".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = child.wait_with_output()?;
    assert!(!output.status.success(), "{output:?}");
    Ok(output)
}

fn entries(dir: &Path) -> Result<Vec<String>> {
    let mut names = std::fs::read_dir(dir)?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<Vec<_>>>()?;
    names.sort();
    Ok(names)
}

#[test]
fn a_start_on_an_address_in_use_leaves_no_files() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let taken = TcpListener::bind("127.0.0.1:0")?;
    let output = failed_start(
        &dir.path().join("payments.redb"),
        &taken.local_addr()?.to_string(),
    )?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("cannot listen on"), "{stderr}");
    assert_eq!(entries(dir.path())?, Vec::<String>::new());
    Ok(())
}

#[test]
fn a_start_on_an_unusable_database_path_leaves_no_files() -> Result<()> {
    let dir = tempfile::tempdir()?;
    // A directory where the database file should be: the ledger beside it
    // can be created, the database cannot.
    std::fs::create_dir(dir.path().join("payments.redb"))?;
    let output = failed_start(&dir.path().join("payments.redb"), "127.0.0.1:0")?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("cannot open"), "{stderr}");
    assert_eq!(entries(dir.path())?, vec!["payments.redb".to_string()]);
    Ok(())
}
