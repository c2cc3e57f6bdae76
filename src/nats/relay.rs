//! The outbox relay: publish, wait for the ack, then mark published.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::context::{GetStreamByNameErrorKind, PublishErrorKind};
use async_nats::jetstream::ErrorCode;

use super::error::NatsError;
use super::support::{blocking, Backoff, MSG_ID_HEADER};
use crate::message::OutboxEntry;
use crate::Engine;

/// Publishes an engine's outbox to JetStream (see the module docs).
///
/// Run one relay per database (as for any outbox relay): two would both
/// publish the same messages, which the window and the inbox then drop.
///
/// A message that can never be published as it is
/// ([`NatsError::Unpublishable`]: a bad or wildcard subject, too large, no
/// stream for its subject) blocks the ones behind it for
/// [`Relay::give_up_after`] passes, then goes to the dead letters
/// ([`crate::Outbox::give_up`]) and the relay goes on. Transient errors (a
/// timeout, a server restarting, no responders while a stream exists)
/// never count: those messages wait, in order, however long it takes.
#[derive(Clone)]
pub struct Relay {
    engine: Arc<Engine>,
    js: jetstream::Context,
    batch: usize,
    give_up_after: u32,
    /// Permanent failures so far, by outbox seq (in memory: a restarted
    /// relay counts again from 0).
    failures: Arc<Mutex<HashMap<u64, u32>>>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("batch", &self.batch)
            .field("give_up_after", &self.give_up_after)
            .finish_non_exhaustive()
    }
}

/// What one [`Relay::relay_once`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RelayPass {
    /// Messages the server acked and that are now marked published.
    pub published: usize,
    /// Of those, how many the server reported as duplicates (published
    /// before, inside its dedup window: a relay that stopped between a
    /// publish and its mark).
    pub duplicates: usize,
    /// Messages given up to the dead letters: they failed permanently
    /// ([`NatsError::Unpublishable`]) [`Relay::give_up_after`] times.
    pub dead_lettered: usize,
}

impl Relay {
    /// A relay of `engine`'s outbox to the streams of `js`; each outbox
    /// message's topic is its subject. Batch size 64; an unpublishable
    /// message is given up after 5 attempts.
    pub fn new(engine: Arc<Engine>, js: jetstream::Context) -> Relay {
        Relay {
            engine,
            js,
            batch: 64,
            give_up_after: 5,
            failures: Arc::default(),
        }
    }

    /// How many passes an unpublishable message ([`NatsError::Unpublishable`])
    /// is tried before it goes to the dead letters (at least 1; default 5).
    /// Until then it holds back the messages behind it, so order holds
    /// while an operator may still fix the cause (create the missing
    /// stream). The count is kept in memory, per relay.
    #[must_use]
    pub fn give_up_after(mut self, attempts: u32) -> Relay {
        self.give_up_after = attempts.max(1);
        self
    }

    /// Messages taken from the outbox per pass (at least 1).
    #[must_use]
    pub fn batch(mut self, messages: usize) -> Relay {
        self.batch = messages.max(1);
        self
    }

    /// One pass: takes up to a batch of unpublished messages, publishes
    /// each in order with `Nats-Msg-Id` set to its outbox id, waits for
    /// each publish ack, and marks the acked ones published. On the first
    /// failure it stops publishing (so order holds), marks what was acked
    /// before it, and returns the error; except that a message that failed
    /// permanently for the [`Relay::give_up_after`]th time goes to the
    /// dead letters (logged, counted in [`RelayPass::dead_lettered`]) and
    /// the pass goes on with the next. (When a later message then fails,
    /// the pass returns only that error: what it published and gave up
    /// before is marked, and logged.)
    ///
    /// # Errors
    ///
    /// [`NatsError::Publish`] (transient: that message and the rest stay
    /// in the outbox), [`NatsError::Unpublishable`] (before the limit),
    /// [`NatsError::Engine`] (nothing marked), [`NatsError::Blocking`].
    pub async fn relay_once(&self) -> Result<RelayPass, NatsError> {
        let engine = Arc::clone(&self.engine);
        let batch = self.batch;
        let taken = blocking(move || engine.outbox().take(batch)).await??;
        let mut pass = RelayPass::default();
        let mut rest = &taken[..];
        loop {
            let (acked, duplicates, failed) = self.publish(rest).await;
            pass.published += acked.len();
            pass.duplicates += duplicates;
            let done = acked.len();
            if !acked.is_empty() {
                self.forget(&acked);
                let engine = Arc::clone(&self.engine);
                blocking(move || engine.outbox().mark_published(&acked)).await??;
            }
            let Some(error) = failed else {
                return Ok(pass);
            };
            let (Some(entry), NatsError::Unpublishable { problem, .. }) = (rest.get(done), &error)
            else {
                return Err(error);
            };
            let attempts = self.count_failure(entry.seq);
            if attempts < self.give_up_after {
                return Err(NatsError::Unpublishable {
                    id: entry.id.clone(),
                    subject: entry.topic.clone(),
                    problem: problem.clone(),
                    attempts,
                    give_up_after: self.give_up_after,
                });
            }
            let reason = format!("the relay could not publish it {attempts} times: {problem}");
            let engine = Arc::clone(&self.engine);
            let given = entry.clone();
            let letter =
                blocking(move || engine.outbox().give_up(&given, attempts, &reason)).await??;
            self.forget(&[entry.seq]);
            if let Some(letter) = letter {
                tracing::error!(id = %entry.id, subject = %entry.topic, letter, attempts, problem = %problem, "outbox message given up to the dead letters; the relay goes on");
                pass.dead_lettered += 1;
            }
            rest = &rest[done + 1..];
        }
    }

    /// Counts one more permanent failure of outbox message `seq`.
    fn count_failure(&self, seq: u64) -> u32 {
        let mut failures = self
            .failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = failures.entry(seq).or_insert(0);
        *n = n.saturating_add(1);
        *n
    }

    fn forget(&self, seqs: &[u64]) {
        let mut failures = self
            .failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for seq in seqs {
            failures.remove(seq);
        }
    }

    /// Publishes `entries` in order and waits for each ack, marking
    /// nothing: the seqs the server acked, how many of those it called
    /// duplicates, and the error that stopped it, if any. (`relay_once`
    /// is this plus the mark; a test can call it alone to stop where a
    /// killed relay stops.)
    pub async fn publish(&self, entries: &[OutboxEntry]) -> (Vec<u64>, usize, Option<NatsError>) {
        let mut acked = Vec::with_capacity(entries.len());
        let mut duplicates = 0;
        for entry in entries {
            match self.publish_one(entry).await {
                Ok(duplicate) => {
                    acked.push(entry.seq);
                    duplicates += usize::from(duplicate);
                }
                Err(e) => return (acked, duplicates, Some(e)),
            }
        }
        (acked, duplicates, None)
    }

    async fn publish_one(&self, entry: &OutboxEntry) -> Result<bool, NatsError> {
        let failed = |source: async_nats::Error| NatsError::Publish {
            id: entry.id.clone(),
            subject: entry.topic.clone(),
            source,
        };
        let unpublishable = |problem: String| NatsError::Unpublishable {
            id: entry.id.clone(),
            subject: entry.topic.clone(),
            problem,
            attempts: 0,
            give_up_after: self.give_up_after,
        };
        if let Some(problem) = subject_problem(&entry.topic) {
            return Err(unpublishable(problem));
        }
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(MSG_ID_HEADER, entry.id.as_str());
        let sent = self
            .js
            .publish_with_headers(entry.topic.clone(), headers, entry.payload.clone().into())
            .await;
        let ack = match sent {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        };
        match ack {
            Ok(ack) => Ok(ack.duplicate),
            Err(e) => Err(match self.permanent(&entry.topic, &e).await {
                Some(problem) => unpublishable(problem),
                None => failed(Box::new(e)),
            }),
        }
    }

    /// What makes a publish error permanent for this message, or `None`
    /// when it is (or may be) transient.
    async fn permanent(
        &self,
        subject: &str,
        e: &jetstream::context::PublishError,
    ) -> Option<String> {
        match e.kind() {
            PublishErrorKind::MaxPayloadExceeded => Some(e.to_string()),
            // No responders: no stream takes the subject, or the server is
            // restarting. Only the JetStream API saying "no such stream"
            // makes it permanent.
            PublishErrorKind::StreamNotFound => match self.js.stream_by_subject(subject).await {
                Err(lookup) if lookup.kind() == GetStreamByNameErrorKind::NotFound => Some(
                    format!("no JetStream stream takes the subject {subject:?} (no responders, and the stream lookup found none)"),
                ),
                _ => None,
            },
            PublishErrorKind::Other => {
                let js_error = std::error::Error::source(e)
                    .and_then(|s| s.downcast_ref::<jetstream::Error>())?;
                let code = js_error.error_code();
                (code == ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM
                    || code == ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM)
                    .then(|| js_error.to_string())
            }
            _ => None,
        }
    }

    /// Relays until `stop` resolves: a pass, then, when it published
    /// nothing, a wait of `idle`; after an error (logged), a wait from
    /// `backoff` (doubling while errors repeat, reset by a good pass).
    /// Returns how many messages it published.
    pub async fn run(
        &self,
        idle: Duration,
        backoff: Backoff,
        stop: impl std::future::Future<Output = ()>,
    ) -> u64 {
        let mut stop = std::pin::pin!(stop);
        let mut failures = 0_u32;
        let mut total = 0_u64;
        loop {
            let wait = match self.relay_once().await {
                Ok(pass) => {
                    failures = 0;
                    total += pass.published as u64;
                    if pass.published + pass.dead_lettered > 0 {
                        Duration::ZERO
                    } else {
                        idle
                    }
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    let wait = backoff.after(failures);
                    tracing::warn!(error = %e, failures, ?wait, "outbox relay pass failed; retrying");
                    wait
                }
            };
            tokio::select! {
                () = &mut stop => return total,
                () = tokio::time::sleep(wait) => {}
            }
        }
    }
}

/// Why `subject` must not be published, if it must not: empty, whitespace
/// or control characters (not a subject), empty tokens, or a wildcard
/// (`*` or `>` anywhere, even inside a token: a subject to publish to is
/// literal, and a wildcard one would be stored by a stream and then match
/// consumer filters it was never meant for; it is never published).
fn subject_problem(subject: &str) -> Option<String> {
    if subject.is_empty() {
        return Some("the subject is empty".to_owned());
    }
    if subject.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Some(format!(
            "the subject {subject:?} holds whitespace or control characters"
        ));
    }
    if subject.contains(['*', '>']) {
        return Some(format!(
            "the subject {subject:?} holds a wildcard ('*' or '>'); an outbox message is never published to a wildcard"
        ));
    }
    if subject.split('.').any(str::is_empty) {
        return Some(format!(
            "the subject {subject:?} has an empty token (a leading, trailing or doubled '.')"
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::subject_problem;

    #[test]
    fn wildcards_and_malformed_subjects_are_refused() {
        for bad in [
            "", "a b", "a\tb", "a.*", "a.>", "*", ">", "a*b", ".a", "a.", "a..b",
        ] {
            assert!(subject_problem(bad).is_some(), "{bad:?} accepted");
        }
        for good in ["a", "payment.succeeded", "a-b_c.D9", "ünï.cödé"] {
            assert_eq!(subject_problem(good), None, "{good:?} refused");
        }
    }
}
