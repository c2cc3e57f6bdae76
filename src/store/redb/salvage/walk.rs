//! Walks of a damaged file's tables: forward, then backward from the end
//! where damage stops a walk, and from every key the indexes name, with
//! panics inside redb contained.

use std::collections::{BTreeMap, BTreeSet};

use redb::{ReadableDatabase, ReadableTable, ReadableTableMetadata, StorageError};

use super::super::tables::{EXPIRY, LEASES, RECOVERY};
use super::gathered::{Entries, IndexEntry, Reasons};

/// Runs `step`, turning a panic inside redb into an error message.
pub(super) fn guarded<T>(
    step: impl FnOnce() -> std::result::Result<T, String>,
) -> std::result::Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(step)).unwrap_or_else(|panic| {
        Err(format!(
            "the storage library panicked: {}",
            super::super::writer::panic_message(panic.as_ref())
        ))
    })
}

/// One table's entries, as far as walks reached.
pub(super) struct Walked<K, V> {
    pub(super) entries: BTreeMap<K, V>,
    /// Where damage stopped the walks.
    pub(super) gap: Option<Gap<K>>,
}

/// A stretch of a table no walk could pass.
#[derive(Clone)]
pub(super) struct Gap<K> {
    /// The last key read before it (`None`: the table's start).
    pub(super) after: Option<K>,
    /// The first key read after it (`None`: the table's end).
    pub(super) before: Option<K>,
    /// What stopped the walk.
    pub(super) reason: String,
}

impl<K: Ord> Gap<K> {
    /// Whether `key` lies in the stretch.
    pub(super) fn holds(&self, key: &K) -> bool {
        self.after.as_ref().is_none_or(|a| key > a) && self.before.as_ref().is_none_or(|b| key < b)
    }
}

/// Each index table's name, and the stretch of it no walk passed.
pub(super) type IndexGaps = Vec<(&'static str, Option<Gap<(u64, Vec<u8>)>>)>;

/// Why a walk stopped at a key out of order.
const OUT_OF_ORDER: &str = "keys out of order (a damaged page)";

/// Walks entries from `iter` into `out` until it ends, fails, panics,
/// meets a key out of order, or `stop` says so. Returns why it stopped
/// early (`None`: it reached the end or `stop`).
pub(super) fn walk_into<T, K: Ord + Clone, V, I>(
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
                return Err(OUT_OF_ORDER.to_string());
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
pub(super) fn walk_both<T, K: Ord + Clone, V, I, R>(
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
    // A key out of order may be the damaged key or the one before it (a
    // damaged key read as far ahead makes the next sound key look out of
    // order): the backward walk then goes down to the key before both, so
    // a damaged key cannot hide every key above it.
    let suspect = usize::from(stopped.as_deref() == Some(OUT_OF_ORDER));
    let after = ahead
        .len()
        .checked_sub(1 + suspect)
        .and_then(|i| ahead.get(i))
        .map(|(k, _)| k.clone());
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

/// A table of byte keys and values: format 2's records (record key) or
/// format 3's (slot key).
pub(super) type BytesTable = redb::TableDefinition<'static, &'static [u8], &'static [u8]>;

/// A records table's walk, by its byte keys.
pub(super) type RecordsWalk = Walked<Vec<u8>, Vec<u8>>;

/// The keys a records walk goes on from where damage stopped it, given
/// its gap (`None`: the walks met every entry) and what the walks read.
pub(super) type Seeds<'a> = &'a dyn Fn(Option<&Gap<Vec<u8>>>, &Entries) -> BTreeSet<Vec<u8>>;

/// Walks the records table `def` (`Err`: it could not be opened at all,
/// with the reason). Where damage stops the walk, it goes on from every
/// key `seeds` names that lies in the stretch not yet walked, up to the
/// backward walk's end. Returns the walk and the keys `seeds` named.
pub(super) fn walk_records(
    db: &impl ReadableDatabase,
    def: BytesTable,
    seeds: Seeds<'_>,
) -> std::result::Result<(RecordsWalk, BTreeSet<Vec<u8>>), String> {
    let own = |(k, v): (redb::AccessGuard<'_, &[u8]>, redb::AccessGuard<'_, &[u8]>)| {
        (k.value().to_vec(), v.value().to_vec())
    };
    let table = guarded(|| {
        let txn = db.begin_read().map_err(|e| e.to_string())?;
        txn.open_table(def).map_err(|e| e.to_string())
    })?;
    let mut walked = walk_both(|| table.iter(), || table.iter().map(Iterator::rev), own);
    short_walk(
        &mut walked,
        guarded(|| table.len().map_err(|e| e.to_string())),
    );
    let named = seeds(walked.gap.as_ref(), &walked.entries);
    if let Some(Gap { after, before, .. }) = walked.gap.clone() {
        let mut covered: Option<Vec<u8>> = after.clone();
        for seed in &named {
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
    Ok((walked, named))
}

/// Looks up each of `keys` in the records table `def`: (found, why not).
/// Keys outside the records walks' gap that were not met by a walk are
/// missing (a lookup would only confirm it); those inside are looked up.
pub(super) fn look_up(
    db: &impl ReadableDatabase,
    def: BytesTable,
    keys: &BTreeSet<Vec<u8>>,
    in_gap: &dyn Fn(&Vec<u8>) -> bool,
) -> (Entries, Reasons) {
    let mut found = BTreeMap::new();
    let mut failed = BTreeMap::new();
    let table = match guarded(|| {
        let txn = db.begin_read().map_err(|e| e.to_string())?;
        txn.open_table(def).map_err(|e| e.to_string())
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
pub(super) fn walk_index(db: &impl ReadableDatabase) -> (BTreeSet<IndexEntry>, IndexGaps) {
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
pub(super) fn walk_table<K, V, KO, VO>(
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
pub(super) fn short_walk<K, V>(walked: &mut Walked<K, V>, len: std::result::Result<u64, String>) {
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
