//! The read snapshot point reads share: one redb read transaction with the
//! records table kept open across reads, instead of `begin_read` and
//! `open_table` by name on every read (BENCHMARKS.md, "Kept-open read
//! snapshot (issue 26)").
//!
//! Freshness: the writer calls [`Snapshots::committed`] after every redb
//! commit, before it empties the overlay and before it answers anyone. That
//! bumps the generation and drops the kept snapshot, under one lock; a
//! reader keeps the snapshot it took only if the generation has not moved
//! since it read it before `begin_read`. So a kept snapshot is always of
//! the newest commit that `committed` has announced, and a point read that
//! looks in the overlay first and then takes the snapshot sees the
//! overlay's value or the commit that held it, never neither. Every redb
//! commit of a running store is the writer's (group commits, checkpoints,
//! isolated local writes); those before it starts (preparing, migrating,
//! applying the journal at an open or a reopen) come before its
//! `Snapshots` exists: a reopen starts a new one.
//!
//! Pinning: a live read transaction keeps the pages its commit uses from
//! being reused. The writer drops the kept snapshot at every commit, so it
//! never pins more than the last commit; a reader that still holds an older
//! one holds it only while its read runs.
//!
//! Damage: redb panics opening a damaged table definition. Snapshots are
//! taken on the reader's thread only (inside `contained`), never on the
//! writer, and not under the lock.
//!
//! Layout: a snapshot reads the records of its [`Layout`]. In format 3 it
//! builds the probes of its partitions once, when it is taken, from the
//! partition rows of its own read transaction (`partition/catalog.rs`:
//! never from the writer's list), so a partition sealed or opened by a
//! later commit does not change what it finds.

use std::borrow::Cow;
use std::sync::{Arc, OnceLock};

use parking_lot::RwLock;
use redb::{ReadOnlyTable, ReadTransaction, ReadableDatabase};

use crate::error::Result;

use super::layout::{Found, Layout, Lookup, StepsDef};
use super::tables::{Context, ENTITIES};

/// Record (format 2) or slot (format 3) key bytes → encoded record.
type Records = ReadOnlyTable<&'static [u8], &'static [u8]>;
/// Entity id → encoded state.
type Entities = ReadOnlyTable<&'static str, &'static [u8]>;
/// (record or slot key, step name) → encoded step.
type Steps = ReadOnlyTable<(&'static [u8], &'static str), &'static [u8]>;

/// The kept snapshot of one database, and the commit generation it is of.
/// `Default`: a format-2 file's ([`Layout::Single`]).
#[derive(Default)]
pub(super) struct Snapshots {
    state: RwLock<State>,
    layout: Layout,
}

#[derive(Default)]
struct State {
    /// Commits announced by the writer so far.
    generation: u64,
    /// A snapshot of the commit `generation` counts up to (`None`: none
    /// taken since).
    kept: Option<Arc<Snapshot>>,
    /// No snapshot is kept any more: the database is being closed.
    closed: bool,
}

impl Snapshots {
    /// No snapshot kept yet, of a file laid out as `layout`.
    pub(super) fn new(layout: Layout) -> Snapshots {
        Snapshots {
            state: RwLock::default(),
            layout,
        }
    }

    /// How the file keeps its records (the whole-table reads of `read.rs`
    /// take it from here).
    pub(super) fn layout(&self) -> &Layout {
        &self.layout
    }

    /// A snapshot that sees every commit announced (see
    /// [`Self::committed`]) before this call: the kept one, or a new one,
    /// kept if no commit was announced meanwhile.
    ///
    /// # Errors
    ///
    /// `Error::Storage` with context `what` if redb cannot begin a read,
    /// open the records table or (format 3) read the partition rows.
    pub(super) fn current(
        &self,
        db: &impl ReadableDatabase,
        what: &'static str,
    ) -> Result<Arc<Snapshot>> {
        let generation = match self.kept_or_generation() {
            Ok(kept) => return Ok(kept),
            Err(generation) => generation,
        };
        // Begun after `generation` was read: it holds every commit counted
        // in it.
        let fresh = Arc::new(Snapshot::take(db, &self.layout, what)?);
        self.keep(generation, &fresh);
        Ok(fresh)
    }

    /// The kept snapshot, or the generation a new one must be of.
    fn kept_or_generation(&self) -> std::result::Result<Arc<Snapshot>, u64> {
        let state = self.state.read();
        match &state.kept {
            Some(kept) => Ok(kept.clone()),
            None => Err(state.generation),
        }
    }

    /// Keeps `fresh`, begun after `generation` was read, unless a commit
    /// was announced since (it may predate that commit) or another reader
    /// kept one first.
    fn keep(&self, generation: u64, fresh: &Arc<Snapshot>) {
        let mut state = self.state.write();
        if state.generation == generation && state.kept.is_none() && !state.closed {
            state.kept = Some(fresh.clone());
        }
    }

    /// Announces a redb commit (or a commit attempt that failed, which may
    /// have changed the file all the same): the kept snapshot is stale, and
    /// dropped. The writer calls it after every commit, before it empties
    /// the overlay or answers a caller.
    pub(super) fn committed(&self) {
        let stale = {
            let mut state = self.state.write();
            state.generation = state.generation.wrapping_add(1);
            state.kept.take()
        };
        // Ends the read transaction outside the lock (when no read holds it).
        release(stale);
    }

    /// Drops the kept snapshot and keeps none from now on: the database is
    /// about to close (a live read transaction would keep it from closing
    /// cleanly, and its file locked). Reads still work, each with a
    /// snapshot of its own.
    pub(super) fn close(&self) {
        let stale = {
            let mut state = self.state.write();
            state.closed = true;
            state.generation = state.generation.wrapping_add(1);
            state.kept.take()
        };
        release(stale);
    }

    /// Whether a snapshot is kept now (for tests).
    #[cfg(test)]
    pub(super) fn is_kept(&self) -> bool {
        self.state.read().kept.is_some()
    }
}

/// Drops a snapshot taken out of the cache. After a panic inside redb
/// (a failed commit), ending a read transaction may panic on its poisoned
/// locks: on the writer thread that must not take the thread down.
fn release(stale: Option<Arc<Snapshot>>) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(stale)));
}

/// One read transaction with the records table open (and, in format 3,
/// the probes of its partitions); the entities and steps tables are opened
/// in it on first use.
pub(super) struct Snapshot {
    // Declared first, dropped first: the tables before their transaction.
    records: Records,
    lookup: Lookup,
    entities: OnceLock<Entities>,
    /// `None`: the file has no steps table (format 2 before any step).
    steps: OnceLock<Option<Steps>>,
    steps_def: StepsDef,
    txn: ReadTransaction,
}

impl Snapshot {
    fn take(db: &impl ReadableDatabase, layout: &Layout, what: &'static str) -> Result<Snapshot> {
        let txn = db.begin_read().context(what)?;
        let records = txn.open_table(layout.records()).context(what)?;
        let lookup = layout.lookup(&txn).context(what)?;
        Ok(Snapshot {
            records,
            lookup,
            entities: OnceLock::new(),
            steps: OnceLock::new(),
            steps_def: layout.steps(),
            txn,
        })
    }

    /// Record key `rkey`'s stored record, and the key its steps are under,
    /// in either layout; `None`: no record.
    ///
    /// # Errors
    ///
    /// `Error::Storage` with context `what` for a failed read.
    pub(super) fn find<'k>(&self, rkey: &'k [u8], what: &'static str) -> Result<Option<Found<'k>>> {
        self.lookup.find(&self.records, rkey).context(what)
    }

    /// Where `rkey`'s steps are while it has no record
    /// ([`Lookup::slot_without_record`]).
    pub(super) fn slot_without_record<'k>(&self, rkey: &'k [u8]) -> Option<Cow<'k, [u8]>> {
        self.lookup.slot_without_record(rkey)
    }

    /// How this snapshot finds a record key (for tests).
    #[cfg(test)]
    pub(super) fn lookup(&self) -> &Lookup {
        &self.lookup
    }

    /// The entities table.
    pub(super) fn entities(&self, what: &'static str) -> Result<&Entities> {
        lazily(&self.entities, || {
            self.txn.open_table(ENTITIES).context(what)
        })
    }

    /// The steps table of the layout (keyed by the [`Found::slot`] of a
    /// record), `None` in a file that has none.
    pub(super) fn steps(&self, what: &'static str) -> Result<Option<&Steps>> {
        let steps = lazily(&self.steps, || match self.txn.open_table(self.steps_def) {
            Ok(table) => Ok(Some(table)),
            Err(redb::TableError::TableDoesNotExist(_)) => Ok(None),
            Err(e) => Err(e).context(what),
        })?;
        Ok(steps.as_ref())
    }
}

/// The value in `cell`, set by `open` if it is empty (an error is not
/// kept: the next call tries again).
fn lazily<T>(cell: &OnceLock<T>, open: impl FnOnce() -> Result<T>) -> Result<&T> {
    if let Some(value) = cell.get() {
        return Ok(value);
    }
    let value = open()?;
    // Another reader may have set it meanwhile: theirs is the same table
    // of the same snapshot.
    Ok(cell.get_or_init(|| value))
}

#[cfg(test)]
mod tests {
    use redb::Database;

    use super::super::tables::RECORDS;
    use super::*;

    type R<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

    fn db() -> R<Database> {
        let db = Database::builder().create_with_backend(redb::backends::InMemoryBackend::new())?;
        put(&db, b"k", b"1")?;
        Ok(db)
    }

    fn put(db: &Database, k: &[u8], v: &[u8]) -> R<()> {
        let txn = db.begin_write()?;
        txn.open_table(RECORDS)?.insert(k, v)?;
        txn.commit()?;
        Ok(())
    }

    fn value(snapshot: &Snapshot, k: &[u8]) -> R<Option<Vec<u8>>> {
        Ok(snapshot.find(k, "test")?.map(|f| f.value.value().to_vec()))
    }

    #[test]
    fn reads_share_one_snapshot_until_a_commit() -> R<()> {
        let db = db()?;
        let reads = Snapshots::default();
        let first = reads.current(&db, "test")?;
        assert!(Arc::ptr_eq(&first, &reads.current(&db, "test")?));
        put(&db, b"k", b"2")?;
        reads.committed();
        assert!(!reads.is_kept(), "the commit dropped it");
        let second = reads.current(&db, "test")?;
        assert!(!Arc::ptr_eq(&first, &second));
        assert_eq!(value(&first, b"k")?, Some(b"1".to_vec()));
        assert_eq!(value(&second, b"k")?, Some(b"2".to_vec()));
        Ok(())
    }

    #[test]
    fn a_snapshot_begun_before_a_commit_announced_after_is_not_kept() -> R<()> {
        let db = db()?;
        let reads = Snapshots::default();
        let Err(generation) = reads.kept_or_generation() else {
            return Err("nothing kept yet".into());
        };
        let early = Arc::new(Snapshot::take(&db, &Layout::Single, "test")?);
        put(&db, b"k", b"2")?;
        reads.committed();
        reads.keep(generation, &early);
        assert!(!reads.is_kept(), "it may predate the commit");
        assert_eq!(
            value(&*reads.current(&db, "test")?, b"k")?,
            Some(b"2".to_vec())
        );
        Ok(())
    }

    #[test]
    fn a_closed_store_keeps_no_snapshot() -> R<()> {
        let db = db()?;
        let reads = Snapshots::default();
        reads.current(&db, "test")?;
        reads.close();
        assert!(!reads.is_kept());
        assert_eq!(
            value(&*reads.current(&db, "test")?, b"k")?,
            Some(b"1".to_vec())
        );
        assert!(!reads.is_kept(), "reads after close take their own");
        Ok(())
    }

    #[test]
    fn tables_opened_lazily_come_from_the_same_snapshot() -> R<()> {
        let db = db()?;
        let reads = Snapshots::default();
        let snapshot = reads.current(&db, "test")?;
        assert!(snapshot.steps("test")?.is_none(), "no steps table yet");
        let txn = db.begin_write()?;
        txn.open_table(ENTITIES)?.insert("e", &b"x"[..])?;
        txn.commit()?;
        assert!(
            snapshot.entities("test").is_err(),
            "the entities table is not in this snapshot"
        );
        reads.committed();
        let fresh = reads.current(&db, "test")?;
        assert!(fresh.entities("test")?.get("e")?.is_some());
        Ok(())
    }
}
