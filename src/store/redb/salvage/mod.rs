//! Salvage: copies what still reads of a damaged database file into a new
//! one, and lists every key it could not copy.
//!
//! The damaged file is read through a view that writes nothing to it and
//! skips redb's whole-file integrity check (`open::open_salvage_view`),
//! each step in its own read transaction with panics inside redb
//! contained. Each table is walked forward from its start; where damage
//! stops the walk, it is walked backward from its end (down to the last
//! key read, or the one before it when the walk stopped at a key out of
//! order: either may be the damaged one), and the records
//! table again forward from every key an index entry or a journal frame
//! names, with a lookup of each such key. A walk stops at an error, a
//! panic, or a key out of order (a damaged page read as another); a walk
//! that meets fewer entries than the table counts skipped some silently.
//! What lies between the two walks' ends, and was not found another way,
//! is a range of unknown keys.
//!
//! A value is copied only as stored (its bytes unchanged) and only if it
//! passes its checksum. A record is copied only if the index entry its
//! state names was found, or if no index entry names its key at all and
//! its index could not be walked whole: a damaged tree page can point to
//! an older copy of a page, whose values still pass their checksums, and
//! the index then puts the key elsewhere. The journal's frames beyond the
//! last checkpoint are read as a writable open reads them (frame by frame
//! where that read refuses the journal: `journal/salvage.rs`) and applied
//! on top, so what they hold is copied even where the file's own pages are
//! damaged; a key last written before a frame that could not be read is
//! listed, not copied. The new file is written through a
//! temporary file beside it, renamed into place once committed.
//!
//! A format-3 file (partitioned records, docs/format3-plan.md) is read
//! with the same care, its records, steps and log under slot keys
//! `[partition][record key]` (`partitioned.rs`): the record key an index
//! entry or a frame names is looked for in every partition the file shows
//! (its rows, its filters, its frames, and the prefixes every walk met, so
//! a damaged rows table hides none), and frames are applied with the slot
//! keys they carry. A record key found in two partitions is damage: the
//! copy the journal or the index entries point to is taken, else the key
//! is listed. The new file is of format 3 too, its records in one sealed
//! partition built as a migration from format 2 builds it (`write.rs`);
//! rows and filters are built anew, never copied. A format-2 file is
//! salvaged into format 2.

mod frames;
mod gathered;
mod partitioned;
mod walk;
mod write;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use redb::ReadableDatabase;

use crate::error::{OpenError, Result};
use crate::salvage::{Lost, SalvageReport};
use crate::store::record::hex;

use super::journal::{Change, Frame, JournalStorage};
use super::meta::{self, Counter, Format};
use super::open::{open_salvage_view, SalvageView};
use super::partition::{catalog, slot};
use super::tables::{ENTITIES, HISTORY, OUTBOX, RECORDS, STEPS};

use self::frames::{frames_one_by_one, settle_counter, Work};
use self::gathered::{Entries, Gathered, IndexEntry, Reasons, StoredCounter};
use self::walk::{look_up, walk_index, walk_records, walk_table, BytesTable, Gap, Seeds};
use self::write::{temporary, write_new};

/// Copies what still reads of the database at `damaged` into a new file at
/// `new` (see the module docs); never writes to `damaged` or its journal.
pub(crate) fn salvage(damaged: &Path, new: &Path) -> Result<SalvageReport, OpenError> {
    refuse_existing(new)?;
    refuse_existing(&JournalStorage::path_of(new))?;
    // The new file is written through `NEW.salvaging`, which is removed
    // first (an earlier salvage's leftover): never when that is the
    // damaged file or its journal.
    let tmp = temporary(new);
    for input in [damaged.to_path_buf(), JournalStorage::path_of(damaged)] {
        if same_file(&tmp, &input) {
            return Err(OpenError::SalvageTargetExists { path: tmp });
        }
    }
    let view = super::open_contained(damaged, || open_salvage_view(damaged))?;
    let gathered = match &view {
        SalvageView::Clean(db) => gather(db, damaged),
        SalvageView::Recovered(db) => gather(db, damaged),
    };
    // After a panic inside redb its `Drop` may panic on poisoned locks.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(view)));
    let gathered = gathered?;
    write_new(&gathered, new)?;
    Ok(gathered.report)
}

/// Refuses an existing, non-empty `path`.
fn refuse_existing(path: &Path) -> Result<(), OpenError> {
    match std::fs::metadata(path) {
        Ok(m) if m.len() > 0 => Err(OpenError::SalvageTargetExists {
            path: path.to_path_buf(),
        }),
        _ => Ok(()),
    }
}

/// Whether `a` and `b` both exist and are the same file (links followed).
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Reads everything that can be read of `db` (the file at `path`).
fn gather(db: &impl ReadableDatabase, path: &Path) -> Result<Gathered, OpenError> {
    let mut g = Gathered::default();
    let (format, stored_token, stored_outbox) = read_meta_values(db, path, &mut g)?;
    let format3 = format == Format::V3;
    g.partitioned = format3;
    let records_def = if format3 { catalog::RECORDS } else { RECORDS };
    let (index, index_gaps) = walk_index(db);
    let outbox = walk_table(
        db,
        OUTBOX,
        |(k, v): (redb::AccessGuard<'_, u64>, redb::AccessGuard<'_, &[u8]>)| {
            (k.value(), v.value().to_vec())
        },
    );
    let entities = walk_table(
        db,
        ENTITIES,
        |(k, v): (redb::AccessGuard<'_, &str>, redb::AccessGuard<'_, &[u8]>)| {
            (k.value().to_string(), v.value().to_vec())
        },
    );
    let (steps, history) = walk_step_tables(db, format3);
    let (frames, stale_before) = read_frames(db, path, format, &mut g.report.lost);
    // Format 2: every key an index entry or a frame names is a record key.
    // Format 3: frames name slot keys, and a record key an index entry
    // names is looked for in every partition the file shows.
    let named = named_keys(&index, &frames, format3);
    let known = if format3 {
        partitioned::known_partitions(db, &frames, &steps.entries, &history.entries)
    } else {
        BTreeSet::new()
    };
    let seeds = |gap: Option<&Gap<Vec<u8>>>, walked: &Entries| {
        if format3 {
            partitioned::seeds(&named, &known, gap, walked)
        } else {
            named.record_keys.clone()
        }
    };
    let (records, record_gap, failed) = read_records(db, records_def, &seeds);
    // Format 3's failed lookups are weighed per record key (`unslot`).
    let (unreadable, failed) = if format3 {
        (Reasons::new(), failed)
    } else {
        (failed, Reasons::new())
    };
    let mut work = Work {
        records,
        index,
        outbox: outbox.entries,
        entities: entities.entries,
        unreadable,
        next_token: 0,
        next_outbox: 0,
        stale_entities: Vec::new(),
        steps: steps.entries,
        history: history.entries,
    };
    work.apply(&frames, stale_before);
    g.report.journal_frames = frames.len() as u64;
    let (steps_gap, history_gap) = if format3 {
        partitioned::unslot(&mut work, &frames, failed, &mut g.report.lost);
        (
            partitioned::unslot_gap(steps.gap),
            partitioned::unslot_gap(history.gap),
        )
    } else {
        (steps.gap, history.gap)
    };
    work.check_records(&index_gaps, &mut g);
    if let Some(gap) = record_gap {
        list_record_gap(gap, format3, &mut g.report.lost);
    }
    work.check_rest(outbox.gap, entities.gap, &mut g);
    work.check_steps(steps_gap, history_gap, &mut g);
    let lost = &mut g.report.lost;
    g.next_token = settle_counter(lost, "next_token", stored_token, work.next_token);
    g.next_outbox = settle_counter(lost, "next_outbox_seq", stored_outbox, work.next_outbox);
    g.report.records = g.records.len() as u64;
    g.report.outbox_messages = g.outbox.len() as u64;
    g.report.entities = g.entities.len() as u64;
    Ok(g)
}

/// The steps and history tables as far as they walk, keyed by record key
/// (format 2) or slot key (format 3, `partitioned`). Created on first
/// use: a file may not have them.
fn walk_step_tables(db: &impl ReadableDatabase, partitioned: bool) -> (StepsWalk, HistoryWalk) {
    let (steps_def, history_def) = if partitioned {
        (catalog::STEPS, catalog::HISTORY)
    } else {
        (STEPS, HISTORY)
    };
    let steps = walk_if_present(db, steps_def, |(k, v): StepEntry<'_, '_>| {
        let (rkey, name) = k.value();
        ((rkey.to_vec(), name.to_owned()), v.value().to_vec())
    });
    let history = walk_if_present(db, history_def, |(k, v): HistoryEntry<'_, '_>| {
        let (rkey, seq) = k.value();
        ((rkey.to_vec(), seq), v.value().to_vec())
    });
    (steps, history)
}

/// Lists the records walks' `gap` in `lost` (format 3, `partitioned`:
/// one range per partition it touches, by record key).
fn list_record_gap(gap: Gap<Vec<u8>>, partitioned: bool, lost: &mut Vec<Lost>) {
    if partitioned {
        lost.extend(partitioned::lost_range(&gap));
        return;
    }
    lost.push(Lost::Range {
        table: "records",
        after_hex: gap.after.map(|k| hex(&k)),
        before_hex: gap.before.map(|k| hex(&k)),
        reason: gap.reason,
    });
}

/// The keys the index entries and the journal's frames name.
#[derive(Default)]
pub(super) struct Named {
    /// Record keys: all of them in format 2; in format 3 those of index
    /// entries and of frames' changes (a slot key's record key too).
    pub(super) record_keys: BTreeSet<Vec<u8>>,
    /// Format 3: the slot keys frames name.
    pub(super) slots: BTreeSet<Vec<u8>>,
}

/// What `index` and `frames` name (`partitioned`: the file is of format
/// 3, its frames' record changes carry slot keys).
fn named_keys(index: &BTreeSet<IndexEntry>, frames: &[(u64, Frame)], partitioned: bool) -> Named {
    let mut named = Named {
        record_keys: index.iter().map(|(_, _, k)| k.clone()).collect(),
        slots: BTreeSet::new(),
    };
    for (_, frame) in frames {
        for change in &frame.changes {
            match (change.record_write(), change) {
                (Some((key, _)), _) if partitioned => {
                    if let Some((_, rkey)) = slot::split(key) {
                        named.record_keys.insert(rkey.to_vec());
                    }
                    named.slots.insert(key.clone());
                }
                (Some((key, _)), _)
                | (_, Change::PutIndex { key, .. } | Change::DelIndex { key, .. }) => {
                    named.record_keys.insert(key.clone());
                }
                _ => {}
            }
        }
    }
    named
}

/// The steps table's walk: (key, step name) → encoded step.
type StepsWalk = walk::Walked<(Vec<u8>, String), Vec<u8>>;
/// The history table's walk: (key, seq) → encoded log entry.
type HistoryWalk = walk::Walked<(Vec<u8>, u32), Vec<u8>>;

/// An entry of the steps table as a walk meets it.
type StepEntry<'k, 'v> = (
    redb::AccessGuard<'k, (&'static [u8], &'static str)>,
    redb::AccessGuard<'v, &'static [u8]>,
);
/// An entry of the history table as a walk meets it.
type HistoryEntry<'k, 'v> = (
    redb::AccessGuard<'k, (&'static [u8], u32)>,
    redb::AccessGuard<'v, &'static [u8]>,
);

/// [`walk_table`] of a table created on first use: none (and no gap) when
/// the file does not have it.
fn walk_if_present<K, V, KO, VO>(
    db: &impl ReadableDatabase,
    def: redb::TableDefinition<K, V>,
    own: impl Fn((redb::AccessGuard<'_, K>, redb::AccessGuard<'_, V>)) -> (KO, VO) + Copy,
) -> walk::Walked<KO, VO>
where
    K: redb::Key + 'static,
    V: redb::Value + 'static,
    KO: Ord + Clone,
{
    let absent = walk::guarded(|| {
        let txn = db.begin_read().map_err(|e| e.to_string())?;
        Ok(matches!(
            txn.open_table(def),
            Err(redb::TableError::TableDoesNotExist(_))
        ))
    });
    if absent == Ok(true) {
        return walk::Walked {
            entries: BTreeMap::new(),
            gap: None,
        };
    }
    walk_table(db, def, own)
}

/// The file's format, its two counters and (into `g`) its expiry
/// settings; what cannot be read is listed in `g`.
fn read_meta_values(
    db: &impl ReadableDatabase,
    path: &Path,
    g: &mut Gathered,
) -> Result<(Format, StoredCounter, StoredCounter), OpenError> {
    let lost = &mut g.report.lost;
    let format = match meta::file_format(db, path) {
        Ok(Some(format)) => format,
        Ok(None) => {
            return Err(OpenError::NoEngineTables {
                path: path.to_path_buf(),
            })
        }
        // A file of an unknown or pre-release format is not guessed at.
        Err(e @ (OpenError::UnsupportedFormat { .. } | OpenError::PreReleaseFormat { .. })) => {
            return Err(e)
        }
        Err(e) => {
            lost.push(Lost::MetaValue {
                key: meta::Key::FormatVersion.name().to_string(),
                reason: format!("unreadable ({e}); the values are read as format 2"),
            });
            Format::V2
        }
    };
    let counter = |counter: Counter| {
        meta::read_meta(db, path, "reading a counter for salvage", |t| {
            meta::read_counter(t, counter, format)
        })
        .map(Option::flatten)
    };
    let stored_token = counter(Counter::NextToken);
    let stored_outbox = counter(Counter::NextOutboxSeq);
    g.expiry = match meta::stored_expiry(db, format, path) {
        Ok(expiry) => expiry,
        Err(e) => {
            lost.push(Lost::MetaValue {
                key: "ttl_ms, expiry_policy".into(),
                reason: format!("unreadable ({e}); not copied: the next app stores its own"),
            });
            None
        }
    };
    Ok((format, stored_token, stored_outbox))
}

/// The journal's frames beyond the last checkpoint, and the last LSN that
/// could not be read among them (0: none): a key whose last write found
/// comes before it may have a later state in it.
fn read_frames(
    db: &impl ReadableDatabase,
    path: &Path,
    format: Format,
    lost: &mut Vec<Lost>,
) -> (Vec<(u64, Frame)>, u64) {
    match meta::read_meta(db, path, "reading the journal position", |t| {
        meta::read_journal(t, format)
    }) {
        Ok(Some(Some(stored))) if !stored.clean => {
            match super::recover::frames_beside(&stored, path) {
                Ok(frames) => (frames, 0),
                Err(e) => {
                    let (frames, last_missing, detail) = frames_one_by_one(path, &stored);
                    lost.push(Lost::Journal {
                        detail: format!("{e}; {detail}"),
                    });
                    (frames, last_missing)
                }
            }
        }
        Ok(_) => (Vec::new(), 0),
        Err(e) => {
            lost.push(Lost::Journal {
                detail: format!("the meta values naming the journal are unreadable: {e}"),
            });
            (Vec::new(), 0)
        }
    }
}

/// The records table `def` as far as it reads: walked, then from every
/// key `seeds` names; with the stretch no walk passed, and the keys whose
/// lookup failed.
fn read_records(
    db: &impl ReadableDatabase,
    def: BytesTable,
    seeds: Seeds<'_>,
) -> (Entries, Option<Gap<Vec<u8>>>, Reasons) {
    let (mut entries, gap, mut named) = match walk_records(db, def, seeds) {
        Ok((walked, named)) => (walked.entries, walked.gap, named),
        Err(reason) => {
            let gap = Gap {
                after: None,
                before: None,
                reason,
            };
            let named = seeds(Some(&gap), &BTreeMap::new());
            (BTreeMap::new(), Some(gap), named)
        }
    };
    let mut unreadable = BTreeMap::new();
    named.retain(|k| !entries.contains_key(k));
    if !named.is_empty() {
        let in_gap = |k: &Vec<u8>| gap.as_ref().is_some_and(|gap| gap.holds(k));
        let (found, failed) = look_up(db, def, &named, &in_gap);
        entries.extend(found);
        unreadable.extend(failed);
    }
    (entries, gap, unreadable)
}
