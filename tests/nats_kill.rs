//! The real kill test of the message side, on a real `nats-server -js`
//! (`scripts/with-nats`): guards against a relay that loses or renames an
//! outbox message when it is SIGKILLed between the publish, the ack and
//! the mark, a consumer that books a payment twice or never when it is
//! SIGKILLed between its commit and its ack (or mid-handler), and either
//! side losing messages across a restart of the broker (JetStream file
//! storage).
//!
//! Two children (this test binary re-invoked with `IDEM_NATS_KILL_ROLE`
//! set, running only `child_entry`):
//! - `payments`: claims payment keys `pay-<incarnation>-<n>` on its own
//!   redb file and completes each with an outbox message
//!   (`payment.succeeded`, payload = the payment's key), while a
//!   `nats::Relay` in the same process (it needs the same engine) publishes
//!   the outbox with `Nats-Msg-Id` = the outbox id;
//! - `consumer`: a `nats::Consumer` on a durable JetStream pull consumer
//!   (explicit acks, 1 s ack wait) booking each event into a `ledger` table
//!   of its own redb file (+1 per booking) through the inbox's local
//!   exactly-once, then acking.
//!
//! The parent SIGKILLs one of the two at random delays from a seeded RNG
//! and restarts it; once, halfway, it also stops the NATS server (SIGTERM
//! to the pid in `IDEMPOTENCY_TEST_NATS_PIDFILE`) and starts it again on
//! the same port and store dir. Then a relay-only child and a consumer
//! child drain the outbox and the stream, and the audit checks that every
//! completed payment is booked exactly once (0 doubles, 0 lost, 0
//! unknown), that there are no dead letters (the handler never fails), and
//! that the outbox is empty.
//!
//! 10 kills by default (well under a minute); `IDEMPOTENCY_NATS_KILLS=200`
//! for the long run. `IDEMPOTENCY_NATS_KILL_SEED` replays the kill delays
//! and victims of an earlier run (scheduling is not replayed).
//!
//! Without `IDEMPOTENCY_TEST_NATS` the test is skipped with a message; with
//! `CI=true` that is a failure. Unix only (SIGKILL, `/proc`).
#![cfg(unix)]

#[path = "common/split_mix.rs"]
mod split_mix;

#[path = "common/nats_env.rs"]
mod nats_env;
use nats_env::{nats_url, unique_name, NATS_ENV};
#[path = "common/nats_ledger.rs"]
mod nats_ledger;

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, stream};
use idempotency::nats::{self, async_nats, Backoff, Consumer, Incoming, Relay};
use idempotency::{
    Begin, BoxError, Engine, Envelope, Fingerprint, IdempotencyKey, LocalTx, OutgoingMessage,
    RecordFilter, State,
};
use redb::ReadableTable;
use split_mix::SplitMix64;

type TestResult = Result<(), BoxError>;

const KILLS_VAR: &str = "IDEMPOTENCY_NATS_KILLS";
const SEED_VAR: &str = "IDEMPOTENCY_NATS_KILL_SEED";
/// Set in a child: `payments`, `relay-drain`, `consumer` or `consumer-drain`.
const ROLE_VAR: &str = "IDEM_NATS_KILL_ROLE";
/// The parent's temp dir (both engine files live there).
const DIR_VAR: &str = "IDEM_NATS_KILL_DIR";
/// The payments child's incarnation (its key prefix).
const INCARNATION_VAR: &str = "IDEM_NATS_KILL_INCARNATION";
/// The stream's name (its subjects are `<name>.>`).
const STREAM_VAR: &str = "IDEM_NATS_KILL_STREAM";

const DEFAULT_KILLS: u64 = 10;
const SCOPE: &str = "tenant-1:pay";
const INBOX: &str = "ledger";
const DURABLE: &str = "ledger";
const READY: &str = "NATS-KILL CHILD READY";
const SIGKILL: i32 = 9;
const LEDGER: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("ledger");
/// No payment claim's lease runs out during the test (a killed claim stays
/// PROCESSING, UNKNOWN after the next open, and never gets an outbox
/// message).
const LEASE: Duration = Duration::from_secs(3600);
/// A child the parent forgot ends itself (exit 4) after this long.
const CHILD_LIMIT: Duration = Duration::from_secs(300);
/// How long a drain child may take to empty the outbox or the stream.
const DRAIN_LIMIT: Duration = Duration::from_secs(90);
/// The backoff of both children (short: the broker comes back quickly).
const BACKOFF: Backoff = Backoff {
    initial: Duration::from_millis(20),
    max: Duration::from_millis(500),
};

fn env(var: &str) -> Result<String, BoxError> {
    std::env::var(var).map_err(|e| format!("{var}: {e}").into())
}

fn env_u64(var: &str) -> Result<Option<u64>, BoxError> {
    match std::env::var(var) {
        Ok(v) => Ok(Some(
            v.trim().parse().map_err(|e| format!("{var}={v:?}: {e}"))?,
        )),
        Err(_) => Ok(None),
    }
}

fn subject(stream: &str) -> String {
    format!("{stream}.payment.succeeded")
}

// ---------------------------------------------------------------- children

/// Entry point of the child processes; a no-op in the normal test run.
#[test]
fn child_entry() -> TestResult {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return Ok(());
    };
    let dir = PathBuf::from(env(DIR_VAR)?);
    let stream = env(STREAM_VAR)?;
    let url = env(NATS_ENV)?;
    std::thread::spawn(|| {
        std::thread::sleep(CHILD_LIMIT);
        eprintln!("child still running after {CHILD_LIMIT:?}: the parent is gone");
        std::process::exit(4);
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    match role.as_str() {
        "payments" => {
            let incarnation: u64 = env(INCARNATION_VAR)?.parse()?;
            runtime.block_on(payments(&dir, &url, &stream, incarnation))
        }
        "relay-drain" => runtime.block_on(relay_drain(&dir, &url)),
        "consumer" => runtime.block_on(consume(&dir, &url, &stream, false)),
        "consumer-drain" => runtime.block_on(consume(&dir, &url, &stream, true)),
        other => Err(format!("unknown role {other:?}").into()),
    }
}

fn say_ready() -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{READY}")?;
    out.flush()
}

fn payments_engine(dir: &Path) -> Result<Arc<Engine>, BoxError> {
    Ok(Arc::new(
        Engine::builder()
            .lease(LEASE)
            .sweep_interval(None)
            .open(dir.join("payments.redb"))?,
    ))
}

fn ledger_engine(dir: &Path) -> Result<Arc<Engine>, BoxError> {
    Ok(Arc::new(
        Engine::builder()
            .sweep_interval(None)
            .dead_letter_after(5)
            .open(dir.join("ledger.redb"))?,
    ))
}

/// Claims and completes payments (one every few ms, each with its
/// `payment.succeeded` event in the outbox) while the relay publishes,
/// until killed.
async fn payments(dir: &Path, url: &str, stream: &str, incarnation: u64) -> TestResult {
    let engine = payments_engine(dir)?;
    say_ready()?;
    let subject = subject(stream);
    let writer = Arc::clone(&engine);
    std::thread::spawn(move || {
        if let Err(e) = pay_forever(&writer, &subject, incarnation) {
            eprintln!("payments thread: {e}");
            std::process::exit(3);
        }
    });
    let client = nats::connect(url, BACKOFF, Duration::from_secs(60)).await?;
    let relay = Relay::new(engine, jetstream::new(client)).batch(8);
    relay
        .run(Duration::from_millis(10), BACKOFF, std::future::pending())
        .await;
    Err("the relay stopped".into())
}

fn pay_forever(engine: &Engine, subject: &str, incarnation: u64) -> TestResult {
    for n in 0.. {
        let name = format!("pay-{incarnation}-{n}");
        let key = IdempotencyKey::new(SCOPE, name.as_str())?;
        let claim = match engine.begin(&key, Fingerprint::of_json(b"{}", &[])?)? {
            Begin::Claimed(c) => c,
            other => return Err(format!("fresh payment {name} was not claimed: {other:?}").into()),
        };
        engine.complete_with_messages(
            claim,
            Envelope::new(0, 201, "paid"),
            vec![OutgoingMessage::new(subject.to_owned(), name)],
        )?;
        // Paces the payments (a few hundred a second), so the outbox and
        // the stream stay small enough to drain in a short run.
        std::thread::sleep(Duration::from_millis(3));
    }
    Ok(())
}

/// The final relay run: publishes until the outbox is empty, then exits.
async fn relay_drain(dir: &Path, url: &str) -> TestResult {
    let engine = payments_engine(dir)?;
    say_ready()?;
    let client = nats::connect(url, BACKOFF, Duration::from_secs(60)).await?;
    let relay = Relay::new(Arc::clone(&engine), jetstream::new(client)).batch(64);
    let started = Instant::now();
    let mut failures = 0;
    while !engine.outbox().is_empty()? {
        if started.elapsed() > DRAIN_LIMIT {
            return Err(format!(
                "the outbox still holds {} messages after {DRAIN_LIMIT:?}",
                engine.outbox().len()?
            )
            .into());
        }
        if let Err(e) = relay.relay_once().await {
            failures += 1;
            eprintln!("relay drain pass failed: {e}");
            tokio::time::sleep(BACKOFF.after(failures)).await;
        }
    }
    Ok(())
}

/// Books `incoming` (payload = the payment's key) in the ledger: +1 per
/// booking, so a double booking shows as 2.
fn book(incoming: &Incoming, tx: &mut LocalTx<'_>) -> Result<(), BoxError> {
    let payment = std::str::from_utf8(&incoming.payload)?;
    let txn = tx.redb().ok_or("not a redb engine")?;
    let mut table = txn.open_table(LEDGER)?;
    let before = table.get(payment)?.map_or(0, |v| v.value());
    table.insert(payment, before + 1)?;
    Ok(())
}

/// The ledger consumer: consumes until killed, or (`drain`) until the
/// JetStream consumer has nothing pending or unacked.
async fn consume(dir: &Path, url: &str, stream: &str, drain: bool) -> TestResult {
    let engine = ledger_engine(dir)?;
    say_ready()?;
    let client = nats::connect(url, BACKOFF, Duration::from_secs(60)).await?;
    let js = jetstream::new(client);
    // The broker may be restarting: look the consumer up until it answers.
    let started = Instant::now();
    let mut failures = 0;
    let pull: consumer::PullConsumer = loop {
        let found = async {
            let found: consumer::PullConsumer =
                js.get_stream(stream).await?.get_consumer(DURABLE).await?;
            Ok::<_, BoxError>(found)
        };
        match found.await {
            Ok(pull) => break pull,
            Err(e) if started.elapsed() < Duration::from_secs(60) => {
                failures += 1;
                eprintln!("looking up the JetStream consumer: {e}");
                tokio::time::sleep(BACKOFF.after(failures)).await;
            }
            Err(e) => return Err(e),
        }
    };
    let c = Consumer::new(engine, INBOX, js.clone(), pull.clone(), book)?;
    if !drain {
        c.run(16, BACKOFF, std::future::pending()).await;
        return Err("the consumer stopped".into());
    }
    loop {
        if started.elapsed() > DRAIN_LIMIT {
            return Err(format!("the stream did not drain in {DRAIN_LIMIT:?}").into());
        }
        match c.consume_once(64, Duration::from_millis(300)).await {
            Ok(pass) if pass.processed + pass.duplicates + pass.retried + pass.deferred > 0 => {
                continue
            }
            Ok(_) => {}
            Err(e) => {
                eprintln!("consumer drain pass failed: {e}");
                tokio::time::sleep(BACKOFF.max).await;
                continue;
            }
        }
        let info = pull.get_info().await?;
        if info.num_pending == 0 && info.num_ack_pending == 0 {
            println!(
                "drained: delivered {} acked {}",
                info.delivered.stream_sequence, info.ack_floor.stream_sequence
            );
            return Ok(());
        }
    }
}

// ------------------------------------------------------------------ parent

/// Starts this binary's `child_entry` as `role` and waits for its ready
/// line; its stderr goes to `stderr`.
fn spawn_child(
    role: &str,
    incarnation: u64,
    dir: &Path,
    stream: &str,
    stderr: &Path,
) -> Result<Child, BoxError> {
    let mut child = Command::new("/bin/sh")
        .arg("-c")
        .arg(r#"ulimit -c 0 2>/dev/null; exec "$0" "$@""#)
        .arg(std::env::current_exe()?)
        .args([
            "--exact", // `<file>::child_entry` where this file is a module of a test binary.
            concat!(module_path!(), "::child_entry")
                .split_once("::")
                .map_or("child_entry", |(_, t)| t),
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_VAR, role)
        .env(DIR_VAR, dir)
        .env(INCARNATION_VAR, incarnation.to_string())
        .env(STREAM_VAR, stream)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(File::create(stderr)?)
        .spawn()?;
    let out = child.stdout.take().ok_or("no child stdout")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut out = BufReader::new(out);
        let mut line = String::new();
        let mut sent = false;
        loop {
            line.clear();
            match out.read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) if !sent && line.trim_end().ends_with(READY) => {
                    sent = true;
                    let _ = tx.send(true);
                }
                Ok(_) => {}
            }
        }
        if !sent {
            let _ = tx.send(false);
        }
    });
    if rx.recv_timeout(Duration::from_secs(60)).unwrap_or(false) {
        Ok(child)
    } else {
        let _ = child.kill();
        let status = child.wait()?;
        Err(format!(
            "{role} child {incarnation} never got ready ({status:?}): {}",
            std::fs::read_to_string(stderr).unwrap_or_default()
        )
        .into())
    }
}

/// SIGKILLs `child`; an error if it had ended by itself.
fn kill(child: &mut Child, what: &str, stderr: &Path) -> TestResult {
    let early = child.try_wait()?;
    child.kill()?;
    let status = child.wait()?;
    if early.is_some() || status.signal() != Some(SIGKILL) {
        return Err(format!(
            "{what} ended by itself ({status:?}): {}",
            std::fs::read_to_string(stderr).unwrap_or_default()
        )
        .into());
    }
    Ok(())
}

/// Waits (at most `DRAIN_LIMIT` and a bit) for a drain child to exit 0.
fn wait_done(mut child: Child, what: &str, stderr: &Path) -> TestResult {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            if status.success() {
                return Ok(());
            }
            return Err(format!(
                "{what} failed ({status:?}): {}",
                std::fs::read_to_string(stderr).unwrap_or_default()
            )
            .into());
        }
        if started.elapsed() > DRAIN_LIMIT + Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{what} hung").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Where `scripts/with-nats` runs its server, to restart it the same way.
struct NatsServer {
    bin: String,
    port: String,
    store: String,
    pidfile: String,
    log: String,
}

impl NatsServer {
    fn from_env() -> Result<NatsServer, BoxError> {
        let var = |name: &str| {
            std::env::var(name).map_err(|_| {
                format!("{name} not set: run through scripts/with-nats (it restarts the server)")
            })
        };
        Ok(NatsServer {
            bin: var("IDEMPOTENCY_TEST_NATS_BIN")?,
            port: var("IDEMPOTENCY_TEST_NATS_PORT")?,
            store: var("IDEMPOTENCY_TEST_NATS_STORE")?,
            pidfile: var("IDEMPOTENCY_TEST_NATS_PIDFILE")?,
            log: var("IDEMPOTENCY_TEST_NATS_LOG")?,
        })
    }

    /// Stops the running server (SIGTERM, SIGKILL after 15 s) and starts a
    /// new one on the same port and store dir, writing the same pid file
    /// (so `scripts/with-nats` stops it at the end). Returns the new
    /// server's process, left running.
    fn restart(&self) -> Result<Child, BoxError> {
        let pid = std::fs::read_to_string(&self.pidfile)?.trim().to_owned();
        pid.parse::<u32>()
            .map_err(|e| format!("pid file {}: {pid:?}: {e}", self.pidfile))?;
        signal("TERM", &pid)?;
        let started = Instant::now();
        while alive(&pid) {
            if started.elapsed() > Duration::from_secs(15) {
                signal("KILL", &pid)?;
            }
            if started.elapsed() > Duration::from_secs(30) {
                return Err(format!("nats-server {pid} does not stop").into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        for attempt in 1..=20 {
            let mut server = Command::new(&self.bin)
                .args(["-js", "-a", "127.0.0.1", "-p", &self.port])
                .args(["-sd", &self.store, "-P", &self.pidfile, "-l", &self.log])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()?;
            let started = Instant::now();
            while server.try_wait()?.is_none() && started.elapsed() < Duration::from_secs(20) {
                if self.answers() {
                    return Ok(server);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = server.kill();
            let status = server.wait()?;
            eprintln!("nats-server restart attempt {attempt} failed ({status:?}); retrying");
            std::thread::sleep(Duration::from_millis(250));
        }
        Err(format!("nats-server did not come back on port {}", self.port).into())
    }

    /// Whether the server greets a client with its INFO line.
    fn answers(&self) -> bool {
        let Ok(port) = self.port.parse::<u16>() else {
            return false;
        };
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let mut greeting = [0u8; 4];
        s.read_exact(&mut greeting).is_ok() && &greeting == b"INFO"
    }
}

fn signal(name: &str, pid: &str) -> TestResult {
    let status = Command::new("kill")
        .args([&format!("-{name}"), pid])
        .status()?;
    if !status.success() && alive(pid) {
        return Err(format!("kill -{name} {pid} failed: {status}").into());
    }
    Ok(())
}

/// Whether process `pid` runs (a zombie does not).
fn alive(pid: &str) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

#[test]
fn sigkilled_relay_and_consumer_and_a_broker_restart_book_each_payment_once() -> TestResult {
    let Some(url) = nats_url() else {
        return Ok(());
    };
    let server = NatsServer::from_env()?;
    let kills = env_u64(KILLS_VAR)?.unwrap_or(DEFAULT_KILLS);
    let seed = match env_u64(SEED_VAR)? {
        Some(s) => s,
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos() as u64,
    };
    println!("nats kill test: {kills} kills, seed {seed} (replay with {SEED_VAR}={seed})");
    let mut rng = SplitMix64(seed);
    let started = Instant::now();
    let dir = tempfile::tempdir()?;
    let stream_name = unique_name("KILL");

    // The stream (file storage, JetStream's default 2 min duplicate
    // window) and the durable pull consumer (explicit acks, 1 s ack wait,
    // no delivery limit of its own).
    let runtime = tokio::runtime::Runtime::new()?;
    let js = runtime.block_on(async {
        let client = nats::connect(&url, BACKOFF, Duration::from_secs(10)).await?;
        let js = jetstream::new(client);
        let stream = js
            .create_stream(stream::Config {
                name: stream_name.clone(),
                subjects: vec![format!("{stream_name}.>")],
                storage: stream::StorageType::File,
                ..Default::default()
            })
            .await?;
        stream
            .create_consumer(consumer::pull::Config {
                durable_name: Some(DURABLE.to_owned()),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(1),
                ..Default::default()
            })
            .await?;
        Ok::<_, BoxError>(js)
    })?;

    let stderr = |role: &str, n: u64| dir.path().join(format!("{role}-{n}.stderr"));
    let (mut pay_n, mut con_n) = (0u64, 0u64);
    let mut payments = spawn_child(
        "payments",
        pay_n,
        dir.path(),
        &stream_name,
        &stderr("payments", pay_n),
    )?;
    let mut consumer = spawn_child(
        "consumer",
        con_n,
        dir.path(),
        &stream_name,
        &stderr("consumer", con_n),
    )?;
    let (mut relay_kills, mut consumer_kills) = (0u64, 0u64);
    let mut restarted_server = None;
    for k in 0..kills {
        std::thread::sleep(Duration::from_millis(100 + rng.below(600)));
        // Kill one child at random and start its next incarnation.
        let (role, child, n, count) = if rng.below(2) == 0 {
            ("payments", &mut payments, &mut pay_n, &mut relay_kills)
        } else {
            ("consumer", &mut consumer, &mut con_n, &mut consumer_kills)
        };
        kill(child, &format!("{role} child {n}"), &stderr(role, *n))?;
        *count += 1;
        *n += 1;
        *child = spawn_child(role, *n, dir.path(), &stream_name, &stderr(role, *n))?;
        if k == kills / 2 {
            let stopped = Instant::now();
            restarted_server = Some(server.restart()?);
            println!(
                "nats-server restarted after kill {k} (down and up in {:.1} s)",
                stopped.elapsed().as_secs_f64()
            );
        }
    }
    std::thread::sleep(Duration::from_millis(200 + rng.below(300)));
    kill(
        &mut payments,
        &format!("payments child {pay_n}"),
        &stderr("payments", pay_n),
    )?;
    kill(
        &mut consumer,
        &format!("consumer child {con_n}"),
        &stderr("consumer", con_n),
    )?;
    relay_kills += 1;
    consumer_kills += 1;
    if restarted_server.is_none() {
        return Err("the NATS server was never restarted (0 kills?)".into());
    }

    // A clean run of each side: the relay empties the outbox, then the
    // consumer empties the stream.
    let drain = spawn_child(
        "relay-drain",
        0,
        dir.path(),
        &stream_name,
        &stderr("relay-drain", 0),
    )?;
    wait_done(drain, "the relay drain", &stderr("relay-drain", 0))?;
    let drain = spawn_child(
        "consumer-drain",
        0,
        dir.path(),
        &stream_name,
        &stderr("consumer-drain", 0),
    )?;
    wait_done(drain, "the consumer drain", &stderr("consumer-drain", 0))?;

    // The audit.
    let paid_engine = Engine::builder()
        .lease(LEASE)
        .sweep_interval(None)
        .open_existing(dir.path().join("payments.redb"))?;
    let mut completed = Vec::new();
    let mut processing = 0;
    for record in paid_engine.records(&RecordFilter {
        scope: Some(SCOPE.to_owned()),
        ..Default::default()
    })? {
        let record = record?;
        match record.state {
            State::Completed => completed.push(record.key.key().to_owned()),
            // Killed between the claim and the completion: no event was
            // written (the reopen marks the claim UNKNOWN, for the resolver).
            State::Processing | State::Unknown => processing += 1,
            other => return Err(format!("payment {} is {other:?}", record.key.key()).into()),
        }
    }
    let outbox_left = paid_engine.outbox().len()?;
    drop(paid_engine);
    let ledger = ledger_engine(dir.path())?;
    let rows = nats_ledger::bookings(&ledger)?;
    let dead_letters = ledger.dead_letters(1_000)?;
    drop(ledger);
    let stream_messages = runtime.block_on(async {
        Ok::<_, BoxError>(
            js.get_stream(&stream_name)
                .await?
                .get_info()
                .await?
                .state
                .messages,
        )
    })?;

    completed.sort();
    let doubles: Vec<_> = rows.iter().filter(|(_, n)| **n > 1).collect();
    let lost: Vec<_> = completed
        .iter()
        .filter(|p| !rows.contains_key(*p))
        .collect();
    let unknown: Vec<_> = rows
        .keys()
        .filter(|p| completed.binary_search(p).is_err())
        .collect();
    println!(
        "nats kill summary: kills {} (relay {relay_kills}, consumer {consumer_kills}), \
         server restarts 1, payments completed {} (killed mid-claim {processing}), \
         stream messages {stream_messages}, booked {}, doubles {}, lost {}, unknown {}, \
         dead letters {}, outbox left {outbox_left} ({:.1} s, seed {seed})",
        relay_kills + consumer_kills,
        completed.len(),
        rows.len(),
        doubles.len(),
        lost.len(),
        unknown.len(),
        dead_letters.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        !completed.is_empty(),
        "no payment completed: the test tested nothing"
    );
    assert!(
        doubles.is_empty(),
        "double bookings (seed {seed}): {doubles:?}"
    );
    assert!(lost.is_empty(), "lost payments (seed {seed}): {lost:?}");
    assert!(
        unknown.is_empty(),
        "bookings of no payment (seed {seed}): {unknown:?}"
    );
    assert!(
        dead_letters.is_empty(),
        "dead letters (seed {seed}): {dead_letters:#?}"
    );
    assert_eq!(outbox_left, 0, "the outbox was not drained");
    Ok(())
}
