//! Local exactly-once: the app's own redb write and the idempotency outcome
//! in one transaction.
//!
//! Because the engine lives in the same redb file as the app's data, a ledger
//! row and its dedup mark can commit together or not at all, which a separate
//! idempotency service cannot offer. The app's closure runs on the engine's
//! writer thread inside a write transaction of its own (not shared with a
//! group-commit batch, so its failure cannot touch other callers' work).
//!
//! Table naming rule: the engine owns every table whose name starts with
//! `idempotency.`; the app may create and use any other table in the file.

use std::panic::{catch_unwind, AssertUnwindSafe};

use redb::WriteTransaction;

use std::time::Duration;

use crate::claim::Claim;
use crate::clock::duration_ms;
use crate::codec::StoredResponse;
use crate::engine::Engine;
use crate::envelope::Envelope;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::ops::Class;
use crate::ops::{Op, OpError, Reply, Store};
use crate::outbox::OutgoingMessage;
use crate::outcome::Begin;

/// The error type an app's local write returns to abort.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

type LocalFn = Box<dyn FnOnce(&mut LocalTx<'_>) -> Result<Envelope, BoxError> + Send>;

/// The transaction an app's local write runs in.
pub struct LocalTx<'a> {
    txn: &'a WriteTransaction,
    outbox: Vec<OutgoingMessage>,
}

impl LocalTx<'_> {
    /// The redb write transaction. Open the app's own tables on it (any name
    /// not starting with `idempotency.`); everything written commits with
    /// the idempotency outcome, or not at all.
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

/// Whose record a local write completes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Target {
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
pub(crate) struct LocalOp {
    pub(crate) key: IdempotencyKey,
    target: Target,
    run: LocalFn,
}

impl std::fmt::Debug for LocalOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalOp")
            .field("key", &self.key)
            .field("target", &self.target)
            .finish()
    }
}

impl LocalOp {
    /// Runs the app's closure and the completion in `txn`. `Ok(Err(_))`: the
    /// op was refused and `txn` must be aborted; `Err(_)`: storage failed.
    pub(crate) fn apply(
        self,
        txn: &WriteTransaction,
        store: impl FnOnce(&WriteTransaction) -> Result<Store<'_>, redb::Error>,
        max_response_bytes: usize,
    ) -> Result<Result<(Reply, crate::ops::Sequences), Error>, redb::Error> {
        // The engine's tables stay open while the app's closure runs, so the
        // closure cannot open (and corrupt) them: redb refuses a second open.
        let mut store = store(txn)?;
        let key = self.key;
        let token = match self.target {
            Target::Claimed { token } => token,
            Target::Fresh {
                fingerprint,
                lease_ms,
            } => {
                let op = Op::Begin {
                    key: key.clone(),
                    fingerprint,
                    lease_ms,
                };
                match store.apply(op) {
                    Ok(Reply::Claimed { token, .. }) => token,
                    Ok(other) => return Ok(Ok((other, store.seq))),
                    Err(OpError::Refused(e)) => return Ok(Err(e)),
                    Err(OpError::Fatal(e)) => return Err(e),
                }
            }
        };
        let mut ltx = LocalTx {
            txn,
            outbox: Vec::new(),
        };
        let envelope = match catch_unwind(AssertUnwindSafe(|| (self.run)(&mut ltx))) {
            Ok(Ok(envelope)) => envelope,
            Ok(Err(source)) => return Ok(Err(Error::LocalWrite { key, source })),
            Err(_) => {
                return Ok(Err(Error::LocalWrite {
                    key,
                    source: "the local write panicked".into(),
                }))
            }
        };
        let size = envelope.size_bytes();
        if size > max_response_bytes {
            return Ok(Err(Error::ResponseTooLarge {
                key,
                size,
                limit: max_response_bytes,
            }));
        }
        let outbox = ltx.outbox;
        let op = Op::Complete {
            key,
            token,
            response: StoredResponse::new(envelope, None),
            final_failure: false,
            outbox,
        };
        match store.apply(op) {
            Ok(reply) => Ok(Ok((reply, store.seq))),
            Err(OpError::Refused(e)) => Ok(Err(e)),
            Err(OpError::Fatal(e)) => Err(e),
        }
    }
}

impl Engine {
    /// Completes `claim` and runs the app's own write in the same durable
    /// transaction: `write` gets the transaction (open your tables on
    /// [`LocalTx::txn`], queue outbox messages with [`LocalTx::send`]) and
    /// returns the envelope to store for replay. Either the app's rows, the
    /// outbox messages and the COMPLETED record all commit, or none does.
    ///
    /// The closure runs on the engine's writer thread (hence `Send +
    /// 'static`); keep it short: it holds the write lock.
    ///
    /// # Errors
    ///
    /// - [`Error::LocalWrite`] if `write` returns an error or panics: the
    ///   transaction is rolled back and the key is released (nothing
    ///   happened, so the next delivery or request executes afresh).
    /// - [`Error::ResponseTooLarge`]: rolled back and released likewise.
    /// - [`Error::Fenced`] if the claim no longer owns the record: rolled
    ///   back, so a fenced holder can never commit its local effect.
    /// - [`Error::ForeignClaim`], [`Error::Poisoned`], [`Error::Closed`],
    ///   storage errors.
    pub fn complete_local<F>(&self, claim: Claim, write: F) -> Result<()>
    where
        F: FnOnce(&mut LocalTx<'_>) -> Result<Envelope, BoxError> + Send + 'static,
    {
        let mut claim = self.own_claim(claim)?;
        claim.finished = true;
        let key = claim.key.clone();
        let token = claim.token;
        let op = Op::Local(LocalOp {
            key: key.clone(),
            target: Target::Claimed { token },
            run: Box::new(write),
        });
        match self.shared.submit(op) {
            Ok(_) => Ok(()),
            Err(e @ (Error::LocalWrite { .. } | Error::ResponseTooLarge { .. })) => {
                self.shared.submit(Op::Release { key, token })?;
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    /// Runs `write` exactly once for `key`, with no claim in between: in one
    /// write transaction the engine checks the key, runs the app's write
    /// (see [`Engine::complete_local`]) and stores the COMPLETED record with
    /// the envelope `write` returns. A crash anywhere leaves nothing: no
    /// app rows, no record, so a retry simply runs it. Use it when the
    /// work is entirely local (a ledger row in the same file).
    ///
    /// Returns [`LocalRun::Executed`], or [`LocalRun::Skipped`] with what
    /// `begin` would have answered (replay, in progress, mismatch, unknown,
    /// expired) when the key is not free; the resolver is not consulted.
    ///
    /// # Errors
    ///
    /// [`Error::LocalWrite`] (rolled back; nothing stored),
    /// [`Error::ResponseTooLarge`], [`Error::CorruptRecord`], storage errors.
    pub fn execute_local<F>(
        &self,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        write: F,
    ) -> Result<LocalRun>
    where
        F: FnOnce(&mut LocalTx<'_>) -> Result<Envelope, BoxError> + Send + 'static,
    {
        let s = &self.shared;
        let op = Op::Local(LocalOp {
            key: key.clone(),
            target: Target::Fresh {
                fingerprint,
                lease_ms: duration_ms(s.cfg.lease).max(1),
            },
            run: Box::new(write),
        });
        match s.submit(op)? {
            Reply::Existing { record, class } => Ok(LocalRun::Skipped(match class {
                Class::Live { retry_after_ms } => Begin::InProgress {
                    retry_after: Duration::from_millis(retry_after_ms.max(1)),
                },
                Class::Done => Begin::Replay(s.replay(key, &record)?),
                Class::Tombstoned {
                    expired_at_ms,
                    reusable_at_ms,
                } => Begin::Expired {
                    expired_at_ms,
                    reusable_at_ms,
                },
                Class::Unknown | Class::Stale => Begin::Unknown(s.pending_of(key.clone(), &record)),
                Class::Mismatch | Class::Absent => Begin::Mismatch,
            })),
            _ => Ok(LocalRun::Executed),
        }
    }

    /// [`Engine::complete`] that also stores outbox `messages` in the same
    /// transaction. Their ids are `<claim reference>/<n>`.
    ///
    /// # Errors
    ///
    /// As for [`Engine::complete`].
    pub fn complete_with_messages(
        &self,
        claim: Claim,
        envelope: Envelope,
        messages: Vec<OutgoingMessage>,
    ) -> Result<()> {
        self.finish_with(claim, Some(envelope), None, false, messages)
    }
}

/// The answer to [`Engine::execute_local`].
#[derive(Debug)]
pub enum LocalRun {
    /// The write ran and committed with its COMPLETED record.
    Executed,
    /// The key was not free; the write did not run. Never `Claimed`.
    Skipped(Begin),
}
