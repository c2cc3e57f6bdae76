//! How the engine's synchronous and async entry points share one
//! implementation: the logic is written once as a future over the store's
//! [`Pending`] answers; a synchronous call runs that future to completion
//! on its own thread ([`block_on`]), an async call awaits it.

use std::fmt;
use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;

use crate::error::Result;
use crate::store::Pending;

/// Wakes a thread parked in [`block_on`].
struct Unpark(Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs `future` on this thread, parking it while the future waits (the
/// writer's reply unparks it). No runtime is needed: the only thing the
/// engine's futures ever wait for is a reply slot.
pub(crate) fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(output) = future.as_mut().poll(&mut cx) {
            return output;
        }
        // A spurious unpark only costs one more poll.
        std::thread::park();
    }
}

/// A write handed to the engine (by [`crate::Engine::complete_async`] or
/// [`crate::Engine::fail_async`]): resolves to its result once it is
/// durable (committed and synced), or to the error that refused it.
///
/// The write is queued when the method returns, before the first poll:
/// dropping this future does not cancel it, and the claim's outcome is
/// recorded all the same (only its result goes unheard). No thread waits
/// for it: the engine's writer thread wakes the task when the group commit
/// holding the write is durable.
#[must_use = "the write is queued either way; await it to learn whether it is durable"]
pub struct DurableWrite(Pending<()>);

impl DurableWrite {
    pub(crate) fn new(pending: Pending<()>) -> DurableWrite {
        DurableWrite(pending)
    }

    /// Waits for the answer on this thread.
    pub(crate) fn wait(self) -> Result<()> {
        self.0.wait()
    }
}

impl Future for DurableWrite {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        Pin::new(&mut self.0).poll(cx)
    }
}

impl fmt::Debug for DurableWrite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DurableWrite").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_on_waits_for_a_reply_from_another_thread() {
        let (tx, rx) = crate::store::reply::reply::<Result<u8>>();
        let poison: Arc<crate::store::poison::Poison> = Arc::default();
        let pending = Pending::reply(rx, poison);
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            tx.send(Ok(5));
        });
        assert_eq!(block_on(pending).ok(), Some(5));
        t.join().unwrap();
    }
}
