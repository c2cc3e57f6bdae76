//! `Engine::salvage`: a new database file from what still reads of a
//! damaged one.

use std::path::Path;

use crate::engine::handle::Engine;
use crate::error::OpenError;
use crate::salvage::SalvageReport;
use crate::store::redb as redb_store;

impl Engine {
    /// Copies what still reads of the damaged database file at `damaged`
    /// into a new database file at `new`, and lists every key it could not
    /// copy. For a file an open refuses as corrupt
    /// ([`OpenError::Corrupt`]): serve from the new file while the listed
    /// keys are resolved (`docs/operations.md`, "Damaged files").
    ///
    /// Every record (inbox marks included), outbox message and entity whose
    /// stored value still reads and passes its checksum is copied with its
    /// bytes unchanged, and with it the changes the journal holds beyond
    /// the last checkpoint; index entries and meta values are written anew
    /// to match (the stored TTL and expiry policy, when readable, are
    /// kept). Nothing is guessed: a value that fails its checksum, a record
    /// whose index entry disagrees with it (it may be an older copy), a key
    /// an index entry or a journal frame names whose record cannot be read,
    /// and a stretch of a table that could not be walked are listed in
    /// [`SalvageReport::lost`], not copied. A listed key has no record in
    /// the new file, so its work would run again on a retry: resolve each
    /// with the provider first.
    ///
    /// The new file has the damaged file's format: a file of format 3
    /// (time-partitioned records) gives a format-3 file, its records in
    /// one sealed partition with its key filter built anew; a record key
    /// found in two partitions (damage) is copied only where its journal
    /// or index entry says which copy is current, else listed.
    ///
    /// `damaged` and its journal are only read (a file that needs recovery
    /// is recovered in memory). `new` must not exist or be empty, and so
    /// must its journal (`<new>.journal`); it is written through a
    /// temporary file beside it (`<new>.salvaging`) and renamed into
    /// place once complete, with its directory synced. The whole file is
    /// read into memory: salvage needs about as much memory as the data.
    ///
    /// # Errors
    ///
    /// [`OpenError::SalvageTargetExists`] if `new` or its journal exists
    /// and is not empty; [`OpenError::MissingDatabase`],
    /// [`OpenError::EmptyFile`] for `damaged`;
    /// [`OpenError::NotADatabase`] or [`OpenError::Corrupt`] when redb
    /// cannot open `damaged` at all (its header is damaged, or it needs
    /// recovery and its tree is damaged: redb's repair refuses it);
    /// [`OpenError::NoEngineTables`], [`OpenError::UnsupportedFormat`],
    /// [`OpenError::PreReleaseFormat`]; [`OpenError::AlreadyOpen`] while
    /// an app has it open; [`OpenError::Storage`] if writing `new` fails
    /// (nothing is left at `new` then).
    pub fn salvage(
        damaged: impl AsRef<Path>,
        new: impl AsRef<Path>,
    ) -> Result<SalvageReport, OpenError> {
        let damaged = damaged.as_ref();
        match std::fs::metadata(damaged) {
            Ok(m) if m.len() > 0 => {}
            Ok(_) => {
                return Err(OpenError::EmptyFile {
                    path: damaged.to_path_buf(),
                })
            }
            Err(_) => {
                return Err(OpenError::MissingDatabase {
                    path: damaged.to_path_buf(),
                })
            }
        }
        redb_store::salvage(damaged, new.as_ref())
    }
}
