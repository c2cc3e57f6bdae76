//! Sticky failure: once the disk has said no, the engine stops writing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// Set once by the writer after a failed commit (or a panic); read by every
/// call.
#[derive(Debug, Default)]
pub(crate) struct Poison {
    flag: AtomicBool,
    cause: Mutex<Option<Arc<str>>>,
    /// Why the last attempt to reopen failed, if one did: said with the
    /// cause, so nobody reads "it reopens once storage works" while a
    /// reopen keeps failing.
    reopen: Mutex<Option<String>>,
}

impl Poison {
    pub(crate) fn set(&self, cause: String) {
        let mut slot = self.cause.lock();
        if slot.is_none() {
            *slot = Some(cause.into());
        }
        self.flag.store(true, Ordering::SeqCst);
    }

    pub(crate) fn cause(&self) -> Option<Arc<str>> {
        if !self.flag.load(Ordering::SeqCst) {
            return None;
        }
        let cause = self.cause.lock().clone()?;
        match &*self.reopen.lock() {
            Some(failed) => {
                Some(format!("{cause}; the last reopen attempt failed: {failed}").into())
            }
            None => Some(cause),
        }
    }

    /// Records why an attempt to reopen failed (replacing the previous
    /// attempt's reason).
    pub(crate) fn reopen_failed(&self, why: String) {
        *self.reopen.lock() = Some(why);
    }

    pub(crate) fn check(&self) -> Result<()> {
        match self.cause() {
            Some(cause) => Err(Error::Poisoned { cause }),
            None => Ok(()),
        }
    }
}
