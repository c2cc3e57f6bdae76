//! Opening the journal of a redb database: frames written after the last
//! checkpoint are applied again (in one durable transaction), then the
//! journal starts over.

use std::path::Path;

use redb::{Database, Durability, ReadableDatabase, ReadableTable, Table, WriteTransaction};

use crate::error::OpenError;

use super::journal::{
    expand, Change, Frame, IndexTable, Journal, JournalError, JournalStorage, Recovered, Scanned,
};
use super::meta::{self, file_format, read_meta, Counter, Format, MetaError, StoredJournal};
use super::partition::catalog;
use super::partition::merge::{self, MergeTables};
use super::partition::row::{PartitionRow, PartitionState, FILTERS, PARTITIONS};
use super::tables::{
    DEAD_LETTERS, ENTITIES, EXPIRY, HISTORY, LEASES, META, OUTBOX, RECORDS, RECOVERY, STEPS,
};

/// The journal the database at `path` (a file of `format`) was last used
/// with (`None`: it has never had one, or it has no meta table yet: a new
/// or foreign redb file).
fn stored_journal(
    db: &impl ReadableDatabase,
    format: Format,
    path: &Path,
) -> Result<Option<StoredJournal>, OpenError> {
    read_meta(db, path, "reading the journal position", |t| {
        meta::read_journal(t, format)
    })
    .map(Option::flatten)
}

/// Why a journal without the checkpoint's frame cannot be used.
fn unanchored(lsn: u64) -> String {
    format!(
        "the database was not closed cleanly, and this journal does not hold frame {lsn}, \
         the database's last checkpoint: the journal was deleted, emptied, or replaced by \
         another copy, so writes acknowledged after that checkpoint would be lost; put back \
         the journal this database file was last used with"
    )
}

/// The one rule for whether a journal can serve a database whose meta table
/// says `stored`, given what reading the journal found (`scanned`; a
/// missing, empty or header-only journal holds no frame and no anchor). A
/// file closed cleanly needs nothing from its journal; one that was not
/// needs the frame of its last checkpoint, or acknowledged writes may be
/// lost. Returns the frames the database does not hold yet. Used before a
/// writable open (nothing written yet), by the recovery after it, and by
/// read-only opens.
fn serving(
    stored: &StoredJournal,
    journal: &str,
    scanned: Scanned,
) -> Result<Vec<(u64, Frame)>, OpenError> {
    if !stored.clean && !scanned.anchored {
        return Err(OpenError::Journal {
            path: journal.into(),
            detail: unanchored(stored.lsn),
        });
    }
    Ok(scanned.frames)
}

/// Reads the journal beside the database file `db_path` (see
/// [`JournalStorage::path_of`]) without creating or writing it, and decides
/// whether it can serve a database whose meta table says `stored` (see
/// [`serving`]). Returns the frames the database does not hold yet.
pub(super) fn frames_beside(
    stored: &StoredJournal,
    db_path: &Path,
) -> Result<Vec<(u64, Frame)>, OpenError> {
    let journal_path = JournalStorage::path_of(db_path);
    let name = journal_path.display().to_string();
    let scanned = match std::fs::File::open(&journal_path) {
        Ok(file) => {
            let storage = JournalStorage::read_only(file, &journal_path);
            Journal::scan(&storage, stored.id, stored.lsn).map_err(|e| OpenError::Journal {
                path: journal_path.clone(),
                detail: e.to_string(),
            })?
        }
        // No journal holds what an empty one holds.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Scanned {
            frames: Vec::new(),
            anchored: false,
            torn: None,
        },
        Err(e) => {
            return Err(OpenError::Storage {
                context: "opening the journal",
                source: Box::new(e),
            })
        }
    };
    serving(stored, &name, scanned)
}

/// Decides, before a writable open writes anything to the database file at
/// `path` or creates its journal, whether the journal can serve it: `db` is
/// a view of the file that writes nothing to it. A database without a
/// journal id (new, format 1, or without the engine's tables) passes: it is
/// given a journal at open.
///
/// # Errors
///
/// [`OpenError::Journal`] when the journal is damaged, another database's,
/// or (after a crash) lacks the last checkpoint's frame;
/// [`OpenError::Corrupt`] when the journal's meta values are damaged;
/// [`OpenError::Storage`] when the meta table or the journal cannot be
/// read.
pub(super) fn check_before_open(
    db: &impl ReadableDatabase,
    format: Format,
    path: &Path,
) -> Result<(), OpenError> {
    match stored_journal(db, format, path)? {
        Some(stored) => frames_beside(&stored, path).map(drop),
        None => Ok(()),
    }
}

/// Opens the journal in `storage` for `db` (prepared: format 2; `path`
/// names it in errors), applying the frames the database does not hold
/// yet. A database without a journal id gets one, and any bytes already in
/// `storage` are discarded (they cannot be its journal). `grow_bytes`: the
/// most the journal file grows by at a time (see `Journal::set_grow_bytes`).
pub(crate) fn open_journal(
    db: &Database,
    path: &Path,
    storage: JournalStorage,
    grow_bytes: u64,
) -> Result<Journal, OpenError> {
    let format = file_format(db, path)?.unwrap_or(Format::V2);
    let what = "opening the journal";
    let name = storage.name.clone();
    let journal_error = |e: JournalError| OpenError::Journal {
        path: name.clone().into(),
        detail: e.to_string(),
    };
    let storage_error = |e: redb::Error| OpenError::Storage {
        context: what,
        source: Box::new(e),
    };
    let meta_error = |e: MetaError| e.open_error(path, what);
    let stored = match stored_journal(db, format, path)? {
        Some(stored) => stored,
        None => StoredJournal {
            id: give_journal(db, &storage)?,
            lsn: 0,
            clean: true,
        },
    };
    let Recovered {
        mut journal,
        frames,
        anchored,
        torn,
    } = Journal::recover(storage, stored.id, stored.lsn).map_err(journal_error)?;
    journal.set_grow_bytes(grow_bytes);
    let frames = serving(
        &stored,
        &name,
        Scanned {
            frames,
            anchored,
            torn,
        },
    )?;
    if let Some((last, _)) = frames.last() {
        let last = *last;
        let count = frames.len();
        let mut txn = db.begin_write().map_err(|e| storage_error(e.into()))?;
        txn.set_durability(Durability::Immediate)
            .map_err(|e| storage_error(e.into()))?;
        for (_, frame) in &frames {
            apply(&txn, frame, format == Format::V3).map_err(meta_error)?;
        }
        {
            let mut table = txn.open_table(META).map_err(|e| storage_error(e.into()))?;
            meta::write_counter(&mut table, Counter::JournalLsn, last)
                .map_err(|e| storage_error(e.into()))?;
        }
        txn.commit().map_err(|e| storage_error(e.into()))?;
        tracing::info!(
            frames = count,
            last_lsn = last,
            journal = %name,
            "applied journal frames written after the last checkpoint"
        );
    }
    // The anchor first, then "in use": a crash in between leaves a journal
    // that holds the checkpoint's frame either way.
    journal.checkpointed().map_err(journal_error)?;
    set_clean(db, false).map_err(storage_error)?;
    Ok(journal)
}

/// Applies, to `db` (a view whose writes stay in memory, see
/// `open::open_read_view`), the frames the journal beside `path` holds
/// beyond the database's last checkpoint, reading the journal without
/// creating or writing it.
pub(super) fn apply_in_view(db: &Database, path: &Path) -> Result<(), OpenError> {
    let what = "reading the journal into a read view";
    let storage_error = |e: redb::Error| OpenError::Storage {
        context: what,
        source: Box::new(e),
    };
    // Only a file of format 2 or 3 has ever had a journal.
    let Some(format) = file_format(db, path)? else {
        return Ok(());
    };
    let frames = match stored_journal(db, format, path)? {
        Some(stored) if !stored.clean => frames_beside(&stored, path)?,
        _ => return Ok(()),
    };
    if frames.is_empty() {
        return Ok(());
    }
    let txn = db.begin_write().map_err(|e| storage_error(e.into()))?;
    for (_, frame) in &frames {
        apply(&txn, frame, format == Format::V3).map_err(|e| e.open_error(path, what))?;
    }
    txn.commit().map_err(|e| storage_error(e.into()))
}

/// Marks durably whether the engine closed cleanly (set by the last
/// checkpoint of a shutdown, cleared when an engine opens the file).
pub(super) fn set_clean(db: &Database, clean: bool) -> Result<(), redb::Error> {
    let mut txn = db.begin_write()?;
    txn.set_durability(Durability::Immediate)?;
    {
        let mut table = txn.open_table(META)?;
        meta::write_clean(&mut table, clean)?;
    }
    txn.commit()?;
    Ok(())
}

/// Gives a database its first journal: a fresh id, stored durably, and an
/// emptied journal file (bytes already there cannot be this database's).
fn give_journal(db: &Database, storage: &JournalStorage) -> Result<[u8; 16], OpenError> {
    let what = "giving the database a journal";
    let storage_error = |e: redb::Error| OpenError::Storage {
        context: what,
        source: Box::new(e),
    };
    let id = super::journal::new_id(storage.name.as_bytes());
    storage
        .backend
        .set_len(0)
        .map_err(|source| OpenError::Storage {
            context: what,
            source: Box::new(source),
        })?;
    let mut txn = db.begin_write().map_err(|e| storage_error(e.into()))?;
    txn.set_durability(Durability::Immediate)
        .map_err(|e| storage_error(e.into()))?;
    {
        let mut table = txn.open_table(META).map_err(|e| storage_error(e.into()))?;
        // Marked clean: nothing is pending yet, and a crash before the
        // first anchor is written must not read as a lost journal.
        meta::write_journal(&mut table, &id).map_err(|e| storage_error(e.into()))?;
    }
    txn.commit().map_err(|e| storage_error(e.into()))?;
    Ok(id)
}

/// How many frames the journal beside `path` holds that the database (a
/// file of `format`) does not (for a read-only open, which cannot apply
/// them). Writes nothing. After a clean close the journal is not read: the
/// file alone is enough.
pub(crate) fn pending_frames(
    db: &impl ReadableDatabase,
    format: Format,
    path: &Path,
) -> Result<usize, OpenError> {
    match stored_journal(db, format, path)? {
        Some(stored) if !stored.clean => frames_beside(&stored, path).map(|f| f.len()),
        _ => Ok(0),
    }
}

/// Applies one frame's changes, and its counters. `partitioned`: the
/// file is of format 3, whose record, step and log changes carry slot keys
/// into its partitioned tables (`partition/slot.rs`).
pub(super) fn apply(
    txn: &WriteTransaction,
    frame: &Frame,
    partitioned: bool,
) -> Result<(), MetaError> {
    let (records_def, steps_def, history_def) = if partitioned {
        (catalog::RECORDS, catalog::STEPS, catalog::HISTORY)
    } else {
        (RECORDS, STEPS, HISTORY)
    };
    let mut records = txn.open_table(records_def)?;
    let mut leases = txn.open_table(LEASES)?;
    let mut recovery = txn.open_table(RECOVERY)?;
    let mut expiry = txn.open_table(EXPIRY)?;
    let mut outbox = txn.open_table(OUTBOX)?;
    let mut entities = txn.open_table(ENTITIES)?;
    let mut steps = txn.open_table(steps_def)?;
    let mut history = txn.open_table(history_def)?;
    let mut table = txn.open_table(META)?;
    for logged in &frame.changes {
        // A derived change (format 3) stands for the plain changes the
        // live path made, which the record stored under its key tells.
        let expanded;
        let plain = match logged.derived_key() {
            Some(key) => {
                if !partitioned {
                    return Err(misfit(format!(
                        "a format-2 file's journal holds format 3's change {logged:?}"
                    )));
                }
                let base = records.get(key.as_slice())?.map(|v| v.value().to_vec());
                expanded = expand(logged, base.as_deref()).map_err(|e| misfit(e.to_string()))?;
                expanded.as_slice()
            }
            None => std::slice::from_ref(logged),
        };
        for change in plain {
            apply_plain(
                txn,
                change,
                &mut AppliedTables {
                    records: &mut records,
                    leases: &mut leases,
                    recovery: &mut recovery,
                    expiry: &mut expiry,
                    outbox: &mut outbox,
                    entities: &mut entities,
                    steps: &mut steps,
                    history: &mut history,
                },
            )?;
        }
    }
    // Counters never go back (a frame holds them after its batch).
    for (counter, in_frame) in [
        (Counter::NextToken, frame.next_token),
        (Counter::NextOutboxSeq, frame.next_outbox),
    ] {
        let stored = meta::required_counter(&table, counter)?;
        meta::write_counter(&mut table, counter, stored.max(in_frame))?;
    }
    Ok(())
}

/// The engine tables a frame's changes are applied to.
struct AppliedTables<'a, 't> {
    records: &'a mut Table<'t, &'static [u8], &'static [u8]>,
    leases: &'a mut Table<'t, (u64, &'static [u8]), ()>,
    recovery: &'a mut Table<'t, (u64, &'static [u8]), ()>,
    expiry: &'a mut Table<'t, (u64, &'static [u8]), ()>,
    outbox: &'a mut Table<'t, u64, &'static [u8]>,
    entities: &'a mut Table<'t, &'static str, &'static [u8]>,
    steps: &'a mut Table<'t, (&'static [u8], &'static str), &'static [u8]>,
    history: &'a mut Table<'t, (&'static [u8], u32), &'static [u8]>,
}

/// The journal does not fit the file: reported as corruption.
fn misfit(what: impl std::fmt::Display) -> MetaError {
    MetaError::Storage(redb::Error::Corrupted(format!(
        "{what}: the journal does not fit the file"
    )))
}

/// Applies one plain change (a derived one is refused: [`expand`] turns
/// it into plain ones first).
fn apply_plain(
    txn: &WriteTransaction,
    change: &Change,
    t: &mut AppliedTables<'_, '_>,
) -> Result<(), MetaError> {
    let AppliedTables {
        records,
        leases,
        recovery,
        expiry,
        outbox,
        entities,
        steps,
        history,
    } = t;
    {
        match change {
            Change::PutRecord { key, value } => {
                records.insert(key.as_slice(), value.as_slice())?;
            }
            Change::DelRecord { key } => {
                records.remove(key.as_slice())?;
            }
            Change::PutIndex { index, at, key } => {
                let indexes = [&mut **leases, &mut **recovery, &mut **expiry];
                pick(indexes, *index).insert((*at, key.as_slice()), ())?;
            }
            Change::DelIndex { index, at, key } => {
                let indexes = [&mut **leases, &mut **recovery, &mut **expiry];
                pick(indexes, *index).remove((*at, key.as_slice()))?;
            }
            Change::PutOutbox { seq, value } => {
                outbox.insert(*seq, value.as_slice())?;
            }
            Change::DelOutbox { seq } => {
                outbox.remove(*seq)?;
            }
            Change::PutEntity { id, value } => {
                entities.insert(id.as_str(), value.as_slice())?;
            }
            Change::PutStep { key, name, value } => {
                steps.insert((key.as_slice(), name.as_str()), value.as_slice())?;
            }
            Change::DelStep { key, name } => {
                steps.remove((key.as_slice(), name.as_str()))?;
            }
            Change::PutHistory { key, seq, value } => {
                history.insert((key.as_slice(), *seq), value.as_slice())?;
            }
            Change::DelHistory { key, seq } => {
                history.remove((key.as_slice(), *seq))?;
            }
            Change::PutDeadLetter { seq, value } => {
                txn.open_table(DEAD_LETTERS)?
                    .insert(*seq, value.as_slice())?;
            }
            Change::DelDeadLetter { seq } => {
                txn.open_table(DEAD_LETTERS)?.remove(*seq)?;
            }
            Change::PutPartition { partition, value } => {
                txn.open_table(PARTITIONS)?
                    .insert(*partition, value.as_slice())?;
            }
            Change::DelPartition { partition } => {
                txn.open_table(PARTITIONS)?.remove(*partition)?;
            }
            Change::PutFilter { partition, value } => {
                txn.open_table(FILTERS)?
                    .insert(*partition, value.as_slice())?;
            }
            Change::DelFilter { partition } => {
                txn.open_table(FILTERS)?.remove(*partition)?;
            }
            Change::MergeDrop { .. } | Change::MergeCopy { .. } => {
                let mut t = MergeTables {
                    records,
                    steps,
                    history,
                };
                replay_merge_step(txn, &mut t, change)?;
            }
            Change::PutNewRecord { .. }
            | Change::PutRecordDelta { .. }
            | Change::DelIndexedRecord { .. } => {
                return Err(misfit(format!("{change:?} was not expanded")));
            }
        }
    }
    Ok(())
}

/// Runs again a merge's copy or drop step (`partition/merge.rs`): the
/// merge sources are the partitions whose rows say so, as they did when
/// the step ran, so the step copies (or deletes) the same records.
///
/// # Errors
///
/// A storage error, also when the step copies or deletes a different
/// count (the journal does not fit the file: reported as corruption).
fn replay_merge_step(
    txn: &WriteTransaction,
    t: &mut MergeTables<'_, '_>,
    change: &Change,
) -> Result<(), MetaError> {
    match change {
        Change::MergeDrop {
            partition,
            limit,
            records,
        } => {
            let limit = usize::try_from(*limit).unwrap_or(usize::MAX);
            let step = merge::drop_step(t, *partition, limit, &|| false)?;
            if step.records != *records {
                return Err(misfit(format!(
                    "the journal's drop step deletes {records} records of partition \
                     {partition}, but {} are there",
                    step.records
                )));
            }
        }
        Change::MergeCopy {
            target,
            after,
            copied,
        } => {
            let mut sources = Vec::new();
            let rows = txn.open_table(PARTITIONS)?;
            for entry in redb::ReadableTable::iter(&rows)? {
                let (k, v) = entry?;
                let partition = k.value();
                if PartitionRow::decode(partition, v.value())
                    .is_ok_and(|row| row.state == PartitionState::MergeSource)
                {
                    sources.push(partition);
                }
            }
            let limit = usize::try_from(*copied).unwrap_or(usize::MAX);
            let step = merge::copy_step(t, *target, &sources, after.as_deref(), limit, &|| false)?;
            if step.keys.len() as u64 != *copied {
                return Err(misfit(format!(
                    "the journal's merge step copies {copied} records into partition \
                     {target}, but {} are left to copy",
                    step.keys.len()
                )));
            }
        }
        _ => {}
    }
    Ok(())
}

/// The index table `which` names, out of (leases, recovery, expiry).
fn pick<T>([leases, recovery, expiry]: [T; 3], which: IndexTable) -> T {
    match which {
        IndexTable::Leases => leases,
        IndexTable::Recovery => recovery,
        IndexTable::Expiry => expiry,
    }
}
