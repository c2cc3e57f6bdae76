//! The message inbox: at-least-once deliveries, processed once.
//!
//! An inbox message is an idempotency record under the reserved scope
//! `@inbox:<consumer>` keyed by the message id, so it has the same states,
//! leases, recovery and TTL as a request: a crashed consumer leaves it
//! PROCESSING until the lease runs out, then UNKNOWN.

use std::time::Duration;

use crate::dead_letter::{DeadLetter, Delivery};
use crate::engine::begin::Begin;
use crate::engine::claim::Claim;
use crate::engine::core::Core;
use crate::engine::local::{complete_local, execute_local, LocalRun};
use crate::envelope::Envelope;
use crate::error::{BoxError, Result};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::message::OutgoingMessage;
use crate::outcome::InDoubt;
use crate::store::{Completion, DeadLetterRequest, GiveUpClaim, LocalTx, StoredResponse};

/// A consumer's inbox, from [`crate::Engine::inbox`].
#[derive(Clone)]
pub struct Inbox<'e> {
    core: &'e Core,
    consumer: String,
}

impl std::fmt::Debug for Inbox<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox")
            .field("consumer", &self.consumer)
            .finish_non_exhaustive()
    }
}

/// The answer to [`Inbox::receive`].
#[derive(Debug)]
#[must_use = "a Fresh ticket must be acked or released"]
pub enum Receive<'e> {
    /// First delivery (or a redelivery after `release`): process it, then
    /// `ack` the ticket.
    Fresh(Ticket<'e>),
    /// Already processed: skip it and ack the broker.
    Duplicate,
    /// Another consumer is processing it now; redeliver later.
    Processing {
        /// Remaining lease of the current holder.
        retry_after: Duration,
    },
    /// A consumer crashed mid-processing (lease ran out) or failed it as
    /// in doubt: UNKNOWN, never reprocessed automatically; resolve it.
    InDoubt(InDoubt),
}

/// The answer to [`Inbox::process_local`].
#[derive(Debug)]
pub enum Processed {
    /// Processed now: the app's write and the mark committed together.
    Done,
    /// Already processed: skip it and ack the broker.
    Duplicate,
    /// Another consumer holds it through [`Inbox::receive`]; redeliver later.
    Processing {
        /// Remaining lease of the current holder.
        retry_after: Duration,
    },
    /// A `receive`-based consumer crashed holding it: resolve it first.
    InDoubt(InDoubt),
}

/// What a clean failure led to ([`Ticket::fail_cleanly`],
/// [`Inbox::fail_cleanly`]).
#[derive(Debug)]
#[non_exhaustive]
pub enum AfterFailure {
    /// Released (nothing happened, nothing kept): nak it so the broker
    /// redelivers.
    Redeliver,
    /// The last allowed delivery ([`crate::EngineBuilder::dead_letter_after`]):
    /// the message is in the dead-letter list under `seq` and its inbox
    /// record is `FINAL_FAILURE`, so a redelivery is a `Duplicate`; ack (or
    /// terminate) it at the broker.
    DeadLettered {
        /// Its position in the dead-letter list.
        seq: u64,
    },
    /// Not this consumer's to give up (nothing written): the message was
    /// processed already (`Duplicate`: ack it), another consumer holds it
    /// (`Processing`), or it is in doubt (`InDoubt`: a handler died
    /// mid-effect, so it belongs to the resolver, never to the dead
    /// letters).
    NotFree(Processed),
}

/// The right to process one message once.
///
/// Dropped without `ack` or `release`, it counts as in doubt (the
/// processing may have had side effects), like a dropped [`Claim`].
pub struct Ticket<'e> {
    core: &'e Core,
    claim: Claim,
}

impl std::fmt::Debug for Ticket<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("claim", &self.claim)
            .finish_non_exhaustive()
    }
}

/// Message ids carry no request body: the fingerprint is fixed.
fn message_fingerprint() -> Fingerprint {
    Fingerprint::builder().part("inbox message", b"").finish()
}

impl<'e> Inbox<'e> {
    /// The inbox of `consumer`.
    ///
    /// # Errors
    ///
    /// [`crate::Error::InvalidKey`] if `@inbox:<consumer>` is not a valid
    /// scope.
    pub(crate) fn new(core: &'e Core, consumer: &str) -> Result<Inbox<'e>> {
        if consumer.is_empty() {
            return Err(crate::error::Error::InvalidKey {
                what: "inbox consumer",
                value: String::new(),
                reason: "must not be empty",
            });
        }
        IdempotencyKey::inbox(consumer, "probe")?;
        Ok(Inbox {
            core,
            consumer: consumer.to_owned(),
        })
    }

    /// Records a delivery of `message_id`.
    ///
    /// # Errors
    ///
    /// [`crate::Error::InvalidKey`] for a bad message id (1..=255 bytes, no
    /// control characters); storage errors.
    pub fn receive(&self, message_id: &str) -> Result<Receive<'e>> {
        let key = IdempotencyKey::inbox(&self.consumer, message_id)?;
        let lease_ms = self.core.cfg.lease_ms();
        Ok(
            match self.core.begin(&key, message_fingerprint(), lease_ms)? {
                Begin::Claimed(claim) => Receive::Fresh(Ticket {
                    core: self.core,
                    claim,
                }),
                Begin::Processing { retry_after } => Receive::Processing { retry_after },
                Begin::InDoubt(in_doubt) => Receive::InDoubt(in_doubt),
                // Processed (or processed long ago and tombstoned): never again.
                Begin::Replay(_) | Begin::Tombstoned { .. } | Begin::Mismatch => Receive::Duplicate,
            },
        )
    }

    /// Processes `message_id` exactly once with a purely local effect: the
    /// dedup check, the app's write and the processed mark share one
    /// transaction (see [`crate::Engine::execute_local`]). A crash inside `write`
    /// leaves neither the app's rows nor the mark, so redelivery processes
    /// it once.
    ///
    /// # Errors
    ///
    /// [`crate::Error::LocalWrite`] if `write` fails (nothing stored; the
    /// message can be redelivered), bad message ids, storage errors.
    pub fn process_local<F>(&self, message_id: &str, write: F) -> Result<Processed>
    where
        F: FnOnce(&mut LocalTx<'_>) -> Result<(), BoxError> + Send + 'static,
    {
        let key = IdempotencyKey::inbox(&self.consumer, message_id)?;
        let run = execute_local(self.core, &key, message_fingerprint(), move |tx| {
            write(tx)?;
            Ok(processed())
        })?;
        Ok(match run {
            LocalRun::Executed => Processed::Done,
            LocalRun::Skipped(Begin::Processing { retry_after }) => {
                Processed::Processing { retry_after }
            }
            LocalRun::Skipped(Begin::InDoubt(in_doubt)) => Processed::InDoubt(in_doubt),
            LocalRun::Skipped(
                Begin::Claimed(_) | Begin::Replay(_) | Begin::Mismatch | Begin::Tombstoned { .. },
            ) => Processed::Duplicate,
        })
    }

    /// Records that the handler of `delivery` failed *cleanly*: nothing
    /// happened (a `Failure::Retryable`, or an error before any side
    /// effect, such as a [`crate::Error::LocalWrite`] from
    /// [`Inbox::process_local`], which stored nothing). Before the last
    /// allowed delivery it writes nothing and answers `Redeliver`; on it
    /// (`delivery.attempt >=` [`crate::EngineBuilder::dead_letter_after`])
    /// it claims the message and gives it up to the dead letters with
    /// `reason`, in one write. A message that is not free (processed,
    /// held, or in doubt) is never dead-lettered: `NotFree`.
    ///
    /// For a handler that holds a [`Ticket`], use [`Ticket::fail_cleanly`].
    ///
    /// # Errors
    ///
    /// [`crate::Error::InvalidKey`] for a bad message id (use
    /// [`Inbox::reject`] for those); storage errors.
    pub fn fail_cleanly(&self, delivery: &Delivery<'_>, reason: &str) -> Result<AfterFailure> {
        let key = IdempotencyKey::inbox(&self.consumer, delivery.message_id)?;
        if delivery.attempt < self.core.cfg.dead_letter_after {
            return Ok(AfterFailure::Redeliver);
        }
        match self.receive(key.key())? {
            Receive::Fresh(ticket) => ticket.give_up(&self.consumer, delivery, reason),
            Receive::Duplicate => Ok(AfterFailure::NotFree(Processed::Duplicate)),
            Receive::Processing { retry_after } => {
                Ok(AfterFailure::NotFree(Processed::Processing { retry_after }))
            }
            Receive::InDoubt(in_doubt) => Ok(AfterFailure::NotFree(Processed::InDoubt(in_doubt))),
        }
    }

    /// Gives up a message that cannot be processed at all (no id, an id
    /// over [`crate::MAX_KEY_BYTES`], control characters, a payload the
    /// app cannot parse): it goes to the dead letters at once with
    /// `reason`, under no inbox key (a bad id is none). Returns its seq.
    ///
    /// # Errors
    ///
    /// Storage errors only: bad input is what this takes.
    pub fn reject(&self, delivery: &Delivery<'_>, reason: &str) -> Result<u64> {
        tracing::warn!(consumer = %self.consumer, message_id = ?delivery.message_id, reason, "message rejected to the dead letters");
        self.core.store.dead_letter(DeadLetterRequest {
            claim: None,
            outbox_seq: None,
            letter: letter(&self.consumer, delivery, reason),
        })
    }

    /// The consumer name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }
}

impl Ticket<'_> {
    /// The message id.
    pub fn message_id(&self) -> &str {
        self.claim.key().key()
    }

    /// The claim reference, stable for this processing attempt.
    pub fn reference(&self) -> &str {
        self.claim.reference()
    }

    /// Marks the message processed (durably). Later deliveries are
    /// `Duplicate` until the TTL runs out.
    ///
    /// # Errors
    ///
    /// As for [`crate::Engine::complete`].
    pub fn ack(self) -> Result<()> {
        self.ack_with_messages(Vec::new())
    }

    /// Marks the message processed and stores outbox `messages` in the same
    /// transaction.
    ///
    /// # Errors
    ///
    /// As for [`crate::Engine::complete`].
    pub fn ack_with_messages(self, messages: Vec<OutgoingMessage>) -> Result<()> {
        self.core
            .finish(self.claim, Completion::Success, processed(), None, messages)
            .wait()
    }

    /// Runs the app's own write and marks the message processed in one
    /// transaction: both commit or neither does (see
    /// [`crate::Engine::complete_local`]).
    ///
    /// # Errors
    ///
    /// As for [`crate::Engine::complete_local`]; on [`crate::Error::LocalWrite`]
    /// the message is released for redelivery.
    pub fn ack_local<F>(self, write: F) -> Result<()>
    where
        F: FnOnce(&mut LocalTx<'_>) -> Result<(), BoxError> + Send + 'static,
    {
        complete_local(self.core, self.claim, move |tx| {
            write(tx)?;
            Ok(processed())
        })
    }

    /// Records that the handler failed *cleanly* on `delivery` (nothing
    /// happened): released for redelivery before the last allowed
    /// delivery ([`crate::EngineBuilder::dead_letter_after`]); on it, the
    /// message goes to the dead letters with `reason` and its inbox record
    /// becomes `FINAL_FAILURE`, in one write. A handler that may have had a
    /// side effect must not call this: drop the ticket (in doubt) or
    /// complete it.
    ///
    /// # Errors
    ///
    /// As for [`crate::Engine::fail`].
    pub fn fail_cleanly(self, delivery: &Delivery<'_>, reason: &str) -> Result<AfterFailure> {
        if delivery.attempt < self.core.cfg.dead_letter_after {
            self.release()?;
            return Ok(AfterFailure::Redeliver);
        }
        let consumer = self
            .claim
            .key()
            .scope()
            .strip_prefix("@inbox:")
            .unwrap_or_default()
            .to_owned();
        self.give_up(&consumer, delivery, reason)
    }

    fn give_up(
        self,
        consumer: &str,
        delivery: &Delivery<'_>,
        reason: &str,
    ) -> Result<AfterFailure> {
        let core = self.core;
        let mut claim = core.own_claim(self.claim)?;
        let finished = claim.take_deferred();
        let (key, token) = claim.finish();
        let body = format!("dead-lettered: {reason}").into_bytes();
        let seq = core.store.dead_letter(DeadLetterRequest {
            claim: Some(GiveUpClaim {
                key: key.clone(),
                token,
                response: StoredResponse::new(Envelope::new(0, 500, body), None),
                finished,
            }),
            outbox_seq: None,
            letter: letter(consumer, delivery, reason),
        })?;
        tracing::warn!(key = %key, seq, attempts = delivery.attempt, reason, "message given up to the dead letters");
        Ok(AfterFailure::DeadLettered { seq })
    }

    /// Frees the message for redelivery: nothing happened.
    ///
    /// # Errors
    ///
    /// As for [`crate::Engine::fail`].
    pub fn release(self) -> Result<()> {
        self.core.release(self.claim).wait()
    }
}

fn letter(consumer: &str, delivery: &Delivery<'_>, reason: &str) -> DeadLetter {
    DeadLetter {
        seq: 0,
        consumer: consumer.to_owned(),
        message_id: delivery.message_id.to_owned(),
        topic: delivery.topic.to_owned(),
        payload: delivery.payload.to_vec(),
        attempts: delivery.attempt,
        reason: reason.to_owned(),
        dead_at_ms: 0,
    }
}

fn processed() -> Envelope {
    Envelope::new(0, 200, Vec::new())
}
