//! Local exactly-once on Redis: the app's own keys and the key's
//! completion in one guarded script. The app's closure gets a
//! [`RedisLocal`] (through `LocalTx::redis`): its reads are guarded like
//! the engine's, its writes buffered, and all of them commit with the
//! key's COMPLETED record (and any outbox messages), or none does.

use crate::error::{BoxError, Error, Result};
use crate::store::local_tx::{run_local, LocalTarget, LocalTx, LocalWrite};
use crate::store::ops::{OpError, Ops};
use crate::store::record::{Completion, StoredResponse};
use crate::store::{ClaimRequest, ClaimResult, CompleteRequest, LocalResult};

use super::conn::storage;
use super::script::Write;
use super::shared::{Attempt, Shared, CONFLICT_RETRIES};
use super::txn::{Fault, RedisTxn};

const WHAT: &str = "running a local write";

/// The app's keys inside a local write on Redis (feature `redis`): reads
/// see the server as of the read (and this write's own writes), writes are
/// applied when the key's completion commits, in the same script, or not
/// at all. Keys must lie outside the engine's key prefix.
///
/// A read is remembered: if another client changes a key this write read
/// before the write commits, nothing is written and the local write fails
/// with [`Error::NotCommitted`] (retry it: the key is still free).
pub struct RedisLocal<'a> {
    txn: &'a mut (dyn AppKeys + 'a),
}

/// What a local write may do with the app's keys.
pub(crate) trait AppKeys {
    fn get(&mut self, key: &[u8]) -> std::result::Result<Option<Vec<u8>>, BoxError>;
    fn set(&mut self, key: &[u8], value: &[u8]) -> std::result::Result<(), BoxError>;
    fn del(&mut self, key: &[u8]) -> std::result::Result<(), BoxError>;
}

impl<'a> RedisLocal<'a> {
    pub(crate) fn new(txn: &'a mut (dyn AppKeys + 'a)) -> RedisLocal<'a> {
        RedisLocal { txn }
    }

    /// The bytes of the app's string key `key` (`None`: absent).
    ///
    /// # Errors
    ///
    /// A key under the engine's key prefix; a failed round trip.
    pub fn get(&mut self, key: &[u8]) -> std::result::Result<Option<Vec<u8>>, BoxError> {
        self.txn.get(key)
    }

    /// Sets the app's string key `key` to `value` when the write commits.
    ///
    /// # Errors
    ///
    /// A key under the engine's key prefix.
    pub fn set(&mut self, key: &[u8], value: &[u8]) -> std::result::Result<(), BoxError> {
        self.txn.set(key, value)
    }

    /// Deletes the app's key `key` when the write commits.
    ///
    /// # Errors
    ///
    /// A key under the engine's key prefix.
    pub fn del(&mut self, key: &[u8]) -> std::result::Result<(), BoxError> {
        self.txn.del(key)
    }
}

impl std::fmt::Debug for RedisLocal<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLocal").finish_non_exhaustive()
    }
}

impl RedisTxn<'_> {
    fn app_key(&self, key: &[u8]) -> std::result::Result<Vec<u8>, BoxError> {
        if key.starts_with(self.keys.prefix.as_bytes()) {
            return Err(format!(
                "key {:?} lies under the engine's key prefix {:?}; a local write may only \
                 touch the app's own keys",
                String::from_utf8_lossy(key),
                self.keys.prefix
            )
            .into());
        }
        Ok(key.to_vec())
    }
}

impl AppKeys for RedisTxn<'_> {
    fn get(&mut self, key: &[u8]) -> std::result::Result<Option<Vec<u8>>, BoxError> {
        let key = self.app_key(key)?;
        self.load_str(key)
            .map_err(|Fault(e)| storage(WHAT)(e).into())
    }

    fn set(&mut self, key: &[u8], value: &[u8]) -> std::result::Result<(), BoxError> {
        let key = self.app_key(key)?;
        self.set_app(key.clone(), Some(value.to_vec()));
        self.batch.writes.push(Write::Set(key, value.to_vec()));
        Ok(())
    }

    fn del(&mut self, key: &[u8]) -> std::result::Result<(), BoxError> {
        let key = self.app_key(key)?;
        self.set_app(key.clone(), None);
        self.batch.writes.push(Write::Del(key));
        Ok(())
    }
}

fn refused(e: OpError<Fault>) -> Error {
    match e {
        OpError::Refused(e) => e,
        OpError::Fatal(Fault(e)) => storage(WHAT)(e),
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
        let mut conn = self.conn(WHAT)?;
        // Only reruns before the app's closure ran (it runs once).
        let mut attempt = 0;
        loop {
            attempt += 1;
            let now = self.clock.now_ms();
            let mut t = RedisTxn::new(&mut conn, &self.keys, now, self.cfg);
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
                    match t.claim(&req).map_err(refused)? {
                        ClaimResult::Claimed(claimed) => claimed.token,
                        ClaimResult::Held(found) => {
                            // A stale claim moved to UNKNOWN is kept.
                            let batch = std::mem::take(&mut t.batch);
                            let reads = t.reads;
                            drop(t);
                            match self.commit(WHAT, &mut conn, &batch, reads)? {
                                Attempt::Done(()) => return Ok(LocalResult::Held(found)),
                                Attempt::Again if attempt < CONFLICT_RETRIES => continue,
                                Attempt::Again => return Err(not_committed(&key)),
                            }
                        }
                    }
                }
            };
            let (envelope, messages) = {
                let mut ltx = LocalTx::on_redis(RedisLocal::new(&mut t));
                let envelope = run_local(run, &mut ltx, &key, self.cfg.max_response_bytes)?;
                (envelope, ltx.into_outbox())
            };
            t.complete(CompleteRequest {
                key: key.clone(),
                token,
                completion: Completion::Success,
                response: StoredResponse::new(envelope, None),
                messages,
                finished,
            })
            .map_err(refused)?;
            let batch = std::mem::take(&mut t.batch);
            let reads = t.reads;
            drop(t);
            return match self.commit(WHAT, &mut conn, &batch, reads)? {
                Attempt::Done(()) => Ok(LocalResult::Executed),
                // The closure ran against reads that changed: nothing of it
                // was written, and it cannot run again here.
                Attempt::Again => Err(not_committed(&key)),
            };
        }
    }
}

fn not_committed(key: &crate::key::IdempotencyKey) -> Error {
    Error::NotCommitted {
        context: "running a local write (another client changed a key it read first)",
        key: Some(key.clone()),
        step: None,
    }
}
