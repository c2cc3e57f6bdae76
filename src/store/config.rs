//! The settings every store write needs, fixed when the engine opens.

use crate::policy::ExpiryPolicy;

/// Settings the store needs for every write.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StoreConfig {
    /// How long a COMPLETED or `FINAL_FAILURE` record is replayed, in ms.
    pub(crate) ttl_ms: u64,
    pub(crate) expiry: ExpiryPolicy,
    /// Largest stored response (body plus headers), in bytes.
    pub(crate) max_response_bytes: usize,
}
