//! Local exactly-once on redb: the app's own write and the key's completion
//! in one write transaction.
//!
//! Because the engine lives in the same redb file as the app's data, a ledger
//! row and its dedup mark can commit together or not at all. The app's
//! closure runs on the writer thread inside a transaction of its own (an
//! isolated job), so its failure cannot touch other callers' work.

use crate::store::local_tx::{run_local, LocalTarget, LocalTx, LocalWrite};
use crate::store::record::{Completion, StoredResponse};
use crate::store::{ClaimRequest, ClaimResult, CompleteRequest, LocalResult};

use crate::store::ops::Ops;

use super::tables::{OpError, Tables};

impl Tables<'_> {
    /// Runs the app's closure and the completion. A refusal (the closure
    /// failed or panicked, the response is too large, the claim is fenced)
    /// makes the writer roll the whole transaction back.
    pub(super) fn local(&mut self, write: LocalWrite) -> Result<LocalResult, OpError> {
        let LocalWrite {
            key,
            target,
            run,
            finished,
        } = write;
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
        let mut ltx = LocalTx::on_redb(self.txn);
        let envelope = run_local(run, &mut ltx, &key, self.cfg.max_response_bytes)
            .map_err(OpError::Refused)?;
        self.complete(CompleteRequest {
            key,
            token,
            completion: Completion::Success,
            response: StoredResponse::new(envelope, None),
            messages: ltx.into_outbox(),
            finished,
        })?;
        Ok(LocalResult::Executed)
    }
}
