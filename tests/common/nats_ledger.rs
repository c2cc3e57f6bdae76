//! A ledger for the JetStream fault tests (`tests/fault29_*.rs`): payment
//! events put in an engine's outbox, a handler that books each in a redb
//! table of the consumer's engine (+1 per booking, so a double booking
//! shows as 2), and a read of those bookings.

#![allow(dead_code)] // each test file uses what it needs

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::nats::async_nats::jetstream::{consumer, stream};
use idempotency::nats::Incoming;
use idempotency::{
    Begin, BoxError, Engine, Envelope, Fingerprint, IdempotencyKey, LocalTx, OutgoingMessage,
};
use redb::ReadableTable;

/// Bookings by message id.
pub const LEDGER: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("ledger");

/// Books `incoming` in [`LEDGER`], in the inbox mark's transaction.
///
/// # Errors
///
/// Not a redb engine, or redb refused the write.
pub fn book(incoming: &Incoming, tx: &mut LocalTx<'_>) -> Result<(), BoxError> {
    let txn = tx.redb().ok_or("not a redb engine")?;
    let mut table = txn.open_table(LEDGER)?;
    let before = table
        .get(incoming.message_id.as_str())?
        .map_or(0, |v| v.value());
    table.insert(incoming.message_id.as_str(), before + 1)?;
    Ok(())
}

/// Bookings per message id, read inside one local write of `engine` (the
/// ledger lives in the engine's redb file, which the engine holds open).
///
/// # Errors
///
/// The engine's, or redb's.
pub fn bookings(engine: &Engine) -> Result<BTreeMap<String, u64>, BoxError> {
    let rows = Arc::new(Mutex::new(BTreeMap::new()));
    let slot = Arc::clone(&rows);
    let key = IdempotencyKey::new(
        "test:read-ledger",
        format!("{:?}", std::time::Instant::now()),
    )?;
    let claim = match engine.begin(&key, Fingerprint::of_json(b"{}", &[])?)? {
        Begin::Claimed(c) => c,
        other => return Err(format!("reading the ledger: {other:?}").into()),
    };
    engine.complete_local(claim, move |tx| {
        let txn = tx.redb().ok_or("not a redb engine")?;
        let mut found = BTreeMap::new();
        let table = txn.open_table(LEDGER)?;
        for entry in table.iter()? {
            let (k, v) = entry?;
            found.insert(k.value().to_owned(), v.value());
        }
        *slot.lock().map_err(|_| "poisoned")? = found;
        Ok(Envelope::new(0, 200, Vec::new()))
    })?;
    let rows = rows.lock().map_err(|_| "poisoned")?.clone();
    Ok(rows)
}

/// Payment `i`'s event to `subject` in `engine`'s outbox (one completion);
/// returns its message id (`<claim reference>/0`).
///
/// # Errors
///
/// The engine's (a full disk among them).
pub fn event(engine: &Engine, subject: &str, i: usize) -> Result<String, BoxError> {
    let key = IdempotencyKey::new("tenant-1:pay", format!("p-{i:05}"))?;
    let claim = match engine.begin(&key, Fingerprint::of_json(b"{}", &[])?)? {
        Begin::Claimed(c) => c,
        other => return Err(format!("payment {i}: {other:?}").into()),
    };
    let id = format!("{}/0", claim.reference());
    engine.complete_with_messages(
        claim,
        Envelope::new(0, 201, "paid"),
        vec![OutgoingMessage::new(
            subject.to_owned(),
            format!("{{\"payment\":{i}}}"),
        )],
    )?;
    Ok(id)
}

/// A durable pull consumer `name` on `stream`: explicit acks, unlimited
/// deliveries, redelivery after `ack_wait`.
///
/// # Errors
///
/// The server's.
pub async fn pull_consumer(
    stream: &stream::Stream,
    name: &str,
    ack_wait: Duration,
) -> Result<consumer::PullConsumer, BoxError> {
    Ok(stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(name.to_owned()),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait,
            ..Default::default()
        })
        .await?)
}
