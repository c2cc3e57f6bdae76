//! The relay side of the transactional outbox: messages stored in the same
//! transaction as the outcome that produced them, read and marked
//! published here.

use crate::dead_letter::DeadLetter;
use crate::engine::core::Core;
use crate::error::Result;
use crate::message::OutboxEntry;
use crate::store::DeadLetterRequest;

/// The consumer name of a dead letter that was an outbox message the relay
/// could never publish ([`Outbox::give_up`]), so `idem dead-letters` tells
/// those apart from an inbox's letters (the `@` marks it as the engine's
/// own name, as in the `@inbox:` scope; do not give an inbox this name).
pub const OUTBOX_DEAD_LETTER_CONSUMER: &str = "@outbox";

/// The relay side of the outbox, from [`crate::Engine::outbox`].
///
/// A relay loop: `take` a batch, publish each message, then
/// `mark_published` their `seq`s. A message is never lost, and is published
/// again only if the relay stops between publishing and marking; it then
/// carries the same `id`, so a consumer's inbox keeps exactly one effect.
/// Run one relay per database: two relays taking at once would both publish
/// the same messages (still deduped downstream, but wasted).
#[derive(Clone, Copy)]
pub struct Outbox<'e> {
    core: &'e Core,
}

impl<'e> Outbox<'e> {
    pub(crate) fn new(core: &'e Core) -> Outbox<'e> {
        Outbox { core }
    }

    /// Up to `limit` unpublished messages, oldest first. Reading does not
    /// remove them.
    ///
    /// # Errors
    ///
    /// Storage errors; [`crate::Error::Corrupt`] for an entry
    /// that does not decode.
    pub fn take(&self, limit: usize) -> Result<Vec<OutboxEntry>> {
        self.core.store.outbox(limit)
    }

    /// Removes published messages (durably, before it returns). Unknown
    /// `seq`s are ignored, so marking twice is harmless. Returns how many
    /// were removed.
    ///
    /// # Errors
    ///
    /// Storage errors, [`crate::Error::Poisoned`].
    pub fn mark_published(&self, seqs: &[u64]) -> Result<u64> {
        self.core.store.mark_published(seqs.to_vec())
    }

    /// Gives up an outbox message that can never be published (a relay
    /// saw a permanent error `attempts` times: no stream for its topic, a
    /// topic that is not a valid subject, a payload over the broker's
    /// limit): it moves to the dead letters with `reason`, under the
    /// consumer name [`OUTBOX_DEAD_LETTER_CONSUMER`] and its outbox id, and
    /// leaves the outbox, in one write, so the messages behind it go on.
    /// An operator lists it with `idem dead-letters` and, once the cause is
    /// fixed, publishes it again with `idem redrive` (under a new id, see
    /// [`crate::Engine::redrive`]). Returns the letter's seq, or `None`
    /// when `entry` is no longer in the outbox (marked published meanwhile;
    /// nothing is written).
    ///
    /// # Errors
    ///
    /// Storage errors, [`crate::Error::Poisoned`].
    pub fn give_up(&self, entry: &OutboxEntry, attempts: u32, reason: &str) -> Result<Option<u64>> {
        let seq = self.core.store.dead_letter(DeadLetterRequest {
            claim: None,
            outbox_seq: Some(entry.seq),
            letter: DeadLetter {
                seq: 0,
                consumer: OUTBOX_DEAD_LETTER_CONSUMER.to_owned(),
                message_id: entry.id.clone(),
                topic: entry.topic.clone(),
                payload: entry.payload.clone(),
                attempts,
                reason: reason.to_owned(),
                dead_at_ms: 0,
            },
        })?;
        if seq == 0 {
            return Ok(None);
        }
        tracing::warn!(id = %entry.id, topic = %entry.topic, seq, attempts, reason, "outbox message given up to the dead letters");
        Ok(Some(seq))
    }

    /// Number of unpublished messages.
    ///
    /// # Errors
    ///
    /// Storage errors.
    pub fn len(&self) -> Result<u64> {
        self.core.store.outbox_len()
    }

    /// Whether no message awaits publishing.
    ///
    /// # Errors
    ///
    /// Storage errors.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }
}

impl std::fmt::Debug for Outbox<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox").finish_non_exhaustive()
    }
}
