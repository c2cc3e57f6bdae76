//! The engine's settings, fixed when it opens.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::duration_ms;
use crate::envelope::Upcasters;
use crate::policy::ExpiryPolicy;
use crate::resolver::Resolver;
use crate::step::{InDoubtStep, StepResolution};

/// A per-step-name resolver (see `EngineBuilder::step_resolver`).
pub(crate) type StepResolver = Arc<dyn Fn(&InDoubtStep) -> StepResolution + Send + Sync>;
use crate::store::config::StoreConfig;

/// Settings fixed when the engine opens.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) lease: Duration,
    pub(crate) store: StoreConfig,
    pub(crate) upcasters: Upcasters,
    pub(crate) resolver: Option<Arc<dyn Resolver>>,
    /// Resolvers for effect steps, by step name.
    pub(crate) step_resolvers: HashMap<String, StepResolver>,
    pub(crate) max_batch: usize,
    /// Bytes of changes after which a group commit takes no more
    /// operations (see `EngineBuilder::max_group_bytes`).
    pub(crate) max_group_bytes: usize,
    pub(crate) queue_capacity: usize,
    pub(crate) sweep_batch: usize,
    /// Bytes kept beside a database file for recovery (see
    /// `EngineBuilder::recovery_reserve`).
    pub(crate) recovery_reserve: u64,
    /// Shortest time between two resolver questions about one dropped
    /// claim while its lease runs (see `engine/early.rs`).
    pub(crate) resolver_interval: Duration,
    /// Deliveries after which a message that keeps failing cleanly goes to
    /// the dead letters (see `EngineBuilder::dead_letter_after`), >= 1.
    pub(crate) dead_letter_after: u32,
}

impl Config {
    /// The default lease in whole milliseconds, at least 1.
    pub(crate) fn lease_ms(&self) -> u64 {
        duration_ms(self.lease).max(1)
    }

    /// The resolver interval in whole milliseconds, at least 1.
    pub(crate) fn resolver_interval_ms(&self) -> u64 {
        duration_ms(self.resolver_interval).max(1)
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
            step_resolvers: HashMap::new(),
            max_batch: 512,
            max_group_bytes: 64 << 20,
            queue_capacity: 4096,
            sweep_batch: 64,
            recovery_reserve: crate::store::redb::DEFAULT_RECOVERY_RESERVE,
            resolver_interval: Duration::from_secs(1),
            dead_letter_after: 5,
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
            .field(
                "step_resolvers",
                &self.step_resolvers.keys().collect::<Vec<_>>(),
            )
            .field("max_batch", &self.max_batch)
            .field("max_group_bytes", &self.max_group_bytes)
            .field("queue_capacity", &self.queue_capacity)
            .field("sweep_batch", &self.sweep_batch)
            .field("recovery_reserve", &self.recovery_reserve)
            .field("resolver_interval", &self.resolver_interval)
            .field("dead_letter_after", &self.dead_letter_after)
            .finish()
    }
}
