//! Local exactly-once: the app's own write and the idempotency outcome in
//! one transaction (see `store/redb/local.rs` for how it runs).
//!
//! Table naming rule: the engine owns every table whose name starts with
//! `idempotency.`; the app may create and use any other table in the file.

use crate::engine::begin::Begin;
use crate::engine::claim::Claim;
use crate::engine::core::Core;
use crate::envelope::Envelope;
use crate::error::{BoxError, Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::store::{LocalResult, LocalTarget, LocalTx, LocalWrite};

/// The answer to [`crate::Engine::execute_local`].
#[derive(Debug)]
pub enum LocalRun {
    /// The write ran and committed with its COMPLETED record.
    Executed,
    /// The key was not free; the write did not run. Never `Claimed`.
    Skipped(Begin),
}

/// Completes `claim` with the app's write in the same transaction.
pub(crate) fn complete_local<F>(core: &Core, claim: Claim, write: F) -> Result<()>
where
    F: FnOnce(&mut LocalTx<'_>) -> Result<Envelope, BoxError> + Send + 'static,
{
    let mut claim = core.own_claim(claim)?;
    let (key, token) = claim.finish();
    let local = LocalWrite {
        key: key.clone(),
        target: LocalTarget::Claimed { token },
        run: Box::new(write),
    };
    match core.store.local(local) {
        Ok(LocalResult::Executed) => Ok(()),
        // A claim the caller holds is never answered as held: the store
        // refuses a claim it no longer owns with `Error::Fenced`.
        Ok(LocalResult::Held(_)) => Err(Error::Fenced {
            key,
            token,
            reason: "the record is held by another claim".into(),
        }),
        Err(e @ (Error::LocalWrite { .. } | Error::ResponseTooLarge { .. })) => {
            core.store.release(key, token)?;
            Err(e)
        }
        Err(e) => Err(e),
    }
}

/// Runs the app's write exactly once for `key`, claim and completion in one
/// transaction.
pub(crate) fn execute_local<F>(
    core: &Core,
    key: &IdempotencyKey,
    fingerprint: Fingerprint,
    write: F,
) -> Result<LocalRun>
where
    F: FnOnce(&mut LocalTx<'_>) -> Result<Envelope, BoxError> + Send + 'static,
{
    let local = LocalWrite {
        key: key.clone(),
        target: LocalTarget::Fresh {
            fingerprint,
            lease_ms: core.cfg.lease_ms(),
        },
        run: Box::new(write),
    };
    match core.store.local(local)? {
        LocalResult::Executed => Ok(LocalRun::Executed),
        // The resolver is not consulted: the caller hears what holds the key.
        LocalResult::Held(found) => Ok(LocalRun::Skipped(core.answer(key, *found)?)),
    }
}
