//! A database file under a layer that keeps every write in memory, so that
//! redb can open it writable (and recover it after a crash) while the file
//! itself is never written.
//!
//! redb's read-only open refuses a file that was not closed cleanly
//! (`DatabaseError::RepairAborted`): its allocator state must be rebuilt,
//! which writes. But the open of such a file must read its meta table
//! (where the journal's position is) before it may write anything: a file
//! whose journal is gone must be refused unchanged. Opened writable over
//! this layer, redb recovers the file into memory; the layer is dropped
//! afterwards, and the file keeps every byte.
//!
//! Reads see the file with the layer's writes on top, in blocks of
//! [`BLOCK`] bytes. Locks go to the file itself, as for a writable open, so
//! another process holding the database is met here as it would be there.

use std::collections::BTreeMap;
use std::io;
use std::ops::Bound;
use std::path::Path;

use parking_lot::Mutex;
use redb::backends::FileBackend;
use redb::{BackendError, Database, DatabaseError, StorageBackend};

/// Bytes per block of the layer.
const BLOCK: u64 = 4096;
/// Most bytes the layer holds. Recovery writes redb's header and allocator
/// state, a small part of the file; a layer this large means something
/// else is going on, and the write fails rather than fill the memory.
const MAX_LAYER_BYTES: u64 = 256 << 20;

/// Opens the database file at `path` writable over an in-memory layer,
/// with redb's integrity check, as the engine's writable open would: the
/// state it shows is the one that open will find. Nothing reaches the file.
///
/// # Errors
///
/// As redb's writable open: the file is locked by another process, cannot
/// be opened for writing, is damaged, or is not a redb database.
pub(super) fn open(path: &Path) -> Result<Database, DatabaseError> {
    open_with(path, true)
}

/// As [`open`], without the integrity check on open: for salvage, which
/// must read what it can of a file the check refuses. (A file that needs
/// recovery is still checked: redb's repair verifies the tree.)
///
/// # Errors
///
/// As [`open`].
pub(super) fn open_unchecked(path: &Path) -> Result<Database, DatabaseError> {
    open_with(path, false)
}

fn open_with(path: &Path, check: bool) -> Result<Database, DatabaseError> {
    // Opened for writing (nothing is written) because the locks of a
    // writable open need it.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let layer = layered(FileBackend::new(file)?)?;
    let mut builder = redb::Builder::new();
    builder.set_check_integrity_on_open(check);
    builder.create_with_backend(layer)
}

/// `file` under a layer that keeps every write in memory (for
/// `pages.rs`, which opens it with its own reads recorded). Its locks are
/// `file`'s.
///
/// # Errors
///
/// If `file`'s length cannot be read.
pub(super) fn layered<F: StorageBackend>(file: F) -> io::Result<Overlay<F>> {
    let len = file.len()?;
    Ok(Overlay {
        file,
        layer: Mutex::new(Layer {
            len,
            file_len: len,
            blocks: BTreeMap::new(),
        }),
    })
}

/// The file, and the writes kept above it.
#[derive(Debug)]
pub(super) struct Overlay<F = FileBackend> {
    file: F,
    layer: Mutex<Layer>,
}

/// Writes kept in memory, in whole blocks.
///
/// Invariants: `file_len <= len`; the file's bytes from `file_len` on are
/// not part of the view (a shrink hid them); bytes of a block at or past
/// `len` are zero.
#[derive(Debug)]
struct Layer {
    /// The storage's length as redb sees it.
    len: u64,
    /// How much of the file is still seen below the layer.
    file_len: u64,
    /// Block number → the block's bytes (`BLOCK` of them).
    blocks: BTreeMap<u64, Vec<u8>>,
}

impl Layer {
    /// Reads `out.len()` bytes at `offset` of the view (the caller checked
    /// they are within `len`).
    fn read(&self, file: &dyn StorageBackend, offset: u64, out: &mut [u8]) -> io::Result<()> {
        let mut done = 0;
        while done < out.len() {
            let at = offset + done as u64;
            let (block, within) = (at / BLOCK, at % BLOCK);
            let n = usize::try_from(BLOCK - within)
                .unwrap_or(usize::MAX)
                .min(out.len() - done);
            let part = &mut out[done..done + n];
            match self.blocks.get(&block) {
                Some(bytes) => {
                    let start = usize::try_from(within).unwrap_or(usize::MAX);
                    part.copy_from_slice(&bytes[start..start + n]);
                }
                None => self.read_file(file, at, part)?,
            }
            done += n;
        }
        Ok(())
    }

    /// Reads the file's bytes at `at` where the view still shows them;
    /// zeros past them.
    fn read_file(&self, file: &dyn StorageBackend, at: u64, out: &mut [u8]) -> io::Result<()> {
        let shown = usize::try_from(self.file_len.saturating_sub(at))
            .unwrap_or(usize::MAX)
            .min(out.len());
        let (from_file, zeros) = out.split_at_mut(shown);
        if !from_file.is_empty() {
            file.read(at, from_file)?;
        }
        zeros.fill(0);
        Ok(())
    }

    /// Writes `data` at `offset` into the layer, growing the view if it
    /// ends past it.
    fn write(&mut self, file: &dyn StorageBackend, offset: u64, data: &[u8]) -> io::Result<()> {
        let end = offset
            .checked_add(data.len() as u64)
            .ok_or_else(|| io::Error::other("write past the largest offset"))?;
        let mut done = 0;
        while done < data.len() {
            let at = offset + done as u64;
            let (block, within) = (at / BLOCK, at % BLOCK);
            let n = usize::try_from(BLOCK - within)
                .unwrap_or(usize::MAX)
                .min(data.len() - done);
            let start = usize::try_from(within).unwrap_or(usize::MAX);
            self.block_mut(file, block)?[start..start + n].copy_from_slice(&data[done..done + n]);
            done += n;
        }
        self.len = self.len.max(end);
        Ok(())
    }

    /// The layer's copy of block `block`, made from the view on first use.
    fn block_mut(&mut self, file: &dyn StorageBackend, block: u64) -> io::Result<&mut Vec<u8>> {
        if !self.blocks.contains_key(&block) {
            if (self.blocks.len() as u64 + 1) * BLOCK > MAX_LAYER_BYTES {
                return Err(io::Error::new(
                    io::ErrorKind::OutOfMemory,
                    format!(
                        "more than {MAX_LAYER_BYTES} bytes written while reading the file \
                         without changing it"
                    ),
                ));
            }
            let mut bytes = vec![0_u8; usize::try_from(BLOCK).unwrap_or(4096)];
            self.read_file(file, block * BLOCK, &mut bytes)?;
            self.blocks.insert(block, bytes);
        }
        self.blocks
            .get_mut(&block)
            .ok_or_else(|| io::Error::other("a block just made is missing"))
    }

    /// Sets the view's length: a shrink hides what lies past it (the file's
    /// bytes too), so a later growth shows zeros there.
    fn set_len(&mut self, len: u64) {
        if len < self.len {
            let first_gone = len.div_ceil(BLOCK);
            drop(self.blocks.split_off(&first_gone));
            if let Some(bytes) = self.blocks.get_mut(&(len / BLOCK)) {
                let keep = usize::try_from(len % BLOCK).unwrap_or(0);
                if keep > 0 {
                    bytes[keep..].fill(0);
                }
            }
            self.file_len = self.file_len.min(len);
        }
        self.len = len;
    }
}

impl<F: StorageBackend> StorageBackend for Overlay<F> {
    fn len(&self) -> io::Result<u64> {
        Ok(self.layer.lock().len)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        let layer = self.layer.lock();
        let end = offset.checked_add(out.len() as u64);
        if end.is_none_or(|end| end > layer.len) {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("read past the end ({} bytes)", layer.len),
            ));
        }
        layer.read(&self.file, offset, out)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.layer.lock().set_len(len);
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        // Nothing of the layer is ever to be durable.
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.layer.lock().write(&self.file, offset, data)
    }

    fn close(&self) -> io::Result<()> {
        self.file.close()
    }

    fn try_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.file.try_lock_range(start, end)
    }

    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, BackendError> {
        self.file.try_lock_shared_range(start, end)
    }

    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.file.lock_range(start, end)
    }

    fn lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.file.lock_shared_range(start, end)
    }

    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.file.unlock_range(start, end)
    }

    fn query_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.file.query_lock_range(start, end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A layer over a file of `len` bytes, each its offset mod 251.
    fn over(
        len: u64,
    ) -> Result<(tempfile::NamedTempFile, FileBackend, Layer), Box<dyn std::error::Error>> {
        let tmp = tempfile::NamedTempFile::new()?;
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        std::fs::write(tmp.path(), &bytes)?;
        let file = FileBackend::new(std::fs::File::open(tmp.path())?)?;
        let layer = Layer {
            len,
            file_len: len,
            blocks: BTreeMap::new(),
        };
        Ok((tmp, file, layer))
    }

    fn view(layer: &Layer, file: &dyn StorageBackend) -> io::Result<Vec<u8>> {
        let mut out = vec![0; usize::try_from(layer.len).unwrap_or(0)];
        layer.read(file, 0, &mut out)?;
        Ok(out)
    }

    #[test]
    fn writes_show_in_the_view_and_never_reach_the_file() -> Result<(), Box<dyn std::error::Error>>
    {
        let (tmp, file, mut layer) = over(10_000)?;
        let original = std::fs::read(tmp.path())?;
        let mut expected = original.clone();
        // Across a block boundary, and past the end (the view grows).
        layer.write(&file, 4090, &[0xAA; 12])?;
        expected[4090..4102].fill(0xAA);
        layer.write(&file, 9_998, &[0xBB; 6])?;
        expected[9_998..].fill(0xBB);
        expected.extend_from_slice(&[0xBB; 4]);
        assert_eq!(view(&layer, &file)?, expected);
        assert_eq!(std::fs::read(tmp.path())?, original);
        Ok(())
    }

    #[test]
    fn a_shrink_hides_the_files_bytes_and_growth_shows_zeros(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let (tmp, file, mut layer) = over(10_000)?;
        let original = std::fs::read(tmp.path())?;
        layer.write(&file, 5_000, &[0xCC; 10])?;
        layer.set_len(4_100);
        layer.set_len(9_000);
        let mut expected = original[..4_100].to_vec();
        expected.resize(9_000, 0);
        assert_eq!(view(&layer, &file)?, expected);
        assert_eq!(std::fs::read(tmp.path())?, original);
        Ok(())
    }
}
