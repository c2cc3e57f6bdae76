//! The relay side of the transactional outbox: messages stored in the same
//! transaction as the outcome that produced them, read and marked
//! published here.

use crate::engine::core::Core;
use crate::error::Result;
use crate::message::OutboxEntry;

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
