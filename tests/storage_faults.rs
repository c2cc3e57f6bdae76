//! Guards against a storage failure (a failed `write` or `sync_data`, a full
//! disk) turning into a wrong answer: a caller told its claim or outcome is
//! stored when it is not, an acknowledged outcome lost or replayed with
//! other bytes after a crash, or an engine that keeps writing after the
//! disk said no. Faults are injected through redb's `StorageBackend`
//! (`tests/common/storage_faults.rs`); a "crash" reopens from only what was
//! synced.
//!
//! What "nothing acknowledged is lost" means here, per key, after a crash
//! and reopen:
//! - a claim answered `Claimed` is present under its fencing token
//!   (PROCESSING or UNKNOWN, or COMPLETED if its completion committed);
//! - a completion answered `Ok` is COMPLETED and replays its exact bytes;
//! - a completion answered `Err` may be absent (the claim's record is still
//!   there) or present, but if present its bytes are exact;
//! - a claim answered `Err` may be absent or present (its batch may have
//!   committed before the failure was seen), never anything else.

use std::collections::BTreeMap;
use std::error::Error;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey, ManualClock, State};

#[path = "common/storage_faults.rs"]
mod storage_faults;

use storage_faults::{CrashBackend, FailedSync, FailingBackend, Faults};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const T0: u64 = 1_700_000_000_000;
const SCOPE: &str = "tenant:faults";

fn key(name: &str) -> IdempotencyKey {
    IdempotencyKey::new(SCOPE, name).expect("a short printable key is valid")
}

fn fingerprint() -> Fingerprint {
    Fingerprint::of_json(br#"{"amount": 10}"#, &[]).expect("valid JSON")
}

/// The response stored for key `name` (distinct per key, so a replay of
/// another key's bytes is caught).
fn body(name: &str) -> Vec<u8> {
    format!("charged {name}").into_bytes()
}

fn open(
    clock: &ManualClock,
    backend: impl redb::StorageBackend,
) -> Result<Engine, Box<dyn Error + Send + Sync>> {
    Ok(Engine::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .lease(Duration::from_secs(60))
        .open_with_backend(backend)?)
}

fn is_poisoned(e: &idempotency::Error) -> bool {
    matches!(e, idempotency::Error::Poisoned { .. })
}

/// What the caller of the failed batch may hear: `Poisoned`, or today
/// `Closed` when the fault fell inside the transaction (a bug, pinned by
/// `a_storage_error_during_apply_is_reported_as_poisoned`). Later calls
/// must hear `Poisoned`.
fn is_failed_batch(e: &idempotency::Error) -> bool {
    is_poisoned(e) || matches!(e, idempotency::Error::Closed)
}

/// What the callers of one key were told.
#[derive(Clone, Debug, Default)]
struct Told {
    /// `Claimed` with this fencing token.
    claimed: Option<u64>,
    /// The claim was answered with an error.
    claim_failed: bool,
    /// The completion was answered `Ok` / `Err`.
    completed: bool,
    complete_failed: bool,
    /// The errors answered, as text.
    errors: Vec<String>,
}

type Log = Arc<Mutex<BTreeMap<String, Told>>>;

fn note(log: &Log, name: &str, f: impl FnOnce(&mut Told)) {
    let mut log = log.lock().unwrap_or_else(PoisonError::into_inner);
    f(log.entry(name.to_owned()).or_default());
}

/// Claims and completes `name`, noting every answer in `log`. Returns
/// whether the engine answered an error.
fn claim_and_complete(engine: &Engine, name: &str, log: &Log) -> bool {
    let claim = match engine.begin(&key(name), fingerprint()) {
        Ok(Begin::Claimed(claim)) => {
            note(log, name, |t| t.claimed = Some(claim.fencing_token()));
            claim
        }
        Ok(other) => {
            note(log, name, |t| {
                t.errors.push(format!("unexpected {other:?}"))
            });
            return true;
        }
        Err(e) => {
            note(log, name, |t| {
                t.claim_failed = true;
                t.errors.push(e.to_string());
                assert!(is_failed_batch(&e), "claim {name}: {e:?}");
            });
            return true;
        }
    };
    match engine.complete(claim, Envelope::new(1, 201, body(name))) {
        Ok(()) => {
            note(log, name, |t| t.completed = true);
            false
        }
        Err(e) => {
            note(log, name, |t| {
                t.complete_failed = true;
                t.errors.push(e.to_string());
                assert!(is_failed_batch(&e), "complete {name}: {e:?}");
            });
            true
        }
    }
}

/// Checks an engine reopened after a crash against what callers were told.
fn check_reopened(engine: &Engine, log: &BTreeMap<String, Told>, image: &str) -> TestResult {
    for (name, told) in log {
        let info = engine.record(&key(name))?;
        let what = format!("{image} image, key {name}, told {told:?}, found {info:?}");
        let Some(info) = info else {
            assert!(told.claimed.is_none(), "acknowledged claim lost: {what}");
            continue;
        };
        match told.claimed {
            Some(token) => assert_eq!(info.fencing_token, token, "{what}"),
            // Its batch committed although the caller heard an error.
            None => assert!(told.claim_failed, "a record nobody claimed: {what}"),
        }
        match info.state {
            State::Completed => {
                assert!(
                    told.completed || told.complete_failed,
                    "COMPLETED without a completion: {what}"
                );
                let stored = info.response.as_ref().map(|e| e.body.clone());
                assert_eq!(stored, Some(body(name)), "{what}");
                match engine.begin(&key(name), fingerprint())? {
                    Begin::Replay(r) => assert_eq!(r.envelope.body, body(name), "{what}"),
                    other => panic!("expected a replay, got {other:?}: {what}"),
                }
            }
            State::Processing | State::Unknown => {
                assert!(!told.completed, "acknowledged completion lost: {what}");
            }
            other => panic!("unexpected state {other:?}: {what}"),
        }
    }
    Ok(())
}

/// Crashes `backend` under `engine`, then reopens both the durable image
/// and the live one (every unsynced write happened to reach the disk) and
/// checks each against `log`.
fn crash_and_check(
    clock: &ManualClock,
    backend: &CrashBackend,
    engine: Engine,
    log: &Log,
) -> TestResult {
    let live = backend.live_image();
    let durable = backend.crash();
    drop(engine);
    let log = log.lock().unwrap_or_else(PoisonError::into_inner).clone();
    for (image, bytes) in [("durable", durable), ("live", live)] {
        let engine = open(clock, CrashBackend::from_image(bytes, Faults::default()))?;
        check_reopened(&engine, &log, image)?;
    }
    Ok(())
}

/// Where the fault is.
#[derive(Clone, Copy, Debug)]
enum Fault {
    Write(u64),
    Sync(u64, FailedSync),
}

impl Fault {
    fn arm(self, faults: &Faults) {
        match self {
            Fault::Write(n) => faults.fail_write(n),
            Fault::Sync(n, what) => {
                faults.on_failed_sync(what);
                faults.fail_sync(n);
            }
        }
    }
}

/// One thread claims and completes `keys` keys in sequence (the number of
/// writes and syncs is the same every run). Returns the `write` and
/// `sync_data` calls the workload made, and whether the fault fired.
fn sequential_run(
    fault: Option<Fault>,
    keys: usize,
) -> Result<(u64, u64, bool), Box<dyn Error + Send + Sync>> {
    let clock = ManualClock::new(T0);
    let backend = CrashBackend::new();
    let faults = backend.faults();
    let engine = open(&clock, backend.clone())?;
    let (w0, s0) = (faults.writes(), faults.syncs());
    if let Some(fault) = fault {
        fault.arm(&faults);
    }
    let log = Log::default();
    let mut failed = false;
    for i in 0..keys {
        let name = format!("seq-{i}");
        if failed {
            // Every call after the failure is refused as poisoned.
            let e = engine.begin(&key(&name), fingerprint()).err();
            assert!(
                e.as_ref().is_some_and(is_poisoned),
                "after the fault: {e:?}"
            );
            continue;
        }
        failed = claim_and_complete(&engine, &name, &log);
    }
    let counts = (faults.writes() - w0, faults.syncs() - s0);
    let fired = faults.fired() > 0;
    assert_eq!(
        fired, failed,
        "{fault:?}: a fault fired iff a caller heard an error"
    );
    crash_and_check(&clock, &backend, engine, &log)?;
    Ok((counts.0, counts.1, fired))
}

/// Every `write` and every `sync_data` of a small sequential workload fails
/// once, in turn (and a failed sync both with and without its data reaching
/// the disk): the caller of the failed commit hears `Error::Poisoned`, so
/// does every later call, and after a crash nothing acknowledged is lost.
#[test]
fn every_write_and_sync_of_a_workload_fails_once() -> TestResult {
    const KEYS: usize = 4;
    let (writes, syncs, fired) = sequential_run(None, KEYS)?;
    assert!(!fired);
    assert!(writes > 0 && syncs > 0, "{writes} writes, {syncs} syncs");
    for n in 1..=writes {
        let (_, _, fired) = sequential_run(Some(Fault::Write(n)), KEYS)?;
        assert!(fired, "write #{n} of {writes} never failed");
    }
    for n in 1..=syncs {
        for what in [FailedSync::Lost, FailedSync::Persisted] {
            let (_, _, fired) = sequential_run(Some(Fault::Sync(n, what)), KEYS)?;
            assert!(fired, "sync #{n} of {syncs} never failed");
        }
    }
    Ok(())
}

/// Several threads claim and complete keys while one write or sync of a
/// group commit fails: every caller of the failed batch hears an error,
/// the engine is poisoned, and after a crash every acknowledged claim and
/// completion is there, and an unacknowledged completion is either absent
/// or exact.
#[test]
fn a_failed_group_commit_loses_nothing_acknowledged() -> TestResult {
    const THREADS: usize = 4;
    const PER_THREAD: usize = 6;
    let mut faults_fired = 0;
    let positions: Vec<Fault> = (1..=12)
        .map(Fault::Write)
        .chain((1..=6).map(|n| Fault::Sync(n, FailedSync::Lost)))
        .chain((1..=6).map(|n| Fault::Sync(n, FailedSync::Persisted)))
        .collect();
    for fault in positions {
        let clock = ManualClock::new(T0);
        let backend = CrashBackend::new();
        let faults = backend.faults();
        let engine = Arc::new(open(&clock, backend.clone())?);
        fault.arm(&faults);
        let log = Log::default();
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let (engine, log) = (engine.clone(), log.clone());
                s.spawn(move || {
                    for i in 0..PER_THREAD {
                        claim_and_complete(&engine, &format!("t{t}-{i}"), &log);
                    }
                });
            }
        });
        let fired = faults.fired() > 0;
        let heard_error = log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .any(|t| !t.errors.is_empty());
        assert_eq!(
            fired, heard_error,
            "{fault:?}: a fault fired iff a caller heard an error"
        );
        if fired {
            faults_fired += 1;
            let after = engine.begin(&key("after"), fingerprint()).err();
            assert!(
                after.as_ref().is_some_and(is_poisoned),
                "{fault:?}: {after:?}"
            );
        }
        let engine = Arc::into_inner(engine).ok_or("threads still hold the engine")?;
        crash_and_check(&clock, &backend, engine, &log)?;
    }
    assert!(faults_fired > 0, "no fault position was reached");
    Ok(())
}

/// Claims and completes `name`; the engine must acknowledge both.
fn complete_ok(engine: &Engine, name: &str) -> TestResult {
    match engine.begin(&key(name), fingerprint())? {
        Begin::Claimed(claim) => Ok(engine.complete(claim, Envelope::new(1, 201, body(name)))?),
        other => Err(format!("{name}: expected Claimed, got {other:?}").into()),
    }
}

/// The stored bytes of `name` replay exactly.
fn replays(engine: &Engine, name: &str) -> TestResult {
    match engine.begin(&key(name), fingerprint())? {
        Begin::Replay(r) if r.envelope.body == body(name) => Ok(()),
        other => Err(format!("{name}: expected its replay, got {other:?}").into()),
    }
}

/// The disk fills in the middle of a run, then space is freed. The first
/// refused write poisons the engine; every later write is refused as
/// poisoned, even after space is freed, while replays of completed keys
/// (pure reads) go on; a reopen on the healed disk replays every
/// acknowledged outcome and claims again. (An engine that can reopen its
/// storage by itself gets write service back without the app: see
/// `write_service_comes_back_after_space_is_freed`.)
#[test]
fn a_full_disk_poisons_until_reopened() -> TestResult {
    let clock = ManualClock::new(T0);
    let backend = FailingBackend::new();
    let faults = backend.faults();
    let engine = open(&clock, backend.clone())?;
    complete_ok(&engine, "before")?;
    assert_eq!(engine.poisoned(), None);

    faults.disk_full();
    let e = engine.begin(&key("during"), fingerprint()).err();
    assert!(e.as_ref().is_some_and(is_poisoned), "{e:?}");
    // The app can see it, to reopen the file (or exit to be restarted).
    let cause = engine.poisoned().ok_or("not reported as poisoned")?;
    assert!(cause.contains("disk full"), "{cause}");
    // A pure read is still served.
    replays(&engine, "before")?;

    faults.heal();
    let e = engine.begin(&key("after"), fingerprint()).err();
    assert!(e.as_ref().is_some_and(is_poisoned), "after healing: {e:?}");
    replays(&engine, "before")?;
    drop(engine);

    // Reopened on the healed disk: nothing acknowledged is lost, the claim
    // that hit the full disk never committed, and writes work again.
    let engine = open(&clock, backend.clone())?;
    replays(&engine, "before")?;
    assert!(engine.record(&key("during"))?.is_none());
    complete_ok(&engine, "during")?;
    complete_ok(&engine, "after")?;
    drop(engine);

    // Reopened while the disk is still full: redb writes while opening, so
    // the open fails (a storage error: see
    // `opening_on_a_full_disk_is_a_storage_error`); once space is freed it
    // opens and serves what was acknowledged.
    faults.disk_full();
    assert!(open(&clock, backend.clone()).is_err());
    faults.heal();
    let engine = open(&clock, backend)?;
    replays(&engine, "before")?;
    replays(&engine, "after")
}

/// A disk that is full while the database is opened is a storage failure,
/// and the error must say so: an operator told "not a usable redb
/// database" would treat a healthy file as damaged.
#[test]
fn opening_on_a_full_disk_is_a_storage_error() -> TestResult {
    let clock = ManualClock::new(T0);
    let backend = FailingBackend::new();
    drop(open(&clock, backend.clone())?);
    backend.faults().disk_full();
    match Engine::builder()
        .clock(clock)
        .sweep_interval(None)
        .open_with_backend(backend)
    {
        Err(e @ idempotency::OpenError::Storage { .. }) => {
            assert!(e.to_string().contains("disk full"), "{e}");
            Ok(())
        }
        Err(e) => Err(format!("expected a storage error, got {e:?} ({e})").into()),
        Ok(_) => Err("opened on a full disk".into()),
    }
}

/// Issue 14 item 4: while the disk is full, replays of completed keys
/// (pure reads) keep working; only writes are refused.
#[test]
fn replays_keep_working_while_the_disk_is_full() -> TestResult {
    let clock = ManualClock::new(T0);
    let backend = FailingBackend::new();
    let faults = backend.faults();
    let engine = open(&clock, backend)?;
    complete_ok(&engine, "before")?;
    faults.disk_full();
    assert!(engine.begin(&key("during"), fingerprint()).is_err());
    replays(&engine, "before")
}

/// Issue 14 item 4: once space is freed, write service comes back without
/// a reopen by the app (the engine reopens the database itself, at most
/// once a second of its clock), replays go on throughout, and nothing
/// acknowledged is lost.
#[test]
fn write_service_comes_back_after_space_is_freed() -> TestResult {
    let clock = ManualClock::new(T0);
    let backend = FailingBackend::new();
    let faults = backend.faults();
    let health = faults.clone();
    let engine = Engine::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .lease(Duration::from_secs(60))
        .open_with_backend_factory(move || Ok(backend.clone()), move || health.healthy())?;
    complete_ok(&engine, "before")?;
    faults.disk_full();
    let e = engine
        .begin(&key("during"), fingerprint())
        .err()
        .ok_or("claimed on a full disk")?;
    assert!(is_poisoned(&e), "{e:?}");
    assert!(engine.poisoned().is_some());
    // Still full: a reopen attempt fails (or is not due); replays go on.
    clock.advance(Duration::from_secs(2));
    assert!(engine.begin(&key("during"), fingerprint()).is_err());
    replays(&engine, "before")?;
    faults.heal();
    // The next attempt is due a second after the last one.
    clock.advance(Duration::from_secs(2));
    let Begin::Claimed(claim) = engine.begin(&key("after"), fingerprint())? else {
        return Err("writes did not come back after healing".into());
    };
    assert!(engine.poisoned().is_none());
    engine.complete(claim, Envelope::new(1, 201, body("after")))?;
    replays(&engine, "before")?;
    replays(&engine, "after")?;
    // The key refused during the fault was never claimed: it is free.
    assert!(matches!(
        engine.begin(&key("during"), fingerprint())?,
        Begin::Claimed(_)
    ));
    Ok(())
}

/// Without a way to reopen (a backend given by value), a poisoned engine
/// stays poisoned and says so; replays still work.
#[test]
fn an_engine_that_cannot_reopen_stays_poisoned() -> TestResult {
    let clock = ManualClock::new(T0);
    let backend = FailingBackend::new();
    let faults = backend.faults();
    let engine = open(&clock, backend)?;
    complete_ok(&engine, "before")?;
    faults.disk_full();
    assert!(engine.begin(&key("during"), fingerprint()).is_err());
    faults.heal();
    clock.advance(Duration::from_secs(5));
    let e = engine
        .begin(&key("after"), fingerprint())
        .err()
        .ok_or("claimed on a poisoned engine that cannot reopen")?;
    assert!(is_poisoned(&e), "{e:?}");
    replays(&engine, "before")
}

/// A storage error met while a job is applied (not at commit: here redb
/// syncs while it grows the file for a large response) must reach its
/// caller as `Error::Poisoned`. Today `Call::apply`
/// (src/store/redb/writer.rs) drops the caller's reply channel on
/// `OpError::Fatal` before `Writer::commit` sets the poison, so a caller
/// that wakes first hears `Error::Closed` ("the engine was dropped"). Racy:
/// this test repeats the fault until it sees the wrong error.
#[test]
fn a_storage_error_during_apply_is_reported_as_poisoned() -> TestResult {
    let big = vec![b'x'; 4 << 20];
    for round in 0..200 {
        let clock = ManualClock::new(T0);
        let backend = FailingBackend::new();
        let faults = backend.faults();
        let engine = Engine::builder()
            .clock(clock)
            .sweep_interval(None)
            .max_response_bytes(big.len() + 1024)
            .open_with_backend(backend)?;
        let Begin::Claimed(claim) = engine.begin(&key("big"), fingerprint())? else {
            return Err("expected a claim".into());
        };
        // The first sync of this commit is redb's, while it grows the file
        // inside the transaction.
        faults.fail_sync(1);
        let e = engine
            .complete(claim, Envelope::new(1, 201, big.clone()))
            .err()
            .ok_or("completed although a sync failed")?;
        assert!(is_poisoned(&e), "round {round}: {e:?}");
    }
    Ok(())
}

/// How many syncs one commit of a 4 MiB response makes (more than one: redb
/// syncs while it grows the file, inside the transaction).
#[test]
fn a_growing_commit_syncs_inside_the_transaction() -> TestResult {
    let big = vec![b'x'; 4 << 20];
    let backend = FailingBackend::new();
    let faults = backend.faults();
    let engine = Engine::builder()
        .clock(ManualClock::new(T0))
        .sweep_interval(None)
        .max_response_bytes(big.len() + 1024)
        .open_with_backend(backend)?;
    let Begin::Claimed(claim) = engine.begin(&key("big"), fingerprint())? else {
        return Err("expected a claim".into());
    };
    let before = faults.syncs();
    engine.complete(claim, Envelope::new(1, 201, big))?;
    let syncs = faults.syncs() - before;
    assert!(syncs > 1, "{syncs} syncs");
    Ok(())
}

/// The background sweeper survives a poisoning the engine recovers from:
/// ticks while the disk is full are skipped, not the end of the sweeper
/// (it used to stop for good, so after the reopen nothing swept any more).
#[test]
fn the_sweeper_keeps_running_after_the_engine_reopens_itself() -> TestResult {
    let clock = ManualClock::new(T0);
    let backend = FailingBackend::new();
    let faults = backend.faults();
    let health = faults.clone();
    let engine = Engine::builder()
        .clock(clock.clone())
        .sweep_interval(Some(Duration::from_millis(20)))
        .ttl(Duration::from_secs(1))
        .lease(Duration::from_secs(60))
        .open_with_backend_factory(move || Ok(backend.clone()), move || health.healthy())?;
    complete_ok(&engine, "before")?;
    faults.disk_full();
    assert!(engine.begin(&key("during"), fingerprint()).is_err());
    // A few sweeper ticks while the disk is still full.
    std::thread::sleep(Duration::from_millis(300));
    faults.heal();
    clock.advance(Duration::from_secs(2));
    assert!(engine.poisoned().is_none(), "the engine did not reopen");
    // "before" expired a second ago; a live sweeper deletes it within a
    // few ticks.
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while engine.stats()?.expired_deleted == 0 {
        if std::time::Instant::now() > deadline {
            return Err(format!("no sweep after the reopen: {:?}", engine.stats()?).into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// After a write failed inside redb, redb refuses reads of pages it has not
/// cached (`PreviousIo`): replays of older keys on the poisoned engine are
/// storage errors (found on a real full disk: thousands of keys). The
/// contract kept: never a wrong answer (a replay is the stored bytes or a
/// storage error, never a claim or a mismatch), and once storage works the
/// engine reopens and every key replays its exact bytes.
#[test]
fn cold_replays_after_a_failed_write_are_errors_then_come_back() -> TestResult {
    let clock = ManualClock::new(T0);
    let backend = FailingBackend::new();
    let faults = backend.faults();
    let names: Vec<String> = (0..300).map(|i| format!("before-{i}")).collect();
    let stored = |name: &str| {
        let mut bytes = body(name);
        bytes.resize(4000, b'.');
        bytes
    };
    {
        let engine = open(&clock, backend.clone())?;
        for name in &names {
            let Begin::Claimed(claim) = engine.begin(&key(name), fingerprint())? else {
                return Err("expected a claim".into());
            };
            engine.complete(claim, Envelope::new(1, 201, stored(name)))?;
        }
    }
    // Opened again, so most of those records' pages are not cached.
    let make = backend.clone();
    let health = faults.clone();
    let engine = Engine::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .lease(Duration::from_secs(60))
        .open_with_backend_factory(move || Ok(make.clone()), move || health.healthy())?;
    faults.disk_full();
    faults.fail_write(1);
    assert!(engine.begin(&key("during"), fingerprint()).is_err());
    let mut errors = 0;
    for name in &names {
        match engine.begin(&key(name), fingerprint()) {
            Ok(Begin::Replay(r)) if r.envelope.body == stored(name) => {}
            Err(idempotency::Error::Storage { .. } | idempotency::Error::Poisoned { .. }) => {
                errors += 1;
            }
            other => return Err(format!("{name}: a wrong answer while poisoned: {other:?}").into()),
        }
    }
    eprintln!(
        "{errors} of {} cold replays were storage errors while poisoned",
        names.len()
    );
    faults.heal();
    clock.advance(Duration::from_secs(2));
    assert!(engine.poisoned().is_none(), "the engine did not reopen");
    for name in &names {
        match engine.begin(&key(name), fingerprint())? {
            Begin::Replay(r) if r.envelope.body == stored(name) => {}
            other => return Err(format!("{name} after the reopen: {other:?}").into()),
        }
    }
    Ok(())
}
