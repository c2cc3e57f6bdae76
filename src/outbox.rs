//! The transactional outbox: messages stored in the same transaction as the
//! outcome that produced them, and the relay API that publishes them.

use redb::{ReadableTable, ReadableTableMetadata};
use serde::{Deserialize, Serialize};

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::ops::{Op, Reply};
use crate::tables::OUTBOX;

/// A message to publish once the transaction that carries it commits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutgoingMessage {
    /// Where it goes (a queue, topic or email channel; app-defined).
    pub topic: String,
    /// The payload bytes.
    pub payload: Vec<u8>,
}

impl OutgoingMessage {
    /// A message for `topic` with `payload`.
    pub fn new(topic: impl Into<String>, payload: impl Into<Vec<u8>>) -> OutgoingMessage {
        OutgoingMessage {
            topic: topic.into(),
            payload: payload.into(),
        }
    }
}

/// A stored, not yet published outbox message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutboxEntry {
    /// Position in the outbox (commit order). Pass it to
    /// [`Outbox::mark_published`].
    pub seq: u64,
    /// Stable message id: `<claim reference>/<n>`, the same on every
    /// redelivery, so a downstream inbox dedupes it.
    pub id: String,
    /// Destination.
    pub topic: String,
    /// Payload bytes.
    pub payload: Vec<u8>,
    /// When it was stored (ms since the Unix epoch).
    pub created_at_ms: u64,
}

/// The relay side of the outbox, from [`Engine::outbox`].
///
/// A relay loop: `take` a batch, publish each message, then
/// `mark_published` their `seq`s. A message is never lost, and is published
/// again only if the relay stops between publishing and marking; it then
/// carries the same `id`, so a consumer's inbox keeps exactly one effect.
/// Run one relay per database: two relays taking at once would both publish
/// the same messages (still deduped downstream, but wasted).
#[derive(Debug, Clone, Copy)]
pub struct Outbox<'e> {
    engine: &'e Engine,
}

impl Engine {
    /// The outbox relay API.
    pub fn outbox(&self) -> Outbox<'_> {
        Outbox { engine: self }
    }
}

impl Outbox<'_> {
    /// Up to `limit` unpublished messages, oldest first. Reading does not
    /// remove them.
    ///
    /// # Errors
    ///
    /// Storage errors; [`Error::CorruptRecord`] for an entry that does not
    /// decode.
    pub fn take(&self, limit: usize) -> Result<Vec<OutboxEntry>> {
        let ctx = "reading the outbox";
        let table = self.engine.shared.read_table(OUTBOX, ctx)?;
        let mut out = Vec::new();
        for entry in table
            .iter()
            .map_err(|e| Error::storage(ctx, e))?
            .take(limit)
        {
            let (seq, bytes) = entry.map_err(|e| Error::storage(ctx, e))?;
            out.push(crate::codec::decode_outbox(bytes.value()).map_err(|e| {
                Error::CorruptRecord {
                    key: format!("outbox #{}", seq.value()),
                    reason: e.to_string(),
                }
            })?);
        }
        Ok(out)
    }

    /// Removes published messages (durably, before it returns). Unknown
    /// `seq`s are ignored, so marking twice is harmless. Returns how many
    /// were removed.
    ///
    /// # Errors
    ///
    /// Storage errors, [`Error::Poisoned`].
    pub fn mark_published(&self, seqs: &[u64]) -> Result<u64> {
        match self.engine.shared.submit(Op::MarkPublished {
            seqs: seqs.to_vec(),
        })? {
            Reply::Count(n) => Ok(n),
            other => Err(self.engine.shared.unexpected(other)),
        }
    }

    /// Number of unpublished messages.
    ///
    /// # Errors
    ///
    /// Storage errors.
    pub fn len(&self) -> Result<u64> {
        let ctx = "counting the outbox";
        let table = self.engine.shared.read_table(OUTBOX, ctx)?;
        table.len().map_err(|e| Error::storage(ctx, e))
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
