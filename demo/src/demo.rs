//! The demo: runs the API as a child process on a loopback port, drives
//! real HTTP traffic at it, crashes and restarts it (an abort after the
//! charge, a SIGKILL between the charge and the receipt); then serves the
//! same API inside this process on engines of its own, one on a manual
//! clock (expiry) and one on a disk that fills up; then audits both
//! providers' ledgers for double and lost charges and receipts.

use std::collections::BTreeMap;
use std::error::Error;
use std::io::Write;
use std::path::Path;
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;

use crate::provider::{read_ledger, DECLINE_ABOVE};
use crate::receipts::{read_receipts, receipts_path};
use crate::server::{provider_path, DEFAULT_MISMATCH_STATUS, FAULT_HEADER, STEPS_HEADER};
use crate::store::{Store, REDIS_PREFIX, TABLE_PREFIX};

mod audit;
mod in_process;
mod kill_between_steps;

use audit::{ledger_count, receipt_count, Tally};

type DemoResult<T> = Result<T, Box<dyn Error>>;

/// The lease the demo's servers use: short, so the crash scenario's
/// PROCESSING record becomes UNKNOWN quickly.
const LEASE_MS: u64 = 1500;

/// The `--nats` URL every server child is started with, set once by
/// [`run`] (the scenarios start servers in several places).
static CHILD_NATS: OnceLock<String> = OnceLock::new();

/// The fault a server child is started with.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ServerFault {
    None,
    /// `--crash-after-charge`: abort after the first charge.
    CrashAfterCharge,
    /// `--crash-between-steps`: hold a payment once its charge is
    /// confirmed, for the demo to SIGKILL.
    PauseBetweenSteps,
}

/// A server child process.
struct Server {
    child: Child,
    stdin: Option<ChildStdin>,
    base: String,
    /// Copies the server's stderr to ours until the server exits.
    stderr: tokio::task::JoinHandle<()>,
    /// The server's stdout lines after "listening on".
    stdout: mpsc::UnboundedReceiver<String>,
}

impl Server {
    /// Starts `payments serve` on an ephemeral loopback port and waits for
    /// its "listening on" line.
    ///
    /// The server's stderr (its start line, fault injection, log events)
    /// goes to the demo's stderr, marked `[server]`, so the narrative on
    /// stdout stays readable. Its log level is `RUST_LOG` if set, else
    /// `error`: the warnings a server logs in these scenarios (a claim
    /// dropped, a record moved to UNKNOWN) are what the narrative tells;
    /// errors (a failed commit, a poisoned engine) still show.
    async fn start(store: &Store, ledger: &Path, fault: ServerFault) -> DemoResult<Server> {
        let exe = std::env::current_exe()?;
        let mut cmd = Command::new(exe);
        cmd.args(["serve", "--addr", "127.0.0.1:0", "--exit-on-stdin-eof"])
            .arg("--lease-ms")
            .arg(LEASE_MS.to_string())
            .arg("--store")
            .arg(store.to_arg())
            .arg("--ledger")
            .arg(ledger)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "error");
        }
        if let Some(url) = CHILD_NATS.get() {
            cmd.arg("--nats").arg(url);
        }
        match fault {
            ServerFault::None => {}
            ServerFault::CrashAfterCharge => {
                cmd.arg("--crash-after-charge");
            }
            ServerFault::PauseBetweenSteps => {
                cmd.arg("--crash-between-steps");
            }
        }
        let mut child = cmd.spawn()?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let stderr = child.stderr.take().ok_or("no stderr")?;
        // Told once the server's first stderr line (its start line, written
        // before "listening on") has been copied, or the pipe closed.
        let (first_copied, first_line) = tokio::sync::oneshot::channel::<()>();
        let stderr = tokio::spawn(async move {
            let mut first_copied = Some(first_copied);
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                // One write per line, so a line is never split by the
                // narrative when stdout and stderr share a terminal.
                let _ = std::io::stderr().write_all(format!("    [server] {line}\n").as_bytes());
                if let Some(tx) = first_copied.take() {
                    let _ = tx.send(());
                }
            }
        });
        let mut lines = BufReader::new(stdout).lines();
        let first = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .map_err(|_| "the server did not start within 20 s")??
            .ok_or("the server exited before listening")?;
        let base = first
            .strip_prefix("listening on ")
            .ok_or_else(|| format!("unexpected server output: {first}"))?
            .to_string();
        let (tx, stdout) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let _ = tx.send(line);
            }
        });
        let _ = tokio::time::timeout(Duration::from_secs(5), first_line).await;
        let stdin = child.stdin.take();
        Ok(Server {
            child,
            stdin,
            base,
            stderr,
            stdout,
        })
    }

    /// The server's next stdout line that starts with `prefix`, waiting at
    /// most `within`.
    async fn line_starting(&mut self, prefix: &str, within: Duration) -> DemoResult<String> {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.stdout.recv()).await {
                Ok(Some(line)) if line.starts_with(prefix) => return Ok(line),
                Ok(Some(_)) => {}
                Ok(None) => return Err(format!("the server exited before {prefix:?}").into()),
                Err(_) => return Err(format!("no {prefix:?} within {within:?}").into()),
            }
        }
    }

    /// Kills the server with SIGKILL (no shutdown of any kind: the engine
    /// and the providers stop mid-request) and waits for it to exit.
    async fn kill(&mut self) -> DemoResult<std::process::ExitStatus> {
        // tokio sends SIGKILL on Unix.
        self.child.start_kill()?;
        self.exited().await
    }

    /// Closes its standard input (graceful shutdown) and waits for it.
    async fn stop(mut self) -> DemoResult<()> {
        drop(self.stdin.take());
        let status = self.exited().await?;
        if !status.success() {
            return Err(format!("server exited with {status}").into());
        }
        Ok(())
    }

    /// Waits (at most 10 s, then kills it) for the server to exit, and for
    /// its last stderr lines to be copied, so they come before whatever
    /// the demo prints next.
    async fn exited(&mut self) -> DemoResult<std::process::ExitStatus> {
        let status = match tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await {
            Ok(status) => status?,
            Err(_) => {
                self.child.kill().await?;
                return Err("server did not exit within 10 s".into());
            }
        };
        // The pipe closes when the server exits; a grandchild holding it
        // open must not stall the demo.
        let _ = tokio::time::timeout(Duration::from_secs(2), &mut self.stderr).await;
        Ok(status)
    }
}

/// One scenario's counts.
#[derive(Default)]
struct Row {
    name: &'static str,
    requests: u32,
    charges: usize,
    receipts: usize,
    replays: u32,
    conflicts: u32,
    recovered: u32,
}

/// The answer to one request, as the client saw it.
#[derive(Debug)]
struct Answer {
    /// `None`: no response (connection failed).
    status: Option<u16>,
    replayed: bool,
    retry_after: Option<u64>,
    /// The `x-payment-steps` header: what each step did in the run that
    /// answered (`charge=confirmed-earlier, receipt=sent`).
    steps: Option<String>,
    body: serde_json::Value,
}

impl Answer {
    /// Whether the run that answered skipped the charge because an
    /// earlier attempt's charge was confirmed (a resumed payment).
    fn resumed(&self) -> bool {
        self.steps
            .as_deref()
            .is_some_and(|s| s.contains("charge=confirmed-earlier"))
    }

    fn problem_type(&self) -> &str {
        self.body["type"]
            .as_str()
            .and_then(|t| t.rsplit('#').next())
            .unwrap_or("")
    }

    fn payment_id(&self) -> Option<String> {
        self.body["id"].as_str().map(str::to_owned)
    }
}

#[derive(Clone)]
struct Client {
    http: reqwest::Client,
    base: String,
    merchant: String,
}

impl Client {
    /// A client of the API at `base`, as merchant `merchant-1`, giving up
    /// on an answer after `timeout`.
    fn new(base: String, timeout: Duration) -> reqwest::Result<Client> {
        Ok(Client {
            http: reqwest::Client::builder().timeout(timeout).build()?,
            base,
            merchant: "merchant-1".into(),
        })
    }

    async fn pay(&self, key: &str, amount: u64, description: &str, fault: Option<&str>) -> Answer {
        let body = serde_json::json!({
            "amount": amount,
            "currency": "EUR",
            "customer": "cus_demo",
            "description": description,
        });
        let mut req = self
            .http
            .post(format!("{}/payments", self.base))
            .header("idempotency-key", format!("\"{key}\""))
            .header("x-merchant-id", &self.merchant)
            .json(&body);
        if let Some(fault) = fault {
            req = req.header(FAULT_HEADER, fault);
        }
        match req.send().await {
            Ok(r) => {
                let status = Some(r.status().as_u16());
                let replayed = r
                    .headers()
                    .get("idempotent-replayed")
                    .is_some_and(|v| v == "true");
                let retry_after = r
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse().ok());
                let steps = r
                    .headers()
                    .get(STEPS_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                let body = r.json().await.unwrap_or(serde_json::Value::Null);
                Answer {
                    status,
                    replayed,
                    retry_after,
                    steps,
                    body,
                }
            }
            Err(_) => Answer {
                status: None,
                replayed: false,
                retry_after: None,
                steps: None,
                body: serde_json::Value::Null,
            },
        }
    }
}

/// What the demo checks along the way.
#[derive(Default)]
struct Audit {
    /// Client key → the payment id the client was told (a 201).
    succeeded: BTreeMap<String, String>,
    /// Keys the client was refused for (declined): must have no charge.
    refused: Vec<String>,
    failures: Vec<String>,
}

impl Audit {
    /// Records a 201; a second 201 for the key must name the same payment.
    fn success(&mut self, key: &str, answer: &Answer) {
        let Some(id) = answer.payment_id() else {
            self.fail(format!("{key}: a 201 without a payment id"));
            return;
        };
        if let Some(previous) = self.succeeded.insert(key.to_owned(), id.clone()) {
            if previous != id {
                self.fail(format!("{key}: told {previous} first, then {id}"));
            }
        }
    }

    fn expect(&mut self, ok: bool, what: impl FnOnce() -> String) {
        if !ok {
            self.fail(what());
        }
    }

    fn fail(&mut self, what: String) {
        println!("    FAILED: {what}");
        self.failures.push(what);
    }
}

/// `1 payment`, `2 payments`.
fn plural(n: usize, word: &str) -> String {
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
}

/// Runs the whole demo on `store` (a redb file in a temporary directory
/// if `None`); with `nats` (a NATS server URL, `nats` feature), the child
/// servers relay their outbox to JetStream and a ledger consumer books the
/// events. `Ok(false)` if any check failed.
pub async fn run(store: Option<Store>, nats: Option<String>) -> DemoResult<bool> {
    let started = Instant::now();
    let tempdir = tempfile::tempdir()?;
    let store = store.unwrap_or_else(|| Store::Redb(tempdir.path().join("payments.redb")));
    // The providers' ledgers: beside a redb file, else temporary files.
    let ledger = match store.redb_path() {
        Some(db) => provider_path(db),
        None => tempdir.path().join("payments.provider.jsonl"),
    };
    // Keys are unique per run, so a reused store does not mix runs, and
    // nothing needs clearing first.
    let run = format!("demo-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    match &store {
        Store::Redb(db) => println!("engine file    {}", db.display()),
        Store::Postgres(_) => {
            println!("engine         PostgreSQL {store} (tables {TABLE_PREFIX}*)")
        }
        Store::Redis(_) => println!("engine         Redis {store} (keys {REDIS_PREFIX}*)"),
    }
    println!("provider file  {}", ledger.display());
    println!("receipt file   {}", receipts_path(&ledger).display());
    println!("key prefix     {run}");
    #[cfg(feature = "nats")]
    let ledger_consumer = match &nats {
        Some(url) => {
            let started = crate::broker::Ledger::start(url, tempdir.path(), &run)
                .await
                .map_err(|e| e.to_string())?;
            println!(
                "events         NATS JetStream {url}: stream {} ({}), durable pull consumer {} \
                 booking into {}",
                crate::broker::STREAM,
                crate::broker::STREAM_SUBJECTS,
                started.durable,
                tempdir.path().join("books.redb").display()
            );
            let _ = CHILD_NATS.set(url.clone());
            Some(started)
        }
        None => None,
    };
    #[cfg(not(feature = "nats"))]
    if let Some(url) = &nats {
        return Err(format!("--nats {url}: {}", crate::store::NEEDS_NATS).into());
    }
    if nats.is_none() {
        println!(
            "events         each payment's event stays in the outbox (scripts/demo-nats \
             relays it to NATS JetStream and books it)"
        );
    }

    let server = Server::start(&store, &ledger, ServerFault::None).await?;
    println!("server         {} (child process)", server.base);
    let mut client = Client::new(server.base.clone(), Duration::from_secs(10))?;
    let mut audit = Audit::default();
    let mut rows = Vec::new();

    // Each phase counts its charges; its receipts are counted around it.
    let mut receipts = receipt_count(&ledger, &run)?;
    let mut counted = |mut row: Row| -> DemoResult<Row> {
        let now = receipt_count(&ledger, &run)?;
        row.receipts = now - receipts;
        receipts = now;
        Ok(row)
    };
    rows.push(counted(
        concurrent_duplicates(&client, &mut audit, &ledger, &run).await?,
    )?);
    rows.push(counted(
        lost_responses(&client, &mut audit, &ledger, &run).await?,
    )?);
    rows.push(counted(
        tampered_retry(&client, &mut audit, &ledger, &run).await?,
    )?);
    rows.push(counted(
        declined(&client, &mut audit, &ledger, &run).await?,
    )?);
    rows.push(counted(
        provider_timeout(&client, &mut audit, &ledger, &run).await?,
    )?);
    rows.push(counted(
        client_hangs_up(&client, &mut audit, &ledger, &run).await?,
    )?);

    // Crash: restart with fault injection, charge, abort, restart, retry.
    server.stop().await?;
    let key = format!("{run}-crash");
    let before = ledger_count(&ledger, &run)?;
    let mut row = Row {
        name: "server crash after charge",
        ..Row::default()
    };
    println!("\n== {}", row.name);
    let mut crashing = Server::start(&store, &ledger, ServerFault::CrashAfterCharge).await?;
    client.base = crashing.base.clone();
    println!(
        "    server restarted on {} to abort right after the provider charges, before the \
         charge step is confirmed",
        crashing.base
    );
    let first = client.pay(&key, 4_200, "crash", None).await;
    row.requests += 1;
    audit.expect(first.status.is_none(), || {
        format!(
            "{key}: expected the connection to fail, got {:?}",
            first.status
        )
    });
    let status = crashing.exited().await?;
    println!("    server exited: {status} (abort after the provider charged)");
    audit.expect(!status.success(), || {
        "the crashing server exited cleanly".into()
    });
    let restarted = Server::start(&store, &ledger, ServerFault::None).await?;
    client.base = restarted.base.clone();
    println!(
        "    server restarted on {}, without fault injection",
        restarted.base
    );
    if let Some(answer) =
        retry_until_settled(&client, &mut audit, &mut row, &key, 4_200, "crash retry").await
    {
        audit.expect(answer.replayed || answer.resumed(), || {
            format!("{key}: the retry charged again ({:?})", answer.steps)
        });
        println!(
            "    settled: the resolver found charge {} at the provider under the step's \
             reference; {}",
            answer.payment_id().unwrap_or_default(),
            if answer.replayed {
                "replayed".to_owned()
            } else {
                format!(
                    "the retry skipped the charge and sent the receipt ({})",
                    answer.steps.as_deref().unwrap_or("-")
                )
            }
        );
    }
    row.charges = ledger_count(&ledger, &run)? - before;
    rows.push(counted(row)?);
    restarted.stop().await?;

    // SIGKILL between the two calls: charge confirmed, receipt not sent.
    rows.push(counted(
        kill_between_steps::phase(&store, &mut client, &mut audit, &ledger, &run).await?,
    )?);

    // Every child server has stopped, and each relayed its outbox on the
    // way out. The phases below run the API in this process, each on an
    // engine of its own, with the providers on the same ledgers (and, with
    // --nats, relay their engine's outbox before closing it).
    rows.push(counted(
        in_process::expiry(&mut audit, &ledger, &run, tempdir.path(), nats.as_deref()).await?,
    )?);
    rows.push(counted(
        in_process::disk_full(&mut audit, &ledger, &run, nats.as_deref()).await?,
    )?);

    // The ledger consumer books the last events; then every payment's
    // events are audited.
    #[cfg(feature = "nats")]
    let events = match ledger_consumer {
        Some(consumer) => {
            let told: BTreeMap<String, String> = audit
                .succeeded
                .iter()
                .filter(|(key, _)| key.starts_with(&run))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let tally = consumer
                .finish(&told, &run)
                .await
                .map_err(|e| e.to_string())?;
            println!("\n== payment.succeeded events, relayed and booked");
            println!(
                "    ledger consumer: {} booked, {} redeliveries acked without booking, {} \
                 retried, {} dead-lettered, {} deferred",
                tally.pass.processed,
                tally.pass.duplicates,
                tally.pass.retried,
                tally.pass.dead_lettered,
                tally.pass.deferred
            );
            for problem in &tally.problems {
                audit.fail(problem.clone());
            }
            Some(tally.line())
        }
        None => None,
    };
    #[cfg(not(feature = "nats"))]
    let events: Option<String> = None;

    // The audit, from the providers' own ledgers. Every server has
    // stopped, so the ledgers must be whole: a torn or unparsable one
    // fails the audit (it could hide a charge or a receipt).
    let receipt_ledger = receipts_path(&ledger);
    let contents = match (read_ledger(&ledger), read_receipts(&receipt_ledger)) {
        (Ok(charges), Ok(receipts)) => (charges, receipts),
        (Err(e), _) | (_, Err(e)) => {
            audit.fail(format!("the ledgers cannot be audited: {e}"));
            print_table(&rows);
            println!("FAILED: {} check(s) failed", audit.failures.len());
            return Ok(false);
        }
    };
    for (path, torn) in [
        (&ledger, contents.0.torn_tail_bytes),
        (&receipt_ledger, contents.1.torn_tail_bytes),
    ] {
        if torn > 0 {
            audit.fail(format!(
                "{}: a torn last line ({torn} bytes) after every server stopped",
                path.display(),
            ));
        }
    }
    let charges = Tally::charges(&contents.0.entries, &run, &audit);
    let receipts = Tally::receipts(&contents.1.entries, &run, &audit);
    for problem in charges.problems.iter().chain(&receipts.problems) {
        audit.fail(problem.clone());
    }

    print_table(&rows);
    println!(
        "\naudit of both providers' ledgers: {}",
        Tally::line(&charges, &receipts)
    );
    if let Some(events) = &events {
        println!(
            "audit of the payment events (JetStream stream and the ledger consumer's books): \
             {events}"
        );
    }
    println!("finished in {:.1} s", started.elapsed().as_secs_f64());
    if audit.failures.is_empty() {
        println!(
            "OK: every payment the client saw succeed was charged exactly once and receipted \
             exactly once"
        );
        Ok(true)
    } else {
        println!("FAILED: {} check(s) failed", audit.failures.len());
        Ok(false)
    }
}

fn print_table(rows: &[Row]) {
    println!(
        "\n{:<32} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9}",
        "scenario", "requests", "charges", "receipts", "replays", "conflicts", "recovered"
    );
    println!("{}", "-".repeat(88));
    let mut total = Row {
        name: "total",
        ..Row::default()
    };
    for r in rows.iter().chain(std::iter::once(&Row::default())) {
        if r.name.is_empty() {
            println!("{}", "-".repeat(88));
            println!(
                "{:<32} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9}",
                total.name,
                total.requests,
                total.charges,
                total.receipts,
                total.replays,
                total.conflicts,
                total.recovered
            );
            break;
        }
        println!(
            "{:<32} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9}",
            r.name, r.requests, r.charges, r.receipts, r.replays, r.conflicts, r.recovered
        );
        total.requests += r.requests;
        total.charges += r.charges;
        total.receipts += r.receipts;
        total.replays += r.replays;
        total.conflicts += r.conflicts;
        total.recovered += r.recovered;
    }
}

/// 20 identical POSTs at once: one charge; the rest see 409 processing or
/// a replay; each 409 retries after `Retry-After` and gets the replay.
async fn concurrent_duplicates(
    client: &Client,
    audit: &mut Audit,
    ledger: &Path,
    run: &str,
) -> DemoResult<Row> {
    let mut row = Row {
        name: "20 concurrent duplicates",
        ..Row::default()
    };
    println!("\n== {}", row.name);
    let before = ledger_count(ledger, run)?;
    let key = format!("{run}-dup");
    let answers = join_all((0..20).map(|_| client.pay(&key, 1_999, "dup", None))).await;
    row.requests += 20;
    let mut retries = 0;
    let mut originals = 0;
    for answer in &answers {
        match (answer.status, answer.replayed) {
            (Some(201), replayed) => {
                originals += u32::from(!replayed);
                row.replays += u32::from(replayed);
                audit.success(&key, answer);
            }
            (Some(409), _) => {
                row.conflicts += 1;
                audit.expect(answer.problem_type() == "processing", || {
                    format!("{key}: 409 {}", answer.body)
                });
                retries += 1;
            }
            other => audit.fail(format!("{key}: unexpected {other:?} {}", answer.body)),
        }
    }
    audit.expect(originals == 1, || {
        format!("{key}: {originals} original responses")
    });
    println!(
        "    1 charged, {} replayed, {} told 409 processing",
        row.replays, row.conflicts
    );
    if retries > 0 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let again = join_all((0..retries).map(|_| client.pay(&key, 1_999, "dup", None))).await;
        row.requests += retries;
        for answer in &again {
            audit.expect(answer.status == Some(201) && answer.replayed, || {
                format!("{key}: retry after 409 got {:?}", answer.status)
            });
            row.replays += u32::from(answer.replayed);
            audit.success(&key, answer);
        }
        println!("    the {retries} retried after Retry-After: all replayed");
    }
    row.charges = ledger_count(ledger, run)? - before;
    Ok(row)
}

/// 10 payments whose responses were "lost": each is retried, the retry
/// with a different description (not fingerprinted), and replays.
async fn lost_responses(
    client: &Client,
    audit: &mut Audit,
    ledger: &Path,
    run: &str,
) -> DemoResult<Row> {
    let mut row = Row {
        name: "10 payments, each retried",
        ..Row::default()
    };
    println!("\n== {}", row.name);
    let before = ledger_count(ledger, run)?;
    let keys: Vec<String> = (0..10).map(|i| format!("{run}-pay-{i}")).collect();
    let pairs = join_all(keys.iter().enumerate().map(|(i, key)| async move {
        let amount = 1_000 + 100 * i as u64;
        let first = client.pay(key, amount, "order", None).await;
        let retry = client.pay(key, amount, "order (retry)", None).await;
        (key, first, retry)
    }))
    .await;
    for (key, first, retry) in &pairs {
        row.requests += 2;
        audit.expect(first.status == Some(201) && !first.replayed, || {
            format!("{key}: first attempt got {:?}", first.status)
        });
        audit.expect(retry.status == Some(201) && retry.replayed, || {
            format!("{key}: retry got {:?}", retry.status)
        });
        row.replays += u32::from(retry.replayed);
        audit.success(key, first);
        audit.success(key, retry);
    }
    row.charges = ledger_count(ledger, run)? - before;
    println!(
        "    {} charged, {} retries replayed",
        row.charges, row.replays
    );
    Ok(row)
}

/// The same key with a different amount: 422 (the draft's answer, the
/// server's default `--mismatch-status`), nothing charged.
async fn tampered_retry(
    client: &Client,
    audit: &mut Audit,
    ledger: &Path,
    run: &str,
) -> DemoResult<Row> {
    let mut row = Row {
        name: "tampered retry",
        ..Row::default()
    };
    println!("\n== {}", row.name);
    let before = ledger_count(ledger, run)?;
    let key = format!("{run}-pay-0");
    let answer = client.pay(&key, 99_999, "order", None).await;
    row.requests += 1;
    let mismatch = Some(DEFAULT_MISMATCH_STATUS.as_u16());
    if answer.status == mismatch {
        row.conflicts += 1;
    }
    audit.expect(
        answer.status == mismatch && answer.problem_type() == "key-mismatch",
        || {
            format!(
                "{key}: tampered retry got {:?} {}",
                answer.status, answer.body
            )
        },
    );
    println!(
        "    same key, amount 1000 -> 99999: {} {}",
        answer.status.unwrap_or(0),
        answer.problem_type()
    );
    row.charges = ledger_count(ledger, run)? - before;
    Ok(row)
}

/// A declined card: 402 stored; the retry replays the 402, no charge.
async fn declined(client: &Client, audit: &mut Audit, ledger: &Path, run: &str) -> DemoResult<Row> {
    let mut row = Row {
        name: "declined card, retried",
        ..Row::default()
    };
    println!("\n== {}", row.name);
    let before = ledger_count(ledger, run)?;
    let key = format!("{run}-declined");
    let first = client.pay(&key, DECLINE_ABOVE + 1, "too much", None).await;
    let retry = client.pay(&key, DECLINE_ABOVE + 1, "too much", None).await;
    row.requests += 2;
    row.replays += u32::from(retry.replayed);
    audit.expect(first.status == Some(402) && !first.replayed, || {
        format!("{key}: got {:?}", first.status)
    });
    audit.expect(retry.status == Some(402) && retry.replayed, || {
        format!("{key}: retry got {:?}", retry.status)
    });
    audit.refused.push(key);
    row.charges = ledger_count(ledger, run)? - before;
    println!("    402, then a replayed 402");
    Ok(row)
}

/// The provider charges, then the call times out: 503, the key and its
/// charge step UNKNOWN. The retry has the resolver ask the provider about
/// the step by its reference: charged, so the step is confirmed with the
/// provider's answer, and the retry resumes: it skips the charge and sends
/// the receipt.
async fn provider_timeout(
    client: &Client,
    audit: &mut Audit,
    ledger: &Path,
    run: &str,
) -> DemoResult<Row> {
    let mut row = Row {
        name: "provider timeout",
        ..Row::default()
    };
    println!("\n== {}", row.name);
    let before = ledger_count(ledger, run)?;
    let key = format!("{run}-timeout");
    let first = client
        .pay(&key, 3_100, "slow provider", Some("provider-timeout"))
        .await;
    row.requests += 1;
    audit.expect(first.status == Some(503), || {
        format!("{key}: got {:?} {}", first.status, first.body)
    });
    println!(
        "    first attempt: {} (provider charged, then timed out: the charge step is in doubt)",
        first.status.unwrap_or(0)
    );
    if let Some(retry) =
        retry_until_settled(client, audit, &mut row, &key, 3_100, "slow provider").await
    {
        audit.expect(retry.resumed() || retry.replayed, || {
            format!("{key}: the retry charged again ({:?})", retry.steps)
        });
        println!(
            "    retry: 201 (the resolver found charge {} under the step's reference; the retry \
             skipped the charge: {})",
            retry.payment_id().unwrap_or_default(),
            retry.steps.as_deref().unwrap_or("replayed")
        );
    }
    row.charges = ledger_count(ledger, run)? - before;
    Ok(row)
}

/// The client gives up while the provider call is still in flight and
/// retries at once. The dropped request drops its claim, but the work it
/// started still runs: the key answers 409 in progress until the resolver
/// finds the charge at the provider (asked at most once a second while the
/// claim's lease runs; a "not executed" heard before the charge landed
/// waits for the lease end). One charge: the retry resumes (the charge
/// step confirmed from the provider's answer, the receipt sent), or, had
/// the step been found not executed, calls again under the same reference,
/// which the provider dedupes.
async fn client_hangs_up(
    client: &Client,
    audit: &mut Audit,
    ledger: &Path,
    run: &str,
) -> DemoResult<Row> {
    let mut row = Row {
        name: "client hangs up, retries",
        ..Row::default()
    };
    println!("\n== {}", row.name);
    let before = ledger_count(ledger, run)?;
    let key = format!("{run}-hangup");
    let impatient = Client::new(client.base.clone(), Duration::from_millis(50))?;
    let first = impatient.pay(&key, 1_900, "impatient", None).await;
    row.requests += 1;
    audit.expect(first.status.is_none(), || {
        format!(
            "{key}: expected the client to time out, got {:?}",
            first.status
        )
    });
    println!("    first attempt: client gave up after 50 ms (provider call in flight)");
    if let Some(answer) =
        retry_until_settled(client, audit, &mut row, &key, 1_900, "impatient").await
    {
        println!(
            "    retry: 201 replayed={} (charge {}; {})",
            answer.replayed,
            answer.payment_id().unwrap_or_default(),
            answer.steps.as_deref().unwrap_or("replayed")
        );
    }
    row.charges = ledger_count(ledger, run)? - before;
    audit.expect(row.charges == 1, || {
        format!("{key}: {} charges for one payment", row.charges)
    });
    Ok(row)
}

/// Retries `key` until it is answered 201, for at most 20 s, waiting as
/// `Retry-After` says (at most 2 s) after each 409 processing or 503. The
/// 201 is a replay (recovery completed the payment) or a resumed run (its
/// steps settled, the calls already made skipped); the ledgers' audit
/// checks that no call was made twice. Returns that answer, or `None`
/// (recorded as an audit failure).
async fn retry_until_settled(
    client: &Client,
    audit: &mut Audit,
    row: &mut Row,
    key: &str,
    amount: u64,
    description: &str,
) -> Option<Answer> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let answer = client.pay(key, amount, description, None).await;
        row.requests += 1;
        match answer.status {
            Some(201) => {
                row.replays += u32::from(answer.replayed);
                row.recovered += 1;
                audit.success(key, &answer);
                return Some(answer);
            }
            Some(409) => row.conflicts += 1,
            Some(503) | None => {}
            other => {
                audit.fail(format!(
                    "{key}: unexpected answer {other:?} {}",
                    answer.body
                ));
                return None;
            }
        }
        if Instant::now() > deadline {
            audit.fail(format!("{key}: not settled within 20 s"));
            return None;
        }
        let wait = answer.retry_after.unwrap_or(1).min(2);
        println!(
            "    retry got {} ({}); waiting {wait} s",
            answer
                .status
                .map_or("no response".into(), |s| s.to_string()),
            answer.problem_type()
        );
        tokio::time::sleep(Duration::from_secs(wait)).await;
    }
}

/// Runs futures concurrently on the runtime and collects their outputs in
/// order (no `futures` dependency needed).
async fn join_all<F>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future,
{
    let mut set = Vec::new();
    for f in futures {
        set.push(Box::pin(f));
    }
    let mut out = Vec::with_capacity(set.len());
    let mut pending: Vec<Option<F::Output>> = (0..set.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut done = true;
        for (i, f) in set.iter_mut().enumerate() {
            if pending[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => pending[i] = Some(v),
                    std::task::Poll::Pending => done = false,
                }
            }
        }
        if done {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    out.extend(pending.into_iter().flatten());
    out
}
