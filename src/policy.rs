//! The expiry and purge policies a user picks: plain values, shared by the
//! engine and every store.

use std::time::Duration;

use crate::clock::duration_ms;

/// What happens to a COMPLETED or `FINAL_FAILURE` record once its TTL has run
/// out. See the expiry table in `docs/expiry.md`.
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
    /// Only finished records: COMPLETED, `FINAL_FAILURE` and TOMBSTONE. A
    /// PROCESSING or UNKNOWN record is refused, and so is a record that does
    /// not decode.
    FinishedOnly,
    /// Any record, including PROCESSING and UNKNOWN ones and records that do
    /// not decode. Deleting a record whose work may be running or may have
    /// run lets a retry execute it again: a possible double execution.
    Force,
}
