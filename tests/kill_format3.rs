//! Guards format 3 (issue 26) against the two crashes its plan names: a
//! SIGKILL during the migration of a format-2 file, and a SIGKILL while the
//! sweeper empties sealed partitions and drops them. Children are this test
//! binary re-invoked with `IDEM_KILL_F3_ROLE` set (only `child_entry` runs).
//!
//! 1. `sigkill_during_the_migration_loses_nothing`: the parent writes a
//!    format-2 file of completed records, measures how long an open that
//!    migrates it takes, and in each round lets a child open a fresh copy
//!    with `migrate_to_format_3` in steps of 500 records (the migration runs
//!    inside the open, 21 durable transactions), then do a little
//!    traffic; the kill comes a stratified random delay after the child
//!    said it was about to open, from 0 to past the open, so it lands
//!    before the first step, between steps, and after the switch. The
//!    parent looks at a copy of the killed file (its format, the records
//!    the partial copy holds), then reopens it asking for format 3 again,
//!    which resumes a partial copy (in every third round with one, a
//!    format-2 open comes first: it must answer everything and delete the
//!    copy), and checks every record written before, and every write the
//!    child acknowledged, replays byte for byte, and that `verify` finds
//!    the file sound.
//! 2. `sigkill_during_partition_drops_loses_nothing`: a child with
//!    partitions of 16 keys or one second, a 400 ms TTL that forgets, and
//!    the sweeper every 50 ms, claims and completes fresh keys on the
//!    system clock, so sealed partitions empty and are dropped all the
//!    time; the kill comes at random. The parent reopens and checks that
//!    `verify` is sound, that every acknowledged completion whose TTL has
//!    not run out replays, that no acknowledged key is claimable while its
//!    record must live, and counts the partitions dropped (rows of
//!    `idempotency.partitions` read with redb before and after).
//!
//! 3. `sigkill_during_partition_merges_loses_nothing`: a child on a clock
//!    that runs 600 times faster than the system's (a second is ten
//!    minutes: an hour's partitions close every six seconds and merge
//!    into one, `partition/merge.rs`), with partitions of 64 keys or ten
//!    minutes and the sweeper every 50 ms, claims and completes fresh
//!    keys; the kill comes at random, so it lands while a merge copies,
//!    switches or drops, or between merges. The parent counts the rows a
//!    merge holds in a recovered copy of the killed file, reopens it on the
//!    same fast clock, and checks that every acknowledged completion
//!    replays byte for byte (no TTL runs out during the test), that every
//!    acknowledged claim is still held with its token, and that `verify`
//!    finds the file sound (it checks each merge copy against its source).
//!    Each killed file is also salvaged first (`Engine::salvage`), and the
//!    salvaged file must pass the same checks for the round's keys.
//!
//! Rounds: `IDEMPOTENCY_KILL_F3_MIGRATE_ROUNDS` (default 10, half of them
//! aimed at the end of the open, where the migration runs),
//! `IDEMPOTENCY_KILL_F3_DROP_ROUNDS` (default 8),
//! `IDEMPOTENCY_KILL_F3_MERGE_ROUNDS` (default 6); `IDEMPOTENCY_KILL_SEED`
//! replays an earlier run's delays (the migration test's also follow the
//! opens its children measure; thread scheduling is not replayed).
//! Unix only (the kill is observed as SIGKILL).
#![cfg(unix)]

#[path = "common/kill_child.rs"]
mod kill_child;
#[path = "common/kill_model.rs"]
mod kill_model;
#[path = "common/meta_table.rs"]
mod meta_table;
#[path = "common/split_mix.rs"]
mod split_mix;

use std::collections::{BTreeMap, BTreeSet};
use std::error::Error;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idempotency::{
    Begin, Engine, EngineBuilder, Envelope, ExpiryPolicy, Fingerprint, IdempotencyKey, State,
};
use kill_model::fnv1a;
use redb::{ReadableDatabase, ReadableTable, TableDefinition};
use split_mix::SplitMix64;

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;
type AnyResult<T> = Result<T, Box<dyn Error + Send + Sync>>;

const ROLE_VAR: &str = "IDEM_KILL_F3_ROLE";
const DB_VAR: &str = "IDEM_KILL_F3_DB";
const ROUND_VAR: &str = "IDEM_KILL_F3_ROUND";
const LOG_VAR: &str = "IDEM_KILL_F3_LOG";
const MIGRATE_ROUNDS_VAR: &str = "IDEMPOTENCY_KILL_F3_MIGRATE_ROUNDS";
const DROP_ROUNDS_VAR: &str = "IDEMPOTENCY_KILL_F3_DROP_ROUNDS";
const MERGE_ROUNDS_VAR: &str = "IDEMPOTENCY_KILL_F3_MERGE_ROUNDS";
/// The system time (ms) the merge test's fast clock starts from.
const ANCHOR_VAR: &str = "IDEM_KILL_F3_ANCHOR";
const SEED_VAR: &str = "IDEMPOTENCY_KILL_SEED";

const SCOPE: &str = "tenant-1:kill-format3";
/// Printed by a child just before its open; the kill delay counts from it.
const OPENING: &str = "KILL-F3 CHILD OPENING";
/// Printed by a child once its engine is open, with the open's ms.
const READY: &str = "KILL-F3 CHILD READY";
const SIGKILL: i32 = 9;
/// Long enough that no claim's lease runs out during the test.
const LEASE: Duration = Duration::from_secs(3600);
const CHILD_LIMIT: Duration = Duration::from_secs(120);
const EVENT_TIMEOUT: Duration = Duration::from_secs(60);

/// Records of the format-2 file the migration test starts from.
const BASE_RECORDS: u64 = 10_000;
/// Records per migration step: 20 steps and the switch for the base file.
const MIGRATE_STEP_RECORDS: u64 = 500;
const BASE_THREADS: u64 = 16;
const MIGRATE_CHILD_THREADS: u64 = 2;
const DEFAULT_MIGRATE_ROUNDS: u64 = 10;

const DROP_TTL: Duration = Duration::from_millis(400);
const DROP_PARTITION_KEYS: u64 = 16;
const DROP_PARTITION_INTERVAL: Duration = Duration::from_secs(1);
const DROP_SWEEP: Duration = Duration::from_millis(50);
const DROP_CHILD_THREADS: u64 = 8;
const DEFAULT_DROP_ROUNDS: u64 = 8;
/// A completion is replayed by the parent only if its TTL runs this much
/// past the check's start (a later expiry would make the check claim it).
const TTL_MARGIN_MS: u64 = 20;

/// The merge test's clock runs this many times faster than the system's.
const FAST: u64 = 600;
/// Where the merge test's clock starts: the start of an hour.
const FAST_BASE_MS: u64 = 1_900_000_800_000;
const MERGE_PARTITION_KEYS: u64 = 64;
const MERGE_CHILD_THREADS: u64 = 4;
const MERGE_SWEEP: Duration = Duration::from_millis(50);
const DEFAULT_MERGE_ROUNDS: u64 = 6;
/// The first partitions' hour closes 6 s (system time) into the test and
/// merges 1.5 s later (`MERGE_GRACE_MS`): the first round runs past that.
const FIRST_MERGE_ROUND_MS: u64 = 8_000;
/// The first byte of a partition row's payload (after the version byte)
/// is its state: 3 merging, 4 merge source, 2 dropping.
const ROW_STATE_AT: usize = 1;
/// Partition numbers from here up are built by the engine (merges).
const BUILT_PARTITIONS: u64 = 1 << 63;

const PARTITIONS: TableDefinition<u64, &[u8]> = TableDefinition::new("idempotency.partitions");

/// The two tests measure timings: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The merge test's clock: [`FAST_BASE_MS`] at system time `anchor_ms`,
/// then [`FAST`] ms for each ms of system time (the same in the parent
/// and every child, whatever process reads it).
#[derive(Debug, Clone, Copy)]
struct FastClock {
    anchor_ms: u64,
}

impl idempotency::Clock for FastClock {
    fn now_ms(&self) -> u64 {
        FAST_BASE_MS + now_ms().saturating_sub(self.anchor_ms) * FAST
    }
}

fn key(name: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new(SCOPE, name)
}

fn request_fp(name: &str) -> Result<Fingerprint, idempotency::FingerprintError> {
    kill_model::request_fp("kill-format3", name)
}

/// The response stored for `name` (`kill_model::response`): 50-800
/// body bytes.
fn response(name: &str) -> Envelope {
    kill_model::response(name, 800)
}

fn base_name(i: u64) -> String {
    format!("base-{i}")
}

fn env_u64(var: &str) -> AnyResult<Option<u64>> {
    match std::env::var(var) {
        Ok(v) => Ok(Some(
            v.trim().parse().map_err(|e| format!("{var}={v:?}: {e}"))?,
        )),
        Err(_) => Ok(None),
    }
}

fn seed() -> AnyResult<u64> {
    match env_u64(SEED_VAR)? {
        Some(s) => Ok(s),
        None => Ok(SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos() as u64),
    }
}

// ---------------------------------------------------------------- child

/// What a child opens its file with.
fn migrating_builder() -> EngineBuilder {
    Engine::builder()
        .recovery_reserve(0)
        .lease(LEASE)
        .sweep_interval(None)
        .unstable_format_3_migration(MIGRATE_STEP_RECORDS, None)
}

fn dropping_builder() -> EngineBuilder {
    Engine::builder()
        .lease(LEASE)
        .ttl(DROP_TTL)
        .expiry_policy(ExpiryPolicy::Forget)
        .migrate_to_format_3()
        .partition_limits(DROP_PARTITION_KEYS, DROP_PARTITION_INTERVAL)
}

/// The merge test's engine: a day's TTL and an hour's lease on the fast
/// clock (144 s and 6 s of system time).
fn merging_builder(anchor_ms: u64) -> EngineBuilder {
    Engine::builder()
        .clock(FastClock { anchor_ms })
        .lease(Duration::from_secs(3600))
        .ttl(Duration::from_secs(86_400))
        .partition_limits(MERGE_PARTITION_KEYS, Duration::from_secs(600))
}

/// Entry point of the child process; a no-op in the normal test run.
#[test]
fn child_entry() -> TestResult {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return Ok(());
    };
    let db = PathBuf::from(std::env::var(DB_VAR)?);
    let round: u64 = std::env::var(ROUND_VAR)?.parse()?;
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(std::env::var(LOG_VAR)?)?;
    let (builder, threads) = match role.as_str() {
        "migrate" => (migrating_builder(), MIGRATE_CHILD_THREADS),
        "drops" => (
            dropping_builder().sweep_interval(Some(DROP_SWEEP)),
            DROP_CHILD_THREADS,
        ),
        "merges" => (
            merging_builder(std::env::var(ANCHOR_VAR)?.parse()?).sweep_interval(Some(MERGE_SWEEP)),
            MERGE_CHILD_THREADS,
        ),
        other => return Err(format!("unknown child role {other:?}").into()),
    };
    say(OPENING)?;
    let started = Instant::now();
    let engine = builder.open(&db)?;
    let open_ms = started.elapsed().as_millis();
    kill_child::announce_ready(&format!("{READY} {open_ms}"), CHILD_LIMIT)?;
    let migrating = role == "migrate";
    kill_child::run_workers(round, threads, |t| {
        traffic(&engine, &log, round, t, migrating)
    })
}

fn say(line: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()
}

fn append(mut log: &File, line: &str) -> std::io::Result<()> {
    log.write_all(line.as_bytes())
}

/// Claims and completes fresh keys until killed, logging each `Claimed`
/// (with the time after it) and each completion (with the time before
/// the `complete` call, a lower bound of its record's TTL start). With
/// `replay_base`, every fourth step also replays a record of the
/// migrated file and checks its bytes.
fn traffic(engine: &Engine, log: &File, round: u64, t: u64, replay_base: bool) -> TestResult {
    let mut rng = SplitMix64(round << 8 | t);
    for n in 0.. {
        let name = format!("r{round}-t{t}-{n}");
        let claim = match engine.begin(&key(&name)?, request_fp(&name)?)? {
            Begin::Claimed(c) => c,
            other => return Err(format!("fresh key {name} was not claimed: {other:?}").into()),
        };
        let claimed_ms = now_ms();
        append(
            log,
            &format!("claimed {name} {} {claimed_ms}\n", claim.fencing_token()),
        )?;
        let envelope = response(&name);
        let hash = fnv1a(&envelope.body);
        let before_ms = now_ms();
        engine.complete(claim, envelope)?;
        append(log, &format!("completed {name} {hash:016x} {before_ms}\n"))?;
        if replay_base && n % 4 == 3 {
            let old = base_name(rng.below(BASE_RECORDS));
            match engine.begin(&key(&old)?, request_fp(&old)?)? {
                Begin::Replay(r) if r.envelope == response(&old) => {}
                other => return Err(format!("replay of {old} differs: {other:?}").into()),
            }
        }
    }
    Ok(())
}

// --------------------------------------------------------------- parent

/// What the parent hears from a child's stdout.
enum Event {
    Opening,
    /// Ready, with the open's ms.
    Ready(u64),
    /// End of its stdout: the child is gone.
    Gone,
}

fn spawn_child(role: &str, db: &Path, round: u64, log: &Path, stderr: &Path) -> AnyResult<Child> {
    spawn_child_with(role, db, round, log, stderr, None)
}

/// [`spawn_child`], with the merge test's clock anchor.
fn spawn_child_with(
    role: &str,
    db: &Path,
    round: u64,
    log: &Path,
    stderr: &Path,
    anchor_ms: Option<u64>,
) -> AnyResult<Child> {
    let mut command = Command::new("/bin/sh");
    if let Some(anchor) = anchor_ms {
        command.env(ANCHOR_VAR, anchor.to_string());
    }
    Ok(command
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
        .env(DB_VAR, db)
        .env(ROUND_VAR, round.to_string())
        .env(LOG_VAR, log)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(File::create(stderr)?)
        .spawn()?)
}

/// Reads the child's stdout on a thread of its own (libtest may print
/// `test child_entry ... ` before a line on the same line).
fn watch(out: ChildStdout) -> mpsc::Receiver<Event> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut out = BufReader::new(out);
        let mut line = String::new();
        loop {
            line.clear();
            match out.read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let line = line.trim_end();
                    if line.ends_with(OPENING) {
                        let _ = tx.send(Event::Opening);
                    } else if let Some((_, ms)) = line.rsplit_once(READY) {
                        let _ = tx.send(Event::Ready(ms.trim().parse().unwrap_or(0)));
                    }
                }
            }
        }
        let _ = tx.send(Event::Gone);
    });
    rx
}

/// How a round's child ended.
struct Ended {
    /// Its open's ms, if it said it was ready before it died.
    ready_ms: Option<u64>,
    /// The failure to report, if it was not killed by us.
    failure: Option<String>,
}

/// Waits for the child's opening line, lets it run `delay` from there
/// (or from its ready line when `after_ready`), SIGKILLs it, and reports
/// whether it had said it was ready.
fn kill_after(
    mut child: Child,
    round: u64,
    delay: Duration,
    after_ready: bool,
    stderr: &Path,
) -> AnyResult<Ended> {
    let events = watch(child.stdout.take().ok_or("no child stdout")?);
    let mut ready_ms = None;
    let mut opened = false;
    let mut gone = false;
    while !opened && !gone {
        match events.recv_timeout(EVENT_TIMEOUT) {
            Ok(Event::Opening) => opened = true,
            Ok(Event::Ready(ms)) => ready_ms = Some(ms),
            Ok(Event::Gone) | Err(_) => gone = true,
        }
    }
    if after_ready {
        while ready_ms.is_none() && !gone {
            match events.recv_timeout(EVENT_TIMEOUT) {
                Ok(Event::Ready(ms)) => ready_ms = Some(ms),
                Ok(Event::Opening) => {}
                Ok(Event::Gone) | Err(_) => gone = true,
            }
        }
    }
    let deadline = Instant::now() + delay;
    while !gone {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match events.recv_timeout(left) {
            Ok(Event::Ready(ms)) => ready_ms = Some(ms),
            Ok(Event::Opening) => {}
            Ok(Event::Gone) => gone = true,
            Err(_) => break,
        }
    }
    let early = child.try_wait()?;
    child.kill()?;
    let status = child.wait()?;
    // A ready line printed before the kill may still be in the pipe.
    while !gone {
        match events.recv_timeout(EVENT_TIMEOUT) {
            Ok(Event::Ready(ms)) => ready_ms = Some(ms),
            Ok(Event::Opening) => {}
            Ok(Event::Gone) | Err(_) => gone = true,
        }
    }
    let failure = (early.is_some() || status.signal() != Some(SIGKILL)).then(|| {
        format!(
            "round {round}: the child ended by itself ({status:?}): {}",
            std::fs::read_to_string(stderr).unwrap_or_default().trim()
        )
    });
    Ok(Ended { ready_ms, failure })
}

/// What one round's child acknowledged.
#[derive(Default)]
struct Acks {
    /// Key name -> (fencing token, ms after `begin` answered).
    claimed: BTreeMap<String, (u64, u64)>,
    /// Key name -> (body hash, ms before `complete` was called).
    completed: BTreeMap<String, (u64, u64)>,
}

impl Acks {
    fn read_log(&mut self, path: &Path, round: u64) -> AnyResult<Vec<String>> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e.into()),
        };
        // A last line without its newline is a torn write of the log: the
        // event it reports was never acknowledged.
        let whole = text.rsplit_once('\n').map_or("", |(done, _)| done);
        let mut names = Vec::new();
        for line in whole.lines() {
            let bad = || format!("round {round}: bad ack line {line:?}");
            let f: Vec<&str> = line.split(' ').collect();
            let [event, name, value, ms] = f[..] else {
                return Err(bad().into());
            };
            let ms: u64 = ms.parse().map_err(|_| bad())?;
            match event {
                "claimed" => {
                    let token = value.parse().map_err(|_| bad())?;
                    if self.claimed.insert(name.into(), (token, ms)).is_some() {
                        return Err(format!("round {round}: {name} claimed twice").into());
                    }
                    names.push(name.to_string());
                }
                "completed" => {
                    let hash = u64::from_str_radix(value, 16).map_err(|_| bad())?;
                    if !self.claimed.contains_key(name) {
                        return Err(format!("round {round}: {name} completed, unclaimed").into());
                    }
                    self.completed.insert(name.into(), (hash, ms));
                }
                _ => return Err(bad().into()),
            }
        }
        Ok(names)
    }
}

/// The first byte of the file's `format_version` (2 or 3).
fn format_of(db: &Path) -> AnyResult<u8> {
    let meta = meta_table::meta_values(db).map_err(|e| e.to_string())?;
    meta.iter()
        .find(|(k, _)| k == "format_version")
        .and_then(|(_, v)| v.first().copied())
        .ok_or_else(|| format!("{}: no format_version", db.display()).into())
}

/// The partitions with a row in `idempotency.partitions` (none for a
/// missing file or table).
fn partition_rows(db: &Path) -> AnyResult<BTreeSet<u64>> {
    if !db.exists() {
        return Ok(BTreeSet::new());
    }
    let file = redb::Builder::new().open_read_only(db)?;
    let txn = file.begin_read()?;
    let table = match txn.open_table(PARTITIONS) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(BTreeSet::new()),
        Err(e) => return Err(e.into()),
    };
    let mut rows = BTreeSet::new();
    for entry in table.iter()? {
        rows.insert(entry?.0.value());
    }
    Ok(rows)
}

/// Where a kill left the file at `db`, read from a copy at `scratch`
/// (redb recovers a file that was not closed cleanly, which writes): the
/// first byte of its `format_version`, and the records format 3's records
/// table holds (`None`: no such table).
fn peek(db: &Path, scratch: &Path) -> AnyResult<(u8, Option<u64>)> {
    std::fs::copy(db, scratch)?;
    let (format, copied) = {
        let file = redb::Database::open(scratch)?;
        let txn = file.begin_read()?;
        meta_table::migration_state(&txn)?
    };
    std::fs::remove_file(scratch)?;
    Ok((format, copied))
}

fn median(values: &[u64]) -> Option<u64> {
    let mut v = values.to_vec();
    v.sort_unstable();
    v.get(v.len() / 2).copied()
}

fn copy_database(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::copy(from, to)?;
    let journal = |p: &Path| {
        let mut s = p.as_os_str().to_owned();
        s.push(".journal");
        PathBuf::from(s)
    };
    if journal(from).exists() {
        std::fs::copy(journal(from), journal(to))?;
    }
    Ok(())
}

// ------------------------------------------------------ test 1: migration

/// Writes `BASE_RECORDS` completed records on `BASE_THREADS` threads into
/// a new format-2 file, closed cleanly.
fn write_base(db: &Path) -> TestResult {
    let engine = Engine::builder()
        .lease(LEASE)
        .sweep_interval(None)
        .open(db)?;
    std::thread::scope(|s| -> TestResult {
        let workers: Vec<_> = (0..BASE_THREADS)
            .map(|t| {
                let engine = &engine;
                s.spawn(move || -> TestResult {
                    for i in (t..BASE_RECORDS).step_by(BASE_THREADS as usize) {
                        let name = base_name(i);
                        let claim = match engine.begin(&key(&name)?, request_fp(&name)?)? {
                            Begin::Claimed(c) => c,
                            other => return Err(format!("{name}: {other:?}").into()),
                        };
                        engine.complete(claim, response(&name))?;
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join().map_err(|_| "a writer thread panicked")??;
        }
        Ok(())
    })
}

/// Checks every base record and every write the round's child
/// acknowledged on the reopened file.
fn check_migrated(
    engine: &Engine,
    acks: &Acks,
    round: u64,
    failures: &mut Vec<String>,
) -> TestResult {
    for i in 0..BASE_RECORDS {
        let name = base_name(i);
        match engine.begin(&key(&name)?, request_fp(&name)?)? {
            Begin::Replay(r) if r.envelope == response(&name) => {}
            other => failures.push(format!("round {round}: base record {name}: {other:?}")),
        }
    }
    for (name, &(token, _)) in &acks.claimed {
        let mut fail = |what: String| failures.push(format!("round {round}: {name}: {what}"));
        match engine.record(&key(name)?)? {
            None => fail("acknowledged claim has no record".into()),
            Some(r) if r.fencing_token != token => {
                fail(format!("token {}, the claim had {token}", r.fencing_token))
            }
            Some(_) => {}
        }
        let want = response(name);
        match (
            acks.completed.get(name),
            engine.begin(&key(name)?, request_fp(name)?)?,
        ) {
            (Some(&(hash, _)), Begin::Replay(r)) if fnv1a(&r.envelope.body) == hash => {
                if r.envelope != want {
                    fail(format!("replay differs: {:?}", r.envelope));
                }
            }
            (Some(_), other) => fail(format!("acknowledged completion answers {other:?}")),
            (None, Begin::Replay(r)) if r.envelope == want => {}
            (None, Begin::Processing { .. } | Begin::InDoubt(_)) => {}
            (None, other) => fail(format!("acknowledged claim answers {other:?}")),
        }
    }
    Ok(())
}

#[test]
fn sigkill_during_the_migration_loses_nothing() -> TestResult {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let rounds = env_u64(MIGRATE_ROUNDS_VAR)?.unwrap_or(DEFAULT_MIGRATE_ROUNDS);
    let seed = seed()?;
    println!(
        "migration kills: {rounds} rounds, seed {seed} ({SEED_VAR}={seed} replays the delays)"
    );
    let mut rng = SplitMix64(seed);
    let dir = tempfile::tempdir()?;
    let base = dir.path().join("base.redb");
    let started = Instant::now();
    write_base(&base)?;
    let built = started.elapsed();
    let base_bytes = std::fs::metadata(&base)?.len();

    // How long an open takes with and without the migration, measured on
    // copies here; the kill delays are drawn from the migrating one.
    let plain = dir.path().join("plain.redb");
    copy_database(&base, &plain)?;
    let t = Instant::now();
    drop(
        Engine::builder()
            .recovery_reserve(0)
            .sweep_interval(None)
            .open(&plain)?,
    );
    let plain_open = t.elapsed();
    let measured = dir.path().join("measured.redb");
    copy_database(&base, &measured)?;
    let t = Instant::now();
    drop(migrating_builder().open(&measured)?);
    let migrating_open = t.elapsed();
    if format_of(&measured)? != 3 {
        return Err("the measured open did not migrate the file".into());
    }
    // The same open of the migrated file: what is not the migration.
    let t = Instant::now();
    drop(migrating_builder().open(&measured)?);
    let migrated_open = t.elapsed();
    println!(
        "base: {BASE_RECORDS} records, {} MiB, written in {:.1} s; open {:.0} ms, open with \
         migration {:.0} ms, open of the migrated file {:.0} ms",
        base_bytes >> 20,
        built.as_secs_f64(),
        plain_open.as_secs_f64() * 1e3,
        migrating_open.as_secs_f64() * 1e3,
        migrated_open.as_secs_f64() * 1e3,
    );
    // Even rounds: stratified over 0..1.5x the migrating open, each from
    // its own slice, so both sides of the switch are hit in every run.
    // Odd rounds: stratified over 40..105% of it, where the migration's
    // steps run (the open's fixed work comes first). The open's
    // length is the median of the children's opens so far (the measure
    // above until one is ready): one open timed under load can be far off.
    let (wide, late) = (rounds.div_ceil(2), rounds / 2);
    let mut failures = Vec::new();
    let (mut before_steps, mut before_ready, mut after_ready) = (0u64, 0u64, 0u64);
    // Records the partial copy held, for each kill between steps.
    let mut between_steps: Vec<u64> = Vec::new();
    let mut format2_opens = 0u64;
    let mut acked = 0usize;
    let mut child_open_ms = Vec::new();
    for round in 0..rounds {
        let db = dir.path().join(format!("r{round}.redb"));
        copy_database(&base, &db)?;
        let log = dir.path().join(format!("acks-{round}.log"));
        let stderr = dir.path().join(format!("child-{round}.stderr"));
        let open_ms = median(&child_open_ms).unwrap_or(migrating_open.as_millis() as u64);
        let (from, span, i, n) = if round % 2 == 0 {
            (0, (open_ms * 3 / 2).max(20), round / 2, wide)
        } else {
            (
                open_ms * 4 / 10,
                (open_ms * 65 / 100).max(10),
                round / 2,
                late,
            )
        };
        let slice = from + span * i / n..from + span * (i + 1) / n;
        let delay = slice.start + rng.below((slice.end - slice.start).max(1));
        let child = spawn_child("migrate", &db, round, &log, &stderr)?;
        let ended = kill_after(child, round, Duration::from_millis(delay), false, &stderr)?;
        failures.extend(ended.failure);
        child_open_ms.extend(ended.ready_ms);

        let mut acks = Acks::default();
        acks.read_log(&log, round)?;
        acked += acks.claimed.len();
        let (format, copied) = peek(&db, &dir.path().join("peek.redb"))?;
        match (format, copied, ended.ready_ms.is_some()) {
            (2, None, false) => before_steps += 1,
            (2, Some(n), false) => between_steps.push(n),
            (3, _, false) => before_ready += 1,
            (3, _, true) => after_ready += 1,
            (f, n, ready) => failures.push(format!(
                "round {round}: format {f}, partial copy {n:?}, after a kill at {delay} ms \
                 (child ready: {ready})"
            )),
        }
        if format == 2 && copied.is_some() && between_steps.len() % 3 == 1 {
            // A format-2 open of the half-migrated file answers from format
            // 2's tables and deletes the partial copy.
            let engine = Engine::builder().sweep_interval(None).open_existing(&db)?;
            check_migrated(&engine, &acks, round, &mut failures)?;
            drop(engine);
            format2_opens += 1;
            let (f, left) = peek(&db, &dir.path().join("peek.redb"))?;
            if (f, left) != (2, None) {
                failures.push(format!(
                    "round {round}: after a format-2 open: format {f}, partial copy {left:?}"
                ));
            }
        }
        // The migration resumes (or starts over, or is done).
        let engine = migrating_builder().open_existing(&db)?;
        check_migrated(&engine, &acks, round, &mut failures)?;
        let report = engine.verify()?;
        if !report.is_sound() {
            failures.push(format!("round {round}: verify: {:?}", report.damage));
        }
        drop(engine);
        if format_of(&db)? != 3 {
            failures.push(format!(
                "round {round}: not format 3 after the migrating reopen"
            ));
        }
        println!(
            "round {round}: kill {delay} ms after the opening line, file in format {format}, \
             partial copy {copied:?} records, child ready: {:?} ms, {} acknowledged claims",
            ended.ready_ms,
            acks.claimed.len()
        );
        std::fs::remove_file(&db)?;
    }
    println!(
        "migration kills summary: rounds {rounds}; kills before the first step committed \
         {before_steps}, between steps {} (records copied: {between_steps:?}; {format2_opens} \
         of them opened in format 2 first), after the switch but before the open returned \
         {before_ready}, during the traffic after {after_ready}; child opens {child_open_ms:?} ms; \
         acknowledged claims {acked}; failures {} ({:.1} s, seed {seed})",
        between_steps.len(),
        failures.len(),
        started.elapsed().as_secs_f64()
    );
    if between_steps.is_empty() {
        println!("NOTE: no kill landed between migration steps in this run");
    }
    if before_ready + after_ready == 0 {
        println!("NOTE: no kill landed after the migration committed in this run");
    }
    assert!(
        failures.is_empty(),
        "{} failures (seed {seed}), first: {:#?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    Ok(())
}

// -------------------------------------------------- test 2: partition drops

/// Totals of the drop test's checks.
#[derive(Default)]
struct DropTally {
    /// Completions inside their TTL that replayed.
    live_replays: u64,
    /// Completions checked past their TTL (present or not).
    past_ttl: u64,
    /// Claims checked still PROCESSING and unclaimable.
    processing: u64,
    /// Checks whose TTL ran out during the check itself.
    raced: u64,
    failures: Vec<String>,
}

/// Checks one acknowledged key of the drop test; keys a raced check
/// claimed go to `reclaimed` and are not checked again.
fn check_drop_key(
    engine: &Engine,
    acks: &Acks,
    name: &str,
    when: &str,
    tally: &mut DropTally,
    reclaimed: &mut BTreeSet<String>,
) -> TestResult {
    if reclaimed.contains(name) {
        return Ok(());
    }
    let ttl = DROP_TTL.as_millis() as u64;
    let (token, claimed_ms) = acks.claimed[name];
    let want = response(name);
    let mut fail = |what: String| tally.failures.push(format!("{when}: {name}: {what}"));
    if let Some(&(hash, before_ms)) = acks.completed.get(name) {
        if now_ms() + TTL_MARGIN_MS < before_ms + ttl {
            match engine.begin(&key(name)?, request_fp(name)?)? {
                Begin::Replay(r) if fnv1a(&r.envelope.body) == hash && r.envelope == want => {
                    tally.live_replays += 1;
                }
                other => {
                    let at = now_ms();
                    if at < before_ms + ttl {
                        fail(format!(
                            "acknowledged completion (TTL from {before_ms} ms at the earliest) \
                             answers {other:?} at {at} ms"
                        ));
                    } else {
                        tally.raced += 1;
                    }
                    if matches!(other, Begin::Claimed(_)) {
                        reclaimed.insert(name.to_string());
                    }
                }
            }
        } else {
            tally.past_ttl += 1;
            match engine.record(&key(name)?)? {
                Some(r) if r.fencing_token != token => {
                    fail(format!("token {}, the claim had {token}", r.fencing_token))
                }
                Some(r) if r.response.as_ref().is_some_and(|e| *e != want) => {
                    fail(format!("stored response differs: {:?}", r.response))
                }
                _ => {}
            }
        }
        return Ok(());
    }
    // Claimed only: the complete may have committed with its ack lost,
    // and then expired (no sooner than a TTL after the claim's ack).
    match check_claim(engine, name, token)? {
        Err(what) => fail(what),
        Ok(ClaimSeen::Missing) if now_ms() < claimed_ms + ttl => {
            fail("acknowledged claim has no record".into())
        }
        Ok(ClaimSeen::Missing) => tally.past_ttl += 1,
        Ok(ClaimSeen::Held) => tally.processing += 1,
        Ok(ClaimSeen::Completed) => {}
    }
    Ok(())
}

/// What an acknowledged claim without an acknowledged completion left.
enum ClaimSeen {
    /// No record.
    Missing,
    /// Its record, completed with the response its claim would store
    /// (the completion committed, its ack lost).
    Completed,
    /// Its record, still held: a `begin` answers in progress or in doubt.
    Held,
}

/// Looks at claim `token` of key `name`: `Err` names what is wrong (another
/// token, another response, or a `begin` that does not see it held).
fn check_claim(engine: &Engine, name: &str, token: u64) -> AnyResult<Result<ClaimSeen, String>> {
    let want = response(name);
    Ok(match engine.record(&key(name)?)? {
        None => Ok(ClaimSeen::Missing),
        Some(r) if r.fencing_token != token => {
            Err(format!("token {}, the claim had {token}", r.fencing_token))
        }
        Some(r) if r.state == State::Completed => {
            if r.response.as_ref() == Some(&want) {
                Ok(ClaimSeen::Completed)
            } else {
                Err(format!("stored response differs: {:?}", r.response))
            }
        }
        Some(r) => match engine.begin(&key(name)?, request_fp(name)?)? {
            Begin::Processing { .. } | Begin::InDoubt(_) => Ok(ClaimSeen::Held),
            other => Err(format!("claim in state {:?} answers {other:?}", r.state)),
        },
    })
}

#[test]
fn sigkill_during_partition_drops_loses_nothing() -> TestResult {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let rounds = env_u64(DROP_ROUNDS_VAR)?.unwrap_or(DEFAULT_DROP_ROUNDS);
    let seed = seed()?;
    println!("drop kills: {rounds} rounds, seed {seed} ({SEED_VAR}={seed} replays the delays)");
    let mut rng = SplitMix64(seed);
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("drops.redb");
    let started = Instant::now();
    let mut acks = Acks::default();
    let mut earlier: Vec<String> = Vec::new();
    let mut reclaimed = BTreeSet::new();
    let mut tally = DropTally::default();
    let (mut dropped, mut created) = (0usize, 0usize);
    let mut kills = 0u64;
    for round in 0..rounds {
        let before = partition_rows(&db)?;
        let log = dir.path().join(format!("drops-{round}.log"));
        let stderr = dir.path().join(format!("drops-{round}.stderr"));
        // Past a few TTLs and sweeps, so partitions seal, empty and drop.
        let delay = 500 + rng.below(1500);
        let child = spawn_child("drops", &db, round, &log, &stderr)?;
        let ended = kill_after(child, round, Duration::from_millis(delay), true, &stderr)?;
        match ended.failure {
            Some(f) => tally.failures.push(f),
            None => kills += 1,
        }
        let names = acks.read_log(&log, round)?;
        let when = format!("after round {round}'s kill");
        let engine = dropping_builder().sweep_interval(None).open_existing(&db)?;
        for name in names.iter().rev() {
            check_drop_key(&engine, &acks, name, &when, &mut tally, &mut reclaimed)?;
        }
        for name in &earlier {
            // Earlier rounds' completions are long past their TTL: only
            // their claims left PROCESSING by a kill must still be there.
            if !acks.completed.contains_key(name) {
                check_drop_key(&engine, &acks, name, &when, &mut tally, &mut reclaimed)?;
            }
        }
        let report = engine.verify()?;
        if !report.is_sound() {
            tally
                .failures
                .push(format!("{when}: verify: {:?}", report.damage));
        }
        drop(engine);
        let after = partition_rows(&db)?;
        let first_new = before.last().map_or(1, |p| p + 1);
        let last = after.last().copied().unwrap_or(0).max(first_new - 1);
        let new: BTreeSet<u64> = (first_new..=last).collect();
        let round_dropped = before.difference(&after).count() + new.difference(&after).count();
        dropped += round_dropped;
        created += new.len();
        println!(
            "round {round}: kill {delay} ms after ready, {} acknowledged claims, partitions: \
             {} rows before, {} opened, {round_dropped} dropped, {} rows after",
            names.len(),
            before.len(),
            new.len(),
            after.len()
        );
        earlier.extend(names);
    }
    println!(
        "drop kills summary: rounds {rounds}, kills {kills}, acknowledged claims {}, completions {}; \
         partitions opened {created}, dropped {dropped}; live completions replayed {}, checked \
         past their TTL {}, claims still PROCESSING {}, checks that raced expiry {}; failures {} \
         ({:.1} s, seed {seed})",
        acks.claimed.len(),
        acks.completed.len(),
        tally.live_replays,
        tally.past_ttl,
        tally.processing,
        tally.raced,
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

// ------------------------------------------------- test 3: partition merges

/// The rows of the file's partitions a merge holds, read from a copy at
/// `scratch`: (merging, merge sources, dropping, built).
fn merge_rows(db: &Path, scratch: &Path) -> AnyResult<[usize; 4]> {
    if !db.exists() {
        return Ok([0; 4]);
    }
    std::fs::copy(db, scratch)?;
    let mut out = [0usize; 4];
    {
        let file = redb::Database::open(scratch)?;
        let txn = file.begin_read()?;
        if let Ok(table) = txn.open_table(PARTITIONS) {
            for entry in table.iter()? {
                let (k, v) = entry?;
                match v.value().get(ROW_STATE_AT) {
                    Some(3) => out[0] += 1,
                    Some(4) => out[1] += 1,
                    Some(2) => out[2] += 1,
                    _ => {}
                }
                if k.value() >= BUILT_PARTITIONS {
                    out[3] += 1;
                }
            }
        }
    }
    std::fs::remove_file(scratch)?;
    Ok(out)
}

/// Checks one acknowledged key of the merge test: no TTL runs out during
/// the test, so a completion replays, and a claim is still held.
fn check_merge_key(
    engine: &Engine,
    acks: &Acks,
    name: &str,
    failures: &mut Vec<String>,
) -> TestResult {
    let (token, _) = acks.claimed[name];
    let want = response(name);
    let mut fail = |what: String| failures.push(format!("{name}: {what}"));
    if let Some(&(hash, _)) = acks.completed.get(name) {
        match engine.begin(&key(name)?, request_fp(name)?)? {
            Begin::Replay(r) if fnv1a(&r.envelope.body) == hash && r.envelope == want => {}
            other => fail(format!("acknowledged completion answers {other:?}")),
        }
        return Ok(());
    }
    match check_claim(engine, name, token)? {
        Err(what) => fail(what),
        Ok(ClaimSeen::Missing) => fail("acknowledged claim has no record".into()),
        Ok(ClaimSeen::Completed | ClaimSeen::Held) => {}
    }
    Ok(())
}

#[test]
fn sigkill_during_partition_merges_loses_nothing() -> TestResult {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let rounds = env_u64(MERGE_ROUNDS_VAR)?.unwrap_or(DEFAULT_MERGE_ROUNDS);
    let seed = seed()?;
    println!("merge kills: {rounds} rounds, seed {seed} ({SEED_VAR}={seed} replays the delays)");
    let mut rng = SplitMix64(seed);
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("merges.redb");
    let scratch = dir.path().join("scratch.redb");
    let started = Instant::now();
    let anchor = now_ms();
    let mut acks = Acks::default();
    let mut all: Vec<String> = Vec::new();
    let mut failures = Vec::new();
    let mut mid_merge = 0u64;
    let mut built = 0usize;
    for round in 0..rounds {
        let log = dir.path().join(format!("merges-{round}.log"));
        let stderr = dir.path().join(format!("merges-{round}.stderr"));
        let delay = if round == 0 {
            FIRST_MERGE_ROUND_MS + rng.below(4_000)
        } else {
            500 + rng.below(4_500)
        };
        let child = spawn_child_with("merges", &db, round, &log, &stderr, Some(anchor))?;
        let ended = kill_after(child, round, Duration::from_millis(delay), true, &stderr)?;
        if let Some(f) = ended.failure {
            failures.push(f);
        }
        let names = acks.read_log(&log, round)?;
        // Salvage reads a killed file too: a merge's copies and the stale
        // records it leaves are told apart.
        let salvaged = dir.path().join(format!("salvaged-{round}.redb"));
        let report = Engine::salvage(&db, &salvaged)?;
        let engine = merging_builder(anchor)
            .sweep_interval(None)
            .open_existing(&salvaged)?;
        let before = failures.len();
        for name in &names {
            check_merge_key(&engine, &acks, name, &mut failures)?;
        }
        for f in failures.iter_mut().skip(before) {
            *f = format!(
                "salvaged after round {round}'s kill: {f} (lost: {:?})",
                report.lost
            );
        }
        drop(engine);
        std::fs::remove_file(&salvaged)?;
        // The rows as the kill left them, once the journal is applied (an
        // open recovers the file, its close checkpoints it).
        drop(
            merging_builder(anchor)
                .sweep_interval(None)
                .open_existing(&db)?,
        );
        let [merging, sources, dropping, built_rows] = merge_rows(&db, &scratch)?;
        built = built_rows;
        if merging + dropping > 0 {
            mid_merge += 1;
        }
        let engine = merging_builder(anchor)
            .sweep_interval(None)
            .open_existing(&db)?;
        let before = failures.len();
        for name in &names {
            check_merge_key(&engine, &acks, name, &mut failures)?;
        }
        // A sample of earlier rounds' keys, now in merged partitions.
        for _ in 0..all.len().min(500) {
            let name = &all[rng.below(all.len() as u64) as usize];
            check_merge_key(&engine, &acks, name, &mut failures)?;
        }
        for f in failures.iter_mut().skip(before) {
            *f = format!("after round {round}'s kill: {f}");
        }
        let report = engine.verify()?;
        if !report.is_sound() {
            failures.push(format!(
                "after round {round}'s kill: verify: {:?}",
                report.damage
            ));
        }
        drop(engine);
        println!(
            "round {round}: kill {delay} ms after ready, {} acknowledged claims; rows at the \
             kill: merging {merging}, merge sources {sources}, dropping {dropping}, merged \
             {built_rows}",
            names.len()
        );
        all.extend(names);
    }
    println!(
        "merge kills summary: rounds {rounds}, kills landing in a merge {mid_merge}, merged \
         partitions at the end {built}, acknowledged claims {}, completions {}; failures {} \
         ({:.1} s, seed {seed})",
        acks.claimed.len(),
        acks.completed.len(),
        failures.len(),
        started.elapsed().as_secs_f64()
    );
    if mid_merge == 0 {
        println!("NOTE: no kill landed while a merge copied or dropped in this run");
    }
    assert!(
        failures.is_empty(),
        "{} failures (seed {seed}), first: {:#?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(
        built > 0,
        "no partition was merged: the test did not test merges"
    );
    Ok(())
}
