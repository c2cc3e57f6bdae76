//! A store call's answer, to wait for or to await: the one seam by which
//! the engine's synchronous and async entry points share one
//! implementation. The redb backend answers through its writer's reply
//! slot (`reply.rs`); a backend whose calls block (PostgreSQL) answers at
//! once, having done the work on the calling thread.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::error::{Error, Result};
use crate::key::IdempotencyKey;

use super::poison::Poison;
use super::reply::ReplyRx;

/// The answer of a submitted store call: [`Pending::wait`] parks the thread
/// until it comes; awaiting it parks nothing (the writer's reply wakes the
/// task). Dropping it does not cancel the call (it was queued already).
#[must_use = "the answer says whether the write is durable"]
pub(crate) struct Pending<T>(Inner<T>, Option<Box<Subject>>);

/// The key (and effect step) a call was about, named in the
/// [`Error::NotCommitted`] it may answer (see [`Error::naming`]).
struct Subject {
    key: IdempotencyKey,
    step: Option<String>,
}

enum Inner<T> {
    /// Answered already (`None` once taken).
    Ready(Option<Result<T>>),
    /// Answered by the writer; `poison` says why when it drops the call.
    Reply {
        rx: ReplyRx<Result<T>>,
        poison: Arc<Poison>,
    },
}

impl<T> Pending<T> {
    /// An answer known now.
    pub(crate) fn ready(result: Result<T>) -> Pending<T> {
        Pending(Inner::Ready(Some(result)), None)
    }

    /// An answer the writer will put in `rx`.
    pub(crate) fn reply(rx: ReplyRx<Result<T>>, poison: Arc<Poison>) -> Pending<T> {
        Pending(Inner::Reply { rx, poison }, None)
    }

    /// The same answer, an [`Error::NotCommitted`] in it naming `key` (and
    /// `step`).
    pub(crate) fn naming(mut self, key: &IdempotencyKey, step: Option<&str>) -> Pending<T> {
        self.1 = Some(Box::new(Subject {
            key: key.clone(),
            step: step.map(str::to_string),
        }));
        self
    }

    fn named(subject: Option<&Subject>, answer: Result<T>) -> Result<T> {
        match subject {
            Some(s) => answer.map_err(|e| e.naming(&s.key, s.step.as_deref())),
            None => answer,
        }
    }

    /// Waits for the answer on this thread.
    pub(crate) fn wait(self) -> Result<T> {
        let answer = match self.0 {
            Inner::Ready(answer) => answer.unwrap_or(Err(Error::Closed)),
            Inner::Reply { rx, poison } => rx.recv().unwrap_or_else(|| Err(closed(&poison))),
        };
        Self::named(self.1.as_deref(), answer)
    }
}

// `Pending` is never pinned in place: it holds no self-references.
impl<T> Unpin for Pending<T> {}

impl<T> Future for Pending<T> {
    type Output = Result<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        let this = self.get_mut();
        let answer = match &mut this.0 {
            Inner::Ready(answer) => Poll::Ready(answer.take().unwrap_or(Err(Error::Closed))),
            Inner::Reply { rx, poison } => rx
                .poll_recv(cx)
                .map(|answer| answer.unwrap_or_else(|| Err(closed(poison)))),
        };
        answer.map(|answer| Self::named(this.1.as_deref(), answer))
    }
}

/// Why a call got no answer from the writer.
pub(crate) fn closed(poison: &Poison) -> Error {
    match poison.cause() {
        Some(cause) => Error::Poisoned { cause },
        None => Error::Closed,
    }
}
