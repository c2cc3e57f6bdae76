//! A redb storage backend whose writes and syncs fail on command, for
//! disk-full and I/O-error tests. Reads keep working, as on a full disk.
//!
//! Include it with `#[path = "common/faulty_backend.rs"] mod faulty_backend;`.

#![allow(dead_code)] // each test file uses some of these

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use redb::backends::InMemoryBackend;
use redb::StorageBackend;

/// The switch shared by a [`FaultyBackend`] and the test that drives it.
#[derive(Clone, Debug, Default)]
pub struct Faults(Arc<AtomicBool>);

impl Faults {
    /// From now on, every write, `set_len` and sync fails.
    pub fn fail_writes(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Writes work again.
    pub fn heal(&self) {
        self.0.store(false, Ordering::SeqCst);
    }

    fn failing(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// redb's in-memory backend, with writes that fail while [`Faults`] says so.
#[derive(Debug)]
pub struct FaultyBackend {
    inner: InMemoryBackend,
    faults: Faults,
}

impl FaultyBackend {
    /// A fresh, empty backend and the switch that controls it.
    pub fn new() -> (FaultyBackend, Faults) {
        let faults = Faults::default();
        let backend = FaultyBackend {
            inner: InMemoryBackend::new(),
            faults: faults.clone(),
        };
        (backend, faults)
    }

    fn check(&self) -> io::Result<()> {
        if self.faults.failing() {
            Err(io::Error::new(
                io::ErrorKind::StorageFull,
                "injected fault: no space left on device",
            ))
        } else {
            Ok(())
        }
    }
}

impl StorageBackend for FaultyBackend {
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        self.inner.read(offset, out)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.check()?;
        self.inner.set_len(len)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.check()?;
        self.inner.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.check()?;
        self.inner.write(offset, data)
    }
}
