//! Guards against a real process crash (abort, no unwinding, no destructors)
//! causing a double charge or losing an acknowledged result. A child process
//! (this test binary re-invoked with `IDEM_CRASH_ROLE` set, running only
//! `child_entry`) claims a key, charges a simulated payment provider that
//! records charges durably in its own file keyed by the claim's reference,
//! and aborts at a named point. The parent reopens the database after the
//! lease has run out (ManualClock) and retries with a resolver that queries
//! the provider file: the provider must hold exactly one charge and the retry
//! must return that charge's result. A second child aborts while 32 threads
//! are mid group commit: every key it acknowledged must replay, and no record
//! may be half-written. Unix only (abort is observed as SIGABRT).
#![cfg(unix)]

use std::collections::BTreeSet;
use std::error::Error;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency::{
    Begin, Engine, Envelope, Fingerprint, IdempotencyKey, InDoubt, ManualClock, RecordFilter,
    Resolution, State,
};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const ROLE_VAR: &str = "IDEM_CRASH_ROLE";
const DIR_VAR: &str = "IDEM_CRASH_DIR";
const T0: u64 = 1_700_000_000_000;
const LEASE_MS: u64 = 5_000;
const ORDER: &str = "order-1";
const AMOUNT: u64 = 10;
const SIGABRT: i32 = 6;

const BEFORE_PROVIDER_CALL: &str = "before-provider-call";
const AFTER_PROVIDER_CALL: &str = "after-provider-call-before-complete";
const AFTER_COMPLETE: &str = "after-complete-committed";

fn order_key() -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("tenant-1:create_payment", ORDER)
}

fn order_fp() -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(br#"{"amount": 10, "currency": "EUR"}"#, &[])
}

/// A payment provider that appends each charge to `provider.log` and fsyncs
/// before answering, as a real provider commits before it replies.
struct Provider {
    log: PathBuf,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Charge {
    order: String,
    reference: String,
    id: String,
    amount: u64,
}

impl Provider {
    fn new(dir: &Path) -> Provider {
        Provider {
            log: dir.join("provider.log"),
        }
    }

    fn charge(&self, order: &str, reference: &str, amount: u64) -> std::io::Result<Charge> {
        let charges = self.charges()?;
        let charge = Charge {
            order: order.to_string(),
            reference: reference.to_string(),
            id: format!("ch_{}", charges.len() + 1),
            amount,
        };
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        writeln!(
            f,
            "{} {} {} {}",
            charge.order, charge.reference, charge.id, charge.amount
        )?;
        f.sync_all()?;
        Ok(charge)
    }

    fn charges(&self) -> std::io::Result<Vec<Charge>> {
        let text = match std::fs::read_to_string(&self.log) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e),
        };
        // A torn last line (no newline) was never acknowledged: ignore it.
        let complete = text.rsplit_once('\n').map_or("", |(done, _)| done);
        Ok(complete
            .lines()
            .filter_map(|line| {
                let mut f = line.split(' ');
                Some(Charge {
                    order: f.next()?.to_string(),
                    reference: f.next()?.to_string(),
                    id: f.next()?.to_string(),
                    amount: f.next()?.parse().ok()?,
                })
            })
            .collect())
    }

    fn find(&self, reference: &str) -> std::io::Result<Option<Charge>> {
        Ok(self
            .charges()?
            .into_iter()
            .find(|c| c.reference == reference))
    }
}

/// The response the app stores for a charge.
fn receipt(charge: &Charge) -> Envelope {
    Envelope::new(
        1,
        201,
        format!(r#"{{"charge":"{}","amount":{}}}"#, charge.id, charge.amount),
    )
}

fn crash(point: &str) -> ! {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "\nCRASHING AT {point}");
    let _ = out.flush();
    std::process::abort()
}

/// Runs this test binary as a child in `role`; returns its output once it
/// has exited. Core dumps are turned off for the child.
fn run_child(role: &str, dir: &Path) -> std::io::Result<Output> {
    Command::new("/bin/sh")
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
        .stdin(Stdio::null())
        .output()
}

fn check_aborted(out: &Output, point: &str) -> TestResult {
    let stdout = String::from_utf8_lossy(&out.stdout);
    if out.status.signal() != Some(SIGABRT) || !stdout.contains(&format!("CRASHING AT {point}\n")) {
        return Err(format!(
            "child did not abort at {point}: {:?}\nstdout:\n{stdout}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    Ok(())
}

/// Entry point of the child process; a no-op in the normal test run.
#[test]
fn child_entry() -> TestResult {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return Ok(());
    };
    let dir = PathBuf::from(std::env::var(DIR_VAR)?);
    match role.split_once(':') {
        Some(("payment", point)) => child_payment(&dir, point),
        Some(("group", n)) => child_group(&dir, n.parse()?),
        _ => Err(format!("unknown child role {role:?}").into()),
    }
}

fn child_payment(dir: &Path, point: &str) -> TestResult {
    let engine = Engine::builder()
        .clock(ManualClock::new(T0))
        .lease(Duration::from_millis(LEASE_MS))
        .sweep_interval(None)
        .open(dir.join("idem.redb"))?;
    let provider = Provider::new(dir);
    let claim = match engine.begin(&order_key()?, order_fp()?)? {
        Begin::Claimed(c) => c,
        other => return Err(format!("child: expected Claimed, got {other:?}").into()),
    };
    if point == BEFORE_PROVIDER_CALL {
        crash(point);
    }
    let charge = provider.charge(ORDER, claim.reference(), AMOUNT)?;
    if point == AFTER_PROVIDER_CALL {
        crash(point);
    }
    engine.complete(claim, receipt(&charge))?;
    if point == AFTER_COMPLETE {
        crash(point);
    }
    Err(format!("unknown crash point {point:?}").into())
}

/// How the parent's retry was answered.
#[derive(Debug, PartialEq, Eq)]
enum Retry {
    /// Replayed without asking the resolver.
    Replayed,
    /// The resolver found the charge; replayed its result.
    ResolvedFromProvider,
    /// The resolver found no charge; executed once, now.
    ExecutedOnce,
}

fn crash_and_retry(point: &str, want: Retry) -> TestResult {
    let dir = tempfile::tempdir()?;
    let out = run_child(&format!("payment:{point}"), dir.path())?;
    check_aborted(&out, point)?;
    let provider = Arc::new(Provider::new(dir.path()));
    let after_crash = provider.charges()?;
    assert!(after_crash.len() <= 1, "{point}: {after_crash:?}");

    let asked = Arc::new(AtomicUsize::new(0));
    let engine = {
        let (provider, asked) = (provider.clone(), asked.clone());
        Engine::builder()
            .clock(ManualClock::new(T0 + LEASE_MS + 1))
            .lease(Duration::from_millis(LEASE_MS))
            .sweep_interval(None)
            .resolver(move |p: &InDoubt| {
                asked.fetch_add(1, Ordering::SeqCst);
                match provider.find(&p.reference) {
                    Ok(Some(charge)) => Resolution::Completed(receipt(&charge)),
                    Ok(None) => Resolution::NotExecuted,
                    Err(_) => Resolution::StillInDoubt,
                }
            })
            .open_existing(dir.path().join("idem.redb"))?
    };
    let crashed_token = engine
        .record(&order_key()?)?
        .ok_or("the claim was not durable before begin returned")?
        .fencing_token;
    let (got, body) = match engine.begin(&order_key()?, order_fp()?)? {
        Begin::Replay(r) if asked.load(Ordering::SeqCst) == 0 => (Retry::Replayed, r.envelope.body),
        Begin::Replay(r) => (Retry::ResolvedFromProvider, r.envelope.body),
        Begin::Claimed(c) => {
            assert!(c.fencing_token() > crashed_token, "{point}: token reused");
            let charge = provider.charge(ORDER, c.reference(), AMOUNT)?;
            let envelope = receipt(&charge);
            engine.complete(c, envelope.clone())?;
            (Retry::ExecutedOnce, envelope.body)
        }
        other => return Err(format!("{point}: retry got {other:?}").into()),
    };
    let charges: Vec<Charge> = provider
        .charges()?
        .into_iter()
        .filter(|c| c.order == ORDER)
        .collect();
    assert_eq!(charges.len(), 1, "{point}: provider holds {charges:?}");
    assert_eq!(
        body,
        receipt(&charges[0]).body,
        "{point}: retry returned another result"
    );
    assert_eq!(got, want, "{point}");
    // Any further retry replays the same result and charges nothing.
    match engine.begin(&order_key()?, order_fp()?)? {
        Begin::Replay(r) => assert_eq!(r.envelope.body, body),
        other => return Err(format!("{point}: second retry got {other:?}").into()),
    }
    assert_eq!(provider.charges()?.len(), 1);
    println!(
        "| {point} | {} charge(s) after crash, {} after retry | {got:?}: {} |",
        after_crash.len(),
        charges.len(),
        String::from_utf8_lossy(&body)
    );
    Ok(())
}

#[test]
fn crash_before_provider_call() -> TestResult {
    crash_and_retry(BEFORE_PROVIDER_CALL, Retry::ExecutedOnce)
}

#[test]
fn crash_after_provider_call_before_complete() -> TestResult {
    crash_and_retry(AFTER_PROVIDER_CALL, Retry::ResolvedFromProvider)
}

#[test]
fn crash_after_complete_committed() -> TestResult {
    crash_and_retry(AFTER_COMPLETE, Retry::Replayed)
}

const GROUP_THREADS: usize = 32;

fn group_body(key: &str) -> String {
    format!(r#"{{"key":"{key}","ok":true}}"#)
}

fn group_key(name: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("tenant-1:group", name)
}

/// 32 threads each begin+complete their own keys; each key is printed once
/// its complete has returned; the process aborts at the `crash_after`th.
fn child_group(dir: &Path, crash_after: usize) -> TestResult {
    let engine = Engine::builder()
        .clock(ManualClock::new(T0))
        .lease(Duration::from_millis(LEASE_MS))
        .sweep_interval(None)
        .open(dir.join("group.redb"))?;
    let fp = order_fp()?;
    let answered = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..GROUP_THREADS {
            let (engine, answered) = (&engine, &answered);
            s.spawn(move || {
                for i in 0.. {
                    let name = format!("g-{t}-{i}");
                    let done = (|| -> Result<(), idempotency::Error> {
                        let k = group_key(&name)?;
                        if let Begin::Claimed(c) = engine.begin(&k, fp)? {
                            engine.complete(c, Envelope::new(1, 201, group_body(&name)))?;
                        }
                        Ok(())
                    })();
                    if let Err(e) = done {
                        eprintln!("child error on {name}: {e}");
                        std::process::exit(3);
                    }
                    {
                        let mut out = std::io::stdout().lock();
                        let _ = writeln!(out, "ANSWERED {name}");
                        let _ = out.flush();
                    }
                    if answered.fetch_add(1, Ordering::SeqCst) + 1 == crash_after {
                        crash("group");
                    }
                }
            });
        }
    });
    Err("group child ran out of keys".into())
}

fn group_crash(crash_after: usize) -> TestResult {
    let dir = tempfile::tempdir()?;
    let out = run_child(&format!("group:{crash_after}"), dir.path())?;
    check_aborted(&out, "group")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    // Only newline-terminated lines were fully written before the abort.
    let complete = stdout.rsplit_once('\n').map_or("", |(done, _)| done);
    let answered: BTreeSet<String> = complete
        .lines()
        .filter_map(|l| l.find("ANSWERED ").map(|at| l[at + 9..].to_string()))
        .collect();
    assert!(answered.len() >= crash_after, "{} answers", answered.len());

    let engine = Engine::builder()
        .clock(ManualClock::new(T0 + LEASE_MS + 1))
        .sweep_interval(None)
        .open_existing(dir.path().join("group.redb"))?;
    let fp = order_fp()?;
    for name in &answered {
        match engine.begin(&group_key(name)?, fp)? {
            Begin::Replay(r) => assert_eq!(r.envelope.body, group_body(name).as_bytes(), "{name}"),
            other => return Err(format!("acknowledged {name} was lost: {other:?}").into()),
        }
    }
    let (mut completed, mut processing) = (0u64, 0u64);
    for rec in engine.records(&RecordFilter::default())? {
        let rec = rec?;
        match rec.state {
            State::Completed => {
                let body = rec.response.as_ref().map(|e| e.body.clone());
                assert_eq!(
                    body,
                    Some(group_body(rec.key.key()).into_bytes()),
                    "{}",
                    rec.key
                );
                completed += 1;
            }
            State::Processing => processing += 1,
            other => return Err(format!("{} is {other} after the crash", rec.key).into()),
        }
    }
    let stats = engine.stats()?;
    assert_eq!(stats.corrupt, 0);
    // Stats count states at read time: every claim the crash left behind
    // has its lease run out, so it counts as UNKNOWN before any sweep.
    assert_eq!(
        (stats.completed, stats.processing, stats.unknown),
        (completed, 0, processing)
    );
    // The lease index matches the records: one sweep moves every stale claim.
    assert_eq!(engine.sweep_now()?.moved_to_unknown, processing);
    assert_eq!(engine.stats()?.unknown, processing);
    println!(
        "group crash after {crash_after}: {} acknowledged, {completed} completed, {processing} PROCESSING (stale) on disk",
        answered.len()
    );
    Ok(())
}

#[test]
fn group_commit_crash_keeps_every_acknowledged_key() -> TestResult {
    for crash_after in [1, 40, 300] {
        group_crash(crash_after)?;
    }
    Ok(())
}
