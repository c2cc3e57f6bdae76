//! Opening a redb database for the engine: the format check, the engine's
//! tables, and the expiry settings stored for operator tools.

use std::path::Path;
use std::sync::Arc;

use redb::{Database, DatabaseError, Durability, ReadableDatabase};

use crate::error::{Corrupted, OpenError};
use crate::policy::ExpiryPolicy;
use crate::store::config::StoreConfig;
use crate::verify::Damage;

use super::meta::{self, check_meta, file_format, stored_expiry, Format, OpenContext};
use super::partition::catalog::{self, Catalog, CatalogError, Filters, SealRule};
use super::partition::filter::FilterHasher;
use super::partition::row::{FILTERS, PARTITIONS};
use super::tables::{ENTITIES, EXPIRY, LEASES, META, OUTBOX, RECORDS, RECOVERY};

/// Opens the file at `path`, creating it if it does not exist or is empty.
/// Nothing is written to an existing file, and no journal is created,
/// before [`check_before_writing`] has accepted it. Then its recovery
/// reserve, if any, is given back: redb's recovery and the journal's replay
/// may need its room (the engine takes it again once it runs, see
/// `RedbStore::start`). Its page cache is `cache_bytes` (`None`: redb's
/// default, 1 GiB).
pub(crate) fn open_path(path: &Path, cache_bytes: Option<usize>) -> Result<Database, OpenError> {
    let builder = || {
        let mut b = redb::Builder::new();
        if let Some(bytes) = cache_bytes {
            b.set_cache_size(bytes);
        }
        b
    };
    let found = std::fs::metadata(path).ok();
    let existing = found.as_ref().is_some_and(|m| m.len() > 0);
    let db = if existing {
        check_before_writing(path)?;
        super::reserve::release(&super::reserve::path_of(path));
        // Every page's checksum is verified before the file is trusted: a
        // file damaged since redb wrote it is refused here, where a plain
        // open can make redb panic later, sometimes twice and then abort
        // the process (docs/upstream/redb-panics.md). It reads the whole
        // file once per writable open.
        let mut checked = builder();
        checked.set_check_integrity_on_open(true);
        checked.open(path)
    } else {
        let created = builder().create(path);
        if let Err(e) = &created {
            undo_create(path, found.is_some(), e);
        }
        created
    };
    db.map_err(|e| open_error(path, e))
}

/// Puts back what a create that failed (a full disk, say) left at `path`:
/// redb may have sized the file before its header write failed, and bytes
/// that are not a database would refuse every later open. The file is
/// removed if it did not exist before (`existed`), else emptied again.
/// Not after `DatabaseAlreadyOpen`: then the file is another engine's.
fn undo_create(path: &Path, existed: bool, e: &DatabaseError) {
    if matches!(e, DatabaseError::DatabaseAlreadyOpen) {
        return;
    }
    let undone = if existed {
        std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .and_then(|f| f.set_len(0))
    } else {
        std::fs::remove_file(path)
    };
    if let Err(undo) = undone {
        if undo.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(error = %undo, path = %path.display(),
                "a create that failed left a file that is not a database; delete it");
        }
    }
}

/// A view of the database at `path` for reads only, while the engine
/// cannot reopen it for writing (its self-reopen failed): the file
/// through a layer that keeps every write in memory, with the frames its
/// journal holds beyond the last checkpoint applied in that memory. It
/// shows every acknowledged write and changes nothing on disk. It holds
/// the file's lock, like a writable open; drop it before the next
/// reopen.
///
/// # Errors
///
/// `OpenError::Corrupt` and `OpenError::Storage` as a writable open (the
/// file locked, damaged, or more to recover than the in-memory layer
/// holds), `OpenError::Journal` if the journal cannot serve the file.
pub(crate) fn open_read_view(path: &Path) -> Result<Database, OpenError> {
    let db = scratch_view::open(path).map_err(|e| open_error(path, e))?;
    super::recover::apply_in_view(&db, path)?;
    Ok(db)
}

/// Why redb's read-only open of the file at `path` said it needs repair:
/// recovery after a crash ([`OpenError::NeedsRecovery`], which a writable
/// open does), or damage a writable open would refuse too (a file cut
/// short, a damaged page: [`OpenError::Corrupt`], pointing to `verify` and
/// `salvage` rather than to a writable open that fails). Tells them apart
/// by recovering the file in memory; writes nothing.
pub(crate) fn needs_repair(path: &Path) -> OpenError {
    match scratch_view::open(path) {
        Err(e @ DatabaseError::Storage(redb::StorageError::Corrupted(_))) => open_error(path, e),
        _ => OpenError::NeedsRecovery {
            path: path.to_path_buf(),
        },
    }
}

/// Refuses, from a view that writes nothing, an existing file a writable
/// open must not touch: an unknown format version (redb's writable open
/// rewrites the file header even when nothing is committed), or a journal
/// that cannot serve it (a file not closed cleanly whose journal is gone,
/// emptied, another database's or damaged). Then the integrity check,
/// migration and recovery may write.
///
/// A file closed cleanly is read through redb's read-only open. One that
/// was not (after a crash) is refused by it, so it is opened writable over
/// a layer that keeps every write in memory (`scratch_view.rs`), which recovers
/// it as the real open will; that reads the whole file a second time, once
/// per crash. A file another engine holds is refused here; one neither
/// view can open (damaged, not a database) goes on to the writable open,
/// which reports it.
fn check_before_writing(path: &Path) -> Result<(), OpenError> {
    match redb::Builder::new().open_read_only(path) {
        Ok(view) => check_view(view, path),
        Err(DatabaseError::RepairAborted) => match scratch_view::open(path) {
            Ok(view) => check_view(view, path),
            Err(e) => {
                tracing::debug!(error = %e, path = %path.display(),
                    "no view of the file before opening it; the writable open reports it");
                Ok(())
            }
        },
        // Another engine holds the file: refused before anything beside
        // it is touched (its recovery reserve above all).
        Err(DatabaseError::DatabaseAlreadyOpen) => Err(OpenError::AlreadyOpen {
            path: path.to_path_buf(),
        }),
        Err(_) => Ok(()),
    }
}

/// Refuses, from a view that writes nothing, an existing file at `path`
/// that is no database of the engine's, for a command that must never
/// write to one (`EngineBuilder::compact`) where a writable open would
/// create the engine's tables in it and a journal beside it: a redb file
/// without the engine's tables, another program's
/// ([`OpenError::NoEngineTables`]); a directory
/// ([`OpenError::NotADatabase`], naming it). A file another engine holds
/// is [`OpenError::AlreadyOpen`]. A file left by a crash is viewed through
/// the in-memory layer (reading it whole). What neither view can open
/// (not a database, damaged) goes on to the writable open, which reports
/// it before it writes.
pub(crate) fn refuse_foreign(path: &Path) -> Result<(), OpenError> {
    let format = match redb::Builder::new().open_read_only(path) {
        Ok(view) => view_format(view, path)?,
        Err(DatabaseError::RepairAborted) => match scratch_view::open(path) {
            Ok(view) => view_format(view, path)?,
            Err(_) => return Ok(()),
        },
        Err(DatabaseError::DatabaseAlreadyOpen) => {
            return Err(OpenError::AlreadyOpen {
                path: path.to_path_buf(),
            })
        }
        Err(source) if path.is_dir() => {
            return Err(OpenError::NotADatabase {
                path: path.to_path_buf(),
                source,
            })
        }
        Err(_) => return Ok(()),
    };
    match format {
        Some(_) => Ok(()),
        None => Err(OpenError::NoEngineTables {
            path: path.to_path_buf(),
        }),
    }
}

/// The engine's format of the file `view` shows (`None`: no engine
/// tables), then closes the view, as [`check_view`].
fn view_format<D: ReadableDatabase>(view: D, path: &Path) -> Result<Option<Format>, OpenError> {
    let format = super::open_contained(path, || file_format(&view, path));
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(view)));
    format
}

/// Checks the format version and the journal on `view`, then closes it. A
/// panic inside redb on damaged bytes becomes `OpenError::Corrupt`, and the
/// view is closed without unwinding through it.
fn check_view<D: ReadableDatabase>(view: D, path: &Path) -> Result<(), OpenError> {
    let verdict = super::open_contained(path, || match file_format(&view, path)? {
        Some(format) => {
            check_meta(&view, format, path)?;
            super::recover::check_before_open(&view, format, path)
        }
        // No meta values: a new file, or a redb file without the engine's
        // tables (no journal either).
        None => Ok(()),
    });
    // After a panic inside redb its `Drop` may panic on poisoned locks.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(view)));
    verdict
}

/// A database on any redb storage backend.
pub(crate) fn open_backend(backend: impl redb::StorageBackend) -> Result<Database, OpenError> {
    redb::Builder::new()
        .create_with_backend(backend)
        .map_err(|e| open_error(Path::new("<backend>"), e))
}

fn open_error(path: &Path, e: DatabaseError) -> OpenError {
    open_error_as(path, e, corrupt_reason)
}

/// [`open_error`] for salvage's own open: a corrupt file's reason is
/// redb's, with what salvage can still do, never the advice to run
/// salvage that the server's open gives.
fn salvage_open_error(path: &Path, e: DatabaseError) -> OpenError {
    open_error_as(path, e, |_, detail| {
        format!(
            "{detail}; redb cannot open this file at all, so salvage cannot read it: restore \
             it from a backup (its journal, kept, holds every write since the last checkpoint)"
        )
    })
}

fn open_error_as(
    path: &Path,
    e: DatabaseError,
    reason: impl FnOnce(&Path, String) -> String,
) -> OpenError {
    match e {
        DatabaseError::DatabaseAlreadyOpen => OpenError::AlreadyOpen {
            path: path.to_path_buf(),
        },
        // A read past the end of the file: its header or a page names
        // bytes the file does not have, so the file is damaged or
        // truncated (a failing disk reports other kinds).
        DatabaseError::Storage(redb::StorageError::Io(source))
            if source.kind() == std::io::ErrorKind::UnexpectedEof =>
        {
            OpenError::Corrupt {
                path: path.to_path_buf(),
                what: Corrupted::File,
                reason: reason(
                    path,
                    format!(
                        "it names bytes past the end of the file ({source}): damaged or truncated"
                    ),
                ),
            }
        }
        // The disk failed (full, read-only, gone), not the file's contents:
        // a healthy file must not be reported as damaged. (redb reports
        // bytes that are not a database as `InvalidData`.)
        DatabaseError::Storage(redb::StorageError::Io(source))
            if source.kind() != std::io::ErrorKind::InvalidData =>
        {
            OpenError::Storage {
                context: "opening the database file",
                source: Box::new(source),
            }
        }
        DatabaseError::Storage(redb::StorageError::Corrupted(detail)) => OpenError::Corrupt {
            path: path.to_path_buf(),
            what: Corrupted::File,
            reason: reason(path, detail),
        },
        source => OpenError::NotADatabase {
            path: path.to_path_buf(),
            source,
        },
    }
}

/// Checks the file's format and meta values, migrating a format-1 file;
/// on a database without the engine's tables, creates them in format 2
/// (its callers reopen an existing file after a storage failure, or are
/// tests of format-2 files; the engine's own opens and salvage use
/// [`prepare_new_as`]). Then applies
/// the expiry settings: with `from_database`, the ones stored by the last
/// app (if any) replace `cfg`'s; otherwise `cfg`'s are stored for operator
/// tools. Returns the settings in force. `path` names the file in errors.
pub(crate) fn prepare(
    db: &Database,
    path: &Path,
    cfg: StoreConfig,
    from_database: bool,
) -> Result<StoreConfig, OpenError> {
    prepare_new_as(db, path, cfg, from_database, NewFormat::Format2)
}

/// The format [`prepare_new_as`] creates a new file in (an existing file
/// keeps its own unless it is migrated: [`migrate_if_asked`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum NewFormat {
    /// One records table keyed by record key (what releases before format
    /// 3 wrote): kept for the crate's tests of format-2 files
    /// (`EngineBuilder::unstable_create_format_2`) and for the salvage of
    /// a format-2 file, which writes format 2's tables.
    Format2,
    /// Partitioned records (docs/format3-plan.md, docs/design.md): the
    /// default.
    #[default]
    Format3,
}

/// How a format-2 file is migrated to format 3 (`migrate3.rs`), when it
/// is (`EngineBuilder::migrate_to_format_3`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MigrationSteps {
    /// Most records one step (one durable transaction) copies; at least 1.
    pub(crate) records: u64,
    /// A test hook: the open fails after this many steps committed, before
    /// the last, leaving a half-migrated (format-2) file, as a crash
    /// between steps would (`EngineBuilder::unstable_format_3_migration`).
    pub(crate) stop_after: Option<u64>,
}

impl MigrationSteps {
    /// Steps of [`migrate3::STEP_RECORDS`] records, to the end.
    pub(crate) const DEFAULT: MigrationSteps = MigrationSteps {
        records: migrate3::STEP_RECORDS,
        stop_after: None,
    };
}

/// [`prepare`], creating a new file in `new_format`.
pub(crate) fn prepare_new_as(
    db: &Database,
    path: &Path,
    mut cfg: StoreConfig,
    from_database: bool,
    new_format: NewFormat,
) -> Result<StoreConfig, OpenError> {
    let format = init_format(db, path, new_format)?;
    match stored_expiry(db, format, path)? {
        Some((ttl_ms, expiry)) if from_database => {
            cfg.ttl_ms = ttl_ms;
            cfg.expiry = expiry;
        }
        _ if from_database => {}
        Some(stored) if stored == (cfg.ttl_ms, cfg.expiry) => {}
        _ => store_expiry(db, cfg.ttl_ms, cfg.expiry)?,
    }
    Ok(cfg)
}

// The migration is a file of its own beside this one; it is declared here
// so that `redb/mod.rs` need not change for it.
#[path = "migrate.rs"]
mod migrate;

// And the migration from format 2 to format 3 (whose sealing of a
// partition built in key order salvage shares).
#[path = "migrate3.rs"]
pub(super) mod migrate3;

/// Migrates a format-2 file to format 3 (`migrate3.rs`, in bounded
/// steps, going on from a partial copy) when `migration` asks for it
/// (`EngineBuilder::migrate_to_format_3`); otherwise deletes a partial
/// copy a format-2 file holds, which its format-2 writes would make stale
/// (`migrate3::drop_partial_copy`). A file of another format is left as it
/// is. Run by the writer's start, after the journal was applied.
///
/// # Errors
///
/// As `migrate3::to_format_3` and `migrate3::drop_partial_copy`.
pub(crate) fn migrate_if_asked(
    db: &Database,
    path: &Path,
    migration: Option<MigrationSteps>,
    now_ms: u64,
) -> Result<(), OpenError> {
    if file_format(db, path)? != Some(Format::V2) {
        return Ok(());
    }
    match migration {
        Some(steps) => migrate3::to_format_3(db, path, &filter_seed(path), now_ms, steps).map(drop),
        None => migrate3::drop_partial_copy(db, path),
    }
}

// Likewise the in-memory layer the check before a writable open reads a
// crashed file through.
#[path = "scratch_view.rs"]
mod scratch_view;

// And redb's page check run without writing, with where its damage lies.
#[path = "pages.rs"]
mod pages;

/// What redb's page check, as a writable open runs it, finds wrong with
/// the file at `path`, without writing to it: nothing if every page
/// passes; else a [`Damage::FailedPageCheck`] naming the first failing
/// page, and the engine tables' entries on it where a walk can tell.
///
/// # Errors
///
/// `Error::Storage` if the check cannot run (the file cannot be read).
pub(crate) fn page_damage(path: &Path) -> crate::error::Result<Vec<Damage>> {
    match pages::check(path) {
        Ok(None) => Ok(Vec::new()),
        Ok(Some(failed)) => Ok(pages::damage(path, &failed)),
        Err(e) => Err(crate::error::Error::Storage {
            context: "running redb's page check",
            source: Box::new(e),
        }),
    }
}

/// redb's `detail` on a file whose page check failed, with what a walk of
/// the file tells about the damage (the page, and the tables and keys on
/// it), and the commands that list and save the rest.
fn corrupt_reason(path: &Path, detail: String) -> String {
    if !path.is_file() {
        return detail;
    }
    let found = match pages::check(path) {
        Ok(Some(failed)) => pages::summary(path, &failed),
        _ => String::new(),
    };
    let found = if found.is_empty() {
        found
    } else {
        format!(" ({found})")
    };
    let shown = path.display();
    format!(
        "{detail}{found}; `idem verify {shown}` names the first damaged page and its keys, and \
         `idem salvage {shown} NEW` copies every record that still reads into a new file"
    )
}

/// Checks (and migrates) an existing file, or creates the engine's tables
/// in a new one; the file's format after.
fn init_format(db: &Database, path: &Path, new_format: NewFormat) -> Result<Format, OpenError> {
    super::read::probe_tables(db)?;
    // The meta values and all tables are created in one transaction, so a
    // format present means every table is.
    if let Some(format) = file_format(db, path)? {
        check_meta(db, format, path)?;
        if format == Format::V1 {
            migrate::from_format_1(db, path)?;
            return Ok(Format::V2);
        }
        return Ok(format);
    }
    let what = "creating the engine's tables";
    let mut txn = db.begin_write().open_context(what)?;
    txn.set_durability(Durability::Immediate)
        .open_context(what)?;
    let format = {
        let mut meta = txn.open_table(META).open_context(what)?;
        let format = match new_format {
            NewFormat::Format2 => {
                meta::create(&mut meta).open_context(what)?;
                txn.open_table(RECORDS).open_context(what)?;
                Format::V2
            }
            NewFormat::Format3 => {
                meta::create_format_3(&mut meta, &filter_seed(path)).open_context(what)?;
                txn.open_table(catalog::RECORDS).open_context(what)?;
                txn.open_table(PARTITIONS).open_context(what)?;
                txn.open_table(FILTERS).open_context(what)?;
                Format::V3
            }
        };
        txn.open_table(LEASES).open_context(what)?;
        txn.open_table(RECOVERY).open_context(what)?;
        txn.open_table(EXPIRY).open_context(what)?;
        txn.open_table(OUTBOX).open_context(what)?;
        txn.open_table(ENTITIES).open_context(what)?;
        format
    };
    txn.commit().open_context(what)?;
    Ok(format)
}

/// The writer's catalog of a format-3 file at `now_ms`, sealing by `rule` (`None`: the file
/// is of format 2), after its journal was applied: its filters decoded
/// and checked, damaged or missing ones rebuilt, the hot partition found
/// or opened (`Catalog::load`); what that repairs is committed durably
/// here, before the writer starts.
///
/// # Errors
///
/// [`OpenError::Corrupt`] naming `path` for a damaged `filter_seed` or
/// partition row (or two hot partitions); [`OpenError::Storage`] when
/// redb fails.
pub(crate) fn open_catalog(
    db: &Database,
    path: &Path,
    now_ms: u64,
    rule: SealRule,
) -> Result<Option<Catalog>, OpenError> {
    let what = "opening the partitions";
    if file_format(db, path)? != Some(Format::V3) {
        return Ok(None);
    }
    let filters = file_filters(db, path, what)?;
    let mut txn = db.begin_write().open_context(what)?;
    txn.set_durability(Durability::Immediate)
        .open_context(what)?;
    let mut changes = Vec::new();
    let loaded = Catalog::load_in(&txn, filters, rule, now_ms, &mut changes);
    let catalog = loaded.map_err(|e| match e {
        CatalogError::Storage(source) => OpenError::Storage {
            context: what,
            source: Box::new(source),
        },
        other => OpenError::Corrupt {
            path: path.to_path_buf(),
            what: Corrupted::File,
            reason: other.to_string(),
        },
    })?;
    txn.commit().open_context(what)?;
    Ok(Some(catalog))
}

/// No filter kept yet, hashing with the seed of the format-3 file `db`.
///
/// # Errors
///
/// [`OpenError::Corrupt`] naming `path` for a damaged or missing
/// `filter_seed` (or meta table).
fn file_filters(
    db: &impl ReadableDatabase,
    path: &Path,
    what: &'static str,
) -> Result<Arc<Filters>, OpenError> {
    let seed = meta::read_meta(db, path, what, meta::read_filter_seed)?.ok_or_else(|| {
        OpenError::Corrupt {
            path: path.to_path_buf(),
            what: Corrupted::File,
            reason: "a format-3 file without its meta table".into(),
        }
    })?;
    Ok(Arc::new(Filters::new(FilterHasher::new(&seed))))
}

/// The read layout of a format-3 file opened read-only: its filters'
/// hasher, and every stored filter that passes its checks (one that does
/// not is left out: its partition is then read on every lookup, never
/// skipped; nothing is rebuilt or written).
///
/// # Errors
///
/// [`OpenError::Corrupt`] naming `path` for a damaged `filter_seed`;
/// [`OpenError::Storage`] when redb fails.
pub(crate) fn read_only_layout(
    db: &impl ReadableDatabase,
    path: &Path,
) -> Result<super::layout::Layout, OpenError> {
    let what = "reading the partitions' filters";
    let filters = file_filters(db, path, what)?;
    let txn = db.begin_read().open_context(what)?;
    // Without either table, no filter is kept: every partition is read.
    let (Ok(rows), Ok(stored)) = (txn.open_table(PARTITIONS), txn.open_table(FILTERS)) else {
        return Ok(super::layout::Layout::Partitioned(filters));
    };
    catalog::keep_stored_filters(&rows, &stored, &filters).open_context(what)?;
    Ok(super::layout::Layout::Partitioned(filters))
}

/// 16 bytes for a new format-3 file's `filter_seed`: from the operating
/// system's random source, or (without one) hashed from the time, the
/// process and `path`. The seed keeps a client from choosing keys that
/// all fall in one filter block (which would cost reads, never answers).
fn filter_seed(path: &Path) -> [u8; 16] {
    let mut seed = [0u8; 16];
    let from_os = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut seed));
    if from_os.is_err() {
        seed = super::journal::new_id(path.as_os_str().as_encoded_bytes());
    }
    seed
}

fn store_expiry(db: &Database, ttl_ms: u64, policy: ExpiryPolicy) -> Result<(), OpenError> {
    let what = "storing the expiry settings";
    let mut txn = db.begin_write().open_context(what)?;
    txn.set_durability(Durability::Immediate)
        .open_context(what)?;
    {
        let mut meta = txn.open_table(META).open_context(what)?;
        meta::write_expiry(&mut meta, ttl_ms, policy).open_context(what)?;
    }
    txn.commit().open_context(what)
}

/// A view of the database at `path` for salvage: every write stays in
/// memory, and redb's integrity check is skipped so that a file it refuses
/// can still be read where its pages allow. A file closed cleanly is read
/// through redb's read-only open; one that needs recovery is recovered in
/// memory (redb's repair then verifies the tree, and refuses a damaged
/// one). Neither writes to the file. Nothing is checked or applied from
/// the journal: salvage reads it itself.
///
/// # Errors
///
/// As [`open_read_view`], for what redb cannot open at all.
pub(crate) fn open_salvage_view(path: &Path) -> Result<SalvageView, OpenError> {
    match redb::Builder::new().open_read_only(path) {
        Ok(db) => Ok(SalvageView::Clean(db)),
        Err(DatabaseError::RepairAborted) => scratch_view::open_unchecked(path)
            .map(SalvageView::Recovered)
            .map_err(|e| salvage_open_error(path, e)),
        Err(e) => Err(salvage_open_error(path, e)),
    }
}

/// A database opened for salvage (see [`open_salvage_view`]).
pub(crate) enum SalvageView {
    /// Closed cleanly: redb's read-only open.
    Clean(redb::ReadOnlyDatabase),
    /// Recovered in memory over the file.
    Recovered(Database),
}
