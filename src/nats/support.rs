//! What the relay and the consumer share: the dedup header, the backoff,
//! and the hop to the blocking pool.

use std::time::Duration;

use super::error::NatsError;

/// The header JetStream deduplicates on.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// A capped exponential backoff: `initial`, doubled after each failure, at
/// most `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// The first wait. Default 50 ms.
    pub initial: Duration,
    /// The longest wait. Default 5 s.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff {
            initial: Duration::from_millis(50),
            max: Duration::from_secs(5),
        }
    }
}

impl Backoff {
    /// The wait after `failures` failures in a row (1 for the first).
    #[must_use]
    pub fn after(&self, failures: u32) -> Duration {
        let doubled = self
            .initial
            .saturating_mul(1_u32 << failures.saturating_sub(1).min(16));
        doubled.min(self.max)
    }
}

/// Runs `f` (an engine call, which may wait for a commit) on tokio's
/// blocking pool.
pub(super) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, NatsError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| NatsError::Blocking(e.to_string()))
}
