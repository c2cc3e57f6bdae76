//! Settings fixed when an engine opens, and the policies a user picks.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::duration_ms;
use crate::envelope::Upcasters;
use crate::resolver::Resolver;

/// What happens to a COMPLETED or `FINAL_FAILURE` record once its TTL has run
/// out. See the README's expiry table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ExpiryPolicy {
    /// The record is deleted: reusing the key is a new request. The default.
    #[default]
    Forget,
    /// Key and fingerprint are kept for `keep` more (stored in whole
    /// milliseconds); a reuse in that time gets [`crate::Begin::Tombstoned`],
    /// never a second execution.
    Tombstone {
        /// How long the tombstone lasts after expiry.
        keep: Duration,
    },
}

impl ExpiryPolicy {
    /// The tombstone's lifetime in milliseconds, `None` under `Forget`.
    pub(crate) fn keep_ms(self) -> Option<u64> {
        match self {
            ExpiryPolicy::Forget => None,
            ExpiryPolicy::Tombstone { keep } => Some(duration_ms(keep)),
        }
    }
}

/// Which records [`crate::Engine::purge`] may delete.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PurgeMode {
    /// Only settled records: COMPLETED, `FINAL_FAILURE` and TOMBSTONE. A
    /// PROCESSING or UNKNOWN record is refused, and so is a record that does
    /// not decode.
    SettledOnly,
    /// Any record, including PROCESSING and UNKNOWN ones and records that do
    /// not decode. Deleting a record whose work may be running or may have
    /// run lets a retry execute it again: a possible double execution.
    Force,
}

/// Settings the store needs for every write.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StoreConfig {
    /// How long a COMPLETED or `FINAL_FAILURE` record is replayed, in ms.
    pub(crate) ttl_ms: u64,
    pub(crate) expiry: ExpiryPolicy,
    /// Largest stored response (body plus headers), in bytes.
    pub(crate) max_response_bytes: usize,
}

/// Settings fixed when the engine opens.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) lease: Duration,
    pub(crate) store: StoreConfig,
    pub(crate) upcasters: Upcasters,
    pub(crate) resolver: Option<Arc<dyn Resolver>>,
    pub(crate) max_batch: usize,
    /// Bytes of changes after which a group commit takes no more
    /// operations (see `EngineBuilder::max_group_bytes`).
    pub(crate) max_group_bytes: usize,
    pub(crate) queue_capacity: usize,
    pub(crate) sweep_batch: usize,
}

impl Config {
    /// The default lease in whole milliseconds, at least 1.
    pub(crate) fn lease_ms(&self) -> u64 {
        duration_ms(self.lease).max(1)
    }
}

impl Default for Config {
    fn default() -> Config {
        Config {
            lease: Duration::from_secs(30),
            store: StoreConfig {
                ttl_ms: 24 * 60 * 60 * 1000,
                expiry: ExpiryPolicy::Forget,
                max_response_bytes: 1 << 20,
            },
            upcasters: Upcasters::default(),
            resolver: None,
            max_batch: 512,
            max_group_bytes: 64 << 20,
            queue_capacity: 4096,
            sweep_batch: 64,
        }
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("lease", &self.lease)
            .field("max_response_bytes", &self.store.max_response_bytes)
            .field("ttl_ms", &self.store.ttl_ms)
            .field("expiry", &self.store.expiry)
            .field("upcasters", &self.upcasters)
            .field("resolver", &self.resolver.is_some())
            .field("max_batch", &self.max_batch)
            .field("max_group_bytes", &self.max_group_bytes)
            .field("queue_capacity", &self.queue_capacity)
            .field("sweep_batch", &self.sweep_batch)
            .finish()
    }
}
