//! A message consumer that never double-books: a ledger in the same redb
//! file as the engine, a fake queue that delivers every message at least
//! once (and often twice), and an outbox relay to a fake email sender whose
//! own inbox dedupes redeliveries.
//!
//! Run: `cargo run --release --example consumer`

use std::collections::BTreeMap;

use idempotency::{Engine, OutgoingMessage, Processed};
use redb::{ReadableDatabase, ReadableTable, TableDefinition};

/// The app's own table (any name not starting with `idempotency.`).
const LEDGER: TableDefinition<&str, i64> = TableDefinition::new("ledger");

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("consumer.redb");
    let engine = Engine::builder().open(&db)?;
    let inbox = engine.inbox("ledger-writer")?;

    // The fake queue: 5 payment events, each delivered 1-3 times, shuffled.
    let events = [
        ("evt-1", 500),
        ("evt-2", -200),
        ("evt-3", 1250),
        ("evt-4", 75),
        ("evt-5", -40),
    ];
    let mut deliveries = Vec::new();
    for (i, ev) in events.iter().enumerate() {
        for _ in 0..=(i % 3) {
            deliveries.push(*ev);
        }
    }
    deliveries.rotate_left(3);

    let (mut done, mut duplicates) = (0, 0);
    for (id, amount) in deliveries.iter().copied() {
        let entry = id.to_owned();
        // Ledger row, outbox email and processed mark: one transaction.
        let outcome = inbox.process_local(id, move |tx| {
            let mut ledger = tx.redb().ok_or("not on redb")?.open_table(LEDGER)?;
            ledger.insert(entry.as_str(), amount)?;
            drop(ledger);
            tx.send(OutgoingMessage::new(
                "email",
                format!("booked {amount} for {entry}"),
            ));
            Ok(())
        })?;
        match outcome {
            Processed::Done => done += 1,
            Processed::Duplicate => duplicates += 1,
            other => println!("{id}: {other:?}"),
        }
    }

    // The relay: take, send, mark. The email sender dedupes by message id
    // (here with its own inbox), so a relay crash between send and mark
    // cannot send an email twice.
    let sender = Engine::builder().in_memory()?;
    let mut sent = BTreeMap::new();
    let outbox = engine.outbox();
    loop {
        let batch = outbox.take(2)?;
        if batch.is_empty() {
            break;
        }
        for msg in &batch {
            let payload = String::from_utf8_lossy(&msg.payload).into_owned();
            let id = msg.id.clone();
            if let Processed::Done = sender.inbox("email")?.process_local(&msg.id, |_| Ok(()))? {
                sent.insert(id, payload);
            }
        }
        outbox.mark_published(&batch.iter().map(|m| m.seq).collect::<Vec<_>>())?;
    }
    drop(engine);

    let rows = {
        let db = redb::Database::open(&db)?;
        let txn = db.begin_read()?;
        let ledger = txn.open_table(LEDGER)?;
        ledger.iter()?.count()
    };
    println!("deliveries: {}", deliveries.len());
    println!("processed:  {done}");
    println!("duplicates: {duplicates}");
    println!("ledger rows: {rows}");
    println!("emails sent: {}", sent.len());
    for (id, body) in &sent {
        println!("  {id}: {body}");
    }
    if rows != events.len() || sent.len() != events.len() {
        return Err("a message was booked or emailed twice, or lost".into());
    }
    Ok(())
}
