//! A read-only redb backend, for operator tools: every read works, every
//! write is refused, and the file is never written (not even its header).

use std::path::Path;

use redb::{ReadOnlyDatabase, ReadableDatabase, TableError};

use crate::clock::Clock as _;
use crate::error::{OpenError, Result};
use crate::key::IdempotencyKey;
use crate::message::OutboxEntry;
use crate::policy::ExpiryPolicy;
use crate::store::record::{EntityState, Record};
use crate::store::{Backend, Scanned};

use super::layout::Layout;
use super::meta::Format;
use super::meta::{file_format, stored_expiry};
use super::snapshot::Snapshots;
use super::tables::META;
use super::{contained, read};

/// A database opened read-only.
pub(crate) struct RedbReader {
    /// The read snapshot point reads share (see `snapshot.rs`). Nothing
    /// commits while it lives: a read-only open shares the file with other
    /// read-only opens only (redb's `ExclusiveWriter` mode, the one the
    /// engine opens in), so it never goes stale. Declared before `db`, so
    /// it is dropped first.
    reads: Snapshots,
    db: ReadOnlyDatabase,
    /// Its format (1 is read as it is, never migrated).
    format: Format,
    path: std::path::PathBuf,
}

impl RedbReader {
    /// Opens `path` read-only. A file that needs recovery after a crash is
    /// refused (recovery writes), and so is a redb file without the engine's
    /// tables. Of the meta values, those the open uses are checked (the
    /// format and the journal's: a damaged one is refused); `verify` checks
    /// them all.
    pub(crate) fn open(path: &Path) -> Result<RedbReader, OpenError> {
        let db = redb::Builder::new()
            .open_read_only(path)
            .map_err(|e| match e {
                redb::DatabaseError::DatabaseAlreadyOpen => OpenError::AlreadyOpen {
                    path: path.to_path_buf(),
                },
                redb::DatabaseError::RepairAborted => super::open::needs_repair(path),
                source => OpenError::NotADatabase {
                    path: path.to_path_buf(),
                    source,
                },
            })?;
        let has_tables = match db.begin_read().map(|txn| txn.open_table(META).map(drop)) {
            Ok(Ok(())) => true,
            Ok(Err(TableError::TableDoesNotExist(_))) => false,
            Ok(Err(e)) => {
                return Err(OpenError::Storage {
                    context: "checking for the engine's tables",
                    source: Box::new(redb::Error::from(e)),
                })
            }
            Err(e) => {
                return Err(OpenError::Storage {
                    context: "checking for the engine's tables",
                    source: Box::new(redb::Error::from(e)),
                })
            }
        };
        if !has_tables {
            return Err(OpenError::NoEngineTables {
                path: path.to_path_buf(),
            });
        }
        // The meta table exists, but holds no values: no engine wrote it.
        let Some(format) = file_format(&db, path)? else {
            return Err(OpenError::NoEngineTables {
                path: path.to_path_buf(),
            });
        };
        // Frames the journal holds beyond the last checkpoint are not in
        // the file yet: a view without them would show an older state.
        if super::recover::pending_frames(&db, format, path)? > 0 {
            return Err(OpenError::NeedsRecovery {
                path: path.to_path_buf(),
            });
        }
        let layout = if format == super::meta::Format::V3 {
            super::open::read_only_layout(&db, path)?
        } else {
            Layout::Single
        };
        Ok(RedbReader {
            reads: Snapshots::new(layout),
            db,
            format,
            path: path.to_path_buf(),
        })
    }
}

impl RedbReader {
    /// Whether a read snapshot is kept now (for tests).
    #[cfg(test)]
    pub(super) fn kept(&self) -> bool {
        self.reads.is_kept()
    }

    /// The TTL (ms) and expiry policy the last app stored, if any.
    pub(crate) fn stored_expiry(&self) -> Result<Option<(u64, ExpiryPolicy)>, OpenError> {
        stored_expiry(&self.db, self.format, &self.path)
    }
}

impl Backend for RedbReader {
    fn check(&self) -> Result<()> {
        Ok(())
    }

    fn record(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        contained("reading the database", || {
            read::record(&*self.reads.current(&self.db, read::READING_A_RECORD)?, key)
        })
    }

    fn in_doubt(&self, limit: usize, now_ms: u64) -> Result<Vec<(IdempotencyKey, Record)>> {
        contained("reading the database", || {
            read::in_doubt(&self.db, self.reads.layout(), limit, now_ms)
        })
    }

    fn scan(&self, visit: &mut (dyn FnMut(Scanned) -> bool + Send)) -> Result<()> {
        contained("reading the database", || {
            read::scan(&self.db, self.reads.layout(), visit)
        })
    }

    fn scan_in_key_order(&self, visit: &mut (dyn FnMut(Scanned) -> bool + Send)) -> Result<()> {
        contained("reading the database", || {
            read::scan_in_key_order(&self.db, self.reads.layout(), visit)
        })
    }

    fn oldest_in_doubt_ms(&self, now_ms: u64) -> Result<Option<u64>> {
        contained("reading the database", || {
            read::oldest_in_doubt(&self.db, now_ms)
        })
    }

    fn sweep_due(&self, now_ms: u64) -> Result<bool> {
        contained("reading the database", || {
            read::sweep_due(&self.db, now_ms, None)
        })
    }

    fn outbox(&self, limit: usize) -> Result<Vec<OutboxEntry>> {
        contained("reading the database", || read::outbox(&self.db, limit))
    }

    fn dead_letters(&self, limit: usize) -> Result<Vec<crate::dead_letter::DeadLetter>> {
        contained("reading the database", || {
            read::dead_letters(&self.db, limit)
        })
    }

    fn outbox_len(&self) -> Result<u64> {
        contained("reading the database", || read::outbox_len(&self.db))
    }

    fn entity(&self, entity: &str) -> Result<Option<EntityState>> {
        contained("reading the database", || {
            read::entity(
                &*self.reads.current(&self.db, read::READING_AN_ENTITY)?,
                entity,
            )
        })
    }

    fn steps(&self, key: &IdempotencyKey) -> Result<Vec<crate::store::StepRecord>> {
        let now_ms = crate::clock::SystemClock.now_ms();
        contained("reading the database", || {
            let snapshot = self.reads.current(&self.db, "reading effect steps")?;
            read::steps(&snapshot, key, now_ms)
        })
    }

    fn history(&self, key: &IdempotencyKey) -> Result<Vec<crate::store::HistoryRecord>> {
        contained("reading the database", || {
            read::history(&self.db, self.reads.layout(), key)
        })
    }

    crate::store::refuse::refuse_writes!();

    fn verify(&self) -> Result<(Vec<crate::verify::Damage>, u64)> {
        // First every check a writable open runs (redb's page checksums),
        // so that verify never calls sound a file that open refuses.
        let mut damage = contained("verifying the database's pages", || {
            super::open::page_damage(&self.path)
        })?;
        // And the journal check a writable open runs, clean close or not.
        if let Err(e) = super::recover::check_before_open(&self.db, self.format, &self.path) {
            match e {
                OpenError::Journal { .. } => {
                    damage.push(crate::verify::Damage::UnusableJournal {
                        detail: e.to_string(),
                    });
                }
                e => {
                    return Err(crate::error::Error::Storage {
                        context: "checking the journal",
                        source: Box::new(e),
                    })
                }
            }
        }
        match contained("verifying the database", || super::verify::verify(&self.db)) {
            Ok((found, records)) => {
                damage.extend(found);
                Ok((damage, records))
            }
            // A scrub over a damaged page may fail part way; the page check
            // has said what it can.
            Err(e) if !damage.is_empty() => {
                tracing::warn!(error = %e, "the scrub stopped on the damaged file");
                Ok((damage, 0))
            }
            Err(e) => Err(e),
        }
    }

    fn close(&self) {}

    fn redb_format(&self) -> Option<u32> {
        Some(self.format.number())
    }
}
