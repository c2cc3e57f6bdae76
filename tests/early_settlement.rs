//! Guards against a crashed process's claims blocking their keys for the
//! whole lease when the provider's answer already proves the work done, and
//! against the opposite mistake: a "not executed" answer handing out a
//! second claim while the first claim's work may still be running.
//!
//! A child process (this test binary re-invoked with `IDEM_EARLY_ROLE` set,
//! running only `child_entry`) claims two keys under a `ManualClock` with a
//! 10 s lease, charges a simulated provider (a synced file of references)
//! for one of them, and is SIGKILLed. The parent reopens the file with the
//! clock 1 s after the claims, well before their lease ends, and a resolver
//! that reads the provider file: the charged key replays the provider's
//! answer at once; the other answers Processing with the rest of the lease
//! as its retry hint, asks the provider at most once while the lease runs,
//! and is claimable (with a larger fencing token) once the lease has ended.
//! Unix only (the kill is observed as SIGKILL).
#![cfg(unix)]

mod common;
#[path = "common/kill.rs"]
mod kill;

use std::error::Error;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency::{
    Begin, Engine, Envelope, Fingerprint, IdempotencyKey, InDoubt, ManualClock, Resolution, State,
};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const ROLE_VAR: &str = "IDEM_EARLY_ROLE";
const DIR_VAR: &str = "IDEM_EARLY_DIR";
const READY: &str = "EARLY CHILD READY";
const T0: u64 = 1_700_000_000_000;
/// The payments demo server's default lease (`serve --lease-ms`).
const LEASE_MS: u64 = 10_000;
const CHARGED: &str = "charged-before-the-kill";
const NOT_CHARGED: &str = "killed-before-the-charge";

fn key(name: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("tenant-1:create_payment", name)
}

fn fp() -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(br#"{"amount": 10, "currency": "EUR"}"#, &[])
}

/// The provider: one line per charged reference, synced before it answers.
fn provider(dir: &Path) -> PathBuf {
    dir.join("provider.log")
}

fn charged(dir: &Path, reference: &str) -> std::io::Result<bool> {
    match std::fs::read_to_string(provider(dir)) {
        Ok(log) => Ok(log.lines().any(|line| line == reference)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

fn receipt(reference: &str) -> Envelope {
    Envelope::new(1, 201, format!(r#"{{"charge":"{reference}"}}"#))
}

/// Entry point of the child process; a no-op in the normal test run.
#[test]
fn child_entry() -> TestResult {
    let Some(dir) = std::env::var_os(DIR_VAR) else {
        return Ok(());
    };
    let dir = PathBuf::from(dir);
    kill::exit_if_never_killed();
    let engine = Engine::builder()
        .clock(ManualClock::new(T0))
        .lease(Duration::from_millis(LEASE_MS))
        .sweep_interval(None)
        .open(dir.join("idem.redb"))?;
    let charged = common::claimed(engine.begin(&key(CHARGED)?, fp()?)?)?;
    let _not_charged = common::claimed(engine.begin(&key(NOT_CHARGED)?, fp()?)?)?;
    let mut log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(provider(&dir))?;
    writeln!(log, "{}", charged.reference())?;
    log.sync_all()?;
    println!("{READY}");
    std::io::stdout().flush()?;
    // Both claims stay PROCESSING until the parent kills this process.
    std::thread::sleep(Duration::from_secs(120));
    Err("never killed".into())
}

/// Runs the child to its kill; returns the directory.
fn crashed_child() -> Result<tempfile::TempDir, Box<dyn Error + Send + Sync>> {
    let dir = tempfile::tempdir()?;
    kill::run_then_kill(
        0,
        &[
            (ROLE_VAR, "child".as_ref()),
            (DIR_VAR, dir.path().as_os_str()),
        ],
        READY,
        &dir.path().join("child.stderr"),
        Duration::ZERO,
    )?;
    Ok(dir)
}

/// The engine after the crash, at `clock`, whose resolver reads the
/// provider file and counts the questions it was asked.
fn reopen(
    dir: &Path,
    clock: &ManualClock,
    asked: &Arc<AtomicUsize>,
) -> Result<Engine, Box<dyn Error + Send + Sync>> {
    let (provider_dir, asked) = (dir.to_path_buf(), asked.clone());
    Ok(Engine::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .resolver(move |p: &InDoubt| {
            asked.fetch_add(1, Ordering::SeqCst);
            match charged(&provider_dir, &p.reference) {
                Ok(true) => Resolution::Completed(receipt(&p.reference)),
                Ok(false) => Resolution::NotExecuted,
                Err(_) => Resolution::StillInDoubt,
            }
        })
        .open_existing(dir.join("idem.redb"))?)
}

#[test]
fn a_found_charge_replays_at_once_after_a_kill() -> TestResult {
    let dir = crashed_child()?;
    let clock = ManualClock::new(T0 + 1_000);
    let asked = Arc::new(AtomicUsize::new(0));
    let engine = reopen(dir.path(), &clock, &asked)?;
    // The open found the dead process's claims and says so.
    let rec = engine
        .record(&key(CHARGED)?)?
        .ok_or("the claim was not durable")?;
    assert_eq!(rec.state, State::Unknown, "{rec:?}");
    assert!(rec.reason.contains("process"), "{}", rec.reason);

    let r = common::replay(engine.begin(&key(CHARGED)?, fp()?)?)?;
    assert_eq!(r.envelope, receipt(&rec.reference));
    assert_eq!(asked.load(Ordering::SeqCst), 1);
    assert_eq!(
        engine.record(&key(CHARGED)?)?.ok_or("gone")?.state,
        State::Completed
    );
    // Later retries replay without asking.
    common::replay(engine.begin(&key(CHARGED)?, fp()?)?)?;
    assert_eq!(asked.load(Ordering::SeqCst), 1);
    Ok(())
}

#[test]
fn not_executed_waits_for_the_lease_after_a_kill() -> TestResult {
    let dir = crashed_child()?;
    let clock = ManualClock::new(T0 + 1_000);
    let asked = Arc::new(AtomicUsize::new(0));
    let engine = reopen(dir.path(), &clock, &asked)?;
    let token = engine
        .record(&key(NOT_CHARGED)?)?
        .ok_or("the claim was not durable")?
        .fencing_token;
    for _ in 0..5 {
        match engine.begin(&key(NOT_CHARGED)?, fp()?)? {
            Begin::Processing { retry_after } => {
                assert_eq!(retry_after, Duration::from_millis(LEASE_MS - 1_000));
            }
            other => return Err(format!("before the lease ended: {other:?}").into()),
        }
    }
    assert_eq!(
        asked.load(Ordering::SeqCst),
        1,
        "a crowd of retries asked more than once"
    );
    clock.set(T0 + LEASE_MS - 1);
    assert!(matches!(
        engine.begin(&key(NOT_CHARGED)?, fp()?)?,
        Begin::Processing { .. }
    ));
    clock.set(T0 + LEASE_MS);
    let fresh = common::claimed(engine.begin(&key(NOT_CHARGED)?, fp()?)?)?;
    assert!(fresh.fencing_token() > token);
    engine.complete(fresh, receipt("fresh"))?;
    assert_eq!(asked.load(Ordering::SeqCst), 2);
    Ok(())
}
