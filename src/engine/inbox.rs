//! The message inbox: at-least-once deliveries, processed once.
//!
//! An inbox message is an idempotency record under the reserved scope
//! `@inbox:<consumer>` keyed by the message id, so it has the same states,
//! leases, recovery and TTL as a request: a crashed consumer leaves it
//! PROCESSING until the lease runs out, then UNKNOWN.

use std::time::Duration;

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
use crate::store::{Completion, LocalTx};

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

    /// Frees the message for redelivery: nothing happened.
    ///
    /// # Errors
    ///
    /// As for [`crate::Engine::fail`].
    pub fn release(self) -> Result<()> {
        self.core.release(self.claim).wait()
    }
}

fn processed() -> Envelope {
    Envelope::new(0, 200, Vec::new())
}
