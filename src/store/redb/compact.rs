//! Compaction of a closed file: redb moves the pages in use to the front
//! and cuts the free tail off (`redb::Database::compact`).
//!
//! Why it is needed: redb grows a file by doubling it (up to its 4 GiB
//! regions) and gives space back only from a free tail, so a store that
//! once held more, or filled its file at a doubling, keeps a file longer
//! than its pages (`BENCHMARKS.md`, "A store filled from empty through
//! the merge"). Compaction needs the file to itself, so it runs on a
//! closed file, between the engine's clean close and its next open.
//!
//! Why it is safe: the caller first opens the file as the engine does
//! (the journal's frames applied) and closes it cleanly (a checkpoint:
//! the journal holds nothing to apply), so only redb's pages move. redb
//! compacts through its own commits, two-phase, each durable: a crash part
//! way leaves a file redb opens (repairing it if needed) with every table
//! as it was. Page contents, and with them the engine's checksums, do not
//! change; the journal's position in the meta table still matches it.

use std::path::Path;

use crate::error::OpenError;

use super::open::open_path;

/// redb's passes at most: each moves what it can; one usually suffices.
const PASSES: usize = 16;

/// Compacts the closed, cleanly closed database file at `path` (its page
/// cache `cache_bytes`, as the engine's open). Returns its length before
/// and after, in bytes.
///
/// # Errors
///
/// As for the engine's open of the file ([`open_path`]: a file in use is
/// [`OpenError::AlreadyOpen`]); [`OpenError::Storage`] when a pass fails
/// (an I/O error, a full disk: the file stays as redb's last commit left
/// it, and serves); [`OpenError::Corrupt`] if redb panics.
pub(crate) fn compact(path: &Path, cache_bytes: Option<usize>) -> Result<(u64, u64), OpenError> {
    let length = || {
        std::fs::metadata(path)
            .map(|m| m.len())
            .map_err(|e| OpenError::Storage {
                context: "reading the database file's length",
                source: Box::new(e),
            })
    };
    let before = length()?;
    super::open_contained(path, || {
        let mut db = open_path(path, cache_bytes)?;
        for _ in 0..PASSES {
            let moved = db.compact().map_err(|e| OpenError::Storage {
                context: "compacting the database file",
                source: Box::new(e),
            })?;
            if !moved {
                break;
            }
        }
        super::close_database(db);
        Ok(())
    })?;
    Ok((before, length()?))
}
