//! Space kept for recovery: a file of zeros beside the database
//! (`<database file>.reserve`), given back to the file system when the
//! engine needs room to recover (a reopen after a storage failure, an open
//! after a crash or a full disk) and taken again once it has recovered.
//!
//! Replaying the journal writes into the database file the frames written
//! since the last checkpoint, and the checkpoint after it makes them
//! durable: on a full disk, that needs space exactly when there is none.
//! The reserve holds that space. Its size is proportionate: at most the
//! configured bytes ([`DEFAULT_BYTES`] unless `EngineBuilder::recovery_reserve`
//! says otherwise), at most an eighth of the file system, and at most half
//! of what is free when it is taken (it never fills a disk itself). The
//! writer checkpoints at least every half reserve of journal (see
//! [`checkpoint_bytes`]), so the replay of what a crash leaves fits in it.

use std::io;
use std::path::{Path, PathBuf};

/// The default reserve: room to replay and checkpoint a full journal (the
/// writer checkpoints every 32 MiB of it; applied to the B-trees it takes
/// up to about twice that).
pub(crate) const DEFAULT_BYTES: u64 = 64 << 20;

/// The file's name: the database file's, with this appended.
const SUFFIX: &str = ".reserve";

/// Granularity of the reserve (and of the sizes derived from it).
const BLOCK: u64 = 64 << 10;

/// The reserve of one database file.
#[derive(Debug, Clone)]
pub(crate) struct Reserve {
    path: PathBuf,
    /// The configured size (0: no reserve).
    bytes: u64,
}

impl Reserve {
    /// The reserve beside the database file `db`, of at most `bytes`.
    pub(crate) fn beside(db: &Path, bytes: u64) -> Reserve {
        Reserve {
            path: path_of(db),
            bytes,
        }
    }

    /// The size the reserve aims at on this file system: the configured
    /// size, at most an eighth of the file system, in whole blocks.
    pub(crate) fn target(&self) -> u64 {
        let dir = self.dir();
        let cap = rustix::fs::statvfs(&dir)
            .map_or(u64::MAX, |s| s.f_blocks.saturating_mul(s.f_frsize) / 8);
        self.bytes.min(cap) / BLOCK * BLOCK
    }

    fn dir(&self) -> PathBuf {
        match self.path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        }
    }

    /// Takes the reserve again: [`Self::target`] bytes, or half of what is
    /// free if that is less. Returns the bytes held.
    ///
    /// # Errors
    ///
    /// The file could not be written (the file system refused even the
    /// smaller size); nothing is held then.
    pub(crate) fn take(&self) -> io::Result<u64> {
        let target = self.target();
        let held = std::fs::metadata(&self.path).map_or(0, |m| m.len());
        if target == 0 {
            release(&self.path);
            return Ok(0);
        }
        if held >= target {
            return Ok(held);
        }
        let free = rustix::fs::statvfs(self.dir())
            .map(|s| s.f_bavail.saturating_mul(s.f_frsize))
            .map_err(io::Error::from)?;
        let want = target.min(u64::midpoint(free, held)) / BLOCK * BLOCK;
        if want <= held {
            return Ok(held);
        }
        let written = write_zeros(&self.path, held, want);
        if let Err(e) = written {
            release(&self.path);
            return Err(e);
        }
        Ok(want)
    }
}

/// The reserve file of the database file `db`: beside the file itself
/// (links resolved, as for the journal), on the file system it fills.
pub(crate) fn path_of(db: &Path) -> PathBuf {
    let real = std::fs::canonicalize(db).unwrap_or_else(|_| db.to_path_buf());
    let mut name = real.into_os_string();
    name.push(SUFFIX);
    PathBuf::from(name)
}

/// Removes the reserve at `path`; returns the bytes it held.
pub(crate) fn release(path: &Path) -> u64 {
    let held = std::fs::metadata(path).map_or(0, |m| m.len());
    match std::fs::remove_file(path) {
        Ok(()) => {
            if held > 0 {
                tracing::info!(bytes = held, reserve = %path.display(),
                    "recovery reserve given back to the file system");
            }
            held
        }
        Err(_) => 0,
    }
}

/// Grows the file at `path` from `from` to `to` bytes of allocated space
/// (a sparse file would hold none): `fallocate`, which allocates without
/// writing, or zeros written where the file system does not support it.
/// Not synced: a reserve lost in a crash is taken again at the next open.
fn write_zeros(path: &Path, from: u64, to: u64) -> io::Result<()> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)?;
    let from = if file.metadata()?.len() == from {
        from
    } else {
        file.set_len(0)?;
        0
    };
    match rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), from, to - from) {
        Ok(()) => return Ok(()),
        Err(e) if e != rustix::io::Errno::OPNOTSUPP && e != rustix::io::Errno::NOSYS => {
            return Err(e.into())
        }
        Err(_) => {}
    }
    // Positioned writes: two takes at once (a reopen's and a checkpoint's)
    // write the same bytes, never twice as many.
    let block = vec![0_u8; usize::try_from(BLOCK).unwrap_or(65_536)];
    let mut at = from;
    while at < to {
        let n = usize::try_from((to - at).min(BLOCK)).unwrap_or(block.len());
        std::os::unix::fs::FileExt::write_all_at(&file, &block[..n], at)?;
        at += n as u64;
    }
    Ok(())
}

/// Journal bytes after which the writer checkpoints with a reserve of
/// `reserve` bytes: at most `max`, and at most half the reserve (at least
/// one block), so a replay fits in the reserve.
pub(crate) fn checkpoint_bytes(reserve: u64, max: u64) -> u64 {
    (reserve / 2).max(BLOCK).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_at_most_half_of_what_is_free_and_releases_it() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let db = dir.path().join("a.redb");
        let reserve = Reserve::beside(&db, 256 << 10);
        let held = reserve.take()?;
        assert_eq!(held, reserve.target());
        assert_eq!(std::fs::metadata(path_of(&db))?.len(), held);
        assert_eq!(release(&path_of(&db)), held);
        assert!(!path_of(&db).exists());
        assert_eq!(Reserve::beside(&db, 0).take()?, 0);
        Ok(())
    }

    #[test]
    fn checkpoints_every_half_reserve() {
        assert_eq!(checkpoint_bytes(64 << 20, 32 << 20), 32 << 20);
        assert_eq!(checkpoint_bytes(1 << 20, 32 << 20), 512 << 10);
        assert_eq!(checkpoint_bytes(0, 32 << 20), 64 << 10);
    }
}
