//! Local writes (isolated jobs that run the app's closure on the writer
//! thread and commit durably, after the writer commits its open
//! transaction) among pipelined group commits.
//!
//! - Reads issued from inside a local write's closure (point reads,
//!   listings, the outbox, `in_doubt`, `verify`, entity state) answer
//!   without waiting for the writer, which is busy running that closure,
//!   and see what was acknowledged before; writes from inside get
//!   `Error::Reentrant`. Each call runs under a watchdog: a deadlock fails
//!   the test instead of hanging it.
//! - Local writes interleaved with normal traffic from many threads all
//!   commit with their app rows; after a close and a reopen every
//!   acknowledged outcome is there.

use std::error::Error;
use std::sync::Arc;
use std::time::Duration;

use idempotency::{
    Begin, Engine, Envelope, Fingerprint, IdempotencyKey, LocalRun, OutgoingMessage, RecordFilter,
};
use redb::{ReadableDatabase, ReadableTableMetadata, TableDefinition};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const LEDGER: TableDefinition<&str, u64> = TableDefinition::new("app.ledger");

fn key(name: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("local", name)
}

fn fp(name: &str) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(format!(r#"{{"k":"{name}"}}"#).as_bytes(), &[])
}

fn open(path: &std::path::Path) -> Result<Engine, idempotency::OpenError> {
    Engine::builder()
        .lease(Duration::from_secs(3600))
        .sweep_interval(None)
        .open(path)
}

/// Runs `f` on its own thread; an error if it does not return in time.
fn within<T: Send + 'static>(
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Box<dyn Error + Send + Sync>> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(20))
        .map_err(|_| format!("{what}: no answer after 20 s (deadlock?)").into())
}

#[test]
fn reads_from_inside_a_local_write_answer_and_writes_are_reentrant() -> TestResult {
    let dir = tempfile::tempdir()?;
    let engine = Arc::new(open(&dir.path().join("idem.redb"))?);
    // Acknowledged work of every kind, some of it still in the writer's
    // open transaction (only in the overlay) when the local write starts.
    for i in 0..40 {
        let name = format!("before-{i}");
        let Begin::Claimed(c) = engine.begin(&key(&name)?, fp(&name)?)? else {
            return Err("not claimed".into());
        };
        let msg = OutgoingMessage::new("t", name.clone().into_bytes());
        engine.complete_with_messages(c, Envelope::new(1, 200, name.clone()), vec![msg])?;
        engine.transition(&format!("e-{i}"), &[], "open")?;
    }
    let dropped = key("dropped")?;
    drop(engine.begin(&dropped, fp("dropped")?)?);
    let inside = engine.clone();
    let report = within("execute_local", move || -> TestResult {
        let seen = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let log = seen.clone();
        let e = inside.clone();
        let run = inside.execute_local(&key("local-1")?, fp("local-1")?, move |tx| {
            let note = |s: String| log.lock().expect("lock").push(s);
            match e.begin(&key("before-39")?, fp("before-39")?)? {
                Begin::Replay(r) if r.envelope.body == b"before-39" => {}
                other => note(format!("point read: {other:?}")),
            }
            match e.entity_state("e-39")? {
                Some((s, _)) if s == "open" => {}
                other => note(format!("entity: {other:?}")),
            }
            let listed = e.records(&RecordFilter::default())?.len();
            if listed < 41 {
                note(format!("records: {listed}"));
            }
            let outbox = e.outbox().take(1000)?.len();
            if outbox != 40 {
                note(format!("outbox: {outbox}"));
            }
            let _ = e.in_doubt(100)?;
            if !e.verify()?.is_sound() {
                note("verify: unsound".into());
            }
            let _ = e.stats()?;
            match e.begin(&key("inner")?, fp("inner")?) {
                Err(idempotency::Error::Reentrant) => {}
                other => note(format!("write from inside: {other:?}")),
            }
            match e.flush() {
                Err(idempotency::Error::Reentrant) => {}
                other => note(format!("flush from inside: {other:?}")),
            }
            let mut ledger = tx.redb().ok_or("not redb")?.open_table(LEDGER)?;
            ledger.insert("local-1", 1)?;
            Ok(Envelope::new(1, 200, "local"))
        })?;
        assert!(matches!(run, LocalRun::Executed), "{run:?}");
        let seen = seen.lock().map_err(|_| "lock")?.clone();
        assert!(seen.is_empty(), "inside the local write: {seen:?}");
        Ok(())
    })?;
    report?;
    Ok(())
}

/// Many threads: normal claims and completions, local writes with app
/// rows, transitions, and `flush`; then a close, a reopen, and a check of
/// everything acknowledged.
#[test]
fn local_writes_among_pipelined_traffic_all_commit() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.redb");
    let engine = open(&path)?;
    const THREADS: usize = 6;
    const OPS: usize = 120;
    std::thread::scope(|s| -> TestResult {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let engine = &engine;
                s.spawn(move || -> TestResult {
                    for n in 0..OPS {
                        let name = format!("t{t}-{n}");
                        if (n + t) % 3 == 0 {
                            let row = name.clone();
                            let run =
                                engine.execute_local(&key(&name)?, fp(&name)?, move |tx| {
                                    let txn = tx.redb().ok_or("not redb")?;
                                    txn.open_table(LEDGER)?.insert(row.as_str(), n as u64)?;
                                    Ok(Envelope::new(1, 201, row.clone()))
                                })?;
                            if !matches!(run, LocalRun::Executed) {
                                return Err(format!("{name}: {run:?}").into());
                            }
                        } else {
                            let Begin::Claimed(c) = engine.begin(&key(&name)?, fp(&name)?)? else {
                                return Err(format!("{name} not claimed").into());
                            };
                            engine.complete(c, Envelope::new(1, 200, name.clone()))?;
                        }
                        // Read back at once, from the same thread.
                        match engine.begin(&key(&name)?, fp(&name)?)? {
                            Begin::Replay(r) if r.envelope.body == name.as_bytes() => {}
                            other => return Err(format!("{name} read back: {other:?}").into()),
                        }
                        if n % 17 == 0 {
                            engine.flush()?;
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| "worker panicked")??;
        }
        Ok(())
    })?;
    drop(engine);
    let engine = open(&path)?;
    let mut locals = 0;
    for t in 0..THREADS {
        for n in 0..OPS {
            let name = format!("t{t}-{n}");
            match engine.begin(&key(&name)?, fp(&name)?)? {
                Begin::Replay(r) if r.envelope.body == name.as_bytes() => {}
                other => return Err(format!("{name} after reopen: {other:?}").into()),
            }
            locals += usize::from((n + t) % 3 == 0);
        }
    }
    drop(engine);
    let db = redb::Database::open(&path)?;
    let rows = db.begin_read()?.open_table(LEDGER)?.len()?;
    assert_eq!(rows as usize, locals, "every local write's app row");
    Ok(())
}

/// `Engine::poisoned()` is `None` while the engine is healthy, also when
/// asked from inside a local write's closure (a health check or a log
/// line in app code). It used to answer `Some(..)` there: it is built on
/// the write path's check, which refuses calls from the writer thread with
/// `Error::Reentrant`.
#[test]
fn poisoned_from_inside_a_local_write_is_none_while_healthy() -> TestResult {
    let dir = tempfile::tempdir()?;
    let engine = Arc::new(open(&dir.path().join("idem.redb"))?);
    let inside = engine.clone();
    let (k, f) = (key("health")?, fp("health")?);
    let seen = within(
        "execute_local",
        move || -> Result<Option<String>, String> {
            let (tx, rx) = crossbeam_channel::bounded(1);
            let e = inside.clone();
            inside
                .execute_local(&k, f, move |_| {
                    let _ = tx.send(e.poisoned());
                    Ok(Envelope::new(1, 200, "ok"))
                })
                .map_err(|e| e.to_string())?;
            rx.recv().map_err(|e| e.to_string())
        },
    )??;
    assert_eq!(seen, None, "a healthy engine said it was poisoned");
    assert_eq!(engine.poisoned(), None);
    Ok(())
}
