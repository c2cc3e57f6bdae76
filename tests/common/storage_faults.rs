//! Fault-injecting redb storage backends for the integration tests.
//!
//! - [`FailingBackend`]: one in-memory image whose `write` / `sync_data`
//!   calls fail on command: the Nth one from now, or every write from now
//!   on (a full disk) until healed.
//! - [`CrashBackend`]: the same faults, plus a *durable* image that only a
//!   successful `sync_data` brings up to date. [`CrashBackend::crash`]
//!   freezes it and returns the bytes a crash at that instant leaves on the
//!   disk; [`CrashBackend::from_image`] reopens from them.
//!
//! The switch is a shared [`Faults`] handle, so a test can arm, inspect and
//! heal faults while an engine runs on the backend. Reads never fail.
//!
//! Used through `#[path = "common/storage_faults.rs"] mod storage_faults;`
//! (the file is not part of `common/mod.rs`, so other tests do not compile
//! it).

#![allow(dead_code)] // each test file uses some of these

use std::io;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use redb::StorageBackend;

/// What a failed `sync_data` leaves on the durable image of a
/// [`CrashBackend`]. A failed fsync promises nothing: the data may or may
/// not have reached the disk, and a test should survive both.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FailedSync {
    /// Nothing written since the last good sync is durable.
    #[default]
    Lost,
    /// Everything written so far reached the disk although the sync failed.
    Persisted,
}

#[derive(Debug, Default)]
struct Plan {
    /// `write` / `sync_data` calls so far (failed ones included).
    writes: u64,
    syncs: u64,
    /// The call numbers (1-based, counted as above) that fail.
    fail_write_at: Option<u64>,
    fail_sync_at: Option<u64>,
    /// Every write (and every growth of the file) fails until healed.
    disk_full: bool,
    failed_sync: FailedSync,
    /// How many calls failed on purpose.
    fired: u64,
    /// Reads panic (as a storage library can on a corrupt file).
    panic_reads: bool,
    /// Writes panic.
    panic_writes: bool,
}

/// The switch of a backend's faults, shared with the test.
#[derive(Clone, Debug, Default)]
pub struct Faults(Arc<Mutex<Plan>>);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn injected(what: &str) -> io::Error {
    io::Error::other(format!("injected fault: {what}"))
}

impl Faults {
    /// `Err` while the disk is full (a probe for engines that reopen).
    pub fn healthy(&self) -> io::Result<()> {
        if lock(&self.0).disk_full {
            Err(injected("the disk is still full"))
        } else {
            Ok(())
        }
    }

    /// The `n`th `write` from now fails (1: the next one). `n` 0 disarms.
    pub fn fail_write(&self, n: u64) {
        let mut p = lock(&self.0);
        p.fail_write_at = (n > 0).then(|| p.writes + n);
    }

    /// The `n`th `sync_data` from now fails (1: the next one). `n` 0
    /// disarms.
    pub fn fail_sync(&self, n: u64) {
        let mut p = lock(&self.0);
        p.fail_sync_at = (n > 0).then(|| p.syncs + n);
    }

    /// What a failed sync leaves durable (a [`CrashBackend`] only).
    pub fn on_failed_sync(&self, what: FailedSync) {
        lock(&self.0).failed_sync = what;
    }

    /// From now on every write, and every growth of the file, fails: a
    /// full disk.
    pub fn disk_full(&self) {
        lock(&self.0).disk_full = true;
    }

    /// Disarms every fault: space is freed, the device works again.
    pub fn heal(&self) {
        let mut p = lock(&self.0);
        p.fail_write_at = None;
        p.fail_sync_at = None;
        p.disk_full = false;
    }

    /// `write` calls so far, failed ones included.
    pub fn writes(&self) -> u64 {
        lock(&self.0).writes
    }

    /// `sync_data` calls so far, failed ones included.
    pub fn syncs(&self) -> u64 {
        lock(&self.0).syncs
    }

    /// How many calls have failed on purpose.
    pub fn fired(&self) -> u64 {
        lock(&self.0).fired
    }

    /// From now on reads (`true`) panic, or stop panicking (`false`).
    pub fn panic_on_read(&self, on: bool) {
        lock(&self.0).panic_reads = on;
    }

    /// From now on writes (`true`) panic, or stop panicking (`false`).
    pub fn panic_on_write(&self, on: bool) {
        lock(&self.0).panic_writes = on;
    }

    /// Panics if reads must panic.
    fn read(&self) {
        let panic = lock(&self.0).panic_reads;
        assert!(!panic, "injected panic (read)");
    }

    /// Counts a write; `Err` if it must fail.
    fn write(&self) -> io::Result<()> {
        let panic = lock(&self.0).panic_writes;
        assert!(!panic, "injected panic (write)");
        let mut p = lock(&self.0);
        p.writes += 1;
        if p.disk_full {
            p.fired += 1;
            return Err(injected("disk full (write)"));
        }
        if p.fail_write_at == Some(p.writes) {
            p.fired += 1;
            return Err(injected(&format!("write #{}", p.writes)));
        }
        Ok(())
    }

    /// Counts a sync; `Err` with what it leaves durable if it must fail.
    fn sync(&self) -> Result<(), (io::Error, FailedSync)> {
        let mut p = lock(&self.0);
        p.syncs += 1;
        if p.fail_sync_at == Some(p.syncs) {
            p.fired += 1;
            return Err((injected(&format!("sync #{}", p.syncs)), p.failed_sync));
        }
        Ok(())
    }

    /// `Err` if growing the file to `len` from `current` must fail.
    fn grow(&self, current: usize, len: usize) -> io::Result<()> {
        let mut p = lock(&self.0);
        if p.disk_full && len > current {
            p.fired += 1;
            return Err(injected("disk full (set_len)"));
        }
        Ok(())
    }
}

fn out_of_range() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end")
}

fn to_usize(n: u64) -> io::Result<usize> {
    usize::try_from(n).map_err(|_| out_of_range())
}

fn read_at(image: &[u8], offset: u64, out: &mut [u8]) -> io::Result<()> {
    let offset = to_usize(offset)?;
    let src = image
        .get(offset..offset + out.len())
        .ok_or_else(out_of_range)?;
    out.copy_from_slice(src);
    Ok(())
}

fn write_at(image: &mut Vec<u8>, offset: u64, data: &[u8]) -> io::Result<()> {
    let offset = to_usize(offset)?;
    if image.len() < offset + data.len() {
        image.resize(offset + data.len(), 0);
    }
    image[offset..offset + data.len()].copy_from_slice(data);
    Ok(())
}

/// One in-memory image whose writes and syncs fail on command. Clones
/// share the image and the faults, so a test can reopen on the same bytes.
#[derive(Clone, Debug, Default)]
pub struct FailingBackend {
    image: Arc<Mutex<Vec<u8>>>,
    faults: Faults,
}

impl FailingBackend {
    pub fn new() -> FailingBackend {
        FailingBackend::default()
    }

    /// The switch of this backend's faults.
    pub fn faults(&self) -> Faults {
        self.faults.clone()
    }
}

impl StorageBackend for FailingBackend {
    fn len(&self) -> io::Result<u64> {
        Ok(lock(&self.image).len() as u64)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        self.faults.read();
        read_at(&lock(&self.image), offset, out)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut image = lock(&self.image);
        let len = to_usize(len)?;
        self.faults.grow(image.len(), len)?;
        image.resize(len, 0);
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        self.faults.sync().map_err(|(e, _)| e)
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.faults.write()?;
        write_at(&mut lock(&self.image), offset, data)
    }
}

#[derive(Debug, Default)]
struct Images {
    /// What reads see: every write applied.
    live: Vec<u8>,
    /// What survives a crash: the live image as of the last good sync.
    durable: Vec<u8>,
    /// Set by a crash: the durable image no longer changes.
    crashed: bool,
}

/// A backend with a live image and a durable one, updated only by a good
/// `sync_data` (or by a failed one, if [`Faults::on_failed_sync`] says it
/// persisted). Faults as for [`FailingBackend`].
#[derive(Clone, Debug, Default)]
pub struct CrashBackend {
    images: Arc<Mutex<Images>>,
    faults: Faults,
}

impl CrashBackend {
    /// An empty disk.
    pub fn new() -> CrashBackend {
        CrashBackend::default()
    }

    /// A disk holding `image` (durable), with the faults of `faults` (pass
    /// `Faults::default()` for none).
    pub fn from_image(image: Vec<u8>, faults: Faults) -> CrashBackend {
        CrashBackend {
            images: Arc::new(Mutex::new(Images {
                live: image.clone(),
                durable: image,
                crashed: false,
            })),
            faults,
        }
    }

    /// The switch of this backend's faults.
    pub fn faults(&self) -> Faults {
        self.faults.clone()
    }

    /// The machine dies now: returns what is on the disk (the durable
    /// image) and freezes it, so whatever the dying engine writes while it
    /// is dropped is lost. Drop the engine after this call, then reopen
    /// with [`CrashBackend::from_image`].
    pub fn crash(&self) -> Vec<u8> {
        let mut images = lock(&self.images);
        images.crashed = true;
        images.durable.clone()
    }

    /// The live image: what a crash leaves if every write since the last
    /// sync happened to reach the disk.
    pub fn live_image(&self) -> Vec<u8> {
        lock(&self.images).live.clone()
    }
}

impl StorageBackend for CrashBackend {
    fn len(&self) -> io::Result<u64> {
        Ok(lock(&self.images).live.len() as u64)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        read_at(&lock(&self.images).live, offset, out)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut images = lock(&self.images);
        let len = to_usize(len)?;
        self.faults.grow(images.live.len(), len)?;
        images.live.resize(len, 0);
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        let mut images = lock(&self.images);
        let (result, persisted) = match self.faults.sync() {
            Ok(()) => (Ok(()), true),
            Err((e, what)) => (Err(e), what == FailedSync::Persisted),
        };
        if persisted && !images.crashed {
            images.durable = images.live.clone();
        }
        result
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.faults.write()?;
        write_at(&mut lock(&self.images).live, offset, data)
    }
}
