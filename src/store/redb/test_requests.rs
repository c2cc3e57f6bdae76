//! The claim and completion the redb store's tests send
//! (`snapshot_tests.rs`, `step_tables_tests.rs`, and straight through the
//! writer's [`Tables`]: `partitioned_tables_tests.rs`,
//! `layout_reads_tests.rs`): one copy, so the tests agree on what a plain
//! "claimed, then paid" key looks like.

use crate::envelope::Envelope;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::store::record::StoredResponse;
use crate::store::{Backend, ClaimRequest, ClaimResult, Claimed, CompleteRequest, Completion};

use super::tables::Tables;
use super::RedbStore;
use crate::store::ops::Ops;

/// A test's result: `?` on the store's errors and on strings.
pub(super) type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Claims `key` (a fixed fingerprint, a 30 s lease); an error if it is
/// held.
pub(super) fn claim(store: &RedbStore, key: &IdempotencyKey) -> R<Claimed> {
    match store.claim(ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes([3; 32]),
        lease_ms: 30_000,
    })? {
        ClaimResult::Claimed(c) => Ok(c),
        ClaimResult::Held(found) => Err(format!("{key} held: {:?}", found.held).into()),
    }
}

/// The success completion of `key`'s claim `token`: status 200, body
/// `paid`, no messages, no step confirmations.
pub(super) fn paid(key: &IdempotencyKey, token: u64) -> CompleteRequest {
    CompleteRequest {
        key: key.clone(),
        token,
        completion: Completion::Success,
        response: StoredResponse::new(Envelope::new(1, 200, b"paid".to_vec()), None),
        messages: Vec::new(),
        finished: Vec::new(),
    }
}

/// Claims `key` in the writer's tables `t` (fingerprint `[7; 32]`,
/// `lease_ms`): its fencing token, or an error if it is held.
pub(super) fn claim_in(t: &mut Tables<'_>, key: &IdempotencyKey, lease_ms: u64) -> R<u64> {
    let req = ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease_ms,
    };
    match t.claim(&req).map_err(|e| format!("{e:?}"))? {
        ClaimResult::Claimed(c) => Ok(c.token),
        ClaimResult::Held(_) => Err(format!("{key} held").into()),
    }
}

/// Completes `key`'s claim `token` in `t` as [`paid`].
pub(super) fn complete_in(t: &mut Tables<'_>, key: &IdempotencyKey, token: u64) -> R<()> {
    t.complete(paid(key, token)).map_err(|e| format!("{e:?}"))?;
    Ok(())
}

/// Reserves effect step "charge" of `k`'s claim `token` and finishes it
/// confirmed, with evidence `ch_1`.
pub(super) fn finish_charge(t: &mut Tables<'_>, k: &IdempotencyKey, token: u64) -> R<()> {
    t.reserve_step(crate::store::StepRequest {
        key: k.clone(),
        token,
        name: "charge".into(),
        finished: Vec::new(),
    })
    .map_err(|e| format!("{e:?}"))?;
    t.finish_step(crate::store::FinishStepRequest {
        key: k.clone(),
        token,
        name: "charge".into(),
        confirmed: true,
        evidence: b"ch_1".to_vec(),
    })
    .map_err(|e| format!("{e:?}"))?;
    Ok(())
}
