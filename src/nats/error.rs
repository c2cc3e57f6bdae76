//! The errors of the JetStream relay and consumer.

use crate::error::BoxError;

/// What went wrong talking to JetStream, or to the engine behind it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NatsError {
    /// The server at `url` could not be reached (see [`super::connect`]).
    #[error("cannot connect to the NATS server at {url} ({attempts} attempts): {source}")]
    Connect {
        /// The server's URL.
        url: String,
        /// Connection attempts made.
        attempts: u32,
        /// The last attempt's error.
        #[source]
        source: BoxError,
    },
    /// Publishing outbox message `id` to `subject` failed, or its publish
    /// ack did not come: it stays in the outbox and is published again
    /// (with the same id) by the next pass.
    #[error("publishing outbox message {id} to JetStream subject {subject}: {source}")]
    Publish {
        /// The outbox message id (its `Nats-Msg-Id`).
        id: String,
        /// The subject (the outbox message's topic).
        subject: String,
        /// What the client said.
        #[source]
        source: BoxError,
    },
    /// Outbox message `id` can never be published as it is: its topic is
    /// not a valid NATS subject for a publish (empty, whitespace or control
    /// characters, empty tokens, or a `*` / `>` wildcard, which is never
    /// published), it is over the server's `max_payload` or the stream's
    /// maximum message size, or no stream takes its subject (the server
    /// had no responders and the JetStream API confirmed it). The relay
    /// tries it [`super::Relay::give_up_after`] times in all, then gives
    /// it up to the dead letters and goes on with the messages behind it.
    #[error(
        "outbox message {id} to {subject:?} cannot be published (attempt {attempts} of \
         {give_up_after}, then dead-lettered): {problem}"
    )]
    Unpublishable {
        /// The outbox message id.
        id: String,
        /// The subject (the outbox message's topic).
        subject: String,
        /// What is wrong with it.
        problem: String,
        /// Passes that have failed on it so far, this one included (0 from
        /// [`super::Relay::publish`], which does not count).
        attempts: u32,
        /// The relay's limit ([`super::Relay::give_up_after`]).
        give_up_after: u32,
    },
    /// Fetching from the pull consumer failed (the server went away, the
    /// stream or consumer is missing).
    #[error("fetching from the JetStream consumer: {source}")]
    Fetch {
        /// What the client said.
        #[source]
        source: BoxError,
    },
    /// The consumer's client is not connected to the NATS server (it went
    /// away, or refuses connections) as a pass starts, or stopped being
    /// while the pass waited for messages: nothing more was fetched or
    /// acked. async-nats reconnects by itself with backoff;
    /// the next pass after that consumes again. (A fetch sent while
    /// disconnected would wait out its expiry plus 5 s and end empty, as
    /// if no message were there: this error says why instead.)
    #[error(
        "JetStream consumer {consumer:?} on stream {stream:?}: the NATS server is not \
         reachable (connection {state}; the client reconnects by itself, with backoff); \
         nothing more was fetched or acked"
    )]
    Disconnected {
        /// The stream's name.
        stream: String,
        /// The consumer's name.
        consumer: String,
        /// The client's connection state (`pending` or `disconnected`).
        state: String,
    },
    /// Acking, naking or terminating message `id` failed; JetStream
    /// redelivers it after its ack wait, and the inbox makes that a
    /// duplicate where it was processed.
    #[error("answering JetStream for message {id}: {source}")]
    Ack {
        /// The message id (`Nats-Msg-Id`), or the stream sequence when it
        /// had none.
        id: String,
        /// What the client said.
        #[source]
        source: BoxError,
    },
    /// The JetStream consumer is configured so that the inbox cannot keep
    /// its promises: an ack policy other than explicit (the server counts
    /// a message done on delivery, or acks earlier messages with a later
    /// one, so a crash or a clean failure loses it), or a `max_deliver`
    /// below [`crate::Engine::dead_letter_after`] (the server stops
    /// delivering a failing message before it reaches the dead letters).
    /// Checked by [`super::Consumer::new`], from the consumer's info.
    #[error("JetStream consumer {consumer:?} on stream {stream:?} cannot be used: {problem}")]
    ConsumerConfig {
        /// The stream's name.
        stream: String,
        /// The consumer's name.
        consumer: String,
        /// What is wrong, and the setting that fixes it.
        problem: String,
    },
    /// The engine failed (storage, a poisoned engine, ...); nothing was
    /// acked or marked published.
    #[error(transparent)]
    Engine(#[from] crate::error::Error),
    /// A blocking engine call did not finish (its task panicked or the
    /// runtime is shutting down).
    #[error("an engine call on the blocking pool did not finish: {0}")]
    Blocking(String),
}
