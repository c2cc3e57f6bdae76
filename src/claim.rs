//! A won claim: the right, fenced by a token, to run one key's work.

use std::fmt;
use std::sync::Weak;
use std::time::Duration;

use crate::clock::duration_ms;
use crate::engine::Shared;
use crate::error::{Error, Result};
use crate::key::IdempotencyKey;
use crate::ops::{Op, Reply};

/// Proof that this caller won the atomic insert of a PROCESSING record.
///
/// Finish it with [`crate::Engine::complete`] or [`crate::Engine::fail`].
/// A claim dropped without an outcome counts as [`crate::Failure::Unknown`]:
/// the work may have had side effects, so the key is kept for recovery and
/// never re-executed. (If the engine is already closed when the claim drops,
/// the lease running out has the same effect.)
///
/// The claim holds only a weak link to its engine: dropping the engine while
/// a claim is alive closes the database, and the claim's calls then return
/// [`Error::Closed`].
pub struct Claim {
    pub(crate) key: IdempotencyKey,
    pub(crate) token: u64,
    pub(crate) reference: String,
    pub(crate) claimed_at_ms: u64,
    pub(crate) lease_until_ms: u64,
    pub(crate) engine: Weak<Shared>,
    pub(crate) finished: bool,
}

impl Claim {
    /// The claimed key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// The fencing token: grows with every claim, so a later claim on the
    /// same key always holds a larger token. An outcome reported with a token
    /// that no longer owns the record is refused with [`Error::Fenced`].
    pub fn fencing_token(&self) -> u64 {
        self.token
    }

    /// A stable, printable reference for this claim, derived from scope, key
    /// and fencing token and stored in the record before `begin` returned.
    /// Pass it to the payment provider as its idempotency key or transaction
    /// id; a [`crate::Resolver`] later asks the provider about it.
    pub fn reference(&self) -> &str {
        &self.reference
    }

    /// When the claim was taken (ms since the Unix epoch).
    pub fn claimed_at_ms(&self) -> u64 {
        self.claimed_at_ms
    }

    /// When the lease runs out (ms since the Unix epoch). After that the
    /// record answers as UNKNOWN to other callers.
    pub fn lease_expires_at_ms(&self) -> u64 {
        self.lease_until_ms
    }

    /// Renews the lease to `lease` from now, for long work. Durable before it
    /// returns. A lease that has run out can still be renewed as long as
    /// nothing has moved the record to UNKNOWN yet (no sweep, no `begin`
    /// with the same fingerprint has seen it).
    ///
    /// # Errors
    ///
    /// [`Error::Fenced`] once the claim no longer owns a PROCESSING record
    /// (its lease ran out and the record moved to UNKNOWN, or recovery took
    /// over); [`Error::Closed`] if the engine was dropped; storage errors.
    pub fn extend(&mut self, lease: Duration) -> Result<()> {
        let shared = self.engine.upgrade().ok_or(Error::Closed)?;
        let op = Op::Extend {
            key: self.key.clone(),
            token: self.token,
            lease_ms: duration_ms(lease),
        };
        match shared.submit(op)? {
            Reply::Lease { until_ms } => {
                self.lease_until_ms = until_ms;
                Ok(())
            }
            other => Err(shared.unexpected(other)),
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        if let Some(shared) = self.engine.upgrade() {
            tracing::warn!(key = %self.key, token = self.token, "claim dropped without an outcome");
            shared.submit_detached(Op::MarkUnknown {
                key: self.key.clone(),
                token: self.token,
                reason: "claim dropped without an outcome".to_string(),
                holder_done: false,
            });
        }
    }
}

impl fmt::Debug for Claim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Claim")
            .field("key", &self.key)
            .field("fencing_token", &self.token)
            .field("reference", &self.reference)
            .field("lease_expires_at_ms", &self.lease_until_ms)
            .finish()
    }
}
