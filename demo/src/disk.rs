//! A disk that fills up: an in-memory redb storage backend with a byte
//! budget, for the demo's full-disk phase.
//!
//! The budget caps the database's length, as free space caps a file on a
//! real disk: growing the file past it, or writing past it, fails with an
//! `ENOSPC`-like error (`io::ErrorKind::StorageFull`). Writes inside the
//! file's current length always succeed (those blocks are allocated).
//! Clones share the bytes and the budget, so the engine can reopen the same
//! database after a failure, and the demo can "free space" by raising the
//! budget while the engine runs.

use std::io;
use std::sync::Arc;

use parking_lot::Mutex;
use redb::StorageBackend;

/// The disk's state, shared by every clone.
#[derive(Debug, Default)]
struct State {
    bytes: Vec<u8>,
    /// The largest length the file may have.
    budget_bytes: u64,
    /// Writes and growths refused for want of space so far.
    refused: u64,
}

/// An in-memory disk with room for `budget_bytes` of database.
#[derive(Clone, Debug)]
pub struct BudgetDisk {
    state: Arc<Mutex<State>>,
}

impl BudgetDisk {
    /// An empty disk with room for `budget_bytes`.
    pub fn new(budget_bytes: u64) -> BudgetDisk {
        BudgetDisk {
            state: Arc::new(Mutex::new(State {
                budget_bytes,
                ..State::default()
            })),
        }
    }

    /// Sets how large the file may grow: lower it to fill the disk, raise
    /// it to free space.
    pub fn set_budget(&self, budget_bytes: u64) {
        self.state.lock().budget_bytes = budget_bytes;
    }

    /// The file's length: the space used.
    pub fn used_bytes(&self) -> u64 {
        self.state.lock().bytes.len() as u64
    }

    /// Writes and growths refused for want of space so far.
    pub fn refused(&self) -> u64 {
        self.state.lock().refused
    }

    /// The engine's health probe: `Err` while the file has no room left to
    /// grow (the engine then keeps its poisoned database and asks again
    /// later).
    ///
    /// # Errors
    ///
    /// The full-disk error, while the budget is used up.
    pub fn check_space(&self) -> io::Result<()> {
        let state = self.state.lock();
        if (state.bytes.len() as u64) < state.budget_bytes {
            Ok(())
        } else {
            Err(no_space(state.budget_bytes))
        }
    }
}

/// What a full disk answers: `ENOSPC`, "No space left on device".
fn no_space(budget_bytes: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::StorageFull,
        format!("no space left on device (ENOSPC): the disk's {budget_bytes} bytes are used up"),
    )
}

fn out_of_range() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "read past the end of the disk",
    )
}

/// `offset + len` as a range into memory, if it fits.
fn range(offset: u64, len: usize) -> io::Result<std::ops::Range<usize>> {
    let start = usize::try_from(offset).map_err(|_| out_of_range())?;
    let end = start.checked_add(len).ok_or_else(out_of_range)?;
    Ok(start..end)
}

impl StorageBackend for BudgetDisk {
    fn len(&self) -> io::Result<u64> {
        Ok(self.used_bytes())
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        let state = self.state.lock();
        let src = state
            .bytes
            .get(range(offset, out.len())?)
            .ok_or_else(out_of_range)?;
        out.copy_from_slice(src);
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut state = self.state.lock();
        if len > state.bytes.len() as u64 && len > state.budget_bytes {
            state.refused += 1;
            return Err(no_space(state.budget_bytes));
        }
        let len = usize::try_from(len).map_err(|_| no_space(state.budget_bytes))?;
        state.bytes.resize(len, 0);
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut state = self.state.lock();
        let at = range(offset, data.len())?;
        if at.end > state.bytes.len() {
            if at.end as u64 > state.budget_bytes {
                state.refused += 1;
                return Err(no_space(state.budget_bytes));
            }
            state.bytes.resize(at.end, 0);
        }
        state.bytes[at].copy_from_slice(data);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_past_the_budget_fails_as_a_full_disk_and_freeing_space_heals_it() -> io::Result<()> {
        let disk = BudgetDisk::new(8);
        disk.set_len(8)?;
        disk.write(4, b"abcd")?;
        let full = disk
            .set_len(9)
            .err()
            .ok_or_else(|| io::Error::other("grew"))?;
        assert_eq!(full.kind(), io::ErrorKind::StorageFull);
        assert!(disk.write(6, b"xyz").is_err());
        assert!(disk.check_space().is_err());
        assert_eq!(disk.refused(), 2);
        // Shrinking and writing inside the file still work.
        disk.write(0, b"1234")?;
        let mut out = [0_u8; 8];
        disk.read(0, &mut out)?;
        assert_eq!(&out, b"1234abcd");

        let clone = disk.clone();
        clone.set_budget(16);
        disk.check_space()?;
        disk.write(8, b"more")?;
        assert_eq!(clone.used_bytes(), 12);
        Ok(())
    }
}
