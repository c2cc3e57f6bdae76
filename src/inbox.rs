//! The message inbox: at-least-once deliveries, processed once.
//!
//! An inbox message is an idempotency record under the reserved scope
//! `@inbox:<consumer>` keyed by the message id, so it has the same states,
//! leases, recovery and TTL as a request: a crashed consumer leaves it
//! PROCESSING until the lease runs out, then UNKNOWN.

use std::time::Duration;

use crate::claim::Claim;
use crate::engine::Engine;
use crate::envelope::Envelope;
use crate::error::Result;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::local::{BoxError, LocalRun, LocalTx};
use crate::outbox::OutgoingMessage;
use crate::outcome::{Begin, Failure, Pending};

/// A consumer's inbox, from [`Engine::inbox`].
#[derive(Debug, Clone)]
pub struct Inbox<'e> {
    engine: &'e Engine,
    consumer: String,
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
    InProgress {
        /// Remaining lease of the current holder.
        retry_after: Duration,
    },
    /// A consumer crashed mid-processing (lease ran out) or failed it as
    /// unknown: never reprocessed automatically; resolve it.
    Unknown(Pending),
}

/// The answer to [`Inbox::process_local`].
#[derive(Debug)]
pub enum Processed {
    /// Processed now: the app's write and the mark committed together.
    Done,
    /// Already processed: skip it and ack the broker.
    Duplicate,
    /// Another consumer holds it through [`Inbox::receive`]; redeliver later.
    InProgress {
        /// Remaining lease of the current holder.
        retry_after: Duration,
    },
    /// A `receive`-based consumer crashed holding it: resolve it first.
    Unknown(Pending),
}

/// The right to process one message once.
///
/// Dropped without `ack` or `release`, it counts as unknown (the
/// processing may have had side effects), like a dropped [`Claim`].
#[derive(Debug)]
pub struct Ticket<'e> {
    engine: &'e Engine,
    claim: Claim,
}

/// Message ids carry no request body: the fingerprint is fixed.
fn message_fingerprint() -> Fingerprint {
    Fingerprint::builder().part("inbox message", b"").finish()
}

impl Engine {
    /// The inbox of `consumer` (a name for the consuming service or
    /// handler). Message ids are scoped per consumer.
    ///
    /// # Errors
    ///
    /// [`crate::Error::InvalidKey`] if `@inbox:<consumer>` is empty, longer
    /// than 255 bytes or has control characters.
    pub fn inbox(&self, consumer: &str) -> Result<Inbox<'_>> {
        IdempotencyKey::inbox(consumer, "probe")?;
        Ok(Inbox {
            engine: self,
            consumer: consumer.to_owned(),
        })
    }
}

impl<'e> Inbox<'e> {
    /// Records a delivery of `message_id`.
    ///
    /// # Errors
    ///
    /// [`crate::Error::InvalidKey`] for a bad message id (1..=255 bytes, no
    /// control characters); storage errors.
    pub fn receive(&self, message_id: &str) -> Result<Receive<'e>> {
        let key = IdempotencyKey::inbox(&self.consumer, message_id)?;
        Ok(match self.engine.begin(&key, message_fingerprint())? {
            Begin::Claimed(claim) => Receive::Fresh(Ticket {
                engine: self.engine,
                claim,
            }),
            Begin::InProgress { retry_after } => Receive::InProgress { retry_after },
            Begin::Unknown(pending) => Receive::Unknown(pending),
            // Processed (or processed long ago and tombstoned): never again.
            Begin::Replay(_) | Begin::Expired { .. } | Begin::Mismatch => Receive::Duplicate,
        })
    }

    /// Processes `message_id` exactly once with a purely local effect: the
    /// dedup check, the app's write and the processed mark share one
    /// transaction (see [`Engine::execute_local`]). A crash inside `write`
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
        let run = self
            .engine
            .execute_local(&key, message_fingerprint(), move |tx| {
                write(tx)?;
                Ok(processed())
            })?;
        Ok(match run {
            LocalRun::Executed => Processed::Done,
            LocalRun::Skipped(Begin::InProgress { retry_after }) => {
                Processed::InProgress { retry_after }
            }
            LocalRun::Skipped(Begin::Unknown(pending)) => Processed::Unknown(pending),
            LocalRun::Skipped(_) => Processed::Duplicate,
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
    /// As for [`Engine::complete`].
    pub fn ack(self) -> Result<()> {
        self.engine.complete(self.claim, processed())
    }

    /// Marks the message processed and stores outbox `messages` in the same
    /// transaction.
    ///
    /// # Errors
    ///
    /// As for [`Engine::complete`].
    pub fn ack_with_messages(self, messages: Vec<OutgoingMessage>) -> Result<()> {
        self.engine
            .complete_with_messages(self.claim, processed(), messages)
    }

    /// Runs the app's own write and marks the message processed in one
    /// transaction: both commit or neither does (see
    /// [`Engine::complete_local`]).
    ///
    /// # Errors
    ///
    /// As for [`Engine::complete_local`]; on [`crate::Error::LocalWrite`]
    /// the message is released for redelivery.
    pub fn ack_local<F>(self, write: F) -> Result<()>
    where
        F: FnOnce(&mut LocalTx<'_>) -> Result<(), BoxError> + Send + 'static,
    {
        self.engine.complete_local(self.claim, move |tx| {
            write(tx)?;
            Ok(processed())
        })
    }

    /// Frees the message for redelivery: nothing happened.
    ///
    /// # Errors
    ///
    /// As for [`Engine::fail`].
    pub fn release(self) -> Result<()> {
        self.engine.fail(self.claim, Failure::Retryable)
    }
}

fn processed() -> Envelope {
    Envelope::new(0, 200, Vec::new())
}
