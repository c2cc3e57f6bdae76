//! Simulated power cuts on the redb store (database file + `<db>.journal`).
//! A SIGKILL leaves the page cache intact; a power cut also loses every
//! write no `fdatasync`/`fsync` covered yet, and every file creation no
//! sync of its directory covered. A child process runs under an
//! `LD_PRELOAD` library (`tests/powercut/shim.c`, built here with `cc`;
//! skipped without one, a failure under `CI=true`) that keeps an undo log
//! of every change under the database's directory and kills the child at
//! a chosen operation; the parent then undoes everything no sync covered
//! (`tests/powercut/undo.rs`) and reopens. Cuts are spread over frame
//! appends, journal syncs, file growth, checkpoints (redb commits), journal
//! restarts (anchors and headers), the open of a crashed database
//! (recovery), a new database's first open, the format-1 migration, the
//! journal outgrowing its file under load, and the closing checkpoint.
//! Guards against:
//!
//! - an acknowledged completion, claim, outbox message or entity
//!   transition that a power cut loses (a sync missing or in the wrong
//!   order: an answer given before its bytes were durable);
//! - a completion visible after the cut that the engine never made
//!   durable, or that was never asked for (see [`audit`] for the rule);
//! - a database or journal that a power cut leaves unopenable;
//! - a format-1 file that a cut during its migration damages.
//!
//! `IDEMPOTENCY_POWERCUT_CUTS=N` sets the number of cuts (default 45, one
//! run well under a minute); `IDEMPOTENCY_POWERCUT_KEEP=1` keeps a random
//! part of the unsynced writes (a disk that wrote back some of its cache)
//! instead of dropping them all; `IDEMPOTENCY_POWERCUT_SEED` the seed;
//! `PC_SYNC_US` the time a simulated sync takes (default 300 µs). For a
//! failure: `IDEMPOTENCY_POWERCUT_ONLY=<part of a target's label>`,
//! `IDEMPOTENCY_POWERCUT_VERBOSE=1` (one line per cut) and
//! `IDEMPOTENCY_POWERCUT_KEEP_LOG=<file>` (the last undo and acks logs).
//! The long run and its figures: docs/redb.md, "Power cuts".
#![cfg(target_os = "linux")]

#[path = "powercut/undo.rs"]
mod undo;

use std::collections::{BTreeMap, BTreeSet};
use std::error::Error;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use idempotency::{
    Begin, Engine, Envelope, ExpiryPolicy, Fingerprint, IdempotencyKey, OutgoingMessage,
    RecordFilter, State,
};

type Res<T> = Result<T, Box<dyn Error + Send + Sync>>;

const SHIM: &str = include_str!("powercut/shim.c");
const CHILD_VAR: &str = "IDEMPOTENCY_POWERCUT_CHILD";
const SCOPE: &str = "powercut";
const WORKERS: usize = 3;
const OPS: usize = 40;
const TRANSITIONS: usize = 30;
const BIG_BODY: usize = 128 << 10;
/// Generations (child runs, each cut) on one directory before a new one.
const CHAIN: u32 = 6;

/// The child's phases, as it tells the shim.
const P_OPEN: u32 = 1;
const P_MIGRATE: u32 = 2;
const P_WORK: u32 = 3;
const P_CLOSE: u32 = 4;

/// The shim's operation classes.
const C_APPEND: u32 = 0;
const C_JSYNC: u32 = 1;
const C_GROWTH: u32 = 2;
const C_DBWRITE: u32 = 3;
const C_DBSYNC: u32 = 4;
const C_RESTART: u32 = 5;
const ALL: u64 = 0xff;

fn bit(n: u32) -> u64 {
    1 << n
}

/// Where a cut is aimed, and on what directory.
#[derive(Clone, Copy)]
struct Target {
    label: &'static str,
    phases: u64,
    classes: u64,
    start: Start,
    /// One client thread sends 128 KiB bodies and no local writes run:
    /// the journal outgrows its first 4 MiB while frames are appended.
    big: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Start {
    /// The current chain's directory (crashed by the previous cut).
    Chain,
    /// A chain directory that has been crashed at least once.
    Crashed,
    /// An empty directory: a new database.
    Fresh,
    /// A copy of `tests/fixtures/format1.redb` (migrated at open).
    Fixture,
}

const TARGETS: [Target; 10] = [
    Target {
        label: "frame append",
        phases: 1 << P_WORK,
        classes: 1 << C_APPEND,
        start: Start::Chain,
        big: false,
    },
    Target {
        label: "journal sync",
        phases: 1 << P_WORK,
        classes: 1 << C_JSYNC,
        start: Start::Chain,
        big: false,
    },
    Target {
        label: "file growth",
        phases: (1 << P_OPEN) | (1 << P_WORK) | (1 << P_CLOSE),
        classes: 1 << C_GROWTH,
        start: Start::Fresh,
        big: false,
    },
    Target {
        label: "checkpoint (redb commit)",
        phases: (1 << P_WORK) | (1 << P_CLOSE),
        classes: (1 << C_DBWRITE) | (1 << C_DBSYNC),
        start: Start::Chain,
        big: false,
    },
    Target {
        label: "journal restart (anchor, header)",
        phases: (1 << P_OPEN) | (1 << P_WORK) | (1 << P_CLOSE),
        classes: 1 << C_RESTART,
        start: Start::Chain,
        big: false,
    },
    Target {
        label: "recovery at open",
        phases: 1 << P_OPEN,
        classes: ALL,
        start: Start::Crashed,
        big: false,
    },
    Target {
        label: "new database",
        phases: 1 << P_OPEN,
        classes: ALL,
        start: Start::Fresh,
        big: false,
    },
    Target {
        label: "format-1 migration",
        phases: 1 << P_MIGRATE,
        classes: ALL,
        start: Start::Fixture,
        big: false,
    },
    Target {
        label: "journal growth under load",
        phases: 1 << P_WORK,
        classes: 1 << C_GROWTH,
        start: Start::Fresh,
        big: true,
    },
    Target {
        label: "closing checkpoint",
        phases: 1 << P_CLOSE,
        classes: ALL,
        start: Start::Chain,
        big: false,
    },
];

fn key(name: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new(SCOPE, name)
}

fn fp(name: &str) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(format!(r#"{{"k":"{name}"}}"#).as_bytes(), &[])
}

/// A key's response: 128 KiB for the `big-` keys, else one line.
fn body(name: &str) -> Vec<u8> {
    let line = format!("the response of {name}").into_bytes();
    if name.starts_with("big-") {
        line.iter().copied().cycle().take(BIG_BODY).collect()
    } else {
        line
    }
}

fn builder() -> idempotency::EngineBuilder {
    Engine::builder()
        .lease(Duration::from_secs(3600))
        .ttl(Duration::from_secs(30 * 24 * 3600))
        .expiry_policy(ExpiryPolicy::Tombstone {
            keep: Duration::from_secs(10 * 24 * 3600),
        })
        .sweep_interval(None)
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/format1.redb")
}

// ---------------------------------------------------------------- child

/// Tells the shim the child's phase (it refuses the open).
fn phase(ctl: &str, p: u32) {
    let _ = File::open(format!("{ctl}phase-{p}"));
}

fn log_line(mut log: &File, line: &str) -> std::io::Result<()> {
    // One write per line (O_APPEND): lines never interleave. Not synced:
    // the cut is a SIGKILL, and this log stands for the clients' memory,
    // which a power cut of the server does not touch.
    log.write_all(format!("{line}\n").as_bytes())
}

#[test]
fn child_entry() -> Res<()> {
    if std::env::var(CHILD_VAR).is_err() {
        return Ok(());
    }
    let db = PathBuf::from(std::env::var("PC_DB")?);
    let ctl = std::env::var("PC_CTL")?;
    let gen: u32 = std::env::var("PC_GEN")?.parse()?;
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(std::env::var("PC_ACKS")?)?;
    let open_phase = if std::env::var("PC_MIGRATE").is_ok() {
        P_MIGRATE
    } else {
        P_OPEN
    };
    phase(&ctl, open_phase);
    let engine = builder().open(&db)?;
    phase(&ctl, P_WORK);
    std::thread::scope(|s| {
        for t in 0..WORKERS {
            let (engine, log) = (&engine, &log);
            s.spawn(move || worker(engine, log, gen, t));
        }
        let (engine, log) = (&engine, &log);
        s.spawn(move || transitions(engine, log, gen));
    });
    phase(&ctl, P_CLOSE);
    drop(engine);
    let mut out = std::io::stdout().lock();
    writeln!(out, "\nCHILD DONE")?;
    Ok(())
}

fn worker(engine: &Engine, log: &File, gen: u32, t: usize) -> Res<()> {
    let big = t == 2 && std::env::var("PC_BIG").is_ok();
    for n in 0..OPS {
        let name = if big {
            format!("big-g{gen}-t{t}-{n}")
        } else {
            format!("g{gen}-t{t}-{n}")
        };
        log_line(log, &format!("begin {name}"))?;
        let claim = match engine.begin(&key(&name)?, fp(&name)?) {
            Ok(Begin::Claimed(c)) => c,
            other => {
                log_line(log, &format!("odd {name} {other:?}"))?;
                continue;
            }
        };
        log_line(log, &format!("claimed {name} {}", claim.fencing_token()))?;
        // Every 8th completion of thread 0 is an app's local write: a
        // redb commit of its own, a checkpoint while the others append.
        if t == 0 && n % 8 == 4 && std::env::var("PC_NO_LOCAL").is_err() {
            log_line(log, &format!("try {name} 0"))?;
            let reply = body(&name);
            let done = engine.complete_local(claim, move |_tx| Ok(Envelope::new(1, 200, reply)));
            match done {
                Ok(()) => log_line(log, &format!("done {name}"))?,
                Err(e) => log_line(log, &format!("err {name} {e}"))?,
            }
            continue;
        }
        let with_message = n % 3 == 0;
        log_line(log, &format!("try {name} {}", u8::from(with_message)))?;
        let envelope = Envelope::new(1, 200, body(&name));
        let done = if with_message {
            let msg = OutgoingMessage::new("pc", name.clone().into_bytes());
            engine.complete_with_messages(claim, envelope, vec![msg])
        } else {
            engine.complete(claim, envelope)
        };
        match done {
            Ok(()) => log_line(log, &format!("done {name}"))?,
            Err(e) => log_line(log, &format!("err {name} {e}"))?,
        }
    }
    Ok(())
}

fn transitions(engine: &Engine, log: &File, gen: u32) -> Res<()> {
    let entity = format!("ent-g{gen}");
    for n in 0..TRANSITIONS {
        let to = format!("s{n}");
        let from = if n == 0 {
            Vec::new()
        } else {
            vec![format!("s{}", n - 1)]
        };
        let from: Vec<&str> = from.iter().map(String::as_str).collect();
        log_line(log, &format!("ttry {entity} {to}"))?;
        match engine.transition(&entity, &from, &to) {
            Ok(idempotency::Transition::Applied { .. }) => {
                log_line(log, &format!("tdone {entity} {to}"))?;
            }
            other => log_line(log, &format!("terr {entity} {to} {other:?}"))?,
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- parent

/// One directory the cuts are applied to, generation after generation.
struct Chain {
    dir: tempfile::TempDir,
    acks: PathBuf,
    gens: u32,
    fixture: bool,
    big: bool,
}

impl Chain {
    fn new(work: &Path, start: Start) -> Res<Chain> {
        let dir = tempfile::tempdir_in(work)?;
        let acks = dir.path().with_extension("acks");
        if start == Start::Fixture {
            std::fs::copy(fixture(), dir.path().join("db.redb"))?;
        }
        Ok(Chain {
            dir,
            acks,
            gens: 0,
            fixture: start == Start::Fixture,
            big: false,
        })
    }

    fn db(&self) -> PathBuf {
        self.dir.path().join("db.redb")
    }
}

struct Env {
    shim: PathBuf,
    /// Extra variables for the child's shim (the control test's).
    shim_env: Vec<(&'static str, &'static str)>,
    work: tempfile::TempDir,
    keep: bool,
    coin: undo::Coin,
    /// The fixture's records and outbox after a migration without cuts.
    fixture_records: Vec<String>,
    fixture_outbox: Vec<String>,
}

/// What one child run did.
struct Run {
    cut: Option<(u32, u32)>,
    counts: BTreeMap<(u32, u32), u64>,
    rolled: undo::Rolled,
}

fn run_child(env: &mut Env, chain: &mut Chain, target: Option<(&Target, u64)>) -> Res<Run> {
    chain.gens += 1;
    let undo_log = env.work.path().join("undo.log");
    let counts = env.work.path().join("counts");
    let _ = std::fs::remove_file(&undo_log);
    let _ = std::fs::remove_file(&counts);
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args([
        "--exact", // `<file>::child_entry` where this file is a module of a test binary.
        concat!(module_path!(), "::child_entry")
            .split_once("::")
            .map_or("child_entry", |(_, t)| t),
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_VAR, "1")
    .env("PC_DB", chain.db())
    .env("PC_GEN", chain.gens.to_string())
    .env("PC_ACKS", &chain.acks)
    .env("PC_DIR", chain.dir.path())
    .env("PC_UNDO", &undo_log)
    .env("PC_CTL", env.work.path().join("ctl-"))
    .env("PC_COUNTS", &counts)
    .env("LD_PRELOAD", &env.shim)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    if chain.fixture && chain.gens == 1 {
        cmd.env("PC_MIGRATE", "1");
    }
    if env.keep {
        cmd.env("PC_KEEP_NEW", "1");
    }
    if chain.big {
        cmd.env("PC_BIG", "1").env("PC_NO_LOCAL", "1");
    }
    cmd.envs(env.shim_env.iter().copied());
    if let Some((t, at)) = target {
        cmd.env("PC_CUT_PHASES", t.phases.to_string())
            .env("PC_CUT_CLASSES", t.classes.to_string())
            .env("PC_CUT_AT", at.to_string());
    }
    let mut child = cmd.spawn()?;
    let started = Instant::now();
    while child.try_wait()?.is_none() {
        if started.elapsed() > Duration::from_secs(120) {
            child.kill()?;
            let out = child.wait_with_output()?;
            return Err(format!("the child hung\n{}", String::from_utf8_lossy(&out.stdout)).into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = child.wait_with_output()?;
    let log = undo::read_log(&undo_log)?;
    // For debugging a failure: the last run's undo log and acks log.
    if let Ok(keep) = std::env::var("IDEMPOTENCY_POWERCUT_KEEP_LOG") {
        std::fs::copy(&undo_log, &keep)?;
        std::fs::copy(&chain.acks, format!("{keep}.acks"))?;
    }
    let cut = undo::cut_of(&log);
    let stdout = String::from_utf8_lossy(&out.stdout);
    if cut.is_none() && !(out.status.success() && stdout.contains("CHILD DONE")) {
        return Err(format!(
            "the child failed without a cut: {:?}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    let rolled = undo::power_cut(chain.dir.path(), &log, env.keep.then_some(&mut env.coin))?;
    let mut counted = BTreeMap::new();
    if let Ok(text) = std::fs::read_to_string(&counts) {
        for line in text.lines() {
            let v: Vec<u64> = line.split(' ').map(str::parse).collect::<Result<_, _>>()?;
            if let [p, c, n] = v.as_slice() {
                counted.insert((u32::try_from(*p)?, u32::try_from(*c)?), *n);
            }
        }
    }
    Ok(Run {
        cut,
        counts: counted,
        rolled,
    })
}

/// What the audit found after one cut.
#[derive(Default)]
struct Found {
    acked: usize,
    lost: Vec<String>,
    phantom: Vec<String>,
    refused: Option<String>,
    /// Completions visible although their answer never reached the
    /// client: durable before the cut, unheard (allowed, see `audit`).
    in_flight_visible: usize,
}

/// What the clients were told, read from the chain's acks log.
#[derive(Default)]
struct Acks {
    begun: BTreeSet<String>,
    claimed: BTreeSet<String>,
    /// Fencing tokens acknowledged, with the key they went to.
    tokens: Vec<(u64, String)>,
    tried: BTreeMap<String, bool>,
    done: BTreeSet<String>,
    failed: BTreeSet<String>,
    /// entity → (states tried in order, states acknowledged)
    entities: BTreeMap<String, (Vec<String>, BTreeSet<String>)>,
    odd: Vec<String>,
}

fn read_acks(path: &Path) -> Res<Acks> {
    let mut a = Acks::default();
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e.into()),
    };
    // A line the kill cut short (no newline) is the last one: the client
    // never finished recording that answer. (Each line is one `write`, so
    // none is expected.)
    for line in text.split_inclusive('\n') {
        let Some(line) = line.strip_suffix('\n') else {
            continue;
        };
        let w: Vec<&str> = line.splitn(4, ' ').collect();
        match w.as_slice() {
            ["begin", n] => {
                a.begun.insert(n.to_string());
            }
            ["claimed", n, token] => {
                a.claimed.insert(n.to_string());
                a.tokens.push((token.parse()?, n.to_string()));
            }
            ["try", n, m] => {
                a.tried.insert(n.to_string(), *m == "1");
            }
            ["done", n] => {
                a.done.insert(n.to_string());
            }
            ["err", n, ..] => {
                a.failed.insert(n.to_string());
            }
            ["ttry", e, s] => a
                .entities
                .entry(e.to_string())
                .or_default()
                .0
                .push(s.to_string()),
            ["tdone", e, s] => {
                a.entities
                    .entry(e.to_string())
                    .or_default()
                    .1
                    .insert(s.to_string());
            }
            _ => a.odd.push(line.to_string()),
        }
    }
    Ok(a)
}

/// Reopens a copy of the chain's directory (so the next generation still
/// finds the state the cut left, and recovers it under the shim) and
/// checks it against what the clients were told:
///
/// - **lost** (must be 0): a completion acknowledged ("done") that does not
///   replay its exact bytes; an acknowledged claim that can be claimed
///   again; an acknowledged completion's outbox message missing; an
///   entity behind its last acknowledged transition; a fencing token
///   acknowledged twice.
/// - **phantom** (must be 0): a record the clients never asked for, or in
///   a state they never asked for; a COMPLETED record whose completion was
///   never sent or was answered with an error, or whose bytes are not the
///   ones sent; an outbox message without its completion; an entity in a
///   state never asked for.
///
/// A completion that was sent but whose answer never arrived (the cut came
/// between its frame's sync and the answer, or the answer was on its way)
/// may be visible: its bytes were durable, and the client, not having an
/// answer, retries and gets the replay. Visibility cannot prove that the
/// engine made it durable, but the rollback can: everything no sync
/// covered is gone from the files, so whatever the reopened engine shows
/// was read from synced bytes. What must never show is a completion not
/// sent, one refused, or bytes other than the ones sent; with every
/// unsynced write dropped, a completion that was not made durable cannot
/// show up unless the engine invents it (e.g. from a frame it should
/// have found torn). Each client thread has at most one request in flight,
/// so at most one such completion per thread.
fn audit(env: &Env, chain: &Chain) -> Res<Found> {
    let acks = read_acks(&chain.acks)?;
    let mut found = Found {
        acked: acks.done.len(),
        ..Found::default()
    };
    found
        .phantom
        .extend(acks.odd.iter().map(|l| format!("odd line: {l}")));
    let copy = tempfile::tempdir_in(env.work.path())?;
    for entry in std::fs::read_dir(chain.dir.path())? {
        let entry = entry?;
        std::fs::copy(entry.path(), copy.path().join(entry.file_name()))?;
    }
    let db = copy.path().join("db.redb");
    if !db.exists() {
        // The cut came before the new database's name was durable; nothing
        // can have been acknowledged.
        if !acks.done.is_empty() || !acks.claimed.is_empty() {
            found.lost.push("the database file is gone".into());
        }
        return Ok(found);
    }
    let engine = match builder().open(&db) {
        Ok(e) => e,
        Err(e) => {
            found.refused = Some(e.to_string());
            return Ok(found);
        }
    };
    for name in &acks.done {
        match engine.begin(&key(name)?, fp(name)?)? {
            Begin::Replay(r) if r.envelope.body == body(name) => {}
            other => found
                .lost
                .push(format!("acknowledged {name} answers {other:?}")),
        }
    }
    for name in acks.claimed.difference(&acks.done) {
        if let Begin::Claimed(c) = engine.begin(&key(name)?, fp(name)?)? {
            found.lost.push(format!(
                "acknowledged claim {name} claimed again (token {})",
                c.fencing_token()
            ));
        }
    }
    let filter = RecordFilter {
        scope: Some(SCOPE.into()),
        ..RecordFilter::default()
    };
    for info in engine.records(&filter)? {
        let info = info?;
        let name = info.key.key().to_string();
        if !acks.begun.contains(&name) {
            found
                .phantom
                .push(format!("{name}: {:?}, never asked for", info.state));
            continue;
        }
        match info.state {
            State::Completed => {}
            State::Processing | State::Unknown => continue,
            other => {
                found
                    .phantom
                    .push(format!("{name}: {other:?}, a state never asked for"));
                continue;
            }
        }
        if !acks.tried.contains_key(&name) || acks.failed.contains(&name) {
            found
                .phantom
                .push(format!("{name}: COMPLETED, never sent or refused"));
        } else if !acks.done.contains(&name) {
            found.in_flight_visible += 1;
            match engine.begin(&key(&name)?, fp(&name)?)? {
                Begin::Replay(r) if r.envelope.body == body(&name) => {}
                other => found
                    .phantom
                    .push(format!("{name}: in flight, answers {other:?}")),
            }
        }
    }
    // A fencing token handed out twice (the counter went back after a
    // cut) would let two holders of one key pass the fence.
    let mut tokens = acks.tokens.clone();
    tokens.sort();
    for pair in tokens.windows(2) {
        if pair[0].0 == pair[1].0 {
            found.lost.push(format!(
                "fencing token {} acknowledged twice: {} and {}",
                pair[0].0, pair[0].1, pair[1].1
            ));
        }
    }
    let outbox = engine.outbox().take(1_000_000)?;
    let mut messages = BTreeSet::new();
    for m in &outbox {
        if m.topic != "pc" {
            continue;
        }
        let name = String::from_utf8_lossy(&m.payload).to_string();
        let completed = engine
            .record(&key(&name)?)?
            .is_some_and(|i| i.state == State::Completed);
        if acks.tried.get(&name) != Some(&true) || !completed {
            found
                .phantom
                .push(format!("outbox message of {name} without its completion"));
        }
        messages.insert(name);
    }
    for (name, with_message) in &acks.tried {
        if *with_message && acks.done.contains(name) && !messages.contains(name) {
            found
                .lost
                .push(format!("{name}: acknowledged, its outbox message is gone"));
        }
    }
    for (entity, (tried, done)) in &acks.entities {
        let state = engine.entity_state(entity)?.map(|(s, _)| s);
        let last_done = tried.iter().rposition(|s| done.contains(s));
        let position = state
            .as_ref()
            .and_then(|s| tried.iter().position(|t| t == s));
        // The last acknowledged state, or the one after it (in flight).
        let (ok, behind) = match (position, last_done) {
            (None, None) => (state.is_none(), false),
            (Some(p), None) => (p == 0, false),
            (Some(p), Some(d)) => (p == d || p == d + 1, p < d),
            (None, Some(_)) => (false, state.is_none()),
        };
        if ok {
            continue;
        }
        let what = format!("{entity}: {state:?} after {tried:?} (acknowledged {done:?})");
        if behind {
            found.lost.push(what);
        } else {
            found.phantom.push(what);
        }
    }
    if chain.fixture {
        let (records, outbox) = fixture_view(&engine)?;
        if records != env.fixture_records {
            found.lost.push(format!(
                "the fixture's records changed: {records:#?} vs {:#?}",
                env.fixture_records
            ));
        }
        for m in &env.fixture_outbox {
            if !outbox.contains(m) {
                found.lost.push(format!("the fixture's outbox lost {m}"));
            }
        }
    }
    let report = engine.verify()?;
    if !report.is_sound() {
        found.refused = Some(format!("verify: {report:?}"));
    }
    Ok(found)
}

/// The fixture's records (scope `shop:pay`, as stored) and outbox.
fn fixture_view(engine: &Engine) -> Res<(Vec<String>, Vec<String>)> {
    let filter = RecordFilter {
        scope: Some("shop:pay".into()),
        ..RecordFilter::default()
    };
    let mut records = Vec::new();
    for info in engine.records(&filter)? {
        records.push(format!("{:?}", info?));
    }
    let outbox = engine
        .outbox()
        .take(1_000_000)?
        .into_iter()
        .filter(|m| m.topic != "pc")
        .map(|m| format!("{} {} {:?}", m.id, m.topic, m.payload))
        .collect();
    Ok((records, outbox))
}

/// Builds the shim in `dir`; `None` without a C compiler.
fn build_shim(dir: &Path) -> Option<PathBuf> {
    let src = dir.join("powercut.c");
    let lib = dir.join("powercut.so");
    std::fs::write(&src, SHIM).ok()?;
    let ok = Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-Wall", "-o"])
        .arg(&lib)
        .arg(&src)
        .arg("-ldl")
        .arg("-lpthread")
        .status()
        .ok()?
        .success();
    ok.then_some(lib)
}

/// Per target: cuts, cuts that hit it, acknowledged completions checked,
/// lost, phantom, refusals, in-flight completions visible.
#[derive(Default)]
struct Tally {
    cuts: usize,
    acked: usize,
    lost: usize,
    phantom: usize,
    refused: usize,
    in_flight: usize,
    undone: usize,
    /// Keep mode: cuts after which a later write of a file survived an
    /// earlier one that was lost.
    reordered: usize,
    removed: usize,
}

fn sum(counts: &BTreeMap<(u32, u32), u64>, t: &Target) -> u64 {
    counts
        .iter()
        .filter(|((p, c), _)| t.phases & bit(*p) != 0 && t.classes & bit(*c) != 0)
        .map(|(_, n)| *n)
        .sum()
}

/// The power-cut library built in `dir`, or `None` (the test is skipped)
/// without a C compiler. Panics under `CI=true`, where the test must run.
fn shim_or_skip(dir: &Path) -> Option<PathBuf> {
    let shim = build_shim(dir);
    if shim.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "no C compiler to build the power-cut library, and CI=true: this test must run in CI"
        );
        eprintln!("skipped: no C compiler to build the power-cut library");
    }
    shim
}

#[test]
fn power_cuts_lose_no_acknowledged_write_and_show_no_phantom() -> Res<()> {
    let tools = tempfile::tempdir()?;
    let Some(shim) = shim_or_skip(tools.path()) else {
        return Ok(());
    };
    let cuts: usize = match std::env::var("IDEMPOTENCY_POWERCUT_CUTS") {
        Ok(v) => v.parse()?,
        Err(_) => 45,
    };
    let seed: u64 = match std::env::var("IDEMPOTENCY_POWERCUT_SEED") {
        Ok(v) => v.parse()?,
        Err(_) => 0x9e37_79b9_7f4a_7c15,
    };
    let mut env = Env {
        shim,
        shim_env: Vec::new(),
        work: tempfile::tempdir()?,
        keep: std::env::var("IDEMPOTENCY_POWERCUT_KEEP").is_ok_and(|v| v == "1"),
        coin: undo::Coin(seed | 1),
        fixture_records: Vec::new(),
        fixture_outbox: Vec::new(),
    };
    // The fixture as a migration without cuts leaves it.
    {
        let copy = tempfile::tempdir()?;
        let db = copy.path().join("db.redb");
        std::fs::copy(fixture(), &db)?;
        let engine = builder().open(&db)?;
        (env.fixture_records, env.fixture_outbox) = fixture_view(&engine)?;
        assert!(!env.fixture_records.is_empty(), "the fixture has records");
    }
    // Calibration, without cuts: how many operations of each phase and
    // class a run does on a new database, a crashed one and the fixture.
    let mut calibration: BTreeMap<&str, BTreeMap<(u32, u32), u64>> = BTreeMap::new();
    {
        let mut big = Chain::new(env.work.path(), Start::Fresh)?;
        big.big = true;
        calibration.insert("big", run_child(&mut env, &mut big, None)?.counts);
        let mut fresh = Chain::new(env.work.path(), Start::Fresh)?;
        calibration.insert("fresh", run_child(&mut env, &mut fresh, None)?.counts);
        let crash = Target {
            label: "",
            phases: bit(P_WORK),
            classes: bit(C_JSYNC),
            start: Start::Chain,
            big: false,
        };
        run_child(&mut env, &mut fresh, Some((&crash, 40)))?;
        calibration.insert("crashed", run_child(&mut env, &mut fresh, None)?.counts);
        let mut fix = Chain::new(env.work.path(), Start::Fixture)?;
        calibration.insert("fixture", run_child(&mut env, &mut fix, None)?.counts);
    }
    for (name, counts) in &calibration {
        let nonzero: Vec<String> = counts
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|((p, c), n)| format!("p{p}/c{c}:{n}"))
            .collect();
        println!("calibration, {name}: {}", nonzero.join(" "));
    }
    let mut tally: BTreeMap<&str, Tally> = BTreeMap::new();
    let mut failures: Vec<String> = Vec::new();
    let mut chain = Chain::new(env.work.path(), Start::Fresh)?;
    let mut uncut = 0;
    let only = std::env::var("IDEMPOTENCY_POWERCUT_ONLY").ok();
    let started = Instant::now();
    let mut done = 0;
    let mut i = 0;
    while done < cuts {
        let target = TARGETS[i % TARGETS.len()];
        i += 1;
        if only
            .as_ref()
            .is_some_and(|o| !target.label.contains(o.as_str()))
        {
            continue;
        }
        let basis = match target.start {
            Start::Fresh if target.big => "big",
            Start::Fresh => "fresh",
            Start::Fixture => "fixture",
            Start::Chain | Start::Crashed => "crashed",
        };
        let max = sum(&calibration[basis], &target).max(1);
        if (target.start != Start::Chain && target.start != Start::Crashed) || chain.gens >= CHAIN {
            chain = Chain::new(env.work.path(), target.start)?;
        }
        if target.start == Start::Crashed {
            // A cut in the work phase to recover from (frames to apply),
            // counted with its own target: a frame append, a journal sync
            // or a checkpoint, in turn.
            let first = TARGETS[[0, 1, 3][i / TARGETS.len() % 3]];
            let at = 1 + env.coin.next() % sum(&calibration["crashed"], &first).max(1);
            record(
                &mut env,
                &mut chain,
                &first,
                at,
                &mut tally,
                &mut failures,
                &mut done,
            )?;
        }
        // Aim within the calibrated count; a run that ends before (runs
        // vary: a recovery with nothing to apply does less) is audited
        // too, and the target is tried again, lower.
        let mut at = 1 + env.coin.next() % max;
        while !record(
            &mut env,
            &mut chain,
            &target,
            at,
            &mut tally,
            &mut failures,
            &mut done,
        )? {
            uncut += 1;
            if at == 1 || uncut > 10 * cuts + 50 {
                break;
            }
            at = 1 + env.coin.next() % (at / 2).max(1);
            // A new database again, where the target's operations happen.
            if matches!(target.start, Start::Fresh | Start::Fixture) {
                chain = Chain::new(env.work.path(), target.start)?;
                chain.big = target.big;
            }
        }
        if uncut > 10 * cuts + 50 {
            return Err(format!("{uncut} runs ended before their cut").into());
        }
    }
    println!(
        "power cuts: {done} in {:.1} s ({uncut} runs ended before their cut, audited too), \
         mode: {}",
        started.elapsed().as_secs_f64(),
        if env.keep {
            "a random part of unsynced writes kept"
        } else {
            "every unsynced write dropped"
        }
    );
    println!(
        "{:<34} {:>5} {:>8} {:>5} {:>8} {:>8} {:>9} {:>8} {:>8} {:>10}",
        "cut at",
        "cuts",
        "checked",
        "lost",
        "phantom",
        "refused",
        "inflight",
        "undone",
        "removed",
        "reordered"
    );
    let mut total = Tally::default();
    for (label, t) in &tally {
        println!(
            "{label:<34} {:>5} {:>8} {:>5} {:>8} {:>8} {:>9} {:>8} {:>8} {:>10}",
            t.cuts,
            t.acked,
            t.lost,
            t.phantom,
            t.refused,
            t.in_flight,
            t.undone,
            t.removed,
            t.reordered
        );
        total.cuts += t.cuts;
        total.acked += t.acked;
        total.lost += t.lost;
        total.phantom += t.phantom;
        total.refused += t.refused;
        total.in_flight += t.in_flight;
        total.undone += t.undone;
        total.removed += t.removed;
        total.reordered += t.reordered;
    }
    let t = total;
    println!(
        "{:<34} {:>5} {:>8} {:>5} {:>8} {:>8} {:>9} {:>8} {:>8} {:>10}",
        "total",
        t.cuts,
        t.acked,
        t.lost,
        t.phantom,
        t.refused,
        t.in_flight,
        t.undone,
        t.removed,
        t.reordered
    );
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
    Ok(())
}

/// Runs one generation aimed at `target`, rolls it back, audits it.
/// Returns whether the cut happened.
fn record(
    env: &mut Env,
    chain: &mut Chain,
    target: &Target,
    at: u64,
    tally: &mut BTreeMap<&'static str, Tally>,
    failures: &mut Vec<String>,
    done: &mut usize,
) -> Res<bool> {
    let gen = chain.gens + 1;
    let run = run_child(env, chain, Some((target, at)))?;
    let found = audit(env, chain)?;
    if std::env::var("IDEMPOTENCY_POWERCUT_VERBOSE").is_ok() {
        println!(
            "{} #{at} gen {gen}: cut {:?}, undone {}, removed {:?}, lost {}, phantom {}",
            target.label,
            run.cut,
            run.rolled.writes_undone,
            run.rolled.creations_removed,
            found.lost.len(),
            found.phantom.len()
        );
    }
    let entry = tally.entry(target.label).or_default();
    let cut = run.cut.is_some();
    if cut {
        entry.cuts += 1;
        *done += 1;
    }
    entry.acked += found.acked;
    entry.lost += found.lost.len();
    entry.phantom += found.phantom.len();
    entry.refused += usize::from(found.refused.is_some());
    entry.in_flight += found.in_flight_visible;
    entry.undone += run.rolled.writes_undone;
    entry.reordered += usize::from(run.rolled.reordered);
    entry.removed += run.rolled.creations_removed.len();
    let where_ = format!(
        "cut aimed at {} #{at} (gen {gen}{}, hit {:?})",
        target.label,
        if chain.fixture { ", fixture" } else { "" },
        run.cut
    );
    for l in found.lost.iter().chain(&found.phantom) {
        failures.push(format!("{where_}: {l}"));
    }
    if let Some(r) = &found.refused {
        failures.push(format!("{where_}: refused: {r}"));
    }
    Ok(cut)
}

/// The control: the same run, but the journal's syncs cover nothing (as if
/// the engine answered before syncing its frames). The audit must find
/// acknowledged completions lost; if it does not, it could not see a bug.
#[test]
fn the_audit_catches_an_engine_that_answers_before_its_sync() -> Res<()> {
    let tools = tempfile::tempdir()?;
    let Some(shim) = shim_or_skip(tools.path()) else {
        return Ok(());
    };
    let mut env = Env {
        shim,
        shim_env: vec![("PC_DROP_SYNCS", ".journal"), ("PC_NO_LOCAL", "1")],
        work: tempfile::tempdir()?,
        keep: false,
        coin: undo::Coin(7),
        fixture_records: Vec::new(),
        fixture_outbox: Vec::new(),
    };
    let mut chain = Chain::new(env.work.path(), Start::Fresh)?;
    // The journal's header and anchor (written at open) are durable; its
    // frames are not, and without local writes no checkpoint runs before
    // the close: every completion acknowledged before the cut is lost.
    let target = Target {
        label: "control",
        phases: bit(P_WORK),
        classes: bit(C_APPEND),
        start: Start::Fresh,
        big: false,
    };
    let run = run_child(&mut env, &mut chain, Some((&target, 100)))?;
    assert!(run.cut.is_some(), "the control run was not cut");
    let found = audit(&env, &chain)?;
    assert!(
        !found.lost.is_empty(),
        "a journal never synced lost nothing: the audit cannot see a missing sync \
         ({} acknowledged, {} writes undone)",
        found.acked,
        run.rolled.writes_undone
    );
    println!(
        "control: {} of {} acknowledged completions lost (expected), first: {:?}",
        found.lost.len(),
        found.acked,
        found.lost.first()
    );
    Ok(())
}
