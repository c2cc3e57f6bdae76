//! Outbox messages: what an app sends with an outcome, and what the relay
//! reads back.

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
///
/// How it is stored is the store's business (a private wire struct), not
/// this type's: its fields may change without changing the disk format.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxEntry {
    /// Position in the outbox (commit order). Pass it to
    /// [`crate::Outbox::mark_published`].
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
