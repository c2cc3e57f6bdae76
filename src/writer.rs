//! The writer thread: every write goes through it, batched into group commits.
//!
//! Callers send an [`Op`] over a bounded channel and block on their own reply
//! channel. The writer takes everything queued (up to `max_batch`), applies
//! each op in arrival order inside one redb write transaction, commits once
//! with `Durability::Immediate`, and only then answers every caller. So no
//! caller hears "claimed" or "completed" before its data is durable, and one
//! fsync serves the whole batch.
//!
//! A refused op (fencing, bad state) fails alone. A storage error or a failed
//! commit fails the whole batch and poisons the engine: every later call says
//! to reopen.

use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};
use redb::{Database, Durability};

use crate::error::{Error, Result};
use crate::ops::{Op, OpError, Reply, Store, WriteConfig};
use crate::poison::Poison;
use crate::tables::{META, META_NEXT_TOKEN};
use crate::Clock;

/// A message to the writer.
pub(crate) enum Msg {
    Op(Request),
    /// Finish the queued work and exit.
    Shutdown,
}

/// An op and where to send its answer (`None`: nobody waits, as for a
/// dropped claim).
pub(crate) struct Request {
    pub(crate) op: Op,
    pub(crate) reply: Option<Sender<Result<Reply>>>,
}

pub(crate) struct Writer {
    pub(crate) db: Arc<Database>,
    pub(crate) rx: Receiver<Msg>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) cfg: WriteConfig,
    pub(crate) poison: Arc<Poison>,
    pub(crate) max_batch: usize,
}

impl Writer {
    pub(crate) fn run(self) {
        // A panic here must not leave callers believing writes succeed.
        let _guard = PoisonOnPanic(self.poison.clone());
        let mut next_token = match read_next_token(&self.db) {
            Ok(t) => t,
            Err(e) => {
                self.poison
                    .set(format!("reading the fencing-token counter: {e}"));
                0
            }
        };
        let mut batch: Vec<Request> = Vec::with_capacity(self.max_batch);
        let mut shutdown = false;
        while !shutdown {
            match self.rx.recv() {
                Ok(Msg::Op(r)) => batch.push(r),
                Ok(Msg::Shutdown) | Err(_) => break,
            }
            while batch.len() < self.max_batch {
                match self.rx.try_recv() {
                    Ok(Msg::Op(r)) => batch.push(r),
                    Ok(Msg::Shutdown) => {
                        shutdown = true;
                        break;
                    }
                    Err(_) => break,
                }
            }
            if let Some(cause) = self.poison.cause() {
                answer_all(&mut batch, || Error::Poisoned {
                    cause: cause.clone(),
                });
                continue;
            }
            match self.commit_batch(&mut batch, next_token) {
                Ok((results, token)) => {
                    next_token = token;
                    for (req, result) in batch.drain(..).zip(results) {
                        if let Some(reply) = req.reply {
                            let _ = reply.send(result);
                        }
                    }
                }
                Err(e) => {
                    let cause: Arc<str> = format!("group commit failed: {e}").into();
                    tracing::error!(%cause, "engine poisoned");
                    self.poison.set(cause.to_string());
                    answer_all(&mut batch, || Error::Poisoned {
                        cause: cause.clone(),
                    });
                }
            }
        }
        // Callers still queued after shutdown hear that the engine closed.
        while let Ok(Msg::Op(mut r)) = self.rx.try_recv() {
            if let Some(reply) = r.reply.take() {
                let _ = reply.send(Err(Error::Closed));
            }
        }
    }

    /// Applies every op of the batch in one transaction and commits it.
    /// Returns each op's result, or the error that sank the whole batch.
    fn commit_batch(
        &self,
        batch: &mut [Request],
        next_token: u64,
    ) -> Result<(Vec<Result<Reply>>, u64), redb::Error> {
        let mut txn = self.db.begin_write()?;
        txn.set_durability(Durability::Immediate)?;
        let mut results = Vec::with_capacity(batch.len());
        let token_after;
        {
            let mut store = Store::open(&txn, next_token, self.clock.now_ms(), self.cfg)?;
            for req in batch.iter_mut() {
                // Ops are moved out; the placeholder is never applied.
                let op = std::mem::replace(&mut req.op, Op::Sweep { limit: 0 });
                match store.apply(op) {
                    Ok(reply) => results.push(Ok(reply)),
                    Err(OpError::Refused(e)) => results.push(Err(e)),
                    Err(OpError::Fatal(e)) => return Err(e),
                }
            }
            token_after = store.next_token;
        }
        if token_after != next_token {
            let mut meta = txn.open_table(META)?;
            meta.insert(META_NEXT_TOKEN, token_after.to_le_bytes().as_slice())?;
        }
        txn.commit()?;
        Ok((results, token_after))
    }
}

fn answer_all(batch: &mut Vec<Request>, err: impl Fn() -> Error) {
    for req in batch.drain(..) {
        if let Some(reply) = req.reply {
            let _ = reply.send(Err(err()));
        }
    }
}

pub(crate) fn read_next_token(db: &Database) -> Result<u64, redb::Error> {
    use redb::ReadableDatabase;
    let txn = db.begin_read()?;
    let meta = txn.open_table(META)?;
    let bytes = meta.get(META_NEXT_TOKEN)?;
    Ok(bytes
        .and_then(|v| <[u8; 8]>::try_from(v.value()).ok())
        .map_or(1, u64::from_le_bytes))
}

struct PoisonOnPanic(Arc<Poison>);

impl Drop for PoisonOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.set("the writer thread panicked".to_string());
        }
    }
}
