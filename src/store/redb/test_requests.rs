//! The claim and completion the redb store's tests send
//! (`snapshot_tests.rs`, `step_tables_tests.rs`): one copy, so the tests
//! agree on what a plain "claimed, then paid" key looks like.

use crate::envelope::Envelope;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::store::record::StoredResponse;
use crate::store::{Backend, ClaimRequest, ClaimResult, Claimed, CompleteRequest, Completion};

use super::RedbStore;

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
