//! Salvage: copies what still reads of a damaged database file into a new
//! one, and lists every key it could not copy.
//!
//! The damaged file is read through a view that writes nothing to it and
//! skips redb's whole-file integrity check (`open::open_salvage_view`),
//! each step in its own read transaction with panics inside redb
//! contained. Each table is walked forward from its start; where damage
//! stops the walk, it is walked backward from its end, and the records
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

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use redb::{Durability, ReadableDatabase, ReadableTable, ReadableTableMetadata, StorageError};

use crate::error::{OpenError, Result};
use crate::policy::ExpiryPolicy;
use crate::salvage::{Lost, SalvageReport};
use crate::store::codec;
use crate::store::config::StoreConfig;
use crate::store::record::hex;

use super::journal::{salvage_frames, Change, Frame, IndexTable, JournalStorage};
use super::meta::{self, Counter, Format, OpenContext};
use super::open::{open_path, open_salvage_view, prepare, SalvageView};
use super::tables::{ENTITIES, EXPIRY, LEASES, META, OUTBOX, RECORDS, RECOVERY};

/// Added to a counter past every value found when its stored value is
/// unreadable: tokens or sequence numbers handed out for records that
/// were lost must not be handed out again.
const COUNTER_MARGIN: u64 = 1 << 32;

/// An index entry: (index name, instant ms, record key).
type IndexEntry = (&'static str, u64, Vec<u8>);

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

/// The temporary file the new file `new` is written through.
fn temporary(new: &Path) -> PathBuf {
    let mut name = new.as_os_str().to_owned();
    name.push(".salvaging");
    PathBuf::from(name)
}

/// Whether `a` and `b` both exist and are the same file (links followed).
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// What was read of the damaged file, checked and ready to write.
#[derive(Default)]
struct Gathered {
    records: BTreeMap<Vec<u8>, Vec<u8>>,
    index: BTreeSet<IndexEntry>,
    outbox: BTreeMap<u64, Vec<u8>>,
    entities: BTreeMap<String, Vec<u8>>,
    next_token: u64,
    next_outbox: u64,
    expiry: Option<(u64, ExpiryPolicy)>,
    report: SalvageReport,
}

/// Runs `step`, turning a panic inside redb into an error message.
fn guarded<T>(
    step: impl FnOnce() -> std::result::Result<T, String>,
) -> std::result::Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(step)).unwrap_or_else(|panic| {
        Err(format!(
            "the storage library panicked: {}",
            super::writer::panic_message(panic.as_ref())
        ))
    })
}

/// One table's entries, as far as walks reached.
struct Walked<K, V> {
    entries: BTreeMap<K, V>,
    /// Where damage stopped the walks.
    gap: Option<Gap<K>>,
}

/// A stretch of a table no walk could pass.
#[derive(Clone)]
struct Gap<K> {
    /// The last key read before it (`None`: the table's start).
    after: Option<K>,
    /// The first key read after it (`None`: the table's end).
    before: Option<K>,
    /// What stopped the walk.
    reason: String,
}

impl<K: Ord> Gap<K> {
    /// Whether `key` lies in the stretch.
    fn holds(&self, key: &K) -> bool {
        self.after.as_ref().is_none_or(|a| key > a) && self.before.as_ref().is_none_or(|b| key < b)
    }
}

/// Each index table's name, and the stretch of it no walk passed.
type IndexGaps = Vec<(&'static str, Option<Gap<(u64, Vec<u8>)>>)>;

/// Walks entries from `iter` into `out` until it ends, fails, panics,
/// meets a key out of order, or `stop` says so. Returns why it stopped
/// early (`None`: it reached the end or `stop`).
fn walk_into<T, K: Ord + Clone, V, I>(
    make: impl FnOnce() -> std::result::Result<I, StorageError>,
    own: impl Fn(T) -> (K, V),
    ascending: bool,
    stop: impl Fn(&K) -> bool,
    out: &mut Vec<(K, V)>,
) -> Option<String>
where
    I: Iterator<Item = std::result::Result<T, StorageError>>,
{
    guarded(|| {
        let iter = make().map_err(|e| e.to_string())?;
        let mut last: Option<K> = None;
        for entry in iter {
            let (k, v) = own(entry.map_err(|e| e.to_string())?);
            if stop(&k) {
                return Ok(());
            }
            if last
                .as_ref()
                .is_some_and(|l| if ascending { &k <= l } else { &k >= l })
            {
                return Err("keys out of order (a damaged page)".to_string());
            }
            last = Some(k.clone());
            out.push((k, v));
        }
        Ok(())
    })
    .err()
}

/// Walks a table forward; where that stops early, backward from its end
/// down to the forward walk's last key.
fn walk_both<T, K: Ord + Clone, V, I, R>(
    forward: impl FnOnce() -> std::result::Result<I, StorageError>,
    backward: impl FnOnce() -> std::result::Result<R, StorageError>,
    own: impl Fn(T) -> (K, V) + Copy,
) -> Walked<K, V>
where
    I: Iterator<Item = std::result::Result<T, StorageError>>,
    R: Iterator<Item = std::result::Result<T, StorageError>>,
{
    let mut ahead = Vec::new();
    let stopped = walk_into(forward, own, true, |_| false, &mut ahead);
    let after = ahead.last().map(|(k, _)| k.clone());
    let mut entries: BTreeMap<K, V> = ahead.into_iter().collect();
    let Some(reason) = stopped else {
        return Walked { entries, gap: None };
    };
    let mut behind = Vec::new();
    let bound = after.clone();
    walk_into(
        backward,
        own,
        false,
        |k| bound.as_ref().is_some_and(|a| k <= a),
        &mut behind,
    );
    let before = behind.last().map(|(k, _)| k.clone());
    for (k, v) in behind {
        entries.entry(k).or_insert(v);
    }
    Walked {
        entries,
        gap: Some(Gap {
            after,
            before,
            reason,
        }),
    }
}

/// Reads everything that can be read of `db` (the file at `path`).
fn gather(db: &impl ReadableDatabase, path: &Path) -> Result<Gathered, OpenError> {
    let mut g = Gathered::default();
    let (format, stored_token, stored_outbox) = read_meta_values(db, path, &mut g)?;
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
    let (frames, stale_before) = read_frames(db, path, format, &mut g.report.lost);
    let (records, record_gap, unreadable) = read_records(db, &index, &frames);
    let mut work = Work {
        records,
        index,
        outbox: outbox.entries,
        entities: entities.entries,
        unreadable,
        next_token: 0,
        next_outbox: 0,
        stale_entities: Vec::new(),
    };
    work.apply(&frames, stale_before);
    g.report.journal_frames = frames.len() as u64;
    work.check_records(&index_gaps, &mut g);
    if let Some(Gap {
        after,
        before,
        reason,
    }) = record_gap
    {
        g.report.lost.push(Lost::Range {
            table: "records",
            after_hex: after.map(|k| hex(&k)),
            before_hex: before.map(|k| hex(&k)),
            reason,
        });
    }
    work.check_rest(outbox.gap, entities.gap, &mut g);
    let lost = &mut g.report.lost;
    g.next_token = settle_counter(lost, "next_token", stored_token, work.next_token);
    g.next_outbox = settle_counter(lost, "next_outbox_seq", stored_outbox, work.next_outbox);
    g.report.records = g.records.len() as u64;
    g.report.outbox_messages = g.outbox.len() as u64;
    g.report.entities = g.entities.len() as u64;
    Ok(g)
}

/// A stored counter: its value (`None`: absent), or why it is unreadable.
type StoredCounter = std::result::Result<Option<u64>, OpenError>;

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

/// Record key → stored value.
type Entries = BTreeMap<Vec<u8>, Vec<u8>>;
/// Record key → why it was not copied.
type Reasons = BTreeMap<Vec<u8>, String>;

/// The records table as far as it reads: walked, then from every key an
/// index entry or a frame names; with the stretch no walk passed, and the
/// keys whose lookup failed.
fn read_records(
    db: &impl ReadableDatabase,
    index: &BTreeSet<IndexEntry>,
    frames: &[(u64, Frame)],
) -> (Entries, Option<Gap<Vec<u8>>>, Reasons) {
    let mut named: BTreeSet<Vec<u8>> = index.iter().map(|(_, _, k)| k.clone()).collect();
    for (_, frame) in frames {
        for change in &frame.changes {
            if let Change::PutRecord { key, .. }
            | Change::DelRecord { key }
            | Change::PutIndex { key, .. }
            | Change::DelIndex { key, .. } = change
            {
                named.insert(key.clone());
            }
        }
    }
    let (mut entries, gap) = match walk_records(db, &named) {
        Ok(walked) => (walked.entries, walked.gap),
        Err(reason) => (
            BTreeMap::new(),
            Some(Gap {
                after: None,
                before: None,
                reason,
            }),
        ),
    };
    let mut unreadable = BTreeMap::new();
    named.retain(|k| !entries.contains_key(k));
    if !named.is_empty() {
        let in_gap = |k: &Vec<u8>| gap.as_ref().is_some_and(|gap| gap.holds(k));
        let (found, failed) = look_up(db, &named, &in_gap);
        entries.extend(found);
        unreadable.extend(failed);
    }
    (entries, gap, unreadable)
}

/// What was read, while frames are applied and values checked.
struct Work {
    records: Entries,
    index: BTreeSet<IndexEntry>,
    outbox: BTreeMap<u64, Vec<u8>>,
    entities: BTreeMap<String, Vec<u8>>,
    unreadable: Reasons,
    next_token: u64,
    next_outbox: u64,
    /// Entities not copied: last written before an unreadable frame (LSN).
    stale_entities: Vec<(String, u64)>,
}

/// Why a value last written before an unreadable frame is not copied.
fn stale(lsn: u64) -> String {
    format!(
        "last written in journal frame {lsn}, before frames that could not be read: \
         its latest state may be in them"
    )
}

impl Work {
    /// Applies the frames' changes in order; then drops what was last
    /// written before `stale_before` (an unreadable frame).
    fn apply(&mut self, frames: &[(u64, Frame)], stale_before: u64) {
        // Record keys and entities by the LSN of their last write found.
        let mut last_write: BTreeMap<Vec<u8>, u64> = BTreeMap::new();
        let mut last_entity_write: BTreeMap<String, u64> = BTreeMap::new();
        for (lsn, frame) in frames {
            for change in &frame.changes {
                match change {
                    Change::PutRecord { key, value } => {
                        last_write.insert(key.clone(), *lsn);
                        self.unreadable.remove(key);
                        self.records.insert(key.clone(), value.clone());
                    }
                    Change::DelRecord { key } => {
                        last_write.insert(key.clone(), *lsn);
                        self.unreadable.remove(key);
                        self.records.remove(key);
                    }
                    Change::PutIndex {
                        index: which,
                        at,
                        key,
                    } => {
                        self.index.insert((index_name(*which), *at, key.clone()));
                    }
                    Change::DelIndex {
                        index: which,
                        at,
                        key,
                    } => {
                        self.index.remove(&(index_name(*which), *at, key.clone()));
                    }
                    Change::PutOutbox { seq, value } => {
                        self.outbox.insert(*seq, value.clone());
                    }
                    Change::DelOutbox { seq } => {
                        self.outbox.remove(seq);
                    }
                    Change::PutEntity { id, value } => {
                        last_entity_write.insert(id.clone(), *lsn);
                        self.entities.insert(id.clone(), value.clone());
                    }
                }
            }
            self.next_token = self.next_token.max(frame.next_token);
            self.next_outbox = self.next_outbox.max(frame.next_outbox);
        }
        for (key, lsn) in last_write.into_iter().filter(|(_, l)| *l < stale_before) {
            self.records.remove(&key);
            self.unreadable.insert(key, stale(lsn));
        }
        for (id, lsn) in last_entity_write
            .into_iter()
            .filter(|(_, l)| *l < stale_before)
        {
            self.entities.remove(&id);
            self.stale_entities.push((id, lsn));
        }
    }

    /// Moves into `g` each record that decodes and sits where its index
    /// entry says, with that entry; lists the others.
    fn check_records(&mut self, index_gaps: &IndexGaps, g: &mut Gathered) {
        // Where the index tables put each key; and the tables holding an
        // entry whose key bytes are not a key at all (a damaged page read
        // as entries): their other entries may be missing unnoticed.
        let mut placed: BTreeMap<Vec<u8>, Vec<(&'static str, u64)>> = BTreeMap::new();
        let mut garbled = BTreeSet::new();
        for (name, at, key) in &self.index {
            placed.entry(key.clone()).or_default().push((name, *at));
            if crate::key::IdempotencyKey::from_record_key(key).is_none() {
                garbled.insert(*name);
            }
        }
        for (key, value) in std::mem::take(&mut self.records) {
            let rec = match codec::decode(&key, &value) {
                Ok(rec) => rec,
                Err(e) => {
                    self.unreadable.insert(key, format!("does not decode: {e}"));
                    continue;
                }
            };
            let (name, at) = rec.index();
            let entry = (name, at, key.clone());
            let unchecked = index_gaps.iter().any(|(which, gap)| {
                *which == name
                    && gap
                        .as_ref()
                        .is_some_and(|gap| gap.holds(&(at, key.clone())))
            });
            // An entry that puts the key elsewhere says the record may be
            // an older copy; no entry at all is trusted only where the
            // index could not be walked.
            let unchecked = unchecked || garbled.contains(name);
            let elsewhere = placed.contains_key(&key);
            if !self.index.contains(&entry) && (elsewhere || !unchecked) {
                let reason = if elsewhere {
                    format!(
                        "its state is not matched by the {name} index entry at {at} ms it needs \
                         (it may be an older copy of the record)"
                    )
                } else {
                    format!("no index entry names it (its state needs one in {name} at {at} ms)")
                };
                self.unreadable.insert(key, reason);
                continue;
            }
            self.next_token = self.next_token.max(rec.token.saturating_add(1));
            g.records.insert(key, value);
            // Only the entry each copied record needs (a stray one is not
            // copied).
            g.index.insert(entry);
        }
        for (name, at, key) in &self.index {
            if !g.records.contains_key(key) && !self.unreadable.contains_key(key) {
                self.unreadable.insert(
                    key.clone(),
                    format!("named by the {name} index entry at {at} ms, but no record was found"),
                );
            }
        }
        for (key, reason) in std::mem::take(&mut self.unreadable) {
            g.report.lost.push(Lost::Record {
                key_hex: hex(&key),
                reason,
            });
        }
    }

    /// Moves into `g` each outbox message and entity that decodes; lists
    /// the others and the stretches no walk passed.
    fn check_rest(
        &mut self,
        outbox_gap: Option<Gap<u64>>,
        entities_gap: Option<Gap<String>>,
        g: &mut Gathered,
    ) {
        let lost = &mut g.report.lost;
        for (seq, value) in std::mem::take(&mut self.outbox) {
            match codec::decode_outbox(seq, &value) {
                Ok(_) => {
                    self.next_outbox = self.next_outbox.max(seq.saturating_add(1));
                    g.outbox.insert(seq, value);
                }
                Err(e) => lost.push(Lost::OutboxMessage {
                    seq: Some(seq),
                    reason: format!("does not decode: {e}"),
                }),
            }
        }
        if let Some(gap) = outbox_gap {
            let end = |s: Option<u64>| s.map_or_else(|| "the end".to_string(), |s| format!("#{s}"));
            lost.push(Lost::OutboxMessage {
                seq: None,
                reason: format!(
                    "messages between {} and {} ({})",
                    end(gap.after),
                    end(gap.before),
                    gap.reason
                ),
            });
        }
        for (id, value) in std::mem::take(&mut self.entities) {
            match codec::decode_entity(&id, &value) {
                Ok(_) => {
                    g.entities.insert(id, value);
                }
                Err(e) => lost.push(Lost::Entity {
                    entity: id,
                    reason: format!("does not decode: {e}"),
                }),
            }
        }
        for (id, lsn) in std::mem::take(&mut self.stale_entities) {
            lost.push(Lost::Entity {
                entity: id,
                reason: stale(lsn),
            });
        }
        if let Some(gap) = entities_gap {
            lost.push(Lost::Range {
                table: "entities",
                after_hex: gap.after.map(|k| hex(k.as_bytes())),
                before_hex: gap.before.map(|k| hex(k.as_bytes())),
                reason: gap.reason,
            });
        }
    }
}

/// The frames beyond the checkpoint in the journal beside `path` that
/// still check, read one by one (after the ordinary read refused the
/// journal), and what was missing.
fn frames_one_by_one(
    path: &Path,
    stored: &meta::StoredJournal,
) -> (Vec<(u64, Frame)>, u64, String) {
    let journal = JournalStorage::path_of(path);
    let bytes = match std::fs::read(&journal) {
        Ok(bytes) => bytes,
        Err(e) => return (Vec::new(), 0, format!("it cannot be read: {e}")),
    };
    let name = journal.display().to_string();
    match salvage_frames(&name, &bytes, stored.id, stored.lsn) {
        Ok(found) => {
            let mut detail = format!(
                "read frame by frame instead: {} frames beyond the checkpoint (LSN {}) taken in",
                found.frames.len(),
                stored.lsn
            );
            if !found.anchored {
                detail.push_str("; the checkpoint's own frame is missing");
            }
            for (first, last) in &found.missing {
                // Writing to a String cannot fail.
                let _ = write!(
                    detail,
                    "; frames {first} to {last} are unreadable, and the keys they changed unknown"
                );
            }
            let last_missing = found.missing.last().map_or(0, |(_, last)| *last);
            (found.frames, last_missing, detail)
        }
        Err(e) => (
            Vec::new(),
            0,
            format!("it cannot be read frame by frame either: {e}"),
        ),
    }
}

/// The counter for the new file: at least the stored one and past every
/// value found; if the stored one is unreadable, well past them.
fn settle_counter(lost: &mut Vec<Lost>, key: &str, stored: StoredCounter, found: u64) -> u64 {
    match stored {
        Ok(Some(stored)) => stored.max(found).max(1),
        Ok(_) => found.max(1),
        Err(e) => {
            let value = found.saturating_add(COUNTER_MARGIN);
            lost.push(Lost::MetaValue {
                key: key.to_string(),
                reason: format!("unreadable ({e}); set to {value}, past every value found"),
            });
            value
        }
    }
}

fn index_name(which: IndexTable) -> &'static str {
    match which {
        IndexTable::Leases => "leases",
        IndexTable::Recovery => "recovery",
        IndexTable::Expiry => "expiry",
    }
}

/// Walks the records table (`Err`: it could not be opened at all). Where
/// damage stops the walk, it goes on from every key in `named` that lies
/// in the stretch not yet walked, up to the backward walk's end.
fn walk_records(
    db: &impl ReadableDatabase,
    named: &BTreeSet<Vec<u8>>,
) -> std::result::Result<Walked<Vec<u8>, Vec<u8>>, String> {
    let own = |(k, v): (redb::AccessGuard<'_, &[u8]>, redb::AccessGuard<'_, &[u8]>)| {
        (k.value().to_vec(), v.value().to_vec())
    };
    let table = guarded(|| {
        let txn = db.begin_read().map_err(|e| e.to_string())?;
        txn.open_table(RECORDS).map_err(|e| e.to_string())
    })?;
    let mut walked = walk_both(|| table.iter(), || table.iter().map(Iterator::rev), own);
    short_walk(
        &mut walked,
        guarded(|| table.len().map_err(|e| e.to_string())),
    );
    if let Some(Gap { after, before, .. }) = walked.gap.clone() {
        let mut covered: Option<Vec<u8>> = after.clone();
        for seed in named {
            let beyond = covered.as_ref().is_none_or(|c| seed > c);
            let inside =
                after.as_ref().is_none_or(|a| seed > a) && before.as_ref().is_none_or(|b| seed < b);
            if !beyond || !inside {
                continue;
            }
            let mut more = Vec::new();
            let stop = before.clone();
            walk_into(
                || table.range::<&[u8]>(seed.as_slice()..),
                own,
                true,
                |k| stop.as_ref().is_some_and(|b| k >= b),
                &mut more,
            );
            covered = Some(more.last().map_or_else(|| seed.clone(), |(k, _)| k.clone()));
            // A value another walk already read is kept: a walk through a
            // damaged page may read a key with another key's bytes.
            for (k, v) in more {
                walked.entries.entry(k).or_insert(v);
            }
        }
    }
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(table)));
    Ok(walked)
}

/// Looks up each of `keys` in the records table: (found, why not).
/// Keys outside the records walks' gap that were not met by a walk are
/// missing (a lookup would only confirm it); those inside are looked up.
fn look_up(
    db: &impl ReadableDatabase,
    keys: &BTreeSet<Vec<u8>>,
    in_gap: &dyn Fn(&Vec<u8>) -> bool,
) -> (Entries, Reasons) {
    let mut found = BTreeMap::new();
    let mut failed = BTreeMap::new();
    let table = match guarded(|| {
        let txn = db.begin_read().map_err(|e| e.to_string())?;
        txn.open_table(RECORDS).map_err(|e| e.to_string())
    }) {
        Ok(table) => table,
        Err(reason) => {
            for key in keys {
                failed.insert(
                    key.clone(),
                    format!("the records table cannot be read: {reason}"),
                );
            }
            return (found, failed);
        }
    };
    for key in keys.iter().filter(|k| in_gap(k)) {
        match guarded(|| {
            Ok(table
                .get(key.as_slice())
                .map_err(|e| e.to_string())?
                .map(|v| v.value().to_vec()))
        }) {
            Ok(Some(value)) => {
                found.insert(key.clone(), value);
            }
            Ok(None) => {}
            Err(reason) => {
                failed.insert(key.clone(), format!("its lookup failed: {reason}"));
            }
        }
    }
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(table)));
    (found, failed)
}

/// Walks the three index tables: the entries found, and each table's
/// walk (for its gap).
fn walk_index(db: &impl ReadableDatabase) -> (BTreeSet<IndexEntry>, IndexGaps) {
    let mut all = BTreeSet::new();
    let mut walks = Vec::new();
    for (name, def) in [
        ("leases", LEASES),
        ("recovery", RECOVERY),
        ("expiry", EXPIRY),
    ] {
        let walked = walk_table(
            db,
            def,
            |(k, _): (
                redb::AccessGuard<'_, (u64, &[u8])>,
                redb::AccessGuard<'_, ()>,
            )| {
                let (at, key) = k.value();
                ((at, key.to_vec()), ())
            },
        );
        for (at, key) in walked.entries.keys() {
            all.insert((name, *at, key.clone()));
        }
        walks.push((name, walked.gap));
    }
    (all, walks)
}

/// Walks one table (forward, then backward from its end if damage
/// stopped the first walk). A table that cannot be opened is one gap.
fn walk_table<K, V, KO, VO>(
    db: &impl ReadableDatabase,
    def: redb::TableDefinition<K, V>,
    own: impl Fn((redb::AccessGuard<'_, K>, redb::AccessGuard<'_, V>)) -> (KO, VO) + Copy,
) -> Walked<KO, VO>
where
    K: redb::Key + 'static,
    V: redb::Value + 'static,
    KO: Ord + Clone,
{
    let table = match guarded(|| {
        let txn = db.begin_read().map_err(|e| e.to_string())?;
        txn.open_table(def).map_err(|e| e.to_string())
    }) {
        Ok(table) => table,
        Err(reason) => {
            return Walked {
                entries: BTreeMap::new(),
                gap: Some(Gap {
                    after: None,
                    before: None,
                    reason,
                }),
            }
        }
    };
    let mut walked = walk_both(|| table.iter(), || table.iter().map(Iterator::rev), own);
    short_walk(
        &mut walked,
        guarded(|| table.len().map_err(|e| e.to_string())),
    );
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(table)));
    walked
}

/// A walk that met fewer entries than the table counts (`len`) skipped
/// some without an error (a damaged page that lost children): which ones
/// cannot be known, so the whole table is a gap.
fn short_walk<K, V>(walked: &mut Walked<K, V>, len: std::result::Result<u64, String>) {
    if walked.gap.is_some() {
        return;
    }
    let met = walked.entries.len() as u64;
    let reason = match len {
        Ok(len) if met < len => {
            format!("the walks met {met} of the {len} entries the table counts (a damaged page)")
        }
        Ok(_) => return,
        Err(e) => format!("the table's entry count cannot be read: {e}"),
    };
    walked.gap = Some(Gap {
        after: None,
        before: None,
        reason,
    });
}

/// Writes `g` into a new database file at `new`, through a temporary file
/// beside it.
fn write_new(g: &Gathered, new: &Path) -> Result<(), OpenError> {
    let tmp = temporary(new);
    let io = |context: &'static str| {
        move |source: std::io::Error| OpenError::Storage {
            context,
            source: Box::new(source),
        }
    };
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("removing an earlier salvage's temporary file")(e)),
    }
    let written = write_tables(g, &tmp);
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, new).map_err(io("moving the salvaged file into place"))?;
    if let Some(dir) = new.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io("syncing the salvaged file's directory"))?;
    }
    Ok(())
}

fn write_tables(g: &Gathered, path: &Path) -> Result<(), OpenError> {
    let db = open_path(path)?;
    // Settings are not taken from `cfg` (nothing is stored from it when
    // they are read from the database, and a new file has none).
    let cfg = StoreConfig {
        ttl_ms: 0,
        expiry: ExpiryPolicy::Forget,
        max_response_bytes: 0,
    };
    prepare(&db, path, cfg, true)?;
    let what = "writing the salvaged database";
    let mut txn = db.begin_write().open_context(what)?;
    txn.set_durability(Durability::Immediate)
        .open_context(what)?;
    {
        let mut records = txn.open_table(RECORDS).open_context(what)?;
        for (key, value) in &g.records {
            records
                .insert(key.as_slice(), value.as_slice())
                .open_context(what)?;
        }
        let mut leases = txn.open_table(LEASES).open_context(what)?;
        let mut recovery = txn.open_table(RECOVERY).open_context(what)?;
        let mut expiry = txn.open_table(EXPIRY).open_context(what)?;
        for (name, at, key) in &g.index {
            let table = match *name {
                "leases" => &mut leases,
                "recovery" => &mut recovery,
                _ => &mut expiry,
            };
            table.insert((*at, key.as_slice()), ()).open_context(what)?;
        }
        let mut outbox = txn.open_table(OUTBOX).open_context(what)?;
        for (seq, value) in &g.outbox {
            outbox.insert(*seq, value.as_slice()).open_context(what)?;
        }
        let mut entities = txn.open_table(ENTITIES).open_context(what)?;
        for (id, value) in &g.entities {
            entities
                .insert(id.as_str(), value.as_slice())
                .open_context(what)?;
        }
        let mut meta_table = txn.open_table(META).open_context(what)?;
        meta::write_counter(&mut meta_table, Counter::NextToken, g.next_token)
            .open_context(what)?;
        meta::write_counter(&mut meta_table, Counter::NextOutboxSeq, g.next_outbox)
            .open_context(what)?;
        if let Some((ttl_ms, policy)) = g.expiry {
            meta::write_expiry(&mut meta_table, ttl_ms, policy).open_context(what)?;
        }
    }
    txn.commit().open_context(what)?;
    drop(db);
    Ok(())
}
