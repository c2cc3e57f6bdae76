//! A won claim: the right, fenced by a token, to run one key's work.

use std::fmt;
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::clock::duration_ms;
use crate::engine::effects::Effects;
use crate::error::{Error, Result, ReturnedClaim};
use crate::key::IdempotencyKey;
use crate::step::{EffectStep, StepInfo};
use crate::store::{Abandon, Backend, Claimed, InDoubtRequest};

/// Proof that this caller won the atomic insert of a PROCESSING record.
///
/// Finish it with [`crate::Engine::complete`] or [`crate::Engine::fail`].
/// A claim dropped without an outcome counts as [`crate::Failure::InDoubt`]:
/// the work may have had side effects, so the key is kept for recovery and
/// never re-executed. (If the engine is already closed when the claim drops,
/// the lease running out has the same effect.)
///
/// The claim holds only a weak link to its engine's store: dropping the
/// engine while a claim is alive closes the database, and the claim's calls
/// then return [`Error::Closed`].
pub struct Claim {
    key: IdempotencyKey,
    token: u64,
    reference: String,
    claimed_at_ms: u64,
    lease_until_ms: u64,
    store: Weak<dyn Backend>,
    /// The key's steps as `begin` saw them (earlier attempts' steps for a
    /// resumed key; empty for a fresh one).
    steps: Vec<StepInfo>,
    effects: Effects,
    finished: bool,
}

impl Claim {
    pub(crate) fn new(
        key: IdempotencyKey,
        claimed: Claimed,
        steps: Vec<StepInfo>,
        store: Weak<dyn Backend>,
    ) -> Claim {
        let effects = Effects::new(key.clone(), claimed.token, store.clone());
        Claim {
            key,
            token: claimed.token,
            reference: claimed.reference,
            claimed_at_ms: claimed.claimed_at_ms,
            lease_until_ms: claimed.lease_until_ms,
            store,
            steps,
            effects,
            finished: false,
        }
    }

    /// Whether the engine owning `store` issued this claim.
    pub(crate) fn issued_by(&self, store: &Arc<dyn Backend>) -> bool {
        std::ptr::addr_eq(Weak::as_ptr(&self.store), Arc::as_ptr(store))
    }

    /// Marks the claim as ended by its holder (so `Drop` sends nothing) and
    /// returns its key and fencing token.
    pub(crate) fn finish(&mut self) -> (IdempotencyKey, u64) {
        self.finished = true;
        (self.key.clone(), self.token)
    }

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

    /// When the lease runs out (ms since the Unix epoch, exclusive). From
    /// then on the record answers as UNKNOWN to other callers.
    pub fn lease_until_ms(&self) -> u64 {
        self.lease_until_ms
    }

    /// Reserves the effect step `name` durably before its external call is
    /// made, or reports that an earlier attempt on this key already has the
    /// call's answer (then skip the call). See [`Effects::effect`].
    ///
    /// # Errors
    ///
    /// As for [`Effects::effect`].
    pub fn effect(&self, name: &str) -> Result<EffectStep> {
        self.effects.effect(name)
    }

    /// Records that the provider said yes to the reserved step `name`;
    /// durable before it returns. See [`Effects::confirm`].
    ///
    /// # Errors
    ///
    /// As for [`Effects::confirm`].
    pub fn confirm(&self, name: &str, evidence: &[u8]) -> Result<()> {
        self.effects.confirm(name, evidence)
    }

    /// Records that the provider said no to the reserved step `name`;
    /// durable before it returns. See [`Effects::reject`].
    ///
    /// # Errors
    ///
    /// As for [`Effects::confirm`].
    pub fn reject(&self, name: &str, evidence: &[u8]) -> Result<()> {
        self.effects.reject(name, evidence)
    }

    /// Records the provider's yes for the reserved step `name`, written
    /// with the claim's next write (its next [`Claim::effect`] or its
    /// completion) instead of a write of its own: one commit wait less per
    /// step. Not durable until then; a crash before it leaves the step to
    /// be settled by asking its provider. See [`Effects::confirm_deferred`].
    ///
    /// # Errors
    ///
    /// As for [`Effects::confirm_deferred`].
    pub fn confirm_deferred(&self, name: &str, evidence: &[u8]) -> Result<()> {
        self.effects.confirm_deferred(name, evidence)
    }

    /// [`Claim::confirm_deferred`] for a provider that said no. See
    /// [`Effects::reject_deferred`].
    ///
    /// # Errors
    ///
    /// As for [`Effects::confirm_deferred`].
    pub fn reject_deferred(&self, name: &str, evidence: &[u8]) -> Result<()> {
        self.effects.reject_deferred(name, evidence)
    }

    /// The deferred step finishes the completion carries.
    pub(crate) fn take_deferred(&self) -> Vec<crate::store::step::StepFinish> {
        self.effects.take_deferred()
    }

    /// The key's effect steps as `begin` saw them: for a key resumed after
    /// an attempt that died, that attempt's settled steps (confirmed ones
    /// are skipped by [`Claim::effect`]); empty for a fresh key. Not
    /// updated by this claim's own calls.
    pub fn steps(&self) -> &[StepInfo] {
        &self.steps
    }

    /// A cloneable handle for this claim's step calls, for async handlers
    /// and tasks that cannot borrow the claim.
    pub fn effects(&self) -> Effects {
        self.effects.clone()
    }

    /// Renews the lease to `lease` from now (whole milliseconds), for long
    /// work. Durable before it returns. A lease that has run out can still
    /// be renewed as long as nothing has moved the record to UNKNOWN yet (no
    /// sweep, no `begin` with the same fingerprint has seen it).
    ///
    /// # Errors
    ///
    /// [`Error::Fenced`] once the claim no longer owns a PROCESSING record
    /// (its lease ran out and the record moved to UNKNOWN, or recovery took
    /// over); [`Error::Closed`] if the engine was dropped; storage errors;
    /// [`Error::Poisoned`].
    pub fn extend(&mut self, lease: Duration) -> Result<()> {
        let store = self.store.upgrade().ok_or(Error::Closed)?;
        self.lease_until_ms = store
            .extend(self.key.clone(), self.token, duration_ms(lease))
            .map_err(|e| e.naming(&self.key, None))?;
        Ok(())
    }
}

impl ReturnedClaim {
    pub(crate) fn new(claim: Claim) -> ReturnedClaim {
        ReturnedClaim(Box::new(claim))
    }

    /// The claim, unused: complete or fail it as usual. `None` only for a
    /// value this crate did not make (it always holds a [`Claim`]).
    pub fn into_claim(self) -> Option<Claim> {
        self.0.downcast::<Claim>().ok().map(|claim| *claim)
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        if let Some(store) = self.store.upgrade() {
            tracing::warn!(key = %self.key, token = self.token, "claim dropped without an outcome");
            store.mark_in_doubt_detached(InDoubtRequest {
                key: self.key.clone(),
                token: self.token,
                reason: "claim dropped without an outcome".to_string(),
                by: Abandon::Dropped,
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
            .field("lease_until_ms", &self.lease_until_ms)
            .field("steps", &self.steps.len())
            .finish()
    }
}
