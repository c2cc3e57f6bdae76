//! An outbox relay and an inbox consumer on NATS JetStream (cargo feature
//! `nats`), built on [`async_nats`].
//!
//! JetStream delivers at least once, and its own deduplication is a window
//! (2 minutes by default, counted from a message id's first sight, never
//! cleared by an ack, blind to payloads). The two halves here close the
//! gaps it leaves:
//!
//! - [`Relay`] publishes the engine's outbox with the `Nats-Msg-Id` header
//!   set to the outbox message id and marks a message published only after
//!   the server's publish ack. A relay killed between the ack and the mark
//!   publishes the message again with the same id: JetStream drops it
//!   inside its window, and the consumer's inbox drops it outside.
//! - [`Consumer`] reads a pull consumer, runs the app's business write and
//!   the inbox mark in one transaction (`Inbox::process_local`), and acks
//!   only after that commit. A consumer killed between the commit and the
//!   ack gets the message again: the inbox says duplicate, it is acked, and
//!   the write is not repeated. A handler error is a *clean* failure
//!   (nothing was written; unless failing storage caused it, such as a
//!   full disk, which is returned as an error and never dead-letters the
//!   message): the message is redelivered until
//!   [`crate::EngineBuilder::dead_letter_after`] deliveries (JetStream's
//!   delivery count; default 5), then given up to the dead letters. The
//!   wait before each redelivery starts at [`Consumer::retry_delay`]
//!   (1 s) and doubles up to [`Consumer::max_retry_delay`] (5 min): with
//!   the defaults a failing message is dead-lettered about 15 s after its
//!   first delivery. A message without
//!   a usable id goes to the dead letters at once. A message in doubt is
//!   left to the resolver (naked with a delay, never dead-lettered).
//!
//! Both take an `Arc<Engine>` and call it on tokio's blocking pool, so no
//! runtime worker waits for a commit. Both return typed errors ([`NatsError`])
//! and, in their `run` loops, retry with a capped exponential backoff;
//! `async_nats` itself reconnects a client whose server went away.
//! Connect with [`connect`], which retries a server that is not up yet.
//!
//! This module sits at the top of the crate's layers, beside `http`: it
//! uses the engine's public API and nothing below imports it.

mod consumer;
mod error;
mod relay;
mod support;
mod unreadable;

pub use self::consumer::{ConsumePass, Consumer, Incoming};
pub use self::error::NatsError;
pub use self::relay::{Relay, RelayPass};
pub use self::support::{Backoff, MSG_ID_HEADER};

/// The `async_nats` crate this module is built on, for building clients,
/// streams and consumers of the same version.
pub use async_nats;

use std::time::Duration;

/// Connects to the NATS server at `url`, retrying with `backoff` for at
/// most `give_up_after` while it is not reachable (a broker still starting,
/// or down). The client reconnects by itself later (async-nats's own
/// backoff), so a server that goes away mid-stream turns into errors of
/// single calls, not a dead client.
///
/// # Errors
///
/// [`NatsError::Connect`] naming `url` and the last error, once
/// `give_up_after` has passed.
pub async fn connect(
    url: &str,
    backoff: Backoff,
    give_up_after: Duration,
) -> Result<async_nats::Client, NatsError> {
    let started = tokio::time::Instant::now();
    let mut failures = 0_u32;
    loop {
        let options = async_nats::ConnectOptions::new().connection_timeout(Duration::from_secs(2));
        match options.connect(url).await {
            Ok(client) => return Ok(client),
            Err(e) => {
                failures = failures.saturating_add(1);
                let wait = backoff.after(failures);
                if started.elapsed() + wait > give_up_after {
                    return Err(NatsError::Connect {
                        url: url.to_owned(),
                        attempts: failures,
                        source: Box::new(e),
                    });
                }
                tracing::warn!(url, failures, ?wait, error = %e, "NATS server not reachable; retrying");
                tokio::time::sleep(wait).await;
            }
        }
    }
}
