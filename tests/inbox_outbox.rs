//! Guards the message-consumer path against double effects: duplicate and
//! concurrent deliveries, a crash inside the app's local write, a relay crash
//! between publishing and marking, and racing state transitions.
//!
//! The crash tests crash for real: the test binary re-runs itself as a child
//! process (selected by `IDEM_CHILD`) that calls `std::process::abort()` at a
//! named point; the parent then reopens the database file.

use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Barrier};

use idempotency::{Engine, OutgoingMessage, Processed, Receive, Transition};
use redb::{ReadableDatabase, ReadableTableMetadata, TableDefinition};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The app's own table, in the engine's database file.
const LEDGER: TableDefinition<&str, u64> = TableDefinition::new("ledger");

fn open_engine(path: &Path) -> idempotency::Result<Engine> {
    Ok(Engine::builder().sweep_interval(None).open(path)?)
}

/// Processes one delivery of `msg` the way the example consumer does: a
/// ledger row and an outbox email, committed with the processed mark.
fn consume(engine: &Engine, msg: &str) -> idempotency::Result<Processed> {
    let id = msg.to_owned();
    engine.inbox("billing")?.process_local(msg, move |tx| {
        let mut ledger = tx.redb().ok_or("not on redb")?.open_table(LEDGER)?;
        ledger.insert(id.as_str(), 500)?;
        drop(ledger);
        tx.send(OutgoingMessage::new("email", format!("receipt for {id}")));
        Ok(())
    })
}

fn ledger_rows(engine_path: &Path) -> Result<u64, Box<dyn std::error::Error>> {
    let db = redb::Database::open(engine_path)?;
    let txn = db.begin_read()?;
    Ok(match txn.open_table(LEDGER) {
        Ok(t) => t.len()?,
        Err(redb::TableError::TableDoesNotExist(_)) => 0,
        Err(e) => return Err(e.into()),
    })
}

#[test]
fn duplicate_and_concurrent_deliveries_have_one_effect() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("consumer.redb");
    let engine = Arc::new(open_engine(&path)?);
    assert!(matches!(consume(&engine, "m1")?, Processed::Done));
    assert!(matches!(consume(&engine, "m1")?, Processed::Duplicate));

    // 8 threads deliver m2 at once.
    let barrier = Arc::new(Barrier::new(8));
    let handles: Vec<_> = (0..8)
        .map(|_| {
            let (engine, barrier) = (engine.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                consume(&engine, "m2")
            })
        })
        .collect();
    let mut done = 0;
    for h in handles {
        match h.join().map_err(|_| "delivery thread panicked")?? {
            Processed::Done => done += 1,
            Processed::Duplicate | Processed::Processing { .. } => {}
            Processed::InDoubt(p) => return Err(format!("unexpected unknown {p:?}").into()),
        }
    }
    assert_eq!(done, 1);
    assert_eq!(engine.outbox().len()?, 2, "one email per message");

    // The claim-based path too: receive + ack, 8 threads at once.
    let barrier = Arc::new(Barrier::new(8));
    let handles: Vec<_> = (0..8)
        .map(|_| {
            let (engine, barrier) = (engine.clone(), barrier.clone());
            std::thread::spawn(move || -> idempotency::Result<bool> {
                barrier.wait();
                let inbox = engine.inbox("billing")?;
                match inbox.receive("m3")? {
                    Receive::Fresh(ticket) => {
                        ticket.ack_with_messages(vec![OutgoingMessage::new("email", "m3")])?;
                        Ok(true)
                    }
                    Receive::Duplicate | Receive::Processing { .. } => Ok(false),
                    Receive::InDoubt(_) => Ok(false),
                }
            })
        })
        .collect();
    let mut fresh = 0;
    for h in handles {
        if h.join().map_err(|_| "receive thread panicked")?? {
            fresh += 1;
        }
    }
    assert_eq!(fresh, 1);
    assert_eq!(engine.outbox().len()?, 3);
    let inbox = engine.inbox("billing")?;
    assert!(matches!(inbox.receive("m3")?, Receive::Duplicate));
    // Message ids are scoped per consumer.
    match engine.inbox("shipping")?.receive("m3")? {
        Receive::Fresh(ticket) => ticket.release()?,
        other => return Err(format!("expected a fresh delivery, got {other:?}").into()),
    }
    drop(engine);
    assert_eq!(ledger_rows(&path)?, 2);
    Ok(())
}

#[test]
fn failed_local_write_rolls_back_and_redelivery_processes_once() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("consumer.redb");
    let engine = open_engine(&path)?;
    let inbox = engine.inbox("billing")?;
    let err = inbox
        .process_local("m1", |tx| {
            let mut ledger = tx.redb().ok_or("not on redb")?.open_table(LEDGER)?;
            ledger.insert("m1", 1)?;
            Err("ledger rule violated".into())
        })
        .err()
        .ok_or("a failing write must be an error")?;
    assert!(err.to_string().contains("ledger rule violated"), "{err}");
    // The closure may not touch the engine's own tables (format 3's
    // records table: the engine creates format-3 files).
    let err =
        inbox
            .process_local("m1", |tx| {
                tx.redb().ok_or("not on redb")?.open_table(
                    TableDefinition::<&[u8], &[u8]>::new("idempotency.partitioned.records"),
                )?;
                Ok(())
            })
            .err()
            .ok_or("opening an engine table must fail")?;
    assert!(
        matches!(err, idempotency::Error::LocalWrite { .. }),
        "{err}"
    );
    assert!(matches!(consume(&engine, "m1")?, Processed::Done));
    drop(engine);
    assert_eq!(ledger_rows(&path)?, 1);
    Ok(())
}

/// The child role: does what `IDEM_CHILD` says, then aborts.
#[test]
fn child_entry() -> TestResult {
    let (Ok(role), Ok(path)) = (std::env::var("IDEM_CHILD"), std::env::var("IDEM_DB")) else {
        return Ok(()); // not a child: nothing to do
    };
    let engine = open_engine(Path::new(&path))?;
    match role.as_str() {
        "abort-inside-local-write" => {
            let _ = engine.inbox("billing")?.process_local("m1", |tx| {
                let mut ledger = tx.redb().ok_or("not on redb")?.open_table(LEDGER)?;
                ledger.insert("m1", 500)?;
                std::process::abort();
            });
        }
        "relay-abort-before-mark" => {
            let downstream = engine_path_downstream(&path);
            let down = Engine::builder().sweep_interval(None).open(&downstream)?;
            let batch = engine.outbox().take(10)?;
            for msg in &batch {
                deliver_downstream(&down, &msg.id)?;
            }
            std::process::abort();
        }
        other => return Err(format!("unknown child role {other}").into()),
    }
    Err("the child should have aborted".into())
}

fn engine_path_downstream(path: &str) -> String {
    format!("{path}.downstream")
}

/// A downstream consumer: counts effects in its own ledger, deduped by the
/// outbox message id.
fn deliver_downstream(down: &Engine, message_id: &str) -> idempotency::Result<Processed> {
    let id = message_id.to_owned();
    down.inbox("mailer")?.process_local(message_id, move |tx| {
        let mut ledger = tx.redb().ok_or("not on redb")?.open_table(LEDGER)?;
        ledger.insert(id.as_str(), 1)?;
        Ok(())
    })
}

fn run_child(role: &str, db: &Path) -> TestResult {
    let status = Command::new(std::env::current_exe()?)
        .args([
            "--exact", // `<file>::child_entry` where this file is a module of a test binary.
            concat!(module_path!(), "::child_entry")
                .split_once("::")
                .map_or("child_entry", |(_, t)| t),
            "--nocapture",
            "--test-threads=1",
        ])
        .env("IDEM_CHILD", role)
        .env("IDEM_DB", db)
        .status()?;
    assert!(!status.success(), "child {role} should have aborted");
    Ok(())
}

#[test]
fn crash_inside_local_write_leaves_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("consumer.redb");
    drop(open_engine(&path)?);
    run_child("abort-inside-local-write", &path)?;
    let engine = open_engine(&path)?;
    let key = idempotency::IdempotencyKey::inbox("billing", "m1")?;
    assert_eq!(engine.record(&key)?, None, "no dedup mark after the crash");
    assert!(matches!(consume(&engine, "m1")?, Processed::Done));
    assert!(matches!(consume(&engine, "m1")?, Processed::Duplicate));
    drop(engine);
    assert_eq!(ledger_rows(&path)?, 1, "the redelivery's row only");
    Ok(())
}

#[test]
fn relay_crash_redelivers_same_ids_and_downstream_dedupes() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("upstream.redb");
    let engine = open_engine(&path)?;
    for m in ["a", "b", "c"] {
        assert!(matches!(consume(&engine, m)?, Processed::Done));
    }
    let before: Vec<String> = engine
        .outbox()
        .take(10)?
        .into_iter()
        .map(|m| m.id)
        .collect();
    assert_eq!(before.len(), 3);
    drop(engine);

    run_child("relay-abort-before-mark", &path)?;

    // Restart: the same messages, same ids, are still there to publish.
    let engine = open_engine(&path)?;
    let batch = engine.outbox().take(10)?;
    let after: Vec<String> = batch.iter().map(|m| m.id.clone()).collect();
    assert_eq!(before, after);
    let down_path = engine_path_downstream(&path.to_string_lossy());
    let down = Engine::builder().sweep_interval(None).open(&down_path)?;
    for msg in &batch {
        assert!(matches!(
            deliver_downstream(&down, &msg.id)?,
            Processed::Duplicate
        ));
    }
    let seqs: Vec<u64> = batch.iter().map(|m| m.seq).collect();
    assert_eq!(engine.outbox().mark_published(&seqs)?, 3);
    assert_eq!(
        engine.outbox().mark_published(&seqs)?,
        0,
        "marking twice is harmless"
    );
    assert!(engine.outbox().is_empty()?);
    drop(down);
    assert_eq!(
        ledger_rows(Path::new(&down_path))?,
        3,
        "one effect per message"
    );
    Ok(())
}

#[test]
fn cancel_and_pay_race_has_one_winner() -> TestResult {
    let engine = Arc::new(Engine::builder().sweep_interval(None).in_memory()?);
    for i in 0..1000 {
        let order = format!("order-{i}");
        assert_eq!(
            engine.transition(&order, &[], "open")?,
            Transition::Applied { version: 1 }
        );
        let barrier = Arc::new(Barrier::new(2));
        let racers: Vec<_> = ["paid", "cancelled"]
            .into_iter()
            .map(|to| {
                let (engine, barrier, order) = (engine.clone(), barrier.clone(), order.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    engine.transition(&order, &["open"], to).map(|t| (to, t))
                })
            })
            .collect();
        let mut winners = Vec::new();
        let mut losers = Vec::new();
        for r in racers {
            match r.join().map_err(|_| "racer panicked")?? {
                (to, Transition::Applied { version: 2 }) => winners.push(to),
                (
                    _,
                    Transition::Conflict {
                        current,
                        version: 2,
                    },
                ) => losers.push(current),
                other => return Err(format!("unexpected {other:?}").into()),
            }
        }
        assert_eq!(winners.len(), 1, "{order}");
        assert_eq!(losers, vec![Some(winners[0].to_owned())], "{order}");
        // Repeating the winning transition is a success with no effect.
        assert_eq!(
            engine.transition(&order, &["open"], winners[0])?,
            Transition::AlreadyInState { version: 2 }
        );
    }
    Ok(())
}

/// A local write runs on the engine's writer thread: a write call back into
/// the same engine from inside it would wait for itself. It must fail fast
/// with a clear error, and the engine must keep serving.
#[test]
fn engine_write_inside_a_local_write_fails_instead_of_hanging() -> TestResult {
    let engine = Arc::new(Engine::builder().sweep_interval(None).in_memory()?);
    let inner = engine.clone();
    let err = engine
        .inbox("billing")?
        .process_local("m1", move |_| {
            let key = idempotency::IdempotencyKey::new("s", "k")?;
            let fp = idempotency::Fingerprint::of_json(b"{}", &[])?;
            drop(inner.begin(&key, fp)?);
            Ok(())
        })
        .err()
        .ok_or("a reentrant write must fail")?;
    assert!(err.to_string().contains("deadlock"), "{err}");
    assert!(matches!(consume(&engine, "m1")?, Processed::Done));
    Ok(())
}
