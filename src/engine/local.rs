//! Local exactly-once: the app's own write and the idempotency outcome in
//! one transaction (see `store/redb/local.rs` for how it runs).
//!
//! Effect steps and local writes: a claim may reserve and confirm steps
//! (its external calls) and then complete with `complete_local`; the steps
//! and their log are kept with the COMPLETED record, and the completion is
//! refused while a step is still reserved, as `complete` is.
//! `execute_local` takes no claim, so it has no steps: nothing in it can be
//! durable before its one transaction commits, and a reservation that
//! commits together with its own confirmation protects nothing. Work with
//! external calls uses `begin`, `effect`/`confirm`, then `complete_local`.
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
use crate::store::step::StepFinish;
use crate::store::{Abandon, InDoubtRequest, LocalResult, LocalTarget, LocalTx, LocalWrite};

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
    let finished = claim.take_deferred();
    let (key, token) = claim.finish();
    let named = key.clone();
    complete_claimed(core, key, token, finished, write).map_err(|e| e.naming(&named, None))
}

/// `complete_local` once the claim is taken apart.
fn complete_claimed<F>(
    core: &Core,
    key: IdempotencyKey,
    token: u64,
    finished: Vec<StepFinish>,
    write: F,
) -> Result<()>
where
    F: FnOnce(&mut LocalTx<'_>) -> Result<Envelope, BoxError> + Send + 'static,
{
    let local = LocalWrite {
        key: key.clone(),
        target: LocalTarget::Claimed { token },
        run: Box::new(write),
        finished,
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
            match core.store.release(key.clone(), token) {
                Ok(()) => Err(e),
                // The claim made effect calls (a confirmed step): work
                // happened, so the key is not released but left in doubt
                // at once; its steps are settled, so the next `begin`
                // resumes it (the confirmed calls are skipped).
                Err(Error::InvalidState { .. }) => {
                    core.store.mark_in_doubt(InDoubtRequest {
                        key,
                        token,
                        reason: "local write failed after effect steps".into(),
                        by: Abandon::Explicit,
                    })?;
                    Err(e)
                }
                Err(release) => Err(release),
            }
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
        finished: Vec::new(),
    };
    match core.store.local(local).map_err(|e| e.naming(key, None))? {
        LocalResult::Executed => Ok(LocalRun::Executed),
        // The resolver is not consulted: the caller hears what holds the key.
        LocalResult::Held(found) => Ok(LocalRun::Skipped(core.answer(key, *found)?)),
    }
}
