//! Guards against a crash between the external calls of a multi-step
//! operation charging a card twice, sending a receipt twice, losing an
//! acknowledged payment, or leaving a key that only an operator can settle
//! (issue 22). Real SIGKILLs, on redb and on PostgreSQL.
//!
//! A child process (this test binary re-invoked with
//! `IDEM_STEP_KILLS_ROLE` set, running only `child_entry`) runs payments on
//! fresh keys from 3 threads: `begin` → `effect("charge")` → provider A
//! called with the step's reference → `confirm` → `effect("receipt")` (on
//! the claim's `Effects` handle) → provider B → `confirm` → `complete`.
//! A provider is a ledger file the test owns: each call appends one line
//! (`call <reference> <key> end`, one `write`), so every call that reached
//! the provider is visible, and its answer (the evidence) is a function of
//! the reference, so the provider is idempotent by reference. Two rounds in
//! three stop one thread at a chosen point ([`Point`]: claimed but no step
//! yet, charge reserved but not called, charged but not confirmed, between
//! the two calls, receipt reserved, receipted but not confirmed, after the
//! receipt but before `complete`, completed but not acknowledged): it says
//! so on stdout and the parent SIGKILLs the child at once, while the other
//! threads are wherever they are (random points). Every third round is
//! killed after a random 2-80 ms instead.
//!
//! After each kill the parent reopens the store with a clock past the dead
//! claims' leases and a resolver that answers from the ledgers
//! (`resolve_step`: executed with the provider's answer if the reference is
//! in the ledger, not executed otherwise; the receipt through a per-step
//! `step_resolver`, the charge through `Resolver::resolve_step`), then:
//! 1. with the providers down (every question answered "still unknown"),
//!    retries every key the child started: a key with an unsettled step
//!    must never be handed out as `Claimed`, and such a step must show the
//!    resolver's attempts;
//! 2. with the providers up, retries every key until it replays: a resumed
//!    claim skips its confirmed steps and calls a provider again only for a
//!    step settled "not executed" (under the same reference); half the keys
//!    let the resolver complete from the steps' evidence
//!    (`complete_from_steps`) instead of resuming;
//! 3. audits them.
//!
//! The audit, per backend, over every key any child started:
//! - **double execution**: a provider call for a (key, step) that already
//!   had a call recorded in that provider's ledger, whatever its reference.
//!   The provider would dedupe a repeated reference, but every call that
//!   reached it counts, so a second call after a confirmed one (or after
//!   one the resolver reported executed) is a double. With the step
//!   reference stable across claims, a correct run has exactly one call per
//!   (key, step). Must be 0.
//! - **lost**: a key the child acknowledged as completed (or that the
//!   retries settled) that does not replay the response built from its two
//!   ledger answers, or lacks exactly one charge and one receipt, or whose
//!   stored steps do not carry those references and answers. Must be 0.
//! - **settled**: keys that reached a replay through retries and the
//!   resolver alone (no `Engine::resolve`, no operator entry in any key's
//!   history), once the providers answer. Must be 100%.
//!
//! At the end every key is checked again on a fresh engine, nothing is in
//! doubt, and `verify` finds the store sound.
//!
//! 24 kills per backend by default (each point twice, 8 random).
//! `IDEMPOTENCY_STEP_KILLS=1000` for the long run (see
//! docs/development.md); `IDEMPOTENCY_STEP_KILLS_SEED` replays the plan
//! and delays of an earlier run (thread scheduling is not replayed). The
//! PostgreSQL half runs under `scripts/with-postgres` and is skipped with a
//! message without a server, except under `CI=true`, where that fails.
//! Run with `--nocapture` to see the summary lines. Unix only.
#![cfg(unix)]

#[path = "common/kill_child.rs"]
mod kill_child;
#[path = "common/pg_chaos.rs"]
mod pg_chaos;
#[path = "common/split_mix.rs"]
mod split_mix;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::error::Error;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use idempotency::{
    Actor, Begin, EffectStep, Engine, Envelope, Fingerprint, IdempotencyKey, InDoubt, InDoubtStep,
    ManualClock, Resolution, Resolver, StepInfo, StepResolution, StepState, MAX_HISTORY_ENTRIES,
};
use split_mix::SplitMix64;

type TestResult<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

const ROLE_VAR: &str = "IDEM_STEP_KILLS_ROLE";
const STORE_VAR: &str = "IDEM_STEP_KILLS_STORE";
const DIR_VAR: &str = "IDEM_STEP_KILLS_DIR";
const ROUND_VAR: &str = "IDEM_STEP_KILLS_ROUND";
const PLAN_VAR: &str = "IDEM_STEP_KILLS_PLAN";
const NOW_VAR: &str = "IDEM_STEP_KILLS_NOW_MS";
const KILLS_VAR: &str = "IDEMPOTENCY_STEP_KILLS";
const SEED_VAR: &str = "IDEMPOTENCY_STEP_KILLS_SEED";

const DEFAULT_KILLS: u64 = 24;
const CHILD_THREADS: u64 = 3;
const PARENT_THREADS: usize = 4;
const SCOPE: &str = "tenant-1:step-kills";
const CHARGE: &str = "charge";
const RECEIPT: &str = "receipt";
const READY: &str = "STEP-KILLS CHILD READY";
const AT: &str = "STEP-KILLS AT ";
/// Every claim's lease, on the test's manual clocks.
const LEASE: Duration = Duration::from_secs(3600);
/// Round `r`'s child reads `BASE_MS + r * ROUND_SPAN_MS` on its clock; the
/// parent reopens one lease and a minute later, so every claim the child
/// left behind has its lease ended, and the next round starts later still.
const BASE_MS: u64 = 1_800_000_000_000;
const ROUND_SPAN_MS: u64 = 3 * 3_600_000;
/// Long enough that no record expires during 1,000s of rounds.
const TTL: Duration = Duration::from_secs(20 * 365 * 86_400);
/// How often the parent retries one key with the providers up before it
/// counts the key as unsettled.
const SETTLE_TRIES: u32 = 4;
const READY_TIMEOUT: Duration = Duration::from_secs(60);
const POINT_TIMEOUT: Duration = Duration::from_secs(60);
/// A child still running after this long was forgotten by its parent.
const CHILD_LIMIT: Duration = Duration::from_secs(120);

/// Serializes the two backends' tests, so each runs alone on the machine.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

// ------------------------------------------------------------ the payment --

/// Where a child's chosen thread stops for the kill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Point {
    /// Claimed; no step reserved yet (before the charge).
    Begun,
    /// `effect("charge")` durable; provider A not called (before the charge).
    ChargeReserved,
    /// Provider A recorded the charge; `confirm` not called.
    Charged,
    /// The charge confirmed; `effect("receipt")` not called (between the calls).
    ChargeConfirmed,
    /// `effect("receipt")` durable; provider B not called (between the calls).
    ReceiptReserved,
    /// Provider B recorded the receipt; `confirm` not called.
    Receipted,
    /// The receipt confirmed; `complete` not called.
    ReceiptConfirmed,
    /// `complete` returned; the acknowledgement not written.
    Completed,
}

impl Point {
    const ALL: [Point; 8] = [
        Point::Begun,
        Point::ChargeReserved,
        Point::Charged,
        Point::ChargeConfirmed,
        Point::ReceiptReserved,
        Point::Receipted,
        Point::ReceiptConfirmed,
        Point::Completed,
    ];

    fn name(self) -> &'static str {
        match self {
            Point::Begun => "begun",
            Point::ChargeReserved => "charge-reserved",
            Point::Charged => "charged",
            Point::ChargeConfirmed => "charge-confirmed",
            Point::ReceiptReserved => "receipt-reserved",
            Point::Receipted => "receipted",
            Point::ReceiptConfirmed => "receipt-confirmed",
            Point::Completed => "completed",
        }
    }

    fn parse(s: &str) -> Option<Point> {
        Point::ALL.into_iter().find(|p| p.name() == s)
    }
}

/// What a round's child does: stop one thread at a point, or nothing
/// special (the parent kills at a random moment).
#[derive(Clone, Copy, Debug)]
enum Plan {
    /// Thread 0 stops at `point` of its payment number `after`.
    At {
        point: Point,
        after: u64,
    },
    Random {
        delay_ms: u64,
    },
}

impl Plan {
    /// Two rounds in three stop at a point (cycling through all of them),
    /// every third is killed at random.
    fn for_round(round: u64, rng: &mut SplitMix64) -> Plan {
        if round % 3 == 2 {
            Plan::Random {
                delay_ms: 2 + rng.below(79),
            }
        } else {
            let nth = round / 3 * 2 + round % 3;
            Plan::At {
                point: Point::ALL[(nth % 8) as usize],
                after: rng.below(3),
            }
        }
    }

    fn to_env(self) -> String {
        match self {
            Plan::At { point, after } => format!("at:{}:{after}", point.name()),
            Plan::Random { delay_ms } => format!("random:{delay_ms}"),
        }
    }

    fn from_env(s: &str) -> Option<Plan> {
        let mut f = s.split(':');
        match (f.next()?, f.next()?, f.next()) {
            ("at", p, Some(n)) => Some(Plan::At {
                point: Point::parse(p)?,
                after: n.parse().ok()?,
            }),
            ("random", d, None) => Some(Plan::Random {
                delay_ms: d.parse().ok()?,
            }),
            _ => None,
        }
    }
}

fn key(name: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new(SCOPE, name)
}

fn fingerprint(name: &str) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(
        format!(r#"{{"op":"pay","key":"{name}","amount":1250}}"#).as_bytes(),
        &[],
    )
}

/// A provider's answer to a call with `reference`: the same bytes for the
/// same reference, every time.
fn evidence(provider: &str, reference: &str) -> Vec<u8> {
    format!("{provider} ok {reference}").into_bytes()
}

/// The response of a payment, built from its two steps' evidence.
fn response(name: &str, charge: &[u8], receipt: &[u8]) -> Envelope {
    Envelope::new(
        1,
        201,
        format!(
            r#"{{"paid":"{name}","charge":"{}","receipt":"{}"}}"#,
            String::from_utf8_lossy(charge),
            String::from_utf8_lossy(receipt)
        ),
    )
}

/// Whether the resolver completes `name` from its steps' evidence (half
/// the keys) rather than letting the next `begin` resume it.
fn completes_from_steps(name: &str) -> bool {
    name.bytes()
        .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)))
        % 2
        == 1
}

fn unsettled(state: &StepState) -> bool {
    matches!(state, StepState::Reserved | StepState::Unknown)
}

/// What one attempt at a payment came to.
enum Paid {
    /// Claimed and completed now; `resumed` if the claim carried steps of
    /// an earlier attempt.
    Now { resumed: bool },
    /// The key had completed (the audit checks its response).
    Replayed,
    /// Not settled yet (processing or in doubt): why.
    Held(String),
}

/// One attempt at paying `name`: the handler the child and the parent's
/// retries share. `hook` is called at each [`Point`].
fn pay(
    engine: &Engine,
    providers: &Providers,
    name: &str,
    hook: &dyn Fn(Point),
) -> TestResult<Paid> {
    let claim = match engine.begin(&key(name)?, fingerprint(name)?)? {
        Begin::Claimed(c) => c,
        Begin::Replay(_) => return Ok(Paid::Replayed),
        Begin::Processing { retry_after } => {
            return Ok(Paid::Held(format!(
                "processing, retry after {retry_after:?}"
            )))
        }
        Begin::InDoubt(d) => {
            return Ok(Paid::Held(format!(
                "in doubt ({}), steps {:?}",
                d.reason,
                d.steps
                    .iter()
                    .map(|s| (s.name.as_str(), &s.state, s.attempts))
                    .collect::<Vec<_>>()
            )))
        }
        other => return Err(format!("{name}: unexpected {other:?}").into()),
    };
    if let Some(s) = claim.steps().iter().find(|s| unsettled(&s.state)) {
        return Err(format!(
            "{name}: handed out Claimed while step {} is {:?}",
            s.name, s.state
        )
        .into());
    }
    let resumed = !claim.steps().is_empty();
    hook(Point::Begun);
    let charge = match claim.effect(CHARGE)? {
        EffectStep::Run { reference } => {
            hook(Point::ChargeReserved);
            let answer = providers.charge.call(&reference, name)?;
            hook(Point::Charged);
            claim.confirm(CHARGE, &answer)?;
            answer
        }
        EffectStep::Confirmed { evidence, .. } => evidence,
        EffectStep::Failed { reference, .. } => {
            return Err(format!("{name}: charge {reference} failed; no provider says no").into())
        }
    };
    hook(Point::ChargeConfirmed);
    let effects = claim.effects();
    let receipt = match effects.effect(RECEIPT)? {
        EffectStep::Run { reference } => {
            hook(Point::ReceiptReserved);
            let answer = providers.receipt.call(&reference, name)?;
            hook(Point::Receipted);
            effects.confirm(RECEIPT, &answer)?;
            answer
        }
        EffectStep::Confirmed { evidence, .. } => evidence,
        EffectStep::Failed { reference, .. } => {
            return Err(format!("{name}: receipt {reference} failed; no provider says no").into())
        }
    };
    hook(Point::ReceiptConfirmed);
    engine.complete(claim, response(name, &charge, &receipt))?;
    hook(Point::Completed);
    Ok(Paid::Now { resumed })
}

// -------------------------------------------------------------- providers --

/// One simulated provider: an append-only ledger file, one line per call
/// that reached it. Children append; the parent also indexes it.
struct Ledger {
    provider: &'static str,
    path: PathBuf,
    file: File,
    index: Mutex<LedgerIndex>,
}

/// The parent's view of a ledger, read incrementally.
#[derive(Default)]
struct LedgerIndex {
    /// Bytes of the file already read (whole lines only).
    offset: u64,
    /// Reference -> calls with it.
    by_reference: HashMap<String, u32>,
    /// Key name -> the references of its calls, in ledger order.
    by_key: HashMap<String, Vec<String>>,
    calls: u64,
    /// Lines a killed child left unfinished: the provider never took them.
    torn: u64,
}

impl Ledger {
    fn open(dir: &Path, provider: &'static str) -> std::io::Result<Ledger> {
        let path = dir.join(format!("{provider}.ledger"));
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        Ok(Ledger {
            provider,
            path,
            file,
            index: Mutex::new(LedgerIndex::default()),
        })
    }

    /// A call to the provider with `reference` for key `name`: one line in
    /// one `write` (O_APPEND), so lines of threads and processes never
    /// interleave; returns the provider's answer.
    fn call(&self, reference: &str, name: &str) -> TestResult<Vec<u8>> {
        if reference.contains(char::is_whitespace) || reference.is_empty() {
            return Err(format!("{name}: unusable step reference {reference:?}").into());
        }
        (&self.file).write_all(format!("call {reference} {name} end\n").as_bytes())?;
        Ok(evidence(self.provider, reference))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LedgerIndex> {
        self.index.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// After a kill, before anyone appends again: ends a line the killed
    /// child left unfinished, so it stays one unreadable (never taken) line.
    fn seal(&self) -> TestResult {
        let mut f = File::open(&self.path)?;
        let len = f.metadata()?.len();
        if len > 0 {
            let mut last = [0u8; 1];
            f.seek(SeekFrom::Start(len - 1))?;
            f.read_exact(&mut last)?;
            if last[0] != b'\n' {
                (&self.file).write_all(b"\n")?;
            }
        }
        Ok(())
    }

    /// Reads the lines appended since the last refresh.
    fn refresh(&self) -> TestResult {
        let mut index = self.lock();
        let mut f = File::open(&self.path)?;
        f.seek(SeekFrom::Start(index.offset))?;
        let mut text = String::new();
        f.read_to_string(&mut text)?;
        let Some((whole, _)) = text.rsplit_once('\n') else {
            return Ok(());
        };
        index.offset += whole.len() as u64 + 1;
        for line in whole.lines() {
            match line.split(' ').collect::<Vec<_>>()[..] {
                ["call", reference, name, "end"] => {
                    *index.by_reference.entry(reference.to_string()).or_default() += 1;
                    index
                        .by_key
                        .entry(name.to_string())
                        .or_default()
                        .push(reference.to_string());
                    index.calls += 1;
                }
                _ => index.torn += 1,
            }
        }
        Ok(())
    }

    fn has(&self, reference: &str) -> bool {
        self.lock().by_reference.contains_key(reference)
    }

    fn calls_for(&self, name: &str) -> Vec<String> {
        self.lock().by_key.get(name).cloned().unwrap_or_default()
    }
}

/// The two providers of a payment.
struct Providers {
    charge: Ledger,
    receipt: Ledger,
}

impl Providers {
    fn open(dir: &Path) -> std::io::Result<Providers> {
        Ok(Providers {
            charge: Ledger::open(dir, CHARGE)?,
            receipt: Ledger::open(dir, RECEIPT)?,
        })
    }

    fn seal_and_refresh(&self) -> TestResult {
        for l in [&self.charge, &self.receipt] {
            l.seal()?;
            l.refresh()?;
        }
        Ok(())
    }

    fn ledger(&self, step: &str) -> Option<&Ledger> {
        match step {
            CHARGE => Some(&self.charge),
            RECEIPT => Some(&self.receipt),
            _ => None,
        }
    }

    fn any_call_for(&self, name: &str) -> bool {
        [&self.charge, &self.receipt]
            .iter()
            .any(|l| !l.calls_for(name).is_empty())
    }
}

// --------------------------------------------------------------- resolver --

/// What the resolver was asked and answered.
#[derive(Default)]
struct Asked {
    executed: AtomicU64,
    not_executed: AtomicU64,
    still_unknown: AtomicU64,
    receipt_by_trait: AtomicU64,
    unexpected_step: AtomicU64,
    operations_not_executed: AtomicU64,
    operations_with_calls: AtomicU64,
    completed_from_steps: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Answers from the ledgers; while `up` is false every answer is "still
/// unknown" (the providers' status pages are down).
#[derive(Clone)]
struct LedgerResolver {
    providers: Arc<Providers>,
    up: Arc<AtomicBool>,
    asked: Arc<Asked>,
}

impl LedgerResolver {
    fn step(&self, step: &InDoubtStep) -> StepResolution {
        if !self.up.load(Ordering::SeqCst) {
            bump(&self.asked.still_unknown);
            return StepResolution::StillUnknown;
        }
        let Some(ledger) = self.providers.ledger(&step.name) else {
            bump(&self.asked.unexpected_step);
            return StepResolution::StillUnknown;
        };
        // The killed child cannot call any more: the ledger is the truth.
        if ledger.has(&step.reference) {
            bump(&self.asked.executed);
            StepResolution::Executed(evidence(ledger.provider, &step.reference))
        } else {
            bump(&self.asked.not_executed);
            StepResolution::NotExecuted
        }
    }
}

impl Resolver for LedgerResolver {
    /// Asked only about keys without steps: no provider saw those.
    fn resolve(&self, in_doubt: &InDoubt) -> Resolution {
        if !self.up.load(Ordering::SeqCst) {
            return Resolution::StillInDoubt;
        }
        if self.providers.any_call_for(in_doubt.key.key()) {
            // Steps a provider saw went missing: only an operator could say.
            bump(&self.asked.operations_with_calls);
            Resolution::StillInDoubt
        } else {
            bump(&self.asked.operations_not_executed);
            Resolution::NotExecuted
        }
    }

    fn resolve_step(&self, step: &InDoubtStep) -> StepResolution {
        if step.name == RECEIPT {
            bump(&self.asked.receipt_by_trait);
        }
        self.step(step)
    }

    fn complete_from_steps(&self, in_doubt: &InDoubt, steps: &[StepInfo]) -> Option<Envelope> {
        let name = in_doubt.key.key();
        if !completes_from_steps(name) {
            return None;
        }
        let confirmed = |step: &str| {
            steps
                .iter()
                .find(|s| s.name == step && matches!(s.state, StepState::Confirmed))
                .and_then(|s| s.evidence.clone())
        };
        let envelope = response(name, &confirmed(CHARGE)?, &confirmed(RECEIPT)?);
        bump(&self.asked.completed_from_steps);
        Some(envelope)
    }
}

// ------------------------------------------------------------------ store --

/// The backend under test.
#[derive(Clone)]
enum Store {
    Redb(PathBuf),
    Postgres { url: String, prefix: String },
}

impl Store {
    fn to_env(&self) -> String {
        match self {
            Store::Redb(path) => format!("redb:{}", path.display()),
            Store::Postgres { prefix, .. } => format!("pg:{prefix}"),
        }
    }

    fn from_env(s: &str) -> TestResult<Store> {
        match s.split_once(':') {
            Some(("redb", path)) => Ok(Store::Redb(PathBuf::from(path))),
            Some(("pg", prefix)) => Ok(Store::Postgres {
                url: std::env::var(pg_chaos::PG_VAR)?,
                prefix: prefix.to_string(),
            }),
            _ => Err(format!("{STORE_VAR}={s:?}").into()),
        }
    }

    fn label(&self) -> &'static str {
        match self {
            Store::Redb(_) => "redb",
            Store::Postgres { .. } => "postgres",
        }
    }

    /// The engine on this store at `clock`; with `resolver`, the receipt's
    /// questions go to a per-step resolver and the charge's to the trait.
    fn open(&self, clock: &ManualClock, resolver: Option<&LedgerResolver>) -> TestResult<Engine> {
        let mut b = Engine::builder()
            .clock(clock.clone())
            .lease(LEASE)
            .ttl(TTL)
            .resolver_interval(Duration::from_secs(1))
            .sweep_interval(None);
        if let Some(r) = resolver {
            let receipts = r.clone();
            b = b
                .step_resolver(RECEIPT, move |s: &InDoubtStep| receipts.step(s))
                .resolver(r.clone());
        }
        Ok(match self {
            Store::Redb(path) => b.open(path)?,
            Store::Postgres { url, prefix } => b
                .table_prefix(prefix)
                .pool_size(4)
                .database_clock(false)
                .open_postgres(url)?,
        })
    }
}

// ------------------------------------------------------------------ child --

/// Entry point of the child process; a no-op in the normal test run.
#[test]
fn child_entry() -> TestResult {
    if std::env::var_os(ROLE_VAR).is_none() {
        return Ok(());
    }
    let store = Store::from_env(&std::env::var(STORE_VAR)?)?;
    let dir = PathBuf::from(std::env::var(DIR_VAR)?);
    let round: u64 = std::env::var(ROUND_VAR)?.parse()?;
    let plan_text = std::env::var(PLAN_VAR)?;
    let plan = Plan::from_env(&plan_text).ok_or_else(|| format!("{PLAN_VAR}={plan_text:?}"))?;
    let clock = ManualClock::new(std::env::var(NOW_VAR)?.parse()?);
    let engine = store.open(&clock, None)?;
    let providers = Providers::open(&dir)?;
    let acks = OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("acks-{round}.log")))?;
    kill_child::announce_ready(READY, CHILD_LIMIT)?;
    kill_child::run_workers(round, CHILD_THREADS, |t| {
        child_worker(&engine, &providers, &acks, round, t, plan)
    })
}

/// Pays fresh keys until the process is killed; thread 0 stops at the
/// plan's point, says so, and waits for the kill.
fn child_worker(
    engine: &Engine,
    providers: &Providers,
    mut acks: &File,
    round: u64,
    t: u64,
    plan: Plan,
) -> TestResult {
    for n in 0.. {
        let name = format!("r{round}-t{t}-{n}");
        acks.write_all(format!("start {name}\n").as_bytes())?;
        let hook = |at: Point| {
            if let Plan::At { point, after } = plan {
                if t == 0 && n == after && at == point {
                    let mut out = std::io::stdout().lock();
                    let _ = writeln!(out, "{AT}{} {name}", at.name());
                    let _ = out.flush();
                    drop(out);
                    loop {
                        std::thread::park();
                    }
                }
            }
        };
        match pay(engine, providers, &name, &hook)? {
            Paid::Now { resumed: false } => {
                acks.write_all(format!("completed {name}\n").as_bytes())?;
            }
            _ => return Err(format!("fresh key {name} was not claimed and paid").into()),
        }
    }
    Ok(())
}

// ----------------------------------------------------------------- parent --

/// Starts round `round`'s child (core dumps off) and returns it with a
/// receiver of its stdout lines.
fn spawn_child(
    store: &Store,
    dir: &Path,
    round: u64,
    plan: Plan,
    now_ms: u64,
) -> TestResult<(Child, mpsc::Receiver<String>)> {
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
        .env(ROLE_VAR, "child")
        .env(STORE_VAR, store.to_env())
        .env(DIR_VAR, dir)
        .env(ROUND_VAR, round.to_string())
        .env(PLAN_VAR, plan.to_env())
        .env(NOW_VAR, now_ms.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(File::create(dir.join(format!("child-{round}.stderr")))?)
        .spawn()?;
    let out = child.stdout.take().ok_or("no child stdout")?;
    Ok((child, lines_of(out)))
}

/// The child's stdout, line by line, on a thread of its own (libtest may
/// print `test child_entry ... ` before the first line).
fn lines_of(out: ChildStdout) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut out = BufReader::new(out);
        let mut line = String::new();
        while matches!(out.read_line(&mut line), Ok(n) if n > 0) {
            if tx.send(std::mem::take(&mut line)).is_err() {
                break;
            }
        }
    });
    rx
}

/// Waits for a line containing `marker`; returns what follows it.
fn wait_for(rx: &mpsc::Receiver<String>, marker: &str, limit: Duration) -> Option<String> {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        let line = rx.recv_timeout(left).ok()?;
        if let Some((_, rest)) = line.split_once(marker) {
            return Some(rest.trim_end().to_string());
        }
    }
}

/// Runs one round's child and SIGKILLs it per its plan. Returns where the
/// chosen thread stood (`None` for a random kill).
fn run_and_kill(
    store: &Store,
    dir: &Path,
    round: u64,
    plan: Plan,
    now_ms: u64,
) -> TestResult<Option<(Point, String)>> {
    let (mut child, lines) = spawn_child(store, dir, round, plan, now_ms)?;
    let stderr =
        || std::fs::read_to_string(dir.join(format!("child-{round}.stderr"))).unwrap_or_default();
    let ready = wait_for(&lines, READY, READY_TIMEOUT).is_some();
    let mut at = None;
    let mut missed = None;
    if ready {
        match plan {
            Plan::Random { delay_ms } => std::thread::sleep(Duration::from_millis(delay_ms)),
            Plan::At { point, .. } => match wait_for(&lines, AT, POINT_TIMEOUT) {
                Some(rest) => {
                    let (p, name) = rest.split_once(' ').ok_or("bad AT line")?;
                    if Point::parse(p) != Some(point) {
                        missed = Some(format!("stopped at {p}, not {}", point.name()));
                    }
                    at = Some((point, name.to_string()));
                }
                None => missed = Some(format!("never reached {}", point.name())),
            },
        }
    }
    let early = child.try_wait()?;
    child.kill()?;
    let status = child.wait()?;
    if !ready || early.is_some() || status.signal() != Some(9) || missed.is_some() {
        return Err(format!(
            "round {round} ({plan:?}): the child was not killed as planned \
             (ready {ready}, {status:?}, {}): {}",
            missed.unwrap_or_default(),
            stderr().trim()
        )
        .into());
    }
    Ok(at)
}

/// The keys round `round`'s child started, and those it acknowledged as
/// completed (a torn last line was never written whole: not acknowledged).
fn read_acks(dir: &Path, round: u64) -> TestResult<(Vec<String>, Vec<String>)> {
    let text = std::fs::read_to_string(dir.join(format!("acks-{round}.log")))?;
    let whole = text.rsplit_once('\n').map_or("", |(done, _)| done);
    let (mut started, mut completed) = (Vec::new(), Vec::new());
    for line in whole.lines() {
        match line.split_once(' ') {
            Some(("start", name)) => started.push(name.to_string()),
            Some(("completed", name)) => completed.push(name.to_string()),
            _ => return Err(format!("round {round}: bad ack line {line:?}").into()),
        }
    }
    Ok((started, completed))
}

/// Everything counted over a backend's run.
#[derive(Default)]
struct Tally {
    kills_at: BTreeMap<&'static str, u64>,
    random_kills: u64,
    held_while_down: u64,
    claimed_while_down: u64,
    unknown_steps_seen: u64,
    settled: u64,
    resumed: u64,
    fresh: u64,
    replayed: u64,
    unsettled: Vec<String>,
    lost: Vec<String>,
    failures: Vec<String>,
}

impl Tally {
    fn fail(&mut self, what: String) {
        self.failures.push(what);
    }
}

/// Runs `f` over `names` on `PARENT_THREADS` threads, merging what each
/// thread tallied.
fn each_key(
    names: &[String],
    tally: &Mutex<Tally>,
    f: impl Fn(&str, &mut Tally) -> TestResult + Sync,
) -> TestResult {
    let chunk = names.len().div_ceil(PARENT_THREADS).max(1);
    std::thread::scope(|s| -> TestResult {
        let handles: Vec<_> = names
            .chunks(chunk)
            .map(|part| {
                let f = &f;
                s.spawn(move || -> TestResult<Tally> {
                    let mut mine = Tally::default();
                    for name in part {
                        f(name, &mut mine)?;
                    }
                    Ok(mine)
                })
            })
            .collect();
        for h in handles {
            let mine = h.join().map_err(|_| "a parent thread panicked")??;
            let mut t = tally.lock().unwrap_or_else(PoisonError::into_inner);
            t.held_while_down += mine.held_while_down;
            t.claimed_while_down += mine.claimed_while_down;
            t.unknown_steps_seen += mine.unknown_steps_seen;
            t.settled += mine.settled;
            t.resumed += mine.resumed;
            t.fresh += mine.fresh;
            t.replayed += mine.replayed;
            t.unsettled.extend(mine.unsettled);
            t.lost.extend(mine.lost);
            t.failures.extend(mine.failures);
        }
        Ok(())
    })
}

/// Providers down: a retry of `name` must not be handed a claim while one
/// of its steps is unsettled, and such a step shows the resolver's attempts.
fn retry_while_down(
    engine: &Engine,
    providers: &Providers,
    name: &str,
    t: &mut Tally,
) -> TestResult {
    let k = key(name)?;
    let open_before: Vec<String> = engine
        .steps(&k)?
        .iter()
        .filter(|s| unsettled(&s.state))
        .map(|s| s.name.clone())
        .collect();
    match pay(engine, providers, name, &|_| {})? {
        Paid::Held(_) => {
            t.held_while_down += 1;
            for s in engine.steps(&k)? {
                if open_before.contains(&s.name) {
                    t.unknown_steps_seen += 1;
                    if s.attempts == 0 || !matches!(s.state, StepState::Unknown) {
                        t.fail(format!(
                            "{name}: step {} is {:?} with {} attempts after the providers \
                             answered \"still unknown\"",
                            s.name, s.state, s.attempts
                        ));
                    }
                }
            }
        }
        Paid::Now { resumed } => {
            t.claimed_while_down += 1;
            if !open_before.is_empty() {
                t.fail(format!(
                    "{name}: claimed while steps {open_before:?} were unsettled and the \
                     providers did not answer"
                ));
            }
            t.settled += 1;
            if resumed {
                t.resumed += 1;
            } else {
                t.fresh += 1;
            }
        }
        Paid::Replayed => {}
    }
    Ok(())
}

/// Providers up: retries `name` until it replays (or `SETTLE_TRIES` run out).
fn settle(
    engine: &Engine,
    clock: &ManualClock,
    providers: &Providers,
    name: &str,
    t: &mut Tally,
) -> TestResult {
    let mut why = String::new();
    for _ in 0..SETTLE_TRIES {
        match pay(engine, providers, name, &|_| {})? {
            Paid::Now { resumed } => {
                t.settled += 1;
                if resumed {
                    t.resumed += 1;
                } else {
                    t.fresh += 1;
                }
                return Ok(());
            }
            Paid::Replayed => {
                t.replayed += 1;
                return Ok(());
            }
            Paid::Held(w) => {
                why = w;
                clock.advance(Duration::from_secs(2));
            }
        }
    }
    t.unsettled.push(format!("{name}: {why}"));
    Ok(())
}

/// The audit of one key (see the file's doc): exactly one charge and one
/// receipt, the steps carry their references and answers, the key replays
/// the response built from them, and no operator appears in its history.
fn audit_key(engine: &Engine, providers: &Providers, name: &str, t: &mut Tally) -> TestResult {
    let k = key(name)?;
    let (charges, receipts) = (
        providers.charge.calls_for(name),
        providers.receipt.calls_for(name),
    );
    let ([charge], [receipt]) = (&charges[..], &receipts[..]) else {
        if charges.len() < 2 && receipts.len() < 2 {
            t.lost.push(format!(
                "{name}: {} charges and {} receipts",
                charges.len(),
                receipts.len()
            ));
        } // more than one: counted as a double from the ledgers
        return Ok(());
    };
    let (charged, receipted) = (evidence(CHARGE, charge), evidence(RECEIPT, receipt));
    let want = response(name, &charged, &receipted);
    match engine.begin(&k, fingerprint(name)?)? {
        Begin::Replay(r) if r.envelope == want => {}
        other => t
            .lost
            .push(format!("{name}: answers {other:?}, not the paid response")),
    }
    let steps = engine.steps(&k)?;
    for (step, reference, answer) in [(CHARGE, charge, &charged), (RECEIPT, receipt, &receipted)] {
        match steps.iter().find(|s| s.name == step) {
            Some(s)
                if matches!(s.state, StepState::Confirmed)
                    && &s.reference == reference
                    && s.evidence.as_ref() == Some(answer) => {}
            other => t.lost.push(format!(
                "{name}: step {step} is {other:?}, the provider saw {reference}"
            )),
        }
    }
    if steps.len() != 2 {
        t.fail(format!("{name}: {} steps stored, 2 expected", steps.len()));
    }
    let history = engine.history(&k)?;
    if history.len() > MAX_HISTORY_ENTRIES {
        t.fail(format!("{name}: {} history entries", history.len()));
    }
    if let Some(e) = history
        .iter()
        .find(|e| matches!(e.actor, Actor::Operator { .. }))
    {
        t.fail(format!("{name}: an operator settled it: {e:?}"));
    }
    Ok(())
}

/// Doubles per the file's doc: calls beyond the first per (key, step).
fn doubles(providers: &Providers) -> (u64, Vec<String>) {
    let mut n = 0;
    let mut examples = Vec::new();
    for ledger in [&providers.charge, &providers.receipt] {
        for (name, refs) in &ledger.lock().by_key {
            if refs.len() > 1 {
                n += refs.len() as u64 - 1;
                examples.push(format!("{} {name}: {refs:?}", ledger.provider));
            }
        }
    }
    (n, examples)
}

fn env_u64(var: &str) -> TestResult<Option<u64>> {
    match std::env::var(var) {
        Ok(v) => Ok(Some(
            v.trim().parse().map_err(|e| format!("{var}={v:?}: {e}"))?,
        )),
        Err(_) => Ok(None),
    }
}

/// The whole kill run on one store; an error holds the audit if it fails.
fn kill_run(store: &Store, dir: &Path) -> TestResult {
    let kills = env_u64(KILLS_VAR)?.unwrap_or(DEFAULT_KILLS);
    let seed = match env_u64(SEED_VAR)? {
        Some(s) => s,
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos() as u64,
    };
    let label = store.label();
    println!("step kills [{label}]: {kills} kills, seed {seed} ({SEED_VAR})");
    let started = Instant::now();
    let mut rng = SplitMix64(seed);
    let providers = Arc::new(Providers::open(dir)?);
    let asked = Arc::new(Asked::default());
    let tally = Mutex::new(Tally::default());
    let mut all_keys: BTreeSet<String> = BTreeSet::new();
    let mut acknowledged: BTreeSet<String> = BTreeSet::new();

    for round in 0..kills {
        let plan = Plan::for_round(round, &mut rng);
        let child_now = BASE_MS + round * ROUND_SPAN_MS;
        let at = run_and_kill(store, dir, round, plan, child_now)?;
        {
            let mut t = tally.lock().unwrap_or_else(PoisonError::into_inner);
            match at {
                Some((p, _)) => *t.kills_at.entry(p.name()).or_default() += 1,
                None => t.random_kills += 1,
            }
        }
        providers.seal_and_refresh()?;
        let (names, completed) = read_acks(dir, round)?;
        if let Some((p, name)) = &at {
            if !names.contains(name) {
                return Err(
                    format!("round {round}: {name} stopped at {p:?} but never started").into(),
                );
            }
        }
        acknowledged.extend(completed);

        let clock = ManualClock::new(child_now + LEASE.as_millis() as u64 + 60_000);
        let resolver = LedgerResolver {
            providers: Arc::clone(&providers),
            up: Arc::new(AtomicBool::new(false)),
            asked: Arc::clone(&asked),
        };
        let engine = store.open(&clock, Some(&resolver))?;
        each_key(&names, &tally, |name, t| {
            retry_while_down(&engine, &providers, name, t)
        })?;
        resolver.up.store(true, Ordering::SeqCst);
        // Past any interval between two questions about one key.
        clock.advance(Duration::from_secs(2));
        each_key(&names, &tally, |name, t| {
            settle(&engine, &clock, &providers, name, t)
        })?;
        providers.charge.refresh()?;
        providers.receipt.refresh()?;
        each_key(&names, &tally, |name, t| {
            audit_key(&engine, &providers, name, t)
        })?;
        drop(engine);
        all_keys.extend(names);
        let t = tally.lock().unwrap_or_else(PoisonError::into_inner);
        if !(t.failures.is_empty() && t.lost.is_empty() && t.unsettled.is_empty()) {
            break; // report what the first bad round found
        }
    }

    // Every key once more on a fresh engine, nothing left in doubt, and a
    // scrub of the store.
    let last = BASE_MS + kills * ROUND_SPAN_MS;
    let clock = ManualClock::new(last);
    let engine = store.open(&clock, None)?;
    let all: Vec<String> = all_keys.iter().cloned().collect();
    let final_tally = Mutex::new(Tally::default());
    each_key(&all, &final_tally, |name, t| {
        audit_key(&engine, &providers, name, t)
    })?;
    let left = engine.in_doubt(100)?;
    let report = engine.verify()?;
    drop(engine);

    let mut t = tally.into_inner().unwrap_or_else(PoisonError::into_inner);
    let f = final_tally
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner);
    t.lost
        .extend(f.lost.into_iter().map(|l| format!("final check: {l}")));
    t.failures
        .extend(f.failures.into_iter().map(|l| format!("final check: {l}")));
    if !left.is_empty() {
        t.fail(format!(
            "{} keys still in doubt, first {:?}",
            left.len(),
            left[0].key
        ));
    }
    if !report.is_sound() {
        t.fail(format!("verify: {:?}", report.damage));
    }
    let lost_acks = acknowledged
        .iter()
        .filter(|n| t.lost.iter().any(|l| l.contains(&format!("{n}:"))))
        .count();
    let (double, double_examples) = doubles(&providers);
    let unexpected = asked.unexpected_step.load(Ordering::Relaxed);
    let with_calls = asked.operations_with_calls.load(Ordering::Relaxed);
    if unexpected > 0 || with_calls > 0 {
        t.fail(format!(
            "the resolver was asked about {unexpected} unknown step names and about \
             {with_calls} operations without steps that a provider saw"
        ));
    }
    let (charges, receipts, torn) = {
        let (c, r) = (providers.charge.lock(), providers.receipt.lock());
        (c.calls, r.calls, c.torn + r.torn)
    };
    let keys = all_keys.len();
    let settled_keys = keys - t.unsettled.len();
    let kills_done = t.random_kills + t.kills_at.values().sum::<u64>();
    println!(
        "step kills [{label}] summary: kills {kills_done} (at points {:?}, random {}), keys {keys}, \
         acknowledged completions {}, charges {charges}, receipts {receipts}, \
         doubles {double}, lost {} (of them acknowledged {lost_acks}), \
         settled without an operator {settled_keys}/{keys} \
         (resumed {}, completed from steps {}, claimed afresh {}, already complete {}), \
         held while the providers were down {} (unknown steps with attempts {}), \
         claimed while down {}, resolver answers: step executed {}, step not executed {}, \
         still unknown {}, operation not executed {}, receipt asked through the trait {}; \
         torn ledger lines {torn}; {:.1} s, seed {seed}",
        t.kills_at,
        t.random_kills,
        acknowledged.len(),
        t.lost.len(),
        t.resumed,
        asked.completed_from_steps.load(Ordering::Relaxed),
        t.fresh,
        t.replayed,
        t.held_while_down,
        t.unknown_steps_seen,
        t.claimed_while_down,
        asked.executed.load(Ordering::Relaxed),
        asked.not_executed.load(Ordering::Relaxed),
        asked.still_unknown.load(Ordering::Relaxed),
        asked.operations_not_executed.load(Ordering::Relaxed),
        asked.receipt_by_trait.load(Ordering::Relaxed),
        started.elapsed().as_secs_f64(),
    );
    let first = |v: &[String]| v[..v.len().min(5)].to_vec();
    if double != 0 || !t.lost.is_empty() || !t.unsettled.is_empty() || !t.failures.is_empty() {
        return Err(format!(
            "[{label}] seed {seed}: doubles {double} {:#?}, lost {} {:#?}, unsettled {} {:#?}, \
             failures {} {:#?} (files in {})",
            first(&double_examples),
            t.lost.len(),
            first(&t.lost),
            t.unsettled.len(),
            first(&t.unsettled),
            t.failures.len(),
            first(&t.failures),
            dir.display()
        )
        .into());
    }
    if kills_done != kills {
        return Err(format!("[{label}] {kills_done} kills, {kills} planned").into());
    }
    Ok(())
}

#[test]
fn redb_sigkill_between_steps_never_doubles_or_loses() -> TestResult {
    if std::env::var_os(ROLE_VAR).is_some() {
        return Ok(());
    }
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
    let dir = tempfile::tempdir()?;
    let store = Store::Redb(dir.path().join("steps.redb"));
    kill_run(&store, dir.path())
}

#[test]
fn postgres_sigkill_between_steps_never_doubles_or_loses() -> TestResult {
    if std::env::var_os(ROLE_VAR).is_some() {
        return Ok(());
    }
    let Some(url) = pg_chaos::pg_url() else {
        return Ok(());
    };
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
    let dir = tempfile::tempdir()?;
    let prefix = pg_chaos::unique_prefix("steps");
    let store = Store::Postgres {
        url: url.clone(),
        prefix: prefix.clone(),
    };
    let result = kill_run(&store, dir.path());
    // Leave nothing behind on a shared server.
    pg_chaos::drop_prefix(&mut pg_chaos::connect(&url)?, &prefix)?;
    result
}
