//! The unit of work the writer thread applies: one queued operation
//! ([`Job`], typed as [`Call`]), and how a group of them is failed when the
//! backend is poisoned. Shared by the writer, which applies jobs, and the
//! syncer, which answers them once their frame is durable.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::store::poison::Poison;
use crate::store::reply::ReplyTx;

use super::tables::{OpError, Tables};

/// One queued operation. It stays in the writer's hands from the moment
/// it is applied until it is answered, so a storage failure or a panic
/// anywhere in its batch can poison the backend *before* its caller hears
/// anything.
pub(super) trait Job: Send {
    /// Whether it needs a transaction of its own, rolled back if refused.
    fn isolated(&self) -> bool;
    /// Applies the operation (once) and keeps its result for `deliver`.
    /// Returns the storage error that sank the batch, if any.
    fn apply(&mut self, tables: &mut Tables<'_>) -> Option<redb::Error>;
    /// Whether the applied operation was refused (an isolated job is then
    /// rolled back).
    fn refused(&self) -> bool;
    /// The transaction committed: sends the kept result.
    fn deliver(self: Box<Self>);
    /// Sends `error` instead (the batch failed, or the backend is poisoned
    /// or closing).
    fn fail(self: Box<Self>, error: Error);
}

/// An operation on the tables producing a `T`.
pub(super) type Op<T> = Box<dyn FnOnce(&mut Tables<'_>) -> Result<T, OpError> + Send>;

/// A typed job: the operation and where its `Result<T>` goes (`None`:
/// nobody waits, as for a dropped claim).
pub(super) struct Call<T> {
    op: Option<Op<T>>,
    isolated: bool,
    reply: Option<ReplyTx<Result<T>>>,
    result: Option<Result<T>>,
}

impl<T> Call<T> {
    pub(super) fn new(op: Op<T>, isolated: bool, reply: Option<ReplyTx<Result<T>>>) -> Call<T> {
        Call {
            op: Some(op),
            isolated,
            reply,
            result: None,
        }
    }
}

impl<T: Send + 'static> Job for Call<T> {
    fn isolated(&self) -> bool {
        self.isolated
    }

    fn apply(&mut self, tables: &mut Tables<'_>) -> Option<redb::Error> {
        let op = self.op.take()?;
        match op(tables) {
            Ok(value) => self.result = Some(Ok(value)),
            Err(OpError::Refused(e)) => self.result = Some(Err(e)),
            Err(OpError::Fatal(e)) => return Some(e),
        }
        None
    }

    fn refused(&self) -> bool {
        matches!(self.result, Some(Err(_)))
    }

    fn deliver(self: Box<Self>) {
        if let (Some(to), Some(result)) = (self.reply, self.result) {
            to.send(result);
        }
    }

    fn fail(self: Box<Self>, error: Error) {
        if let Some(to) = self.reply {
            to.send(Err(error));
        }
    }
}

/// The answer to a [`super::writer::Msg::Commit`], handed to the syncer
/// like a group so it is sent only after every group handed before it has
/// been answered (and the hooks of answers nobody heard have queued their
/// follow-up work).
pub(super) struct CommitAnswer {
    pub(super) reply: ReplyTx<Result<()>>,
    pub(super) result: Result<()>,
}

impl Job for CommitAnswer {
    fn isolated(&self) -> bool {
        false
    }

    fn apply(&mut self, _tables: &mut Tables<'_>) -> Option<redb::Error> {
        None
    }

    fn refused(&self) -> bool {
        false
    }

    fn deliver(self: Box<Self>) {
        self.reply.send(self.result);
    }

    fn fail(self: Box<Self>, error: Error) {
        self.reply.send(Err(error));
    }
}

/// Poisons the backend with `cause` (logged and counted once, here);
/// returns it.
pub(super) fn poison_backend(poison: &Poison, cause: String) -> Arc<str> {
    let cause: Arc<str> = cause.into();
    tracing::error!(%cause, "engine poisoned");
    metrics::counter!("idempotency_poisoned_total").increment(1);
    poison.set(cause.to_string());
    cause
}

/// Answers every job of `group` with the poison `cause`.
pub(super) fn fail_all(group: Vec<Box<dyn Job>>, cause: &Arc<str>) {
    for job in group {
        job.fail(Error::Poisoned {
            cause: cause.clone(),
        });
    }
}
