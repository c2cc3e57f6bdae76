//! Guards against a SIGKILL at an arbitrary moment losing an acknowledged
//! claim or completion, or leaving a stored response that replays with other
//! bytes. Each round runs a child process (this test binary re-invoked with
//! `IDEM_KILL_LOOP_ROLE` set, running only `child_entry`) in which 32 threads
//! claim and complete fresh keys on one database file, appending a line to
//! an ack log after each `begin` answered `Claimed` and after each `complete`
//! returned; the parent kills the child with SIGKILL after a random 30-300 ms,
//! reopens the file, and checks the log: every completed key replays its
//! response byte for byte, every claimed key is present with its fencing
//! token and never claimable again. Earlier rounds' keys are rechecked (a
//! sample each round, all of them at the end).
//!
//! 20 rounds by default; `IDEMPOTENCY_KILL_ROUNDS=200` for the long run.
//! `IDEMPOTENCY_KILL_SEED` replays the kill delays of an earlier run (thread
//! scheduling is not replayed). Unix only (the kill is observed as SIGKILL).
#![cfg(unix)]

#[path = "common/kill_child.rs"]
mod kill_child;

use std::collections::BTreeMap;
use std::error::Error;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey};

#[path = "common/kill_model.rs"]
mod kill_model;
#[path = "common/split_mix.rs"]
mod split_mix;
use kill_model::fnv1a;
use split_mix::SplitMix64;

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const ROLE_VAR: &str = "IDEM_KILL_LOOP_ROLE";
const DB_VAR: &str = "IDEM_KILL_LOOP_DB";
const ROUND_VAR: &str = "IDEM_KILL_LOOP_ROUND";
const LOG_VAR: &str = "IDEM_KILL_LOOP_LOG";
/// Set in a child that creates its file in format 3 (partitioned records).
const FORMAT3_VAR: &str = "IDEM_KILL_LOOP_FORMAT3";
const ROUNDS_VAR: &str = "IDEMPOTENCY_KILL_ROUNDS";
const SEED_VAR: &str = "IDEMPOTENCY_KILL_SEED";

const DEFAULT_ROUNDS: u64 = 20;
const THREADS: u64 = 32;
const SCOPE: &str = "tenant-1:kill-loop";
const READY: &str = "KILL-LOOP CHILD READY";
const SIGKILL: i32 = 9;
/// Long enough that no claim's lease runs out during the whole test.
const LEASE: Duration = Duration::from_secs(3600);
/// The thread that leaves every fourth claim PROCESSING, never finished.
const ABANDONING_THREAD: u64 = 1;
/// Earlier rounds' keys rechecked after each reopen (all at the end).
const RECHECK_SAMPLE: usize = 1_000;
/// How long the parent waits for a child to open the database.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// A child still running after this long was forgotten by its parent (the
/// parent kills it within a second of its ready line): it exits rather than
/// fill the disk.
const CHILD_LIMIT: Duration = Duration::from_secs(120);

fn key_name(round: u64, thread: u64, n: u64) -> String {
    format!("r{round}-t{thread}-{n}")
}

fn key(name: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new(SCOPE, name)
}

fn request_fp(name: &str) -> Result<Fingerprint, idempotency::FingerprintError> {
    kill_model::request_fp("kill-loop", name)
}

/// The response stored for `name` (`kill_model::response`): 50-2000
/// body bytes.
fn response(name: &str) -> Envelope {
    kill_model::response(name, 2000)
}

/// Entry point of the child process; a no-op in the normal test run.
#[test]
fn child_entry() -> TestResult {
    if std::env::var_os(ROLE_VAR).is_none() {
        return Ok(());
    }
    let db = PathBuf::from(std::env::var(DB_VAR)?);
    let round: u64 = std::env::var(ROUND_VAR)?.parse()?;
    let log = PathBuf::from(std::env::var(LOG_VAR)?);
    child(&db, round, &log)
}

/// Opens the engine, says it is ready, and runs the workers until killed.
fn child(db: &Path, round: u64, log: &Path) -> TestResult {
    let mut builder = Engine::builder().lease(LEASE).sweep_interval(None);
    if std::env::var_os(FORMAT3_VAR).is_some() {
        // Small partitions: kills land during seals too.
        builder = builder
            .migrate_to_format_3()
            .partition_limits(64, Duration::from_secs(60));
    }
    let engine = builder.open(db)?;
    // O_APPEND: each event is one `write_all` of a whole line, so lines of
    // different threads never interleave and a kill tears at most the last.
    let log = OpenOptions::new().create(true).append(true).open(log)?;
    kill_child::announce_ready(READY, CHILD_LIMIT)?;
    kill_child::run_workers(round, THREADS, |t| worker(&engine, &log, round, t))
}

fn append(mut log: &File, line: &str) -> std::io::Result<()> {
    log.write_all(line.as_bytes())
}

/// Claims and completes fresh keys until the process is killed. Every
/// fourth thread re-begins one of its completed keys now and then and
/// checks the replay; `ABANDONING_THREAD` keeps every fourth claim alive
/// unfinished, so the kill finds it PROCESSING.
fn worker(engine: &Engine, log: &File, round: u64, t: u64) -> TestResult {
    let mut held = Vec::new();
    let mut done: Vec<String> = Vec::new();
    for n in 0.. {
        let name = key_name(round, t, n);
        let claim = match engine.begin(&key(&name)?, request_fp(&name)?)? {
            Begin::Claimed(c) => c,
            other => return Err(format!("fresh key {name} was not claimed: {other:?}").into()),
        };
        append(log, &format!("claimed {name} {}\n", claim.fencing_token()))?;
        if t == ABANDONING_THREAD && n % 4 == 3 {
            held.push(claim);
            continue;
        }
        let envelope = response(&name);
        let hash = fnv1a(&envelope.body);
        engine.complete(claim, envelope)?;
        append(log, &format!("completed {name} {hash:016x}\n"))?;
        done.push(name);
        if t.is_multiple_of(4) && n % 3 == 2 {
            let again = &done[(n as usize * 7) % done.len()];
            match engine.begin(&key(again)?, request_fp(again)?)? {
                Begin::Replay(r) if r.envelope == response(again) => {}
                other => return Err(format!("replay of {again} differs: {other:?}").into()),
            }
        }
    }
    Ok(())
}

/// Runs this test binary as a child for `round`; core dumps off.
fn spawn_child(
    db: &Path,
    round: u64,
    log: &Path,
    stderr: &Path,
    format3: bool,
) -> std::io::Result<Child> {
    let mut command = Command::new("/bin/sh");
    if format3 {
        command.env(FORMAT3_VAR, "1");
    }
    command
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
        .env(ROLE_VAR, "child")
        .env(DB_VAR, db)
        .env(ROUND_VAR, round.to_string())
        .env(LOG_VAR, log)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(File::create(stderr)?)
        .spawn()
}

/// Reads the child's stdout on a thread of its own: sends `true` at the
/// ready line (libtest may have printed `test child_entry ... ` before it on
/// the same line), `false` at end of file (the child died first), then
/// drains the pipe until the child is gone.
fn watch_ready(out: ChildStdout) -> mpsc::Receiver<bool> {
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
    rx
}

/// What the children acknowledged, over all rounds.
#[derive(Default)]
struct Acks {
    /// Key name -> fencing token of its `Claimed` answer.
    claimed: BTreeMap<String, u64>,
    /// Key name -> FNV-1a of the body `complete` stored.
    completed: BTreeMap<String, u64>,
}

impl Acks {
    /// Reads one round's ack log; returns the key names it acknowledged.
    fn read_log(
        &mut self,
        path: &Path,
        round: u64,
    ) -> Result<Vec<String>, Box<dyn Error + Send + Sync>> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e.into()),
        };
        // A last line without its newline is a torn write of the log itself:
        // the event it reports was never acknowledged.
        let whole = text.rsplit_once('\n').map_or("", |(done, _)| done);
        let mut names = Vec::new();
        for line in whole.lines() {
            let bad = || format!("round {round}: bad ack line {line:?}");
            let mut f = line.split(' ');
            let (event, name, value) = match (f.next(), f.next(), f.next(), f.next()) {
                (Some(e), Some(n), Some(v), None) => (e, n.to_string(), v),
                _ => return Err(bad().into()),
            };
            match event {
                "claimed" => {
                    let token = value.parse().map_err(|_| bad())?;
                    if self.claimed.insert(name.clone(), token).is_some() {
                        return Err(format!("round {round}: {name} claimed twice").into());
                    }
                    names.push(name);
                }
                "completed" => {
                    let hash = u64::from_str_radix(value, 16).map_err(|_| bad())?;
                    if !self.claimed.contains_key(&name) {
                        return Err(
                            format!("round {round}: {name} completed, never claimed").into()
                        );
                    }
                    self.completed.insert(name, hash);
                }
                _ => return Err(bad().into()),
            }
        }
        Ok(names)
    }
}

/// Totals for the summary line.
#[derive(Default)]
struct Tally {
    replays: u64,
    failures: Vec<String>,
}

/// Checks one acknowledged key on a reopened engine.
fn check_key(
    engine: &Engine,
    acks: &Acks,
    name: &str,
    when: &str,
    tally: &mut Tally,
) -> TestResult {
    let mut fail = |what: String| tally.failures.push(format!("{when}: {name}: {what}"));
    let token = acks.claimed[name];
    match engine.record(&key(name)?)? {
        None => {
            fail("acknowledged claim has no record".into());
            return Ok(());
        }
        Some(rec) if rec.fencing_token != token => fail(format!(
            "record has token {}, the acknowledged claim had {token}",
            rec.fencing_token
        )),
        Some(_) => {}
    }
    let want = response(name);
    let answer = engine.begin(&key(name)?, request_fp(name)?)?;
    match (acks.completed.get(name), answer) {
        (Some(&hash), Begin::Replay(r)) => {
            if fnv1a(&r.envelope.body) != hash || r.envelope != want {
                fail(format!(
                    "replay differs from the acknowledged completion: {:?}",
                    r.envelope
                ));
            }
            tally.replays += 1;
        }
        (Some(_), other) => fail(format!("acknowledged completion answers {other:?}")),
        // Claimed only: the complete may have committed with its ack line
        // lost in the kill, so a replay is fine if it is the right one.
        (None, Begin::Replay(r)) if r.envelope == want => tally.replays += 1,
        (None, Begin::Processing { .. } | Begin::InDoubt(_)) => {}
        (None, other) => fail(format!("acknowledged claim answers {other:?}")),
    }
    Ok(())
}

fn env_u64(var: &str) -> Result<Option<u64>, Box<dyn Error + Send + Sync>> {
    match std::env::var(var) {
        Ok(v) => Ok(Some(
            v.trim().parse().map_err(|e| format!("{var}={v:?}: {e}"))?,
        )),
        Err(_) => Ok(None),
    }
}

#[test]
fn sigkill_loop_keeps_every_acknowledged_claim_and_completion() -> TestResult {
    kill_loop(false)
}

/// The same on a file created in format 3 with partitions of 64 keys.
#[test]
fn sigkill_loop_keeps_every_acknowledged_claim_and_completion_in_format_3() -> TestResult {
    kill_loop(true)
}

fn kill_loop(format3: bool) -> TestResult {
    let rounds = env_u64(ROUNDS_VAR)?.unwrap_or(DEFAULT_ROUNDS);
    let seed = match env_u64(SEED_VAR)? {
        Some(s) => s,
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos() as u64,
    };
    println!("kill loop: {rounds} rounds, seed {seed} (replay the delays with {SEED_VAR}={seed})");
    let mut rng = SplitMix64(seed);
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("idem.redb");
    let started = Instant::now();
    let mut acks = Acks::default();
    let mut earlier: Vec<String> = Vec::new();
    let mut tally = Tally::default();
    let mut kills = 0u64;

    for round in 0..rounds {
        let log = dir.path().join(format!("acks-{round}.log"));
        let stderr = dir.path().join(format!("child-{round}.stderr"));
        let mut child = spawn_child(&db, round, &log, &stderr, format3)?;
        let ready = watch_ready(child.stdout.take().ok_or("no child stdout")?)
            .recv_timeout(READY_TIMEOUT)
            .unwrap_or(false);
        let delay_ms = 30 + rng.next() % 271;
        if ready {
            std::thread::sleep(Duration::from_millis(delay_ms));
        }
        let early = child.try_wait()?;
        child.kill()?;
        let status = child.wait()?;
        if early.is_some() || status.signal() != Some(SIGKILL) {
            tally.failures.push(format!(
                "round {round}: the child ended by itself ({status:?}, ready: {ready}): {}",
                std::fs::read_to_string(&stderr).unwrap_or_default().trim()
            ));
        } else {
            kills += 1;
        }

        let names = acks.read_log(&log, round)?;
        let when = format!("after round {round}'s kill");
        let engine = Engine::builder().sweep_interval(None).open_existing(&db)?;
        for name in &names {
            check_key(&engine, &acks, name, &when, &mut tally)?;
        }
        for _ in 0..RECHECK_SAMPLE.min(earlier.len()) {
            let name = &earlier[(rng.next() % earlier.len() as u64) as usize];
            check_key(&engine, &acks, name, &when, &mut tally)?;
        }
        drop(engine);
        earlier.extend(names);
    }

    // Every key of every round, once more, and a scrub of the whole file.
    let engine = Engine::builder().sweep_interval(None).open_existing(&db)?;
    for name in &earlier {
        check_key(&engine, &acks, name, "final check", &mut tally)?;
    }
    let report = engine.verify()?;
    if !report.is_sound() {
        tally.failures.push(format!("verify: {:?}", report.damage));
    }
    drop(engine);

    println!(
        "kill loop summary (format {}): rounds {rounds}, kills {kills}, acknowledged claims {}, \
         acknowledged completions {}, replays checked {}, failures {} ({:.1} s, seed {seed})",
        if format3 { 3 } else { 2 },
        acks.claimed.len(),
        acks.completed.len(),
        tally.replays,
        tally.failures.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        tally.failures.is_empty(),
        "{} failures (seed {seed}), first: {:#?}",
        tally.failures.len(),
        &tally.failures[..tally.failures.len().min(5)]
    );
    Ok(())
}
