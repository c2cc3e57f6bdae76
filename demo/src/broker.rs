//! The demo's NATS JetStream path (cargo feature `nats`, `--nats URL`):
//! the API's outbox relayed to JetStream, and a ledger consumer that books
//! each `payment.succeeded` event exactly once.
//!
//! - **Stream** `PAYMENTS`, subjects `payment.>`, file storage, the default
//!   2-minute duplicate window (JetStream drops a second publish with the
//!   same `Nats-Msg-Id` inside it).
//! - **Relay** (in each `serve` process, beside the engine that holds the
//!   outbox): [`idempotency::nats::Relay`] publishes each outbox message
//!   with `Nats-Msg-Id` = its outbox id and marks it published only after
//!   the server's ack. A server killed between the two publishes it again
//!   from the next server, under the same id.
//! - **Ledger consumer** (in the demo's process, on an engine of its own in
//!   `books.redb`): a durable pull consumer with explicit acks and no
//!   delivery limit of its own (`max_deliver` -1: the engine decides when a
//!   message is dead, and never for one in doubt), read by
//!   [`idempotency::nats::Consumer`]: the booking row and the inbox mark
//!   commit in one transaction, then the message is acked, so a
//!   redelivery is a duplicate that books nothing.

use std::collections::BTreeMap;
use std::error::Error;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency::nats::async_nats::jetstream::{self, consumer, stream};
use idempotency::nats::{self, Backoff, ConsumePass, Consumer, Incoming, Relay};
use idempotency::{BoxError, Engine, LocalTx};
use redb::{ReadableDatabase, ReadableTable, TableDefinition};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::event::{PaymentSucceeded, SUBJECT};

/// The stream the events go to.
pub const STREAM: &str = "PAYMENTS";

/// The stream's subjects.
pub const STREAM_SUBJECTS: &str = "payment.>";

/// The ledger consumer's inbox (its scope in the books engine).
pub const INBOX: &str = "payments-ledger";

/// The books: payment id → how many times it was booked (a double booking
/// shows as 2). A table of the app's own, beside the engine's in
/// `books.redb`.
const BOOKS: TableDefinition<&str, u64> = TableDefinition::new("books");

type BrokerResult<T> = Result<T, Box<dyn Error + Send + Sync>>;

/// Connects (retrying for 10 s a server that is still starting) and makes
/// sure the stream exists.
async fn stream(url: &str) -> BrokerResult<(jetstream::Context, stream::Stream)> {
    let client = nats::connect(url, Backoff::default(), Duration::from_secs(10)).await?;
    let js = jetstream::new(client);
    let stream = js
        .get_or_create_stream(stream::Config {
            name: STREAM.to_owned(),
            subjects: vec![STREAM_SUBJECTS.to_owned()],
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .map_err(|e| format!("NATS {url}: cannot create the stream {STREAM}: {e}"))?;
    Ok((js, stream))
}

/// A relay of a server's outbox, running until [`RelayTask::stop`].
pub struct RelayTask {
    relay: Relay,
    stop: oneshot::Sender<()>,
    task: JoinHandle<u64>,
}

impl RelayTask {
    /// Connects to `url`, makes sure the stream exists, and relays
    /// `engine`'s outbox (a pass, then 50 ms idle when nothing was
    /// pending).
    ///
    /// # Errors
    ///
    /// The server cannot be reached within 10 s, or the stream cannot be
    /// created.
    pub async fn start(engine: Arc<Engine>, url: &str) -> BrokerResult<RelayTask> {
        let (js, _) = stream(url).await?;
        let relay = Relay::new(engine, js);
        let (stop, stopped) = oneshot::channel::<()>();
        let running = relay.clone();
        let task = tokio::spawn(async move {
            running
                .run(Duration::from_millis(50), Backoff::default(), async {
                    let _ = stopped.await;
                })
                .await
        });
        Ok(RelayTask { relay, stop, task })
    }

    /// Stops the loop and publishes what is still pending (one last pass),
    /// so a server stopped cleanly leaves nothing in its outbox. Returns
    /// how many messages it published in all.
    ///
    /// # Errors
    ///
    /// The last pass failed (those messages stay in the outbox, for the
    /// next relay).
    pub async fn stop(self) -> BrokerResult<u64> {
        let _ = self.stop.send(());
        let published = self.task.await.unwrap_or(0);
        let last = self.relay.relay_once().await?;
        Ok(published + last.published as u64)
    }
}

/// Publishes everything in `engine`'s outbox (passes until one publishes
/// nothing): the demo's in-process phases, whose engines have no relay
/// running, call it before they close their engine. Returns how many
/// messages it published.
///
/// # Errors
///
/// The server cannot be reached, or a pass failed.
pub async fn drain(engine: Arc<Engine>, url: &str) -> BrokerResult<u64> {
    let (js, _) = stream(url).await?;
    let relay = Relay::new(engine, js);
    let mut total = 0;
    loop {
        let pass = relay.relay_once().await?;
        if pass.published == 0 {
            return Ok(total);
        }
        total += pass.published as u64;
    }
}

/// The ledger consumer, running in the background.
pub struct Ledger {
    stream: stream::Stream,
    pull: consumer::PullConsumer,
    /// The stream's first sequence of this run.
    first_seq: u64,
    stop: oneshot::Sender<()>,
    task: JoinHandle<ConsumePass>,
    engine: Arc<Engine>,
    books: PathBuf,
    /// The durable consumer's name.
    pub durable: String,
}

/// What the events' audit found.
#[derive(Debug, Default)]
pub struct EventTally {
    /// Payments the client was told succeeded.
    pub payments: usize,
    /// Of those, how many have exactly one event in the stream.
    pub published_once: usize,
    /// Payments with more than one event in the stream.
    pub published_twice: usize,
    /// Payments booked exactly once.
    pub booked_once: usize,
    /// Payments booked more than once.
    pub booked_twice: usize,
    /// Payments never published or never booked, and events or bookings
    /// for a payment the client never learned of.
    pub lost: usize,
    /// What the ledger consumer did, by message.
    pub pass: ConsumePass,
    /// One line per problem.
    pub problems: Vec<String>,
}

impl EventTally {
    /// `N payments: N published once, 0 twice; N booked once, 0 twice; 0 lost`.
    pub fn line(&self) -> String {
        format!(
            "{} payments: {} published once, {} twice; {} booked once, {} twice; {} lost",
            self.payments,
            self.published_once,
            self.published_twice,
            self.booked_once,
            self.booked_twice,
            self.lost
        )
    }
}

impl Ledger {
    /// Connects to `url`, makes sure the stream exists, creates the durable
    /// pull consumer `payments-ledger-<run>` (new messages only, explicit
    /// acks, 5 s ack wait, no delivery limit), opens the books engine in
    /// `dir`, and starts consuming.
    ///
    /// # Errors
    ///
    /// The server cannot be reached, the stream or the consumer cannot be
    /// created, or the books engine cannot be opened.
    pub async fn start(url: &str, dir: &Path, run: &str) -> BrokerResult<Ledger> {
        let (js, stream) = stream(url).await?;
        let first_seq = stream.get_info().await?.state.last_sequence + 1;
        let durable = format!("{INBOX}-{run}");
        let pull = stream
            .create_consumer(consumer::pull::Config {
                durable_name: Some(durable.clone()),
                filter_subject: SUBJECT.to_owned(),
                deliver_policy: consumer::DeliverPolicy::New,
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(5),
                max_deliver: -1,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("NATS {url}: cannot create the consumer {durable}: {e}"))?;
        let books = dir.join("books.redb");
        let path = books.clone();
        let engine = tokio::task::spawn_blocking(move || Engine::builder().open(path)).await??;
        let engine = Arc::new(engine);
        let consumer = Consumer::new(Arc::clone(&engine), INBOX, js, pull.clone(), book)?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            consumer
                .run(64, Backoff::default(), async {
                    let _ = stopped.await;
                })
                .await
        });
        Ok(Ledger {
            stream,
            pull,
            first_seq,
            stop,
            task,
            engine,
            books,
            durable,
        })
    }

    /// Waits (at most 30 s) until the consumer has acked every message in
    /// the stream, stops it, closes the books engine, and audits: every
    /// payment in `expected` (client key → payment id) has exactly one
    /// event in the stream and is booked exactly once; no other event of
    /// this run (key prefix `run`) was published or booked.
    ///
    /// # Errors
    ///
    /// The stream, the consumer or the books cannot be read.
    pub async fn finish(
        self,
        expected: &BTreeMap<String, String>,
        run: &str,
    ) -> BrokerResult<EventTally> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let last_seq = loop {
            let last = self.stream.get_info().await?.state.last_sequence;
            let info = self.pull.get_info().await?;
            let caught_up = info.num_pending == 0 && info.num_ack_pending == 0;
            if caught_up || Instant::now() > deadline {
                break last;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let _ = self.stop.send(());
        let pass = self.task.await?;
        let engine = self.engine;
        tokio::task::spawn_blocking(move || drop(engine)).await?;

        // The stream's events of this run, by payment.
        let mut published: BTreeMap<String, usize> = BTreeMap::new();
        for seq in self.first_seq..=last_seq {
            let message = match self.stream.get_raw_message(seq).await {
                Ok(m) => m,
                // A gap (a message deleted by a limit) is not an event.
                Err(_) => continue,
            };
            if message.subject.as_str() != SUBJECT {
                continue;
            }
            match PaymentSucceeded::parse(&message.payload) {
                Ok(event) if event.key.starts_with(run) => {
                    *published.entry(event.payment).or_default() += 1;
                }
                Ok(_) => {}
                Err(e) => return Err(format!("stream {STREAM} #{seq}: not an event: {e}").into()),
            }
        }
        let booked = read_books(&self.books)?;

        let mut tally = EventTally {
            payments: expected.len(),
            pass,
            ..EventTally::default()
        };
        for (key, payment) in expected {
            match published.get(payment).copied().unwrap_or(0) {
                0 => {
                    tally.lost += 1;
                    tally
                        .problems
                        .push(format!("{key}: {payment} never published"));
                }
                1 => tally.published_once += 1,
                n => {
                    tally.published_twice += 1;
                    tally
                        .problems
                        .push(format!("{key}: {payment} published {n} times"));
                }
            }
            match booked.get(payment).copied().unwrap_or(0) {
                0 => {
                    tally.lost += 1;
                    tally
                        .problems
                        .push(format!("{key}: {payment} never booked"));
                }
                1 => tally.booked_once += 1,
                n => {
                    tally.booked_twice += 1;
                    tally
                        .problems
                        .push(format!("{key}: {payment} booked {n} times"));
                }
            }
        }
        let told: Vec<&String> = expected.values().collect();
        for payment in published.keys().chain(booked.keys()) {
            if !told.contains(&payment) {
                tally.lost += 1;
                tally.problems.push(format!(
                    "{payment}: published or booked, but the client never learned of it"
                ));
            }
        }
        Ok(tally)
    }
}

/// The ledger consumer's business write: +1 for the payment in the books,
/// in the same transaction as the inbox mark. An event that does not parse
/// is a clean failure (nothing written): retried, then dead-lettered.
fn book(incoming: &Incoming, tx: &mut LocalTx<'_>) -> Result<(), BoxError> {
    let event = PaymentSucceeded::parse(&incoming.payload)?;
    let txn = tx.redb().ok_or("the books engine is not on redb")?;
    let mut books = txn.open_table(BOOKS)?;
    let before = books.get(event.payment.as_str())?.map_or(0, |v| v.value());
    books.insert(event.payment.as_str(), before + 1)?;
    Ok(())
}

/// The books, read from the closed engine's file.
fn read_books(path: &Path) -> BrokerResult<BTreeMap<String, u64>> {
    let db = redb::Database::open(path)?;
    let txn = db.begin_read()?;
    let mut out = BTreeMap::new();
    let table = match txn.open_table(BOOKS) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(out),
        Err(e) => return Err(e.into()),
    };
    for entry in table.iter()? {
        let (k, v) = entry?;
        out.insert(k.value().to_owned(), v.value());
    }
    Ok(out)
}
