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
use crate::ops::{Op, OpError, Reply, Sequences, Store, WriteConfig};
use crate::poison::Poison;
use crate::tables::{META, META_NEXT_OUTBOX, META_NEXT_TOKEN};
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
        WRITER_OF.with(|w| w.set(Arc::as_ptr(&self.poison) as usize));
        let mut seq = match read_sequences(&self.db) {
            Ok(seq) => seq,
            Err(e) => {
                self.poison
                    .set(format!("reading the engine's counters: {e}"));
                Sequences {
                    token: 0,
                    outbox: 0,
                }
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
            seq = self.process(std::mem::take(&mut batch), seq);
        }
        // Callers still queued after shutdown hear that the engine closed.
        while let Ok(Msg::Op(mut r)) = self.rx.try_recv() {
            if let Some(reply) = r.reply.take() {
                let _ = reply.send(Err(Error::Closed));
            }
        }
    }

    /// Commits one batch: shared ops are group-committed together; a local
    /// op (the app's own write) gets a transaction of its own. Arrival order
    /// is kept. Every caller is answered only after its transaction
    /// committed.
    fn process(&self, mut rest: Vec<Request>, mut seq: Sequences) -> Sequences {
        while !rest.is_empty() {
            let split = rest
                .iter()
                .position(|r| matches!(r.op, Op::Local(_)))
                .map_or(rest.len(), |i| i.max(1));
            let tail = rest.split_off(split);
            let mut group = std::mem::replace(&mut rest, tail);
            let outcome = match group.first_mut() {
                Some(Request {
                    op: op @ Op::Local(_),
                    ..
                }) => self.commit_local(op, seq).map(|(r, s)| (vec![r], s)),
                _ => self.commit_batch(&mut group, seq),
            };
            match outcome {
                Ok((results, after)) => {
                    seq = after;
                    for (req, result) in group.drain(..).zip(results) {
                        if let Some(reply) = req.reply {
                            let _ = reply.send(result);
                        }
                    }
                }
                Err(e) => {
                    let cause: Arc<str> = format!("group commit failed: {e}").into();
                    tracing::error!(%cause, "engine poisoned");
                    self.poison.set(cause.to_string());
                    group.append(&mut rest);
                    answer_all(&mut group, || Error::Poisoned {
                        cause: cause.clone(),
                    });
                }
            }
        }
        seq
    }

    /// Applies every op of the batch in one transaction and commits it.
    /// Returns each op's result, or the error that sank the whole batch.
    fn commit_batch(
        &self,
        batch: &mut [Request],
        seq: Sequences,
    ) -> Result<(Vec<Result<Reply>>, Sequences), redb::Error> {
        let mut txn = self.db.begin_write()?;
        txn.set_durability(Durability::Immediate)?;
        let mut results = Vec::with_capacity(batch.len());
        let after;
        {
            let mut store = Store::open(&txn, seq, self.clock.now_ms(), self.cfg)?;
            for req in batch.iter_mut() {
                match store.apply(take_op(&mut req.op)) {
                    Ok(reply) => results.push(Ok(reply)),
                    Err(OpError::Refused(e)) => results.push(Err(e)),
                    Err(OpError::Fatal(e)) => return Err(e),
                }
            }
            after = store.seq;
        }
        write_sequences(&txn, seq, after)?;
        txn.commit()?;
        Ok((results, after))
    }

    /// Runs one local op (the app's closure plus its completion) in its own
    /// transaction; a refusal rolls the whole transaction back.
    fn commit_local(
        &self,
        op: &mut Op,
        seq: Sequences,
    ) -> Result<(Result<Reply>, Sequences), redb::Error> {
        let Op::Local(local) = take_op(op) else {
            return Ok((Err(Error::Internal("not a local op".into())), seq));
        };
        let mut txn = self.db.begin_write()?;
        txn.set_durability(Durability::Immediate)?;
        let now = self.clock.now_ms();
        let cfg = self.cfg;
        let applied = local.apply(
            &txn,
            |txn| Store::open(txn, seq, now, cfg),
            cfg.max_response_bytes,
        )?;
        match applied {
            Ok((reply, after)) => {
                write_sequences(&txn, seq, after)?;
                txn.commit()?;
                Ok((Ok(reply), after))
            }
            Err(e) => {
                txn.abort()?;
                Ok((Err(e), seq))
            }
        }
    }
}

/// Moves an op out of its request; the placeholder is never applied.
fn take_op(op: &mut Op) -> Op {
    std::mem::replace(op, Op::Sweep { limit: 0 })
}

fn write_sequences(
    txn: &redb::WriteTransaction,
    before: Sequences,
    after: Sequences,
) -> Result<(), redb::Error> {
    if before != after {
        let mut meta = txn.open_table(META)?;
        meta.insert(META_NEXT_TOKEN, after.token.to_le_bytes().as_slice())?;
        meta.insert(META_NEXT_OUTBOX, after.outbox.to_le_bytes().as_slice())?;
    }
    Ok(())
}

fn answer_all(batch: &mut Vec<Request>, err: impl Fn() -> Error) {
    for req in batch.drain(..) {
        if let Some(reply) = req.reply {
            let _ = reply.send(Err(err()));
        }
    }
}

pub(crate) fn read_sequences(db: &Database) -> Result<Sequences, redb::Error> {
    use redb::ReadableDatabase;
    let txn = db.begin_read()?;
    let meta = txn.open_table(META)?;
    let read = |name| -> Result<u64, redb::Error> {
        Ok(meta
            .get(name)?
            .and_then(|v| <[u8; 8]>::try_from(v.value()).ok())
            .map_or(1, u64::from_le_bytes))
    };
    Ok(Sequences {
        token: read(META_NEXT_TOKEN)?,
        outbox: read(META_NEXT_OUTBOX)?,
    })
}

thread_local! {
    /// On a writer thread: the identity (its poison cell's address) of the
    /// engine it writes for. An app's local write runs on this thread, and
    /// a call from it back into the same engine's writer would wait for
    /// itself forever.
    static WRITER_OF: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Whether the current thread is the writer of the engine owning `poison`.
pub(crate) fn on_writer_of(poison: &Arc<Poison>) -> bool {
    WRITER_OF.with(|w| w.get() == Arc::as_ptr(poison) as usize)
}

struct PoisonOnPanic(Arc<Poison>);

impl Drop for PoisonOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.set("the writer thread panicked".to_string());
        }
    }
}
