//! `EngineBuilder::compact`: a closed database file's free pages given
//! back to the file system.

use std::path::Path;

use crate::compaction::Compaction;
use crate::engine::builder::EngineBuilder;
use crate::error::OpenError;
use crate::store::redb as redb_store;

impl EngineBuilder {
    /// Compacts the database file at `path`: its pages in use move to the
    /// front and the free ones are cut off its end, so the file's length
    /// comes down to what it holds. redb never shrinks a file whose free
    /// pages are not at its end: a store that once held more records
    /// (a busy day, a longer TTL), or whose file grew by one of redb's
    /// doublings, keeps its length until compacted. Nothing it holds
    /// changes: records, steps, logs, indexes and meta values keep their
    /// bytes and checksums.
    ///
    /// The file must not be open elsewhere: stop the app first (an app
    /// that has it open makes this fail with [`OpenError::AlreadyOpen`]).
    /// It is first opened as [`EngineBuilder::open_existing`] opens it
    /// (with this builder's settings, the sweeper off: a file left by a
    /// crash is recovered, its journal applied) and closed cleanly, then
    /// compacted. The expiry settings the file stores (TTL and policy,
    /// which operator tools follow) are kept, whatever this builder's
    /// are, as with [`EngineBuilder::expiry_settings_from_database`]. A
    /// redb file without the engine's tables (another program's) is
    /// refused before anything is written to it or beside it. A crash
    /// part way leaves a file that opens as before. It reads and rewrites
    /// up to the whole file: minutes for a file of several GiB. The
    /// engine's recovery reserve (`<file>.reserve`) is given back while it
    /// runs and taken again by the next open.
    ///
    /// # Errors
    ///
    /// As for [`EngineBuilder::open_existing`] ([`OpenError::MissingDatabase`],
    /// [`OpenError::EmptyFile`], [`OpenError::AlreadyOpen`],
    /// [`OpenError::Corrupt`], [`OpenError::Journal`], …);
    /// [`OpenError::NoEngineTables`] for a redb file without the engine's
    /// tables; [`OpenError::NotADatabase`] for a directory or a file that
    /// is no redb database;
    /// [`OpenError::Storage`] if a compaction pass fails (an I/O error, a
    /// full disk): the file then holds what it held, at the length redb's
    /// last pass left.
    pub fn compact(self, path: impl AsRef<Path>) -> Result<Compaction, OpenError> {
        let path = path.as_ref();
        let cache_bytes = self.cache_bytes;
        super::builder::existing(path)?;
        // A writable open would give another program's redb file the
        // engine's tables and a journal: refused before anything is written.
        redb_store::refuse_foreign(path)?;
        // Recovered and closed cleanly: the journal holds nothing to apply.
        // The expiry settings stay the file's: an open stores its own, and
        // operator tools (`idem sweep`, `idem resolve`) follow the stored
        // ones, which a one-off program's builder defaults must not replace.
        let engine = self
            .sweep_interval(None)
            .expiry_settings_from_database()
            .open_existing(path)?;
        drop(engine);
        let (bytes_before, bytes_after) = redb_store::compact(path, cache_bytes)?;
        Ok(Compaction {
            bytes_before,
            bytes_after,
        })
    }
}
