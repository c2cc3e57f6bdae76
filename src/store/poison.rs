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
        if self.flag.load(Ordering::SeqCst) {
            self.cause.lock().clone()
        } else {
            None
        }
    }

    pub(crate) fn check(&self) -> Result<()> {
        match self.cause() {
            Some(cause) => Err(Error::Poisoned { cause }),
            None => Ok(()),
        }
    }
}
