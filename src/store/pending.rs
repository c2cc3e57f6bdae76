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

use super::poison::Poison;
use super::reply::ReplyRx;

/// The answer of a submitted store call: [`Pending::wait`] parks the thread
/// until it comes; awaiting it parks nothing (the writer's reply wakes the
/// task). Dropping it does not cancel the call (it was queued already).
#[must_use = "the answer says whether the write is durable"]
pub(crate) struct Pending<T>(Inner<T>);

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
        Pending(Inner::Ready(Some(result)))
    }

    /// An answer the writer will put in `rx`.
    pub(crate) fn reply(rx: ReplyRx<Result<T>>, poison: Arc<Poison>) -> Pending<T> {
        Pending(Inner::Reply { rx, poison })
    }

    /// Waits for the answer on this thread.
    pub(crate) fn wait(self) -> Result<T> {
        match self.0 {
            Inner::Ready(answer) => answer.unwrap_or(Err(Error::Closed)),
            Inner::Reply { rx, poison } => rx.recv().unwrap_or_else(|| Err(closed(&poison))),
        }
    }
}

// `Pending` is never pinned in place: it holds no self-references.
impl<T> Unpin for Pending<T> {}

impl<T> Future for Pending<T> {
    type Output = Result<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        match &mut self.get_mut().0 {
            Inner::Ready(answer) => Poll::Ready(answer.take().unwrap_or(Err(Error::Closed))),
            Inner::Reply { rx, poison } => rx
                .poll_recv(cx)
                .map(|answer| answer.unwrap_or_else(|| Err(closed(poison)))),
        }
    }
}

/// Why a call got no answer from the writer.
pub(crate) fn closed(poison: &Poison) -> Error {
    match poison.cause() {
        Some(cause) => Error::Poisoned { cause },
        None => Error::Closed,
    }
}
