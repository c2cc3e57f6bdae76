//! redb's page check, run as the writable open runs it but without writing
//! to the file, and where a failed check's damage lies.
//!
//! The writable open verifies the checksum of every page of the file's
//! trees (`set_check_integrity_on_open`); redb answers yes or no, and its
//! message names no page. Here the check runs over the in-memory layer of
//! `scratch_view.rs` with every read redb makes recorded: the check reads
//! each page once, depth first, and stops at the first page that fails,
//! so the last page read is that page (or the header, at offset 0, when a
//! commit slot fails its checksum).
//!
//! To tell what lies on that page, the file is opened read-only with no
//! page cache, so every page a read needs is read again from the file and
//! recorded: a walk of each engine table, then a lookup of every key it
//! meets. Keys whose walk or lookup reads the page are on it or reached
//! through it. redb's own tables (allocator state, freed pages) are not
//! walked: a page no engine table reads belongs to them.

use std::fs::File;
use std::io;
use std::ops::Bound;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;
use redb::backends::FileBackend;
use redb::{
    BackendError, DatabaseError, Key, ReadableDatabase, ReadableTable, StorageBackend,
    StorageError, TableDefinition, Value,
};

use crate::key::IdempotencyKey;
use crate::store::record::hex;
use crate::verify::Damage;

use super::super::partition::catalog;
use super::super::partition::row::{FILTERS, PARTITIONS};
use super::super::partition::slot;
use super::super::tables::{
    ENTITIES, EXPIRY, HISTORY, LEASES, META, OUTBOX, RECORDS, RECOVERY, STEPS,
};
use super::scratch_view;

/// Most keys one [`Damage::EntriesOnDamagedPage`] lists.
const MAX_KEYS: usize = 1_000;

/// What redb's page check found wrong with a file.
#[derive(Clone, Debug)]
pub(crate) struct FailedCheck {
    /// redb's message.
    pub(crate) reason: String,
    /// The last page read before redb refused: `(offset, length)`.
    pub(crate) page: Option<(u64, u64)>,
}

/// Runs redb's page check on the file at `path` as a writable open does,
/// over a layer that keeps redb's writes in memory: the file is opened for
/// reading only and never written. `Ok(None)`: every page passes.
///
/// # Errors
///
/// `DatabaseError` if the check cannot run (the file cannot be read, is
/// not a redb database); a page that fails is `Ok(Some(..))`.
pub(crate) fn check(path: &Path) -> Result<Option<FailedCheck>, DatabaseError> {
    let reads = Reads::default();
    let file = Recorded {
        inner: scratch_view::layered(FileBackend::new(File::open(path)?)?)?,
        reads: reads.clone(),
    };
    let mut builder = redb::Builder::new();
    builder.set_check_integrity_on_open(true);
    let opened = catch_unwind(AssertUnwindSafe(|| builder.create_with_backend(file)));
    let failed = |reason: String| {
        Ok(Some(FailedCheck {
            reason,
            page: reads.last(),
        }))
    };
    match opened {
        Ok(Ok(db)) => {
            let _ = catch_unwind(AssertUnwindSafe(move || drop(db)));
            Ok(None)
        }
        Ok(Err(DatabaseError::Storage(StorageError::Corrupted(reason)))) => failed(reason),
        Ok(Err(e)) => Err(e),
        Err(panic) => failed(format!(
            "the storage library panicked checking it: {}",
            super::super::writer::panic_message(panic.as_ref())
        )),
    }
}

/// What a failed check means for the engine's tables: `failed` as a
/// [`Damage::FailedPageCheck`], then one [`Damage::EntriesOnDamagedPage`]
/// per engine table with entries on the page. Walks the file (read-only)
/// to tell; a file that cannot be walked (not closed cleanly) gets the
/// page alone.
pub(crate) fn damage(path: &Path, failed: &FailedCheck) -> Vec<Damage> {
    let found = failed.page.and_then(|(offset, _)| {
        let walked = catch_unwind(AssertUnwindSafe(|| locate(path, offset)));
        match walked {
            Ok(Ok(found)) => Some(found),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "the damaged page's entries cannot be walked");
                None
            }
            Err(_) => None,
        }
    });
    let tables = found
        .as_ref()
        .map(|found| found.iter().map(|t| t.table).collect::<Vec<_>>());
    let mut damage = vec![Damage::FailedPageCheck {
        reason: failed.reason.clone(),
        page: failed.page,
        tables,
    }];
    damage.extend(found.into_iter().flatten().map(OnPage::into_damage));
    damage
}

/// A short account of a failed check for an open error: the page and the
/// tables and keys on it, as far as a walk tells.
pub(crate) fn summary(path: &Path, failed: &FailedCheck) -> String {
    let mut parts = Vec::new();
    for d in damage(path, failed) {
        match d {
            Damage::FailedPageCheck { page, .. } => match page {
                Some((0, _)) => parts.push("first failing page: redb's header".to_string()),
                Some((offset, len)) => parts.push(format!(
                    "first failing page: bytes {offset}..{}",
                    offset.saturating_add(len)
                )),
                None => {}
            },
            Damage::EntriesOnDamagedPage {
                table,
                whole_table,
                keys,
                more,
                ..
            } => {
                let table = if whole_table {
                    format!("every entry of the {table} table")
                } else {
                    table.to_string()
                };
                let count = keys.len() as u64 + more;
                match (keys.first(), keys.last()) {
                    (Some(first), Some(last)) if count > 1 => {
                        parts.push(format!("{table}: {count} keys, {first} to {last}"));
                    }
                    (Some(only), _) => parts.push(format!("{table}: {only}")),
                    _ => parts.push(table),
                }
            }
            _ => {}
        }
    }
    parts.join("; ")
}

/// One engine table's entries on the damaged page.
struct OnPage {
    table: &'static str,
    page_offset: u64,
    whole_table: bool,
    keys: Vec<String>,
    more: u64,
    after: Option<String>,
    before: Option<String>,
}

impl OnPage {
    fn into_damage(self) -> Damage {
        Damage::EntriesOnDamagedPage {
            table: self.table,
            page_offset: self.page_offset,
            whole_table: self.whole_table,
            keys: self.keys,
            more: self.more,
            after: self.after,
            before: self.before,
        }
    }
}

/// Walks every engine table of the file read-only, with every page read
/// recorded, and returns the tables with entries on the page at `offset`.
fn locate(path: &Path, offset: u64) -> Result<Vec<OnPage>, redb::Error> {
    let reads = Reads::default();
    let file = Recorded {
        inner: FileBackend::new(File::open(path)?)?,
        reads: reads.clone(),
    };
    // No cache: every page a read needs is read from the file, so each
    // walk and lookup shows the pages it passes through.
    let db = redb::Builder::new()
        .set_cache_size(0)
        .open_read_only_with_backend(file)?;
    let txn = db.begin_read()?;
    let show_index = |k: &(u64, &[u8])| format!("{} {}", k.0, shown(k.1));
    let mut found = Vec::new();
    // A slot key (format 3) as its record key, `scope/key`: the name an
    // operator knows the key by (and `keys_in_doubt` lists), whatever
    // partition holds it.
    let show_slot = |k: &[u8]| match slot::split(k) {
        Some((_, rkey)) => shown(rkey),
        None => shown(k),
    };
    let walks: [Option<OnPage>; 14] = [
        walk(&txn, RECORDS, "records", offset, &reads, |k: &&[u8]| {
            shown(k)
        }),
        walk(&txn, LEASES, "leases", offset, &reads, show_index),
        walk(&txn, RECOVERY, "recovery", offset, &reads, show_index),
        walk(&txn, EXPIRY, "expiry", offset, &reads, show_index),
        walk(&txn, OUTBOX, "outbox", offset, &reads, |k: &u64| {
            format!("#{k}")
        }),
        walk(&txn, ENTITIES, "entities", offset, &reads, |k: &&str| {
            format!("{k:?}")
        }),
        walk(&txn, META, "meta", offset, &reads, |k: &&str| {
            format!("{k:?}")
        }),
        walk(&txn, STEPS, "steps", offset, &reads, |k: &(&[u8], &str)| {
            format!("{} {:?}", shown(k.0), k.1)
        }),
        walk(
            &txn,
            HISTORY,
            "history",
            offset,
            &reads,
            |k: &(&[u8], u32)| format!("{} #{}", shown(k.0), k.1),
        ),
        // Format 3's tables (absent from a format-2 file: no walk).
        walk(
            &txn,
            catalog::RECORDS,
            "records",
            offset,
            &reads,
            |k: &&[u8]| show_slot(k),
        ),
        walk(
            &txn,
            catalog::STEPS,
            "steps",
            offset,
            &reads,
            |k: &(&[u8], &str)| format!("{} {:?}", show_slot(k.0), k.1),
        ),
        walk(
            &txn,
            catalog::HISTORY,
            "history",
            offset,
            &reads,
            |k: &(&[u8], u32)| format!("{} #{}", show_slot(k.0), k.1),
        ),
        walk(&txn, PARTITIONS, "partitions", offset, &reads, |k: &u64| {
            format!("partition {k}")
        }),
        walk(&txn, FILTERS, "filters", offset, &reads, |k: &u64| {
            format!("partition {k}")
        }),
    ];
    found.extend(walks.into_iter().flatten());
    drop(txn);
    let _ = catch_unwind(AssertUnwindSafe(move || drop(db)));
    Ok(found)
}

/// One key the walk met, and whether it is on (or reached through) the
/// damaged page; or (`gap`) the entries between a walk from the start and
/// one from the end that stopped on the damage, which do not read.
struct Met {
    key: String,
    damaged: bool,
    gap: bool,
}

/// Walks `def`'s table: every entry, and a lookup of each entry's key,
/// noting which read the page at `offset`. A walk that fails part way
/// (an error, or a panic in redb on the damaged bytes) goes on from the
/// other end, so the keys past the damage are still told apart.
fn walk<K: Key + 'static, V: Value + 'static>(
    txn: &redb::ReadTransaction,
    def: TableDefinition<K, V>,
    table: &'static str,
    offset: u64,
    reads: &Reads,
    show: impl Fn(&K::SelfType<'_>) -> String,
) -> Option<OnPage> {
    reads.clear();
    let opened = catch_unwind(AssertUnwindSafe(|| txn.open_table(def)));
    let on_page = |whole_table, met: Vec<Met>| {
        let damaged: Vec<String> = met
            .iter()
            .filter(|m| m.damaged && !m.gap)
            .map(|m| m.key.clone())
            .collect();
        let gap = met.iter().any(|m| m.gap);
        (whole_table || gap || !damaged.is_empty()).then(|| {
            let first = met.iter().position(|m| m.damaged);
            let last = met.iter().rposition(|m| m.damaged);
            let after = first
                .and_then(|i| i.checked_sub(1))
                .map(|i| met[i].key.clone());
            let before = last.and_then(|i| met.get(i + 1)).map(|m| m.key.clone());
            let more = damaged.len().saturating_sub(MAX_KEYS) as u64;
            OnPage {
                table,
                page_offset: offset,
                whole_table,
                keys: damaged.into_iter().take(MAX_KEYS).collect(),
                more,
                after,
                before,
            }
        })
    };
    let table_handle = match opened {
        Ok(Ok(t)) => t,
        Ok(Err(redb::TableError::TableDoesNotExist(_))) => return None,
        // The table's definition or root does not read: all of it, if the
        // damaged page was read on the way (else other damage, which the
        // scrub reports).
        Ok(Err(_)) | Err(_) => return reads.contains(offset).then(|| on_page(true, Vec::new()))?,
    };
    // The page is the table's root, or on the path to its definition:
    // every entry is reached through it (a walk still lists them).
    let whole_table = reads.contains(offset);
    let mut met = Vec::new();
    let complete = catch_unwind(AssertUnwindSafe(|| {
        walk_from(&table_handle, false, offset, reads, &show, &mut met)
    }))
    .unwrap_or(false);
    if !complete {
        // Keys from the far end, down to the damage; between the two
        // parts lies what does not read.
        let mut tail = Vec::new();
        let _ = catch_unwind(AssertUnwindSafe(|| {
            walk_from(&table_handle, true, offset, reads, &show, &mut tail)
        }));
        met.push(Met {
            key: String::new(),
            damaged: true,
            gap: true,
        });
        met.extend(tail.into_iter().rev());
    }
    if whole_table {
        for m in &mut met {
            m.damaged = true;
        }
    }
    on_page(whole_table, met)
}

/// Walks `table` forward (or from the end, `backward`), pushing each key
/// met onto `met`; true if the walk reached its end.
fn walk_from<K: Key + 'static, V: Value + 'static>(
    table: &redb::ReadOnlyTable<K, V>,
    backward: bool,
    offset: u64,
    reads: &Reads,
    show: &impl Fn(&K::SelfType<'_>) -> String,
    met: &mut Vec<Met>,
) -> bool {
    reads.clear();
    let Ok(iter) = table.iter() else {
        return false;
    };
    let mut iter: Box<dyn Iterator<Item = _>> = if backward {
        Box::new(iter.rev())
    } else {
        Box::new(iter)
    };
    loop {
        let Some(entry) = iter.next() else {
            return true;
        };
        // The leaf (and branches) this step read hold this entry.
        let mut damaged = reads.contains(offset);
        let Ok((key, _)) = entry else {
            return false;
        };
        reads.clear();
        let key_value = key.value();
        damaged |= table.get(&key_value).map_or(true, |v| v.is_none()) || reads.contains(offset);
        reads.clear();
        met.push(Met {
            key: show(&key_value),
            damaged,
            gap: false,
        });
    }
}

/// A record key for people: `scope/key` when its bytes are one, else hex.
fn shown(record_key: &[u8]) -> String {
    IdempotencyKey::from_record_key(record_key)
        .map_or_else(|| hex(record_key), |key| key.to_string())
}

/// The reads a [`Recorded`] backend has served: `(offset, length)`.
#[derive(Clone, Debug, Default)]
struct Reads(Arc<Mutex<Vec<(u64, u64)>>>);

impl Reads {
    fn push(&self, offset: u64, len: u64) {
        self.0.lock().push((offset, len));
    }

    fn last(&self) -> Option<(u64, u64)> {
        self.0.lock().last().copied()
    }

    fn contains(&self, offset: u64) -> bool {
        self.0.lock().iter().any(|&(at, _)| at == offset)
    }

    fn clear(&self) {
        self.0.lock().clear();
    }
}

/// A storage backend that records every read it serves. It takes no
/// locks (the caller holds the file's, or nothing writes to it), and
/// refuses writes unless `inner` keeps them.
#[derive(Debug)]
struct Recorded<B> {
    inner: B,
    reads: Reads,
}

impl<B: StorageBackend> StorageBackend for Recorded<B> {
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        self.reads.push(offset, out.len() as u64);
        self.inner.read(offset, out)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.inner.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.inner.write(offset, data)
    }

    fn close(&self) -> io::Result<()> {
        self.inner.close()
    }

    fn try_lock_range(&self, _: Bound<u64>, _: Bound<u64>) -> Result<bool, BackendError> {
        Err(BackendError::Unsupported)
    }
}
