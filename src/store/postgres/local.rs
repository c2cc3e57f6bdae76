//! Local exactly-once on PostgreSQL: the app's statements and the key's
//! completion in one transaction, which the app's closure gets as a
//! [`Transaction`] (through [`LocalTx::postgres`]).

use crate::error::{Error, Result};
use crate::store::local_tx::{run_local, LocalTarget, LocalTx, LocalWrite};
use crate::store::ops::{OpError, Ops};
use crate::store::record::{Completion, StoredResponse};
use crate::store::{ClaimRequest, ClaimResult, CompleteRequest, LocalResult};

use super::client::Transaction;
use super::shared::{storage, Shared};
use super::txn::{Fault, PgTxn};

const WHAT: &str = "running a local write";

thread_local! {
    /// While an app's local write closure runs on this thread: the address
    /// of the backend (its `Shared`) whose transaction it holds.
    static INSIDE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Whether the current thread runs a local write closure of `shared`: a
/// write from it would wait for the row lock its own transaction holds.
pub(super) fn inside(shared: &Shared) -> bool {
    INSIDE.with(|c| c.get() == std::ptr::from_ref(shared) as usize)
}

/// Marks the thread as inside a local write of `shared` until dropped.
struct Inside(usize);

impl Inside {
    fn enter(shared: &Shared) -> Inside {
        let previous = INSIDE.with(|c| c.replace(std::ptr::from_ref(shared) as usize));
        Inside(previous)
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        INSIDE.with(|c| c.set(self.0));
    }
}

fn refused(e: OpError<Fault>) -> Error {
    match e {
        OpError::Refused(e) => e,
        OpError::Fatal(Fault::Db(e)) => storage(WHAT)(e),
        OpError::Fatal(Fault::Race) => Error::Storage {
            context: WHAT,
            source: "another transaction claimed the key at the same moment".into(),
        },
    }
}

impl Shared {
    pub(super) fn local(&self, write: LocalWrite) -> Result<LocalResult> {
        let LocalWrite {
            key,
            target,
            run,
            finished,
        } = write;
        let mut conn = self.live_conn(WHAT)?;
        // A fresh claim can lose an insert race before the app's closure
        // runs; the transaction is then retried (the closure has not run).
        let mut tries = 0;
        let (tx, token, now) = loop {
            tries += 1;
            let now = self.clock.now_ms();
            let mut tx = conn.transaction_tracked().map_err(storage(WHAT))?;
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
                    let mut t = self.txn(&mut tx, now);
                    match t.claim(&req) {
                        Ok(ClaimResult::Claimed(claimed)) => claimed.token,
                        Ok(ClaimResult::Held(found)) => {
                            // A stale claim moved to UNKNOWN is kept.
                            self.commit(WHAT, tx)?;
                            return Ok(LocalResult::Held(found));
                        }
                        Err(OpError::Fatal(Fault::Race)) if tries < 16 => continue,
                        Err(e) => return Err(refused(e)),
                    }
                }
            };
            break (tx, token, now);
        };
        let mut ltx = LocalTx::on_postgres(tx);
        // On an error, dropping the transaction rolls the app's writes back.
        let envelope = {
            let _inside = Inside::enter(self);
            run_local(run, &mut ltx, &key, self.cfg.max_response_bytes)?
        };
        let Some((mut tx, messages)) = ltx.into_postgres() else {
            return Err(Error::Storage {
                context: WHAT,
                source: "the local write lost its PostgreSQL transaction".into(),
            });
        };
        self.txn(&mut tx, now)
            .complete(CompleteRequest {
                key,
                token,
                completion: Completion::Success,
                response: StoredResponse::new(envelope, None),
                messages,
                finished,
            })
            .map_err(refused)?;
        self.commit(WHAT, tx)?;
        Ok(LocalResult::Executed)
    }

    pub(super) fn txn<'t, 'c>(&'t self, tx: &'t mut Transaction<'c>, now: u64) -> PgTxn<'t, 'c> {
        PgTxn {
            tx,
            names: &self.names,
            now,
            cfg: self.cfg,
        }
    }
}
