//! The inbox consumer: fetch, process with the inbox mark in one
//! transaction, then ack.

use std::sync::Arc;
use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;

use super::error::NatsError;
use super::support::{blocking, Backoff, MSG_ID_HEADER};
use super::unreadable::Unreadable;
use crate::dead_letter::Delivery;
use crate::engine::inbox::{AfterFailure, Processed};
use crate::error::{BoxError, Error};
use crate::key::IdempotencyKey;
use crate::store::LocalTx;
use crate::Engine;

/// How often a fetch in flight checks that its connection is still up.
const CONNECTION_CHECK: Duration = Duration::from_millis(50);

/// One JetStream message as the handler sees it.
#[derive(Clone, Debug)]
pub struct Incoming {
    /// Its `Nats-Msg-Id` (the inbox key).
    pub message_id: String,
    /// Its subject.
    pub subject: String,
    /// Its payload.
    pub payload: Vec<u8>,
    /// Which delivery this is, from 1 (JetStream's delivery count).
    pub attempt: u32,
    /// Its sequence number in the stream.
    pub stream_sequence: u64,
}

/// The app's business write for one message, run in the same transaction
/// as the inbox mark. An error is a clean failure: the transaction rolls
/// back, nothing is written. Except one caused by failing storage (a full
/// disk: see `storage_failed`), which is not the message's fault and
/// never leads to a dead letter.
type Handler = dyn Fn(&Incoming, &mut LocalTx<'_>) -> Result<(), BoxError> + Send + Sync;

/// The first redelivery wait of a cleanly failed message, by default.
const DEFAULT_RETRY_DELAY: Duration = Duration::from_secs(1);

/// The longest redelivery wait of a cleanly failed message, by default.
const DEFAULT_MAX_RETRY_DELAY: Duration = Duration::from_secs(300);

/// The wait before redelivering a message that failed cleanly on its
/// `attempt`-th delivery (1 = the first): `first`, doubled per delivery
/// after the first, at most `max`.
fn backoff(first: Duration, max: Duration, attempt: u32) -> Duration {
    let doublings = attempt.saturating_sub(1).min(31);
    first.saturating_mul(1 << doublings).min(max)
}

/// Consumes a JetStream pull consumer into an inbox (see the module docs).
#[derive(Clone)]
pub struct Consumer {
    engine: Arc<Engine>,
    inbox: String,
    /// The client of `js`, asked whether it is connected.
    client: async_nats::Client,
    pull: PullConsumer,
    unreadable: Unreadable,
    handler: Arc<Handler>,
    retry_delay: Duration,
    max_retry_delay: Duration,
    in_doubt_delay: Duration,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("inbox", &self.inbox)
            .field("retry_delay", &self.retry_delay)
            .field("max_retry_delay", &self.max_retry_delay)
            .field("in_doubt_delay", &self.in_doubt_delay)
            .finish_non_exhaustive()
    }
}

/// What one [`Consumer::consume_once`] did, by message.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConsumePass {
    /// Processed now: the write and the inbox mark committed, then acked.
    pub processed: usize,
    /// Processed before (a redelivery, or a republish outside JetStream's
    /// window): acked, the write not repeated.
    pub duplicates: usize,
    /// Failed cleanly before the delivery limit: naked for redelivery.
    pub retried: usize,
    /// Given up to the dead letters (clean failures at the limit, or no
    /// usable message id): terminated at the broker. Also messages the
    /// client cannot read at all (headers that are not UTF-8): deleted
    /// from the stream.
    pub dead_lettered: usize,
    /// In doubt (a handler died mid-effect) or held by another consumer:
    /// naked with a delay, for the resolver or the holder.
    pub deferred: usize,
}

/// Adds another pass's counts, field by field (totals over passes, as
/// [`Consumer::run`] keeps them).
impl std::ops::AddAssign for ConsumePass {
    fn add_assign(&mut self, pass: ConsumePass) {
        self.processed += pass.processed;
        self.duplicates += pass.duplicates;
        self.retried += pass.retried;
        self.dead_lettered += pass.dead_lettered;
        self.deferred += pass.deferred;
    }
}

/// What to tell JetStream about one message.
enum Answer {
    Ack,
    Term,
    Nak(Duration),
}

impl Consumer {
    /// A consumer of `pull` into the inbox `inbox` of `engine`, running
    /// `handler` for each fresh message. Defaults: a clean failure is
    /// redelivered after 1 s, the wait doubling per delivery up to 5 min
    /// ([`Consumer::retry_delay`], [`Consumer::max_retry_delay`]), so with
    /// [`Engine::dead_letter_after`] 5 it is dead-lettered about 15 s
    /// after its first delivery; a message in doubt is redelivered after
    /// 1 s ([`Consumer::in_doubt_delay`]), one held by another consumer
    /// after the engine's retry hint (`Processed::Processing`'s
    /// `retry_after`).
    ///
    /// `js` is the JetStream context of `pull`'s server (same account and
    /// API prefix). The consumer uses it to clear messages the client
    /// cannot read: async-nats drops its connection on a delivered message
    /// whose headers are not UTF-8, so such a message would stall the
    /// consumer, redelivered forever and never seen. After a pass that
    /// handled nothing while messages await an ack, the consumer reads
    /// those by stream sequence (64 per pass on its filter subject, each
    /// pass going on where the last stopped), and one
    /// the client cannot parse goes to the dead letters (reason: stream,
    /// sequence, the bad bytes escaped) and is deleted from the stream,
    /// for every consumer of it. A crash between the letter and the delete
    /// files the message twice.
    ///
    /// `pull` must ack explicitly (`AckPolicy::Explicit`, JetStream's
    /// default) and deliver a message at least
    /// [`Engine::dead_letter_after`] times (`max_deliver` -1, unlimited, or
    /// at least that); both are read from the consumer's info as `pull`
    /// holds it. Deliveries of a message in doubt or held by another
    /// consumer count towards `max_deliver` too, so a finite limit can
    /// still stop one of those before the resolver is done with it:
    /// unlimited is the safe setting.
    ///
    /// # Errors
    ///
    /// [`NatsError::Engine`] with [`Error::InvalidKey`] if `inbox` is not a
    /// valid consumer name; [`NatsError::ConsumerConfig`] for an ack
    /// policy other than explicit or a `max_deliver` below
    /// [`Engine::dead_letter_after`].
    pub fn new<H>(
        engine: Arc<Engine>,
        inbox: &str,
        js: jetstream::Context,
        pull: PullConsumer,
        handler: H,
    ) -> Result<Consumer, NatsError>
    where
        H: Fn(&Incoming, &mut LocalTx<'_>) -> Result<(), BoxError> + Send + Sync + 'static,
    {
        engine.inbox(inbox)?;
        check_config(&pull, engine.dead_letter_after())?;
        let client = js.client();
        let unreadable = Unreadable::new(js, pull.cached_info());
        Ok(Consumer {
            engine,
            inbox: inbox.to_owned(),
            client,
            unreadable,
            pull,
            handler: Arc::new(handler),
            retry_delay: DEFAULT_RETRY_DELAY,
            max_retry_delay: DEFAULT_MAX_RETRY_DELAY,
            in_doubt_delay: Duration::from_secs(1),
        })
    }

    /// How long JetStream waits before redelivering a cleanly failed
    /// message after its first delivery (default 1 s). The wait doubles
    /// with each further delivery, up to [`Consumer::max_retry_delay`]:
    /// with the defaults and [`Engine::dead_letter_after`] 5, a message
    /// that keeps failing is naked after 1, 2, 4 and 8 s and dead-lettered
    /// on its fifth delivery, about 15 s after the first.
    #[must_use]
    pub fn retry_delay(mut self, delay: Duration) -> Consumer {
        self.retry_delay = delay;
        self
    }

    /// The longest wait before redelivering a cleanly failed message
    /// (default 5 min): the cap of [`Consumer::retry_delay`]'s doubling.
    #[must_use]
    pub fn max_retry_delay(mut self, delay: Duration) -> Consumer {
        self.max_retry_delay = delay;
        self
    }

    /// How long JetStream waits before redelivering a message in doubt
    /// (default 1 s, the same for every delivery). A message held by
    /// another consumer waits the engine's retry hint instead
    /// (`Processed::Processing`'s `retry_after`).
    #[must_use]
    pub fn in_doubt_delay(mut self, delay: Duration) -> Consumer {
        self.in_doubt_delay = delay;
        self
    }

    /// Fetches up to `max` messages (waiting at most `expires` for them)
    /// and handles each: acked only after its commit. After a pass that
    /// handled nothing, clears messages the client cannot read (see
    /// [`Consumer::new`]); those count as dead-lettered.
    ///
    /// # Errors
    ///
    /// [`NatsError::Disconnected`] when the client is not connected to
    /// the server as the pass starts (nothing fetched) or loses its
    /// connection while it waits for messages (what was handled before
    /// stays handled; the rest is redelivered),
    /// [`NatsError::Fetch`] (also for a failed read or delete of an
    /// unreadable message), [`NatsError::Ack`], and [`NatsError::Engine`]
    /// when the engine failed on a message, or the handler did because
    /// storage did ([`Error::LocalWrite`] whose chain holds an I/O error
    /// for a full disk or an exceeded quota, or a redb I/O error): not
    /// acked, JetStream redelivers it after its ack wait, and it never
    /// counts towards the dead letters.
    pub async fn consume_once(
        &self,
        max: usize,
        expires: Duration,
    ) -> Result<ConsumePass, NatsError> {
        // A pull request sent while disconnected is buffered; its fetch
        // would end empty only after expiry plus 5 s, a silent stall
        // (`fetch` watches for a drop while it waits).
        self.connected()?;
        let mut pass = ConsumePass::default();
        let fetched = self.fetch(max, expires, &mut pass).await;
        if pass != ConsumePass::default() {
            return fetched.map(|()| pass);
        }
        let info = self.pull.get_info().await.map_err(|e| NatsError::Fetch {
            source: Box::new(e),
        })?;
        let cleared = self
            .unreadable
            .clear(&self.engine, &self.inbox, &info)
            .await?;
        pass.dead_lettered += cleared;
        if cleared > 0 {
            return Ok(pass);
        }
        fetched.map(|()| pass)
    }

    /// `Err(NatsError::Disconnected)` unless the client is connected.
    fn connected(&self) -> Result<(), NatsError> {
        match self.client.connection_state() {
            State::Connected => Ok(()),
            state => {
                let info = self.pull.cached_info();
                Err(NatsError::Disconnected {
                    stream: info.stream_name.clone(),
                    consumer: info.name.clone(),
                    state: state.to_string(),
                })
            }
        }
    }

    async fn fetch(
        &self,
        max: usize,
        expires: Duration,
        pass: &mut ConsumePass,
    ) -> Result<(), NatsError> {
        let fetch_failed = |e: BoxError| NatsError::Fetch { source: e };
        let mut batch = self
            .pull
            .fetch()
            .max_messages(max.max(1))
            .expires(expires)
            .messages()
            .await
            .map_err(|e| fetch_failed(Box::new(e)))?;
        loop {
            // A batch whose connection drops is never answered: async-nats
            // ends it empty only after its expiry plus 5 s. Watching the
            // connection turns that silence into an error at once.
            let next = tokio::select! {
                next = batch.next() => next,
                () = self.disconnects() => return self.connected(),
            };
            let Some(message) = next else {
                return Ok(());
            };
            let message = message.map_err(fetch_failed)?;
            self.handle(&message, pass).await?;
        }
    }

    /// Resolves once the client is not connected (checked every
    /// [`CONNECTION_CHECK`]).
    async fn disconnects(&self) {
        while self.client.connection_state() == State::Connected {
            tokio::time::sleep(CONNECTION_CHECK).await;
        }
    }

    async fn handle(
        &self,
        message: &async_nats::jetstream::Message,
        pass: &mut ConsumePass,
    ) -> Result<(), NatsError> {
        let info = message.info().map_err(|e| NatsError::Fetch { source: e })?;
        let incoming = Incoming {
            message_id: message
                .headers
                .as_ref()
                .and_then(|h| h.get(MSG_ID_HEADER))
                .map(|v| v.as_str().to_owned())
                .unwrap_or_default(),
            subject: message.subject.to_string(),
            payload: message.payload.to_vec(),
            attempt: u32::try_from(info.delivered).unwrap_or(u32::MAX).max(1),
            stream_sequence: info.stream_sequence,
        };
        let engine = Arc::clone(&self.engine);
        let inbox = self.inbox.clone();
        let handler = Arc::clone(&self.handler);
        let retry = backoff(self.retry_delay, self.max_retry_delay, incoming.attempt);
        let in_doubt = self.in_doubt_delay;
        let id_for_errors = if incoming.message_id.is_empty() {
            format!("#{} (no id)", incoming.stream_sequence)
        } else {
            incoming.message_id.clone()
        };
        let (answer, counted) =
            blocking(move || decide(&engine, &inbox, incoming, handler, retry, in_doubt)).await??;
        counted.count(pass);
        let kind = match answer {
            Answer::Ack => AckKind::Ack,
            Answer::Term => AckKind::Term,
            Answer::Nak(delay) => AckKind::Nak(Some(delay)),
        };
        message
            .double_ack_with(kind)
            .await
            .map_err(|source| NatsError::Ack {
                id: id_for_errors,
                source,
            })
    }

    /// Consumes until `stop` resolves, fetching up to `max` messages at a
    /// time; after an error (logged), waits from `backoff`. Returns the
    /// totals.
    pub async fn run(
        &self,
        max: usize,
        backoff: Backoff,
        stop: impl std::future::Future<Output = ()>,
    ) -> ConsumePass {
        let mut stop = std::pin::pin!(stop);
        let mut failures = 0_u32;
        let mut total = ConsumePass::default();
        loop {
            let wait = tokio::select! {
                () = &mut stop => return total,
                result = self.consume_once(max, Duration::from_millis(500)) => match result {
                    Ok(pass) => {
                        failures = 0;
                        total += pass;
                        Duration::ZERO
                    }
                    Err(e) => {
                        failures = failures.saturating_add(1);
                        let wait = backoff.after(failures);
                        tracing::warn!(error = %e, failures, ?wait, "JetStream consumer pass failed; retrying");
                        wait
                    }
                },
            };
            tokio::select! {
                () = &mut stop => return total,
                () = tokio::time::sleep(wait) => {}
            }
        }
    }
}

/// Refuses a pull consumer whose settings would lose messages: see
/// [`Consumer::new`].
fn check_config(pull: &PullConsumer, dead_letter_after: u32) -> Result<(), NatsError> {
    let info = pull.cached_info();
    let refuse = |problem: String| NatsError::ConsumerConfig {
        stream: info.stream_name.clone(),
        consumer: info.name.clone(),
        problem,
    };
    let policy = &info.config.ack_policy;
    if !matches!(policy, AckPolicy::Explicit) {
        return Err(refuse(format!(
            "its ack policy is {policy:?}; the inbox consumer acks each message only after its \
             commit and naks clean failures, which needs AckPolicy::Explicit (with None the \
             server counts a message done on delivery, with All a later ack also acks an \
             earlier message waiting for redelivery: either loses messages)"
        )));
    }
    let max_deliver = info.config.max_deliver;
    if max_deliver > 0 && max_deliver < i64::from(dead_letter_after) {
        return Err(refuse(format!(
            "its max_deliver is {max_deliver}, below the engine's dead_letter_after \
             ({dead_letter_after}): the server would stop delivering a cleanly failing \
             message before it reaches the dead letters, and it would be lost; set \
             max_deliver to -1 (unlimited) or at least {dead_letter_after}"
        )));
    }
    Ok(())
}

/// Which counter of [`ConsumePass`] a message adds to.
enum Counted {
    Processed,
    Duplicate,
    Retried,
    DeadLettered,
    Deferred,
}

impl Counted {
    fn count(self, pass: &mut ConsumePass) {
        match self {
            Counted::Processed => pass.processed += 1,
            Counted::Duplicate => pass.duplicates += 1,
            Counted::Retried => pass.retried += 1,
            Counted::DeadLettered => pass.dead_lettered += 1,
            Counted::Deferred => pass.deferred += 1,
        }
    }
}

/// The engine's part, on the blocking pool: what to answer JetStream.
fn decide(
    engine: &Engine,
    inbox_name: &str,
    incoming: Incoming,
    handler: Arc<Handler>,
    retry: Duration,
    in_doubt: Duration,
) -> crate::Result<(Answer, Counted)> {
    let inbox = engine.inbox(inbox_name)?;
    let id = incoming.message_id.clone();
    let payload = incoming.payload.clone();
    let subject = incoming.subject.clone();
    let delivery = Delivery {
        message_id: &id,
        topic: &subject,
        payload: &payload,
        attempt: incoming.attempt,
    };
    // A message without a usable id can never be deduplicated: it goes to
    // the dead letters at once, and the consumer keeps consuming.
    let bad = if id.is_empty() {
        Some(format!("no {MSG_ID_HEADER} header"))
    } else {
        IdempotencyKey::inbox(inbox_name, &id)
            .err()
            .map(|e| format!("unusable {MSG_ID_HEADER}: {e}"))
    };
    if let Some(reason) = bad {
        let delivery = Delivery {
            attempt: 0,
            ..delivery
        };
        inbox.reject(&delivery, &reason)?;
        return Ok((Answer::Term, Counted::DeadLettered));
    }
    let not_free = |p: Processed| match p {
        Processed::Done | Processed::Duplicate => (Answer::Ack, Counted::Duplicate),
        Processed::Processing { retry_after } => (Answer::Nak(retry_after), Counted::Deferred),
        Processed::InDoubt(_) => (Answer::Nak(in_doubt), Counted::Deferred),
    };
    let run = inbox.process_local(&id, move |tx| handler(&incoming, tx));
    match run {
        Ok(Processed::Done) => Ok((Answer::Ack, Counted::Processed)),
        Ok(Processed::InDoubt(p)) => {
            tracing::warn!(key = %p.key, "message in doubt: left to the resolver");
            Ok(not_free(Processed::InDoubt(p)))
        }
        Ok(other) => Ok(not_free(other)),
        // The handler failed because storage did (a full disk, a failing
        // redb file): not the message's fault, and a full disk passes. Not
        // a clean failure, so never a dead letter: not acked, redelivered
        // after the ack wait.
        Err(e @ Error::LocalWrite { .. }) if storage_failed(&e) => Err(e),
        Err(Error::LocalWrite { source, .. }) => {
            let reason = source.to_string();
            Ok(match inbox.fail_cleanly(&delivery, &reason)? {
                AfterFailure::DeadLettered { .. } => (Answer::Term, Counted::DeadLettered),
                AfterFailure::NotFree(p) => not_free(p),
                // Redeliver (and any later variant): nothing was written.
                _ => (Answer::Nak(retry), Counted::Retried),
            })
        }
        Err(e) => Err(e),
    }
}

/// Whether `e`'s chain holds a storage failure: an I/O error for a full
/// disk or an exceeded quota, or redb's I/O errors (a handler's own
/// `table.insert(..)?` on a failing file).
fn storage_failed(e: &(dyn std::error::Error + 'static)) -> bool {
    let full = |io: &std::io::Error| {
        matches!(
            io.kind(),
            std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
        )
    };
    let mut next = Some(e);
    while let Some(e) = next {
        if e.downcast_ref::<std::io::Error>().is_some_and(full)
            || matches!(
                e.downcast_ref::<redb::StorageError>(),
                Some(redb::StorageError::Io(_) | redb::StorageError::PreviousIo)
            )
            || matches!(
                e.downcast_ref::<redb::TableError>(),
                Some(redb::TableError::Storage(
                    redb::StorageError::Io(_) | redb::StorageError::PreviousIo
                ))
            )
            || matches!(
                e.downcast_ref::<redb::Error>(),
                Some(redb::Error::Io(_) | redb::Error::PreviousIo)
            )
        {
            return true;
        }
        next = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::{backoff, storage_failed};
    use crate::error::Error;
    use crate::key::IdempotencyKey;
    use std::time::Duration;

    fn local_write(source: crate::error::BoxError) -> Result<Error, Error> {
        Ok(Error::LocalWrite {
            key: IdempotencyKey::new("s", "k")?,
            source,
        })
    }

    #[test]
    fn storage_failures_are_told_from_handler_failures() -> Result<(), Error> {
        let full = std::io::Error::from(std::io::ErrorKind::StorageFull);
        assert!(storage_failed(&local_write(Box::new(full))?));
        let io = std::io::Error::from(std::io::ErrorKind::Other);
        assert!(storage_failed(&local_write(Box::new(
            redb::StorageError::Io(io)
        ))?));
        assert!(!storage_failed(&local_write("bad payload".into())?));
        let other = std::io::Error::from(std::io::ErrorKind::NotFound);
        assert!(!storage_failed(&local_write(Box::new(other))?));
        Ok(())
    }

    #[test]
    fn the_retry_wait_doubles_per_delivery_up_to_the_cap() {
        let (first, max) = (Duration::from_secs(1), Duration::from_secs(300));
        let waits: Vec<u64> = (1..=11)
            .map(|attempt| backoff(first, max, attempt).as_secs())
            .collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        // Attempt 0 (never sent by the server) waits like the first.
        assert_eq!(backoff(first, max, 0), first);
        // No overflow at the end of the range.
        assert_eq!(backoff(first, max, u32::MAX), max);
        assert_eq!(
            backoff(Duration::MAX, Duration::MAX, u32::MAX),
            Duration::MAX
        );
        // A cap below the first wait wins.
        assert_eq!(backoff(first, Duration::from_millis(10), 1).as_millis(), 10);
    }
}
