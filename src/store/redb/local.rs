//! Local exactly-once on redb: the app's own write and the key's completion
//! in one write transaction.
//!
//! Because the engine lives in the same redb file as the app's data, a ledger
//! row and its dedup mark can commit together or not at all. The app's
//! closure runs on the writer thread inside a transaction of its own (an
//! isolated job), so its failure cannot touch other callers' work.

use std::panic::{catch_unwind, AssertUnwindSafe};

use redb::WriteTransaction;

use crate::envelope::Envelope;
use crate::error::{BoxError, Error};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::message::OutgoingMessage;
use crate::store::record::{Completion, StoredResponse};
use crate::store::{ClaimRequest, ClaimResult, CompleteRequest, LocalResult};

use crate::store::ops::Ops;

use super::tables::{OpError, Tables};

/// The transaction an app's local write runs in (see
/// [`crate::Engine::complete_local`]).
pub struct LocalTx<'a> {
    txn: &'a WriteTransaction,
    outbox: Vec<OutgoingMessage>,
}

impl LocalTx<'_> {
    /// The redb write transaction. Open the app's own tables on it (any name
    /// not starting with `idempotency.`); everything written commits with
    /// the idempotency outcome, or not at all. The engine's own tables are
    /// open for the whole closure, so opening one of them fails.
    pub fn txn(&self) -> &WriteTransaction {
        self.txn
    }

    /// Queues an outbox message, stored in the same transaction. Its id is
    /// `<claim reference>/<n>`, in the order sent.
    pub fn send(&mut self, message: OutgoingMessage) {
        self.outbox.push(message);
    }
}

impl std::fmt::Debug for LocalTx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalTx")
            .field("outbox", &self.outbox.len())
            .finish()
    }
}

/// The app's closure: gets the transaction, returns the envelope to store.
pub(crate) type LocalFn = Box<dyn FnOnce(&mut LocalTx<'_>) -> Result<Envelope, BoxError> + Send>;

/// Whose record a local write completes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum LocalTarget {
    /// A claim the caller already holds.
    Claimed { token: u64 },
    /// No claim yet: check and claim inside the same transaction, so a crash
    /// anywhere leaves nothing behind (no PROCESSING record to recover).
    Fresh {
        fingerprint: Fingerprint,
        lease_ms: u64,
    },
}

/// A local write waiting for the writer thread.
pub(crate) struct LocalWrite {
    pub(crate) key: IdempotencyKey,
    pub(crate) target: LocalTarget,
    pub(crate) run: LocalFn,
}

impl std::fmt::Debug for LocalWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalWrite")
            .field("key", &self.key)
            .field("target", &self.target)
            .finish()
    }
}

impl Tables<'_> {
    /// Runs the app's closure and the completion. A refusal (the closure
    /// failed or panicked, the response is too large, the claim is fenced)
    /// makes the writer roll the whole transaction back.
    pub(super) fn local(&mut self, write: LocalWrite) -> Result<LocalResult, OpError> {
        let LocalWrite { key, target, run } = write;
        let token = match target {
            LocalTarget::Claimed { token } => token,
            LocalTarget::Fresh {
                fingerprint,
                lease_ms,
            } => {
                let req = ClaimRequest {
                    key: key.clone(),
                    fingerprint,
                    lease_ms,
                };
                match self.claim(&req)? {
                    ClaimResult::Claimed(claimed) => claimed.token,
                    ClaimResult::Held(found) => return Ok(LocalResult::Held(found)),
                }
            }
        };
        let mut ltx = LocalTx {
            txn: self.txn,
            outbox: Vec::new(),
        };
        let envelope = match catch_unwind(AssertUnwindSafe(|| run(&mut ltx))) {
            Ok(Ok(envelope)) => envelope,
            Ok(Err(source)) => return Err(OpError::Refused(Error::LocalWrite { key, source })),
            Err(_) => {
                return Err(OpError::Refused(Error::LocalWrite {
                    key,
                    source: "the local write panicked".into(),
                }))
            }
        };
        let size = envelope.size_bytes();
        let limit = self.cfg.max_response_bytes;
        if size > limit {
            return Err(OpError::Refused(Error::ResponseTooLarge {
                key,
                size,
                limit,
                claim: None,
            }));
        }
        self.complete(CompleteRequest {
            key,
            token,
            completion: Completion::Success,
            response: StoredResponse::new(envelope, None),
            messages: ltx.outbox,
        })?;
        Ok(LocalResult::Executed)
    }
}
