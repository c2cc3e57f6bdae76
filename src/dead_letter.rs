//! Dead letters: messages a consumer gave up on, kept for an operator.
//!
//! A message goes here when its handler failed *cleanly* (nothing
//! happened: a `Failure::Retryable`, or an error before any side effect)
//! on its last allowed delivery, or when it cannot be processed at all (no
//! message id, an id over [`crate::MAX_KEY_BYTES`], control characters).
//! An outbox message a relay can never publish comes here too
//! ([`crate::Outbox::give_up`], consumer
//! [`crate::OUTBOX_DEAD_LETTER_CONSUMER`]).
//! A message whose handler died mid-effect never comes here: its inbox
//! record is UNKNOWN (in doubt) and belongs to the resolver.

/// One message in the dead-letter list (`idem dead-letters` lists them,
/// [`crate::Engine::redrive`] moves one back to the outbox).
///
/// How it is stored is the store's business (a private wire struct on
/// redb, columns on PostgreSQL), not this type's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    /// Position in the list (pass it to [`crate::Engine::redrive`]):
    /// greater than every letter listed before it. (On redb, the number of
    /// a letter that was last and got redriven may be given again; the
    /// redrive's message id, which also carries `dead_at_ms` and a digest
    /// of the letter, is not.)
    pub seq: u64,
    /// The inbox's consumer name ([`crate::OUTBOX_DEAD_LETTER_CONSUMER`]
    /// for an outbox message a relay gave up).
    pub consumer: String,
    /// The message id as delivered (empty when it had none; possibly not a
    /// valid key when that is why it is here).
    pub message_id: String,
    /// Where it came from (for a JetStream message: its subject); a
    /// redrive publishes it there again.
    pub topic: String,
    /// The payload bytes, as delivered.
    pub payload: Vec<u8>,
    /// Deliveries seen when it was given up (0: refused before any
    /// handler ran, a bad message).
    pub attempts: u32,
    /// Why: the last clean failure, or what is wrong with the message.
    pub reason: String,
    /// When it was given up (ms since the Unix epoch).
    pub dead_at_ms: u64,
}

/// One delivery of a message, as a consumer hands it to
/// [`crate::Inbox::fail_cleanly`] and [`crate::Inbox::reject`].
#[derive(Clone, Copy, Debug)]
pub struct Delivery<'a> {
    /// The message id (JetStream: the `Nats-Msg-Id` header).
    pub message_id: &'a str,
    /// Where it came from (JetStream: the subject).
    pub topic: &'a str,
    /// The payload bytes.
    pub payload: &'a [u8],
    /// Which delivery this is, from 1 (JetStream: the delivery count in
    /// the message's metadata). The broker counts, not the store: a clean
    /// failure deletes the inbox record, so the store keeps no count.
    pub attempt: u32,
}

/// The message id a redrive publishes `letter` under: a new id, so neither
/// the broker's dedup window nor the inbox's `FINAL_FAILURE` mark of the
/// original drops it, and a valid key whenever the original id was one.
///
/// `<id>~redrive<seq>.<unique>@<dead_at_ms>.<digest>`: `unique` is a number
/// the store never hands out twice (its next fencing token), so no two
/// redrives share an id, not even of two identical letters given up in one
/// millisecond under one seq (on redb a redriven last letter's seq is given
/// again). The digest (12 hex digits of BLAKE3 over the letter's consumer,
/// id, topic, payload, attempts and reason) ties the id to the letter's
/// content for an operator comparing ids.
pub(crate) fn redrive_id(letter: &DeadLetter, unique: u64) -> String {
    let mut hasher = blake3::Hasher::new();
    for part in [
        letter.consumer.as_bytes(),
        letter.message_id.as_bytes(),
        letter.topic.as_bytes(),
        &letter.payload,
        &letter.attempts.to_le_bytes(),
        letter.reason.as_bytes(),
    ] {
        hasher.update(&(part.len() as u64).to_le_bytes());
        hasher.update(part);
    }
    let digest = hasher.finalize().to_hex();
    let suffix = format!(
        "~redrive{}.{unique}@{}.{}",
        letter.seq,
        letter.dead_at_ms,
        &digest.as_str()[..12]
    );
    let id = &letter.message_id;
    if !id.is_empty()
        && id.len() + suffix.len() <= crate::key::MAX_KEY_BYTES
        && !id.chars().any(char::is_control)
    {
        format!("{id}{suffix}")
    } else {
        format!("dead-letter{suffix}")
    }
}
