//! The outbox relay: publish, wait for the ack, then mark published.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;

use super::error::NatsError;
use super::support::{blocking, Backoff, MSG_ID_HEADER};
use crate::message::OutboxEntry;
use crate::Engine;

/// Publishes an engine's outbox to JetStream (see the module docs).
///
/// Run one relay per database (as for any outbox relay): two would both
/// publish the same messages, which the window and the inbox then drop.
#[derive(Clone)]
pub struct Relay {
    engine: Arc<Engine>,
    js: jetstream::Context,
    batch: usize,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

/// What one [`Relay::relay_once`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RelayPass {
    /// Messages the server acked and that are now marked published.
    pub published: usize,
    /// Of those, how many the server reported as duplicates (published
    /// before, inside its dedup window: a relay that stopped between a
    /// publish and its mark).
    pub duplicates: usize,
}

impl Relay {
    /// A relay of `engine`'s outbox to the streams of `js`; each outbox
    /// message's topic is its subject. Batch size 64.
    pub fn new(engine: Arc<Engine>, js: jetstream::Context) -> Relay {
        Relay {
            engine,
            js,
            batch: 64,
        }
    }

    /// Messages taken from the outbox per pass (at least 1).
    #[must_use]
    pub fn batch(mut self, messages: usize) -> Relay {
        self.batch = messages.max(1);
        self
    }

    /// One pass: takes up to a batch of unpublished messages, publishes
    /// each in order with `Nats-Msg-Id` set to its outbox id, waits for
    /// each publish ack, and marks the acked ones published. On the first
    /// failure it stops publishing (so order holds), marks what was acked
    /// before it, and returns the error.
    ///
    /// # Errors
    ///
    /// [`NatsError::Publish`] (that message and the rest stay in the
    /// outbox), [`NatsError::Engine`] (nothing marked), [`NatsError::Blocking`].
    pub async fn relay_once(&self) -> Result<RelayPass, NatsError> {
        let engine = Arc::clone(&self.engine);
        let batch = self.batch;
        let taken = blocking(move || engine.outbox().take(batch)).await??;
        let (acked, duplicates, failed) = self.publish(&taken).await;
        let published = acked.len();
        if !acked.is_empty() {
            let engine = Arc::clone(&self.engine);
            blocking(move || engine.outbox().mark_published(&acked)).await??;
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(RelayPass {
                published,
                duplicates,
            }),
        }
    }

    /// Publishes `entries` in order and waits for each ack, marking
    /// nothing: the seqs the server acked, how many of those it called
    /// duplicates, and the error that stopped it, if any. (`relay_once`
    /// is this plus the mark; a test can call it alone to stop where a
    /// killed relay stops.)
    pub async fn publish(&self, entries: &[OutboxEntry]) -> (Vec<u64>, usize, Option<NatsError>) {
        let mut acked = Vec::with_capacity(entries.len());
        let mut duplicates = 0;
        for entry in entries {
            match self.publish_one(entry).await {
                Ok(duplicate) => {
                    acked.push(entry.seq);
                    duplicates += usize::from(duplicate);
                }
                Err(e) => return (acked, duplicates, Some(e)),
            }
        }
        (acked, duplicates, None)
    }

    async fn publish_one(&self, entry: &OutboxEntry) -> Result<bool, NatsError> {
        let failed = |source: async_nats::Error| NatsError::Publish {
            id: entry.id.clone(),
            subject: entry.topic.clone(),
            source,
        };
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(MSG_ID_HEADER, entry.id.as_str());
        let ack = self
            .js
            .publish_with_headers(entry.topic.clone(), headers, entry.payload.clone().into())
            .await
            .map_err(|e| failed(Box::new(e)))?;
        let ack = ack.await.map_err(|e| failed(Box::new(e)))?;
        Ok(ack.duplicate)
    }

    /// Relays until `stop` resolves: a pass, then, when it published
    /// nothing, a wait of `idle`; after an error (logged), a wait from
    /// `backoff` (doubling while errors repeat, reset by a good pass).
    /// Returns how many messages it published.
    pub async fn run(
        &self,
        idle: Duration,
        backoff: Backoff,
        stop: impl std::future::Future<Output = ()>,
    ) -> u64 {
        let mut stop = std::pin::pin!(stop);
        let mut failures = 0_u32;
        let mut total = 0_u64;
        loop {
            let wait = match self.relay_once().await {
                Ok(pass) => {
                    failures = 0;
                    total += pass.published as u64;
                    if pass.published > 0 {
                        Duration::ZERO
                    } else {
                        idle
                    }
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    let wait = backoff.after(failures);
                    tracing::warn!(error = %e, failures, ?wait, "outbox relay pass failed; retrying");
                    wait
                }
            };
            tokio::select! {
                () = &mut stop => return total,
                () = tokio::time::sleep(wait) => {}
            }
        }
    }
}
