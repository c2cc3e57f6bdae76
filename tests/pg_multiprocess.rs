//! Guards against double execution and lost acknowledged results when
//! several processes share one PostgreSQL database and both the processes
//! and the database server die at random moments (issue 11).
//!
//! Four child processes (this test binary re-invoked with
//! `IDEM_PGCHAOS_ROLE` set, running only `child_entry`), 16 threads each,
//! hammer a sliding window of 400 overlapping keys through engines that share
//! one table prefix, each running its own sweeper, with a 1 s lease on the
//! database's clock. A thread that wins a claim "executes" the work by
//! inserting a row into a side table `<prefix>executions` in its own
//! committed transaction (a plain client, not the engine), then completes
//! with a body derived from key, token and reference, and appends the key
//! and body to its acknowledgement file once `complete` returned `Ok`. A
//! replay must carry the body of the key's completion. Connection errors are
//! logged and survived, never a panic.
//!
//! The parent SIGKILLs random children at random moments and restarts them
//! (12 kills by default; `IDEMPOTENCY_PG_CHAOS_KILLS` for more), and once,
//! mid-run, restarts the server itself with `pg_ctl restart -m immediate`.
//! Then it stops the children, waits out the lease, sweeps, and audits:
//! no key's work ran twice (work that ran but whose completion never landed
//! is legitimately UNKNOWN, once), no key was claimed twice (nothing in this
//! test ever frees a claimed key), every execution ran under a token some
//! `begin` answered `Claimed`, every acknowledged completion replays its
//! exact bytes through a fresh engine, every COMPLETED record matches its
//! one execution, and nothing is PROCESSING. Counts are printed (run with
//! `--nocapture`); request counts are as the children last reported them,
//! claims and acknowledgements are exact (one line each in per-process
//! files). Unix only (SIGKILL, pg_ctl).
#![cfg(unix)]

#[path = "common/pg_chaos.rs"]
mod pg_chaos;
#[path = "common/pg_server.rs"]
mod pg_server;

use std::collections::{BTreeMap, BTreeSet};
use std::error::Error;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idempotency::postgres::Client;
use idempotency::{
    Begin, Engine, Envelope, Failure, Fingerprint, IdempotencyKey, RecordFilter, State,
};

type TestResult<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

const ROLE_VAR: &str = "IDEM_PGCHAOS_ROLE";
const DIR_VAR: &str = "IDEM_PGCHAOS_DIR";
const PREFIX_VAR: &str = "IDEM_PGCHAOS_PREFIX";
const START_VAR: &str = "IDEM_PGCHAOS_START_MS";
const KILLS_VAR: &str = "IDEMPOTENCY_PG_CHAOS_KILLS";
const SEED_VAR: &str = "IDEMPOTENCY_PG_CHAOS_SEED";

const CHILDREN: usize = 4;
const THREADS: usize = 16;
/// Keys live at once; the window slides by `KEYS_PER_SEC`, so claims (not
/// only replays) keep happening for the whole run.
const WINDOW: u64 = 400;
const KEYS_PER_SEC: u64 = 40;
const LEASE: Duration = Duration::from_millis(1_000);
const SWEEP_EVERY: Duration = Duration::from_millis(50);
/// Side-table connections per child (the engine's pool has 6): 4 children
/// stay far below a default `max_connections` of 100.
const SIDE_POOL: usize = 4;
const DEFAULT_KILLS: u64 = 12;
const SCOPE: &str = "chaos";

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// xorshift64*: enough randomness for a schedule, reproducible from a seed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn key_name(i: u64) -> String {
    format!("k{i:07}")
}

fn key(name: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new(SCOPE, name)
}

fn fingerprint(name: &str) -> TestResult<Fingerprint> {
    Ok(Fingerprint::of_json(
        format!(r#"{{"key":"{name}"}}"#).as_bytes(),
        &[],
    )?)
}

/// The response a completion stores: derived from key, token and the
/// claim's reference, so a replay shows which claim completed it.
fn body(name: &str, token: u64, reference: &str) -> String {
    format!(r#"{{"key":"{name}","token":{token},"ref":"{reference}"}}"#)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn executions_table(prefix: &str) -> String {
    format!("{prefix}executions")
}

fn open_engine(url: &str, prefix: &str, sweep: Option<Duration>) -> Result<Engine, String> {
    Engine::builder()
        .table_prefix(prefix)
        .pool_size(6) // with SIDE_POOL: 4 children stay far below max_connections 100
        .database_clock(true)
        .lease(LEASE)
        .sweep_interval(sweep)
        .open_postgres(url)
        .map_err(|e| format!("open_postgres: {e}"))
}

// ---------------------------------------------------------------- child --

/// Entry point of a child process; a no-op in the normal test run.
#[test]
fn child_entry() -> TestResult {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return Ok(());
    };
    let dir = PathBuf::from(std::env::var(DIR_VAR)?);
    let prefix = std::env::var(PREFIX_VAR)?;
    let start_ms: u64 = std::env::var(START_VAR)?.parse()?;
    let url = std::env::var(pg_chaos::PG_VAR)?;
    child_main(&dir, &role, &url, &prefix, start_ms)
}

/// A few side-table connections shared by a child's threads; a connection
/// that saw an error is dropped, and the next use connects afresh.
struct SidePool {
    url: String,
    idle: Mutex<Vec<Client>>,
    permits: Mutex<usize>,
    freed: Condvar,
}

impl SidePool {
    fn new(url: &str) -> SidePool {
        SidePool {
            url: url.to_string(),
            idle: Mutex::new(Vec::new()),
            permits: Mutex::new(SIDE_POOL),
            freed: Condvar::new(),
        }
    }

    /// Runs `f` on a connection; `Err` says what failed. After an error the
    /// statement may or may not have committed.
    fn with<T>(
        &self,
        f: impl FnOnce(&mut Client) -> Result<T, idempotency::postgres::Error>,
    ) -> Result<T, String> {
        {
            let mut permits = self.permits.lock().unwrap_or_else(PoisonError::into_inner);
            while *permits == 0 {
                permits = self
                    .freed
                    .wait(permits)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            *permits -= 1;
        }
        let result = (|| {
            let idle = self
                .idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop();
            let mut client = match idle {
                Some(c) => c,
                None => pg_chaos::connect(&self.url).map_err(|e| e.to_string())?,
            };
            let out = f(&mut client).map_err(|e| format!("side table: {e}"))?;
            self.idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(client);
            Ok(out)
        })();
        *self.permits.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        self.freed.notify_one();
        result
    }
}

/// What a child did, as last reported (a killed child's last ~100 ms are
/// not counted).
#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    claims: AtomicU64,
    executed: AtomicU64,
    exec_errors: AtomicU64,
    acked: AtomicU64,
    complete_errors: AtomicU64,
    begin_errors: AtomicU64,
    replays: AtomicU64,
    processing: AtomicU64,
    unknown: AtomicU64,
    violations: AtomicU64,
}

impl Counters {
    const NAMES: [&'static str; 11] = [
        "requests",
        "claims",
        "executed",
        "exec_errors",
        "acked",
        "complete_errors",
        "begin_errors",
        "replays",
        "processing",
        "unknown",
        "violations",
    ];

    fn values(&self) -> [u64; 11] {
        [
            &self.requests,
            &self.claims,
            &self.executed,
            &self.exec_errors,
            &self.acked,
            &self.complete_errors,
            &self.begin_errors,
            &self.replays,
            &self.processing,
            &self.unknown,
            &self.violations,
        ]
        .map(|c| c.load(Ordering::Relaxed))
    }

    /// Replaces `path` with the current counts (write, then rename, so a
    /// kill never leaves a torn file).
    fn save(&self, path: &Path) -> std::io::Result<()> {
        let text: String = Self::NAMES
            .iter()
            .zip(self.values())
            .map(|(n, v)| format!("{n}={v}\n"))
            .collect();
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, path)
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Appends lines, each in one `write` and flushed, so a SIGKILL can only
/// lose lines not yet written, never tear one.
struct LineLog(Mutex<File>);

impl LineLog {
    fn open(path: &Path) -> std::io::Result<LineLog> {
        let f = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(LineLog(Mutex::new(f)))
    }

    fn line(&self, text: &str) {
        let mut f = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let line = format!("{text}\n");
        if let Err(e) = f.write_all(line.as_bytes()).and_then(|()| f.flush()) {
            eprintln!("cannot append to a log file: {e}");
        }
    }
}

struct ChildCtx<'a> {
    engine: &'a Engine,
    side: &'a SidePool,
    counters: &'a Counters,
    acks: &'a LineLog,
    claims: &'a LineLog,
    violations: &'a LineLog,
    /// key -> the body this process saw acknowledged for it.
    mine: &'a Mutex<BTreeMap<String, Vec<u8>>>,
    stop: &'a AtomicBool,
    table: String,
    start_ms: u64,
}

impl ChildCtx<'_> {
    fn violation(&self, what: String) {
        bump(&self.counters.violations);
        eprintln!("VIOLATION: {what}");
        self.violations.line(&what);
    }

    fn worker(&self, seed: u64) {
        let mut rng = Rng::new(seed);
        let pid = i32::try_from(std::process::id()).unwrap_or(i32::MAX);
        while !self.stop.load(Ordering::Relaxed) {
            let base = now_ms().saturating_sub(self.start_ms) * KEYS_PER_SEC / 1_000;
            let name = key_name(base + rng.below(WINDOW));
            if let Err(e) = self.request(&name, pid) {
                // Bad input is a test bug, not chaos: report it.
                self.violation(format!("{name}: {e}"));
            }
        }
    }

    fn request(&self, name: &str, pid: i32) -> TestResult {
        let (k, fp) = (key(name)?, fingerprint(name)?);
        bump(&self.counters.requests);
        let answer = match self.engine.begin(&k, fp) {
            Ok(a) => a,
            Err(e) => {
                bump(&self.counters.begin_errors);
                eprintln!("begin {name}: {e}");
                std::thread::sleep(Duration::from_millis(20));
                return Ok(());
            }
        };
        match answer {
            Begin::Claimed(claim) => {
                bump(&self.counters.claims);
                let token = claim.fencing_token();
                self.claims.line(&format!("{name}\t{token}"));
                let sql = format!(
                    "INSERT INTO {} (key, token, pid) VALUES ($1, $2, $3)",
                    self.table
                );
                let token_i64 = i64::try_from(token)?;
                // The work: its own committed transaction, before complete.
                let executed = self
                    .side
                    .with(|c| c.execute(sql.as_str(), &[&name, &token_i64, &pid]));
                if let Err(e) = executed {
                    // It may or may not have committed: in doubt, honestly.
                    bump(&self.counters.exec_errors);
                    eprintln!("execute {name}: {e}");
                    let reason = format!("side-table insert failed: {e}");
                    if let Err(e) = self.engine.fail(claim, Failure::InDoubt { reason }) {
                        eprintln!("fail(InDoubt) {name}: {e}");
                    }
                    return Ok(());
                }
                bump(&self.counters.executed);
                let b = body(name, token, claim.reference());
                match self
                    .engine
                    .complete(claim, Envelope::new(1, 201, b.clone()))
                {
                    Ok(()) => {
                        self.acks.line(&format!("{name}\t{}", hex(b.as_bytes())));
                        bump(&self.counters.acked);
                        let mut mine = self.mine.lock().unwrap_or_else(PoisonError::into_inner);
                        if let Some(old) = mine.insert(name.to_string(), b.clone().into_bytes()) {
                            self.violation(format!(
                                "{name} completed twice in one process: {:?} then {b:?}",
                                String::from_utf8_lossy(&old)
                            ));
                        }
                    }
                    Err(e) => {
                        bump(&self.counters.complete_errors);
                        eprintln!("complete {name}: {e}");
                    }
                }
            }
            Begin::Replay(r) => {
                bump(&self.counters.replays);
                let got = &r.envelope.body;
                let text = String::from_utf8_lossy(got);
                let head = format!(r#"{{"key":"{name}","token":"#);
                let tail = format!(r#","ref":"{}"}}"#, r.reference);
                if !text.starts_with(&head) || !text.ends_with(&tail) {
                    self.violation(format!(
                        "{name}: replay {text:?} does not match its reference {}",
                        r.reference
                    ));
                }
                let mine = self.mine.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(acked) = mine.get(name) {
                    if acked != got {
                        self.violation(format!(
                            "{name}: replay {text:?} differs from the acknowledged {:?}",
                            String::from_utf8_lossy(acked)
                        ));
                    }
                }
            }
            Begin::Processing { retry_after } => {
                bump(&self.counters.processing);
                std::thread::sleep(retry_after.min(Duration::from_millis(10)));
            }
            Begin::InDoubt(_) => bump(&self.counters.unknown),
            other @ (Begin::Mismatch | Begin::Tombstoned { .. }) => {
                self.violation(format!("{name}: unexpected {other:?}"));
            }
        }
        Ok(())
    }
}

fn child_main(dir: &Path, role: &str, url: &str, prefix: &str, start_ms: u64) -> TestResult {
    let stop_file = dir.join("stop");
    let counters = Counters::default();
    let stats_path = dir.join(format!("stats-{role}.txt"));
    let parent = std::os::unix::process::parent_id();
    let should_stop = || stop_file.exists() || std::os::unix::process::parent_id() != parent;

    // The server may be restarting: keep trying to open.
    let engine = loop {
        match open_engine(url, prefix, Some(SWEEP_EVERY)) {
            Ok(e) => break e,
            Err(e) => {
                eprintln!("child {role}: {e}; retrying");
                if should_stop() {
                    return Ok(());
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };
    eprintln!("child {role}: engine open");
    let side = SidePool::new(url);
    let acks = LineLog::open(&dir.join(format!("acks-{role}.tsv")))?;
    let claims = LineLog::open(&dir.join(format!("claims-{role}.tsv")))?;
    let violations = LineLog::open(&dir.join(format!("violations-{role}.txt")))?;
    let mine = Mutex::new(BTreeMap::new());
    let stop = AtomicBool::new(false);
    let ctx = ChildCtx {
        engine: &engine,
        side: &side,
        counters: &counters,
        acks: &acks,
        claims: &claims,
        violations: &violations,
        mine: &mine,
        stop: &stop,
        table: executions_table(prefix),
        start_ms,
    };
    let seed = now_ms() ^ (u64::from(std::process::id()) << 32);
    std::thread::scope(|s| -> TestResult {
        for t in 0..THREADS {
            let ctx = &ctx;
            std::thread::Builder::new()
                .name(format!("chaos-{t}"))
                .spawn_scoped(s, move || ctx.worker(seed.wrapping_add(t as u64 * 7919)))?;
        }
        while !should_stop() {
            if let Err(e) = counters.save(&stats_path) {
                eprintln!("child {role}: cannot save stats: {e}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        stop.store(true, Ordering::Relaxed);
        Ok(())
    })?;
    drop(engine);
    counters.save(&stats_path)?;
    eprintln!("child {role}: stopped cleanly");
    Ok(())
}

// --------------------------------------------------------------- parent --

/// The children; the ones still running are killed when this drops (a
/// failing parent never leaves them behind).
struct Children {
    dir: PathBuf,
    prefix: String,
    start_ms: u64,
    slots: Vec<Option<Child>>,
    incarnations: u64,
}

impl Children {
    fn spawn(&mut self, slot: usize) -> TestResult {
        self.incarnations += 1;
        let role = format!("c{slot}-i{}", self.incarnations);
        let log = File::create(self.dir.join(format!("log-{role}.txt")))?;
        let child = Command::new(std::env::current_exe()?)
            .args([
                "--exact", // `<file>::child_entry` where this file is a module of a test binary.
                concat!(module_path!(), "::child_entry")
                    .split_once("::")
                    .map_or("child_entry", |(_, t)| t),
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE_VAR, &role)
            .env(DIR_VAR, &self.dir)
            .env(PREFIX_VAR, &self.prefix)
            .env(START_VAR, self.start_ms.to_string())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.slots[slot] = Some(child);
        Ok(())
    }

    /// SIGKILLs the child in `slot` and reaps it.
    fn kill(&mut self, slot: usize) -> TestResult {
        if let Some(mut c) = self.slots[slot].take() {
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }

    /// Asks every child to stop and waits for each to exit by itself.
    fn stop_all(&mut self, within: Duration) -> TestResult {
        File::create(self.dir.join("stop"))?;
        let deadline = Instant::now() + within;
        for slot in 0..self.slots.len() {
            let Some(mut c) = self.slots[slot].take() else {
                continue;
            };
            loop {
                if let Some(status) = c.try_wait()? {
                    if !status.success() {
                        return Err(format!("child {slot} exited with {status} on stop").into());
                    }
                    break;
                }
                if Instant::now() > deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    return Err(
                        format!("child {slot} did not stop within {within:?} (hung?)").into(),
                    );
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    /// Children that died without being killed (a panic, an error exit).
    fn check_alive(&mut self) -> TestResult {
        for (slot, c) in self.slots.iter_mut().enumerate() {
            if let Some(c) = c {
                if let Some(status) = c.try_wait()? {
                    return Err(format!("child {slot} died on its own: {status}").into());
                }
            }
        }
        Ok(())
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for c in self.slots.iter_mut().filter_map(Option::take) {
            let mut c = c;
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Complete lines of every `<stem>-*.<ext>` file in `dir` (a torn last line
/// was never acknowledged).
fn lines_of(dir: &Path, stem: &str, ext: &str) -> TestResult<Vec<String>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with(&format!("{stem}-")) && name.ends_with(&format!(".{ext}")) {
            let text = std::fs::read_to_string(&path)?;
            let complete = text.rsplit_once('\n').map_or("", |(done, _)| done);
            out.extend(complete.lines().map(str::to_string));
        }
    }
    Ok(out)
}

fn summed_stats(dir: &Path) -> TestResult<BTreeMap<String, u64>> {
    let mut sum = BTreeMap::new();
    for line in lines_of(dir, "stats", "txt")? {
        if let Some((k, v)) = line.split_once('=') {
            *sum.entry(k.to_string()).or_insert(0) += v.parse::<u64>()?;
        }
    }
    Ok(sum)
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[test]
fn processes_and_server_die_at_random_yet_no_work_runs_twice() -> TestResult {
    if std::env::var(ROLE_VAR).is_ok() {
        return Ok(()); // a child runs child_entry only
    }
    let Some(url) = pg_chaos::pg_url() else {
        return Ok(());
    };
    let t0 = Instant::now();
    let kills: u64 = match std::env::var(KILLS_VAR) {
        Ok(v) => v.parse().map_err(|e| format!("{KILLS_VAR}={v:?}: {e}"))?,
        Err(_) => DEFAULT_KILLS,
    };
    let seed: u64 = match std::env::var(SEED_VAR) {
        Ok(v) => v.parse().map_err(|e| format!("{SEED_VAR}={v:?}: {e}"))?,
        Err(_) => now_ms() ^ u64::from(std::process::id()),
    };
    let mut rng = Rng::new(seed);
    let prefix = pg_chaos::unique_prefix("mp");
    let table = executions_table(&prefix);
    let dir = tempfile::tempdir()?;
    eprintln!(
        "pg_multiprocess: seed {seed} ({SEED_VAR}), {kills} kills ({KILLS_VAR}), prefix {prefix}, files in {}",
        dir.path().display()
    );

    pg_chaos::connect(&url)?.batch_execute(&format!(
        "CREATE TABLE {table} (key text NOT NULL, token bigint NOT NULL, pid integer NOT NULL, \
         at timestamptz NOT NULL DEFAULT clock_timestamp())"
    ))?;
    // Create the engine's schema once, so the children do not all race to.
    drop(open_engine(&url, &prefix, None)?);

    let mut children = Children {
        dir: dir.path().to_path_buf(),
        prefix: prefix.clone(),
        start_ms: now_ms(),
        slots: (0..CHILDREN).map(|_| None).collect(),
        incarnations: 0,
    };
    let audit = (|| -> TestResult<Audit> {
        for slot in 0..CHILDREN {
            children.spawn(slot)?;
        }
        std::thread::sleep(Duration::from_millis(1_000));
        let restart_at = kills / 2;
        let mut restart_took = None;
        for i in 0..kills {
            std::thread::sleep(Duration::from_millis(200 + rng.below(1_000)));
            children.check_alive()?;
            let slot = usize::try_from(rng.below(CHILDREN as u64))?;
            children.kill(slot)?;
            children.spawn(slot)?;
            if i == restart_at {
                std::thread::sleep(Duration::from_millis(rng.below(300)));
                eprintln!("restarting the server (pg_ctl restart -m immediate) under load");
                restart_took = Some(pg_server::restart_server()?);
            }
        }
        std::thread::sleep(Duration::from_millis(1_000));
        children.check_alive()?;
        children.stop_all(Duration::from_secs(40))?;
        let restarts = u64::from(restart_took.is_some());
        if let Some(took) = restart_took {
            eprintln!("server restart took {took:?}");
        }
        audit(&url, &prefix, dir.path(), kills, restarts)
    })();
    drop(children);
    let audit = match audit {
        Ok(a) => a,
        Err(e) => {
            for entry in std::fs::read_dir(dir.path())? {
                let path = entry?.path();
                if path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("log-"))
                {
                    eprintln!("--- {} (tail)\n{}", path.display(), tail(&path, 15));
                }
            }
            return Err(e);
        }
    };
    eprintln!("pg_multiprocess: {audit:#?}\ntook {:?}", t0.elapsed());
    let clean = audit.double_executions == 0
        && audit.double_claims == 0
        && audit.unclaimed_executions == 0
        && audit.lost_acknowledged == 0
        && audit.processing_after_sweep == 0
        && audit.completed_without_one_execution == 0
        && audit.executed_without_record == 0
        && audit.child_violations == 0
        && audit.child_panics == 0;
    assert!(clean, "audit failed (files kept in {}): {audit:#?}", {
        let kept = dir.keep();
        kept.display().to_string()
    });
    assert!(audit.kills >= kills && audit.server_restarts == 1);
    // Leave nothing behind on the shared server (on a new connection: the
    // restart closed the first one).
    pg_chaos::drop_prefix(&mut pg_chaos::connect(&url)?, &prefix)?;
    Ok(())
}

#[derive(Debug)]
#[allow(dead_code)] // read through Debug
struct Audit {
    kills: u64,
    server_restarts: u64,
    keys: usize,
    requests: u64,
    claims: usize,
    completions_acknowledged: usize,
    executions: usize,
    completed: u64,
    unknown: u64,
    executed_but_unknown: u64,
    replays: u64,
    processing_answers: u64,
    in_doubt_answers: u64,
    child_begin_errors: u64,
    child_complete_errors: u64,
    child_execute_errors: u64,
    double_executions: usize,
    double_claims: usize,
    unclaimed_executions: usize,
    lost_acknowledged: usize,
    completed_without_one_execution: usize,
    executed_without_record: usize,
    processing_after_sweep: u64,
    child_violations: usize,
    child_panics: usize,
}

fn audit(url: &str, prefix: &str, dir: &Path, kills: u64, restarts: u64) -> TestResult<Audit> {
    // Every claim a killed child left behind has its lease run out.
    std::thread::sleep(LEASE + Duration::from_millis(500));
    let engine = open_engine(url, prefix, None)?;
    while engine.sweep_now()?.more {}

    let mut client = pg_chaos::connect(url)?;
    let mut executions: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let rows = client.query(
        &format!("SELECT key, token FROM {}", executions_table(prefix)),
        &[],
    )?;
    let n_executions = rows.len();
    for row in rows {
        let (k, t): (String, i64) = (row.get(0), row.get(1));
        executions.entry(k).or_default().push(u64::try_from(t)?);
    }

    let mut acked: BTreeMap<String, BTreeSet<Vec<u8>>> = BTreeMap::new();
    let mut n_acked = 0;
    for line in lines_of(dir, "acks", "tsv")? {
        let (k, h) = line
            .split_once('\t')
            .ok_or_else(|| format!("bad ack line {line:?}"))?;
        let b = unhex(h).ok_or_else(|| format!("bad ack hex {line:?}"))?;
        acked.entry(k.to_string()).or_default().insert(b);
        n_acked += 1;
    }
    let mut claims: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
    let mut n_claims = 0;
    for line in lines_of(dir, "claims", "tsv")? {
        let (k, t) = line
            .split_once('\t')
            .ok_or_else(|| format!("bad claim line {line:?}"))?;
        claims.entry(k.to_string()).or_default().insert(t.parse()?);
        n_claims += 1;
    }
    // Nothing here ever frees a claimed key (no Retryable, no resolver, a
    // 24 h TTL): a second claim of a key is a second execution waiting to
    // happen, whether or not it got that far.
    let double_claims: Vec<_> = claims.iter().filter(|(_, t)| t.len() > 1).collect();
    for (k, t) in double_claims.iter().take(20) {
        eprintln!("DOUBLE CLAIM of {k}: tokens {t:?}");
    }
    let unclaimed_executions = executions
        .iter()
        .flat_map(|(k, ts)| ts.iter().map(move |t| (k, t)))
        .filter(|(k, t)| !claims.get(*k).is_some_and(|c| c.contains(t)))
        .inspect(|(k, t)| eprintln!("{k} ran under token {t}, which no begin answered Claimed"))
        .count();
    let violations = lines_of(dir, "violations", "txt")?;
    // A panic on any thread of a child (the engine's included), even one
    // the child survived, is a bug: connection errors must be errors.
    let panics: Vec<String> = lines_of(dir, "log", "txt")?
        .into_iter()
        .filter(|l| l.contains("panicked"))
        .collect();
    for p in panics.iter().take(20) {
        eprintln!("child panic: {p}");
    }
    for v in violations.iter().take(20) {
        eprintln!("child violation: {v}");
    }

    let (mut completed, mut unknown, mut processing) = (0, 0, 0);
    let (mut executed_but_unknown, mut completed_bad) = (0, 0);
    let mut records = BTreeSet::new();
    for rec in engine.records(&RecordFilter::default())? {
        let rec = rec?;
        let name = rec.key.key().to_string();
        let ran = executions.get(&name).map_or(&[][..], Vec::as_slice);
        match rec.state {
            State::Completed => {
                completed += 1;
                let want = body(&name, rec.fencing_token, &rec.reference).into_bytes();
                let got = rec.response.as_ref().map(|e| &e.body);
                if ran != [rec.fencing_token] || got != Some(&want) {
                    completed_bad += 1;
                    eprintln!(
                        "COMPLETED {name} (token {}) has executions {ran:?} and body {:?}",
                        rec.fencing_token,
                        got.map(|b| String::from_utf8_lossy(b))
                    );
                }
            }
            State::Unknown => {
                unknown += 1;
                if !ran.is_empty() {
                    executed_but_unknown += 1;
                }
            }
            State::Processing => {
                processing += 1;
                eprintln!("{name} is still PROCESSING after the leases ended and a sweep");
            }
            other => {
                completed_bad += 1;
                eprintln!("{name} is {other}, which this test never asks for");
            }
        }
        records.insert(name);
    }
    let stats = engine.stats()?;
    processing = processing.max(stats.processing);

    let double: Vec<_> = executions.iter().filter(|(_, t)| t.len() > 1).collect();
    for (k, t) in double.iter().take(20) {
        eprintln!("DOUBLE EXECUTION of {k}: tokens {t:?}");
    }
    let orphans: Vec<_> = executions
        .keys()
        .filter(|k| !records.contains(*k))
        .collect();
    for k in orphans.iter().take(20) {
        eprintln!("{k} was executed but has no record");
    }

    let mut lost = 0;
    for (name, bodies) in &acked {
        let b = bodies.iter().next().ok_or("empty ack set")?;
        if bodies.len() > 1 {
            lost += 1;
            eprintln!(
                "{name} was acknowledged with {} different bodies",
                bodies.len()
            );
            continue;
        }
        match engine.begin(&key(name)?, fingerprint(name)?)? {
            Begin::Replay(r) if &r.envelope.body == b => {}
            other => {
                lost += 1;
                eprintln!(
                    "LOST acknowledged {name} ({:?}): now {other:?}",
                    String::from_utf8_lossy(b)
                );
            }
        }
    }

    let sums = summed_stats(dir)?;
    let get = |k: &str| sums.get(k).copied().unwrap_or(0);
    Ok(Audit {
        kills,
        server_restarts: restarts,
        keys: records.len(),
        requests: get("requests"),
        claims: n_claims,
        completions_acknowledged: n_acked,
        executions: n_executions,
        completed,
        unknown,
        executed_but_unknown,
        replays: get("replays"),
        processing_answers: get("processing"),
        in_doubt_answers: get("unknown"),
        child_begin_errors: get("begin_errors"),
        child_complete_errors: get("complete_errors"),
        child_execute_errors: get("exec_errors"),
        double_executions: double.len(),
        double_claims: double_claims.len(),
        unclaimed_executions,
        lost_acknowledged: lost,
        completed_without_one_execution: completed_bad,
        executed_without_record: orphans.len(),
        processing_after_sweep: processing,
        child_violations: violations.len(),
        child_panics: panics.len(),
    })
}
