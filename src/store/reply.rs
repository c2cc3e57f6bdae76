//! A one-shot reply slot: the writer puts one answer in, the caller takes
//! it out, either parked on the slot's condition variable ([`ReplyRx::recv`],
//! a synchronous call) or as a future woken by the answer
//! ([`ReplyRx::poll_recv`], an async call: no thread waits at all). A
//! synchronous caller parks at once instead of spinning and yielding (a
//! general channel's receive spins first, which under a group commit of 64
//! callers costs more CPU than the commit: see BENCHMARKS.md).
//!
//! A caller that goes away before its answer arrives (an async call whose
//! future was dropped) leaves the slot *abandoned*: the answer is then
//! handed to the slot's `unheard` hook, on whichever side comes second, so
//! that an answer that matters (a won claim) is never silently lost.

use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use parking_lot::{Condvar, Mutex};

/// What happens to an answer nobody will read (runs on the writer's or the
/// dropping caller's thread: it must not block).
pub(crate) type Unheard<T> = Box<dyn FnOnce(T) + Send>;

enum Slot<T> {
    Waiting,
    Answered(T),
    /// The sender was dropped without an answer.
    Dropped,
    /// The receiver was dropped before the answer came.
    Abandoned,
}

struct State<T> {
    slot: Slot<T>,
    /// The async caller to wake when the answer comes.
    waker: Option<Waker>,
    unheard: Option<Unheard<T>>,
}

struct Shared<T> {
    state: Mutex<State<T>>,
    ready: Condvar,
}

/// The writer's end: [`ReplyTx::send`] once.
pub(crate) struct ReplyTx<T>(Option<Arc<Shared<T>>>);

/// The caller's end: [`ReplyRx::recv`] waits for the answer,
/// [`ReplyRx::poll_recv`] polls for it.
pub(crate) struct ReplyRx<T> {
    shared: Arc<Shared<T>>,
    /// The answer was taken (or the sender is gone): nothing to hand on.
    done: bool,
}

/// A connected pair.
pub(crate) fn reply<T>() -> (ReplyTx<T>, ReplyRx<T>) {
    reply_with(None)
}

/// A connected pair whose answer goes to `unheard` if the receiver is
/// dropped before taking it.
pub(crate) fn reply_with<T>(unheard: Option<Unheard<T>>) -> (ReplyTx<T>, ReplyRx<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            slot: Slot::Waiting,
            waker: None,
            unheard,
        }),
        ready: Condvar::new(),
    });
    (
        ReplyTx(Some(shared.clone())),
        ReplyRx {
            shared,
            done: false,
        },
    )
}

impl<T> ReplyTx<T> {
    /// Hands `value` to the caller: wakes a parked one or an async one; if
    /// the caller is gone, to the slot's `unheard` hook (or drops it).
    pub(crate) fn send(mut self, value: T) {
        let Some(shared) = self.0.take() else {
            return;
        };
        let mut state = shared.state.lock();
        if matches!(state.slot, Slot::Abandoned) {
            let unheard = state.unheard.take();
            drop(state);
            if let Some(unheard) = unheard {
                unheard(value);
            }
            return;
        }
        state.slot = Slot::Answered(value);
        let waker = state.waker.take();
        drop(state);
        shared.ready.notify_one();
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl<T> Drop for ReplyTx<T> {
    fn drop(&mut self) {
        if let Some(shared) = self.0.take() {
            let mut state = shared.state.lock();
            if matches!(state.slot, Slot::Waiting) {
                state.slot = Slot::Dropped;
            }
            let waker = state.waker.take();
            drop(state);
            shared.ready.notify_one();
            if let Some(waker) = waker {
                waker.wake();
            }
        }
    }
}

impl<T> ReplyRx<T> {
    /// The answer, or `None` if the writer dropped the job unanswered.
    pub(crate) fn recv(mut self) -> Option<T> {
        let mut state = self.shared.state.lock();
        loop {
            match std::mem::replace(&mut state.slot, Slot::Dropped) {
                Slot::Answered(value) => {
                    self.done = true;
                    return Some(value);
                }
                Slot::Dropped | Slot::Abandoned => {
                    self.done = true;
                    return None;
                }
                Slot::Waiting => {
                    state.slot = Slot::Waiting;
                    self.shared.ready.wait(&mut state);
                }
            }
        }
    }

    /// The answer if it is there (`Some(None)`: the writer dropped the job
    /// unanswered); otherwise registers `cx`'s waker, which the writer's
    /// `send` wakes. Not to be polled again once it returned `Ready`.
    pub(crate) fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let mut state = self.shared.state.lock();
        match std::mem::replace(&mut state.slot, Slot::Dropped) {
            Slot::Answered(value) => {
                self.done = true;
                Poll::Ready(Some(value))
            }
            Slot::Dropped | Slot::Abandoned => {
                self.done = true;
                Poll::Ready(None)
            }
            Slot::Waiting => {
                state.slot = Slot::Waiting;
                match &mut state.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    other => *other = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
        }
    }
}

impl<T> Drop for ReplyRx<T> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut state = self.shared.state.lock();
        state.waker = None;
        match std::mem::replace(&mut state.slot, Slot::Abandoned) {
            // The answer came but was never taken: hand it on here.
            Slot::Answered(value) => {
                let unheard = state.unheard.take();
                drop(state);
                if let Some(unheard) = unheard {
                    unheard(value);
                }
            }
            // The writer hands it on when it answers.
            Slot::Waiting | Slot::Abandoned => {}
            Slot::Dropped => state.slot = Slot::Dropped,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    #[test]
    fn an_answer_arrives_across_threads() {
        let (tx, rx) = reply();
        let t = std::thread::spawn(move || tx.send(7));
        assert_eq!(rx.recv(), Some(7));
        t.join().unwrap();
    }

    #[test]
    fn a_dropped_sender_wakes_the_caller() {
        let (tx, rx) = reply::<u8>();
        let t = std::thread::spawn(move || drop(tx));
        assert_eq!(rx.recv(), None);
        t.join().unwrap();
    }

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn send_wakes_a_polling_caller() {
        let woken = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(woken.clone());
        let mut cx = Context::from_waker(&waker);
        let (tx, mut rx) = reply();
        assert!(rx.poll_recv(&mut cx).is_pending());
        tx.send(3);
        assert_eq!(woken.0.load(Ordering::SeqCst), 1);
        assert_eq!(rx.poll_recv(&mut cx), Poll::Ready(Some(3)));
    }

    #[test]
    fn an_unheard_answer_goes_to_the_hook_whichever_side_comes_second() {
        let heard = Arc::new(Mutex::new(Vec::new()));
        let hook = |heard: &Arc<Mutex<Vec<u8>>>| -> Option<Unheard<u8>> {
            let heard = heard.clone();
            Some(Box::new(move |v| heard.lock().push(v)))
        };
        // The caller leaves first; the writer answers later.
        let (tx, rx) = reply_with(hook(&heard));
        drop(rx);
        tx.send(1);
        // The writer answers first; the caller leaves without taking it.
        let (tx, rx) = reply_with(hook(&heard));
        tx.send(2);
        drop(rx);
        // Taken: never handed on.
        let (tx, rx) = reply_with(hook(&heard));
        tx.send(3);
        assert_eq!(rx.recv(), Some(3));
        assert_eq!(*heard.lock(), vec![1, 2]);
    }
}
