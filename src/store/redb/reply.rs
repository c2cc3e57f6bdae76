//! A one-shot reply slot: the writer puts one answer in, the waiting caller
//! takes it out. The caller parks at once instead of spinning and yielding
//! (a general channel's receive spins first, which under a group commit of
//! 64 callers costs more CPU than the commit: see BENCHMARKS.md).

use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

enum Slot<T> {
    Waiting,
    Answered(T),
    /// The sender was dropped without an answer.
    Dropped,
}

struct Shared<T> {
    slot: Mutex<Slot<T>>,
    ready: Condvar,
}

/// The writer's end: [`ReplyTx::send`] once.
pub(super) struct ReplyTx<T>(Option<Arc<Shared<T>>>);

/// The caller's end: [`ReplyRx::recv`] waits for the answer.
pub(super) struct ReplyRx<T>(Arc<Shared<T>>);

/// A connected pair.
pub(super) fn reply<T>() -> (ReplyTx<T>, ReplyRx<T>) {
    let shared = Arc::new(Shared {
        slot: Mutex::new(Slot::Waiting),
        ready: Condvar::new(),
    });
    (ReplyTx(Some(shared.clone())), ReplyRx(shared))
}

impl<T> ReplyTx<T> {
    /// Hands `value` to the waiting caller (dropped if nobody waits).
    pub(super) fn send(mut self, value: T) {
        if let Some(shared) = self.0.take() {
            *shared.slot.lock() = Slot::Answered(value);
            shared.ready.notify_one();
        }
    }
}

impl<T> Drop for ReplyTx<T> {
    fn drop(&mut self) {
        if let Some(shared) = self.0.take() {
            let mut slot = shared.slot.lock();
            if matches!(*slot, Slot::Waiting) {
                *slot = Slot::Dropped;
            }
            drop(slot);
            shared.ready.notify_one();
        }
    }
}

impl<T> ReplyRx<T> {
    /// The answer, or `None` if the writer dropped the job unanswered.
    pub(super) fn recv(self) -> Option<T> {
        let mut slot = self.0.slot.lock();
        loop {
            match std::mem::replace(&mut *slot, Slot::Dropped) {
                Slot::Answered(value) => return Some(value),
                Slot::Dropped => return None,
                Slot::Waiting => {
                    *slot = Slot::Waiting;
                    self.0.ready.wait(&mut slot);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
