//! The redb backend: one database file, one writer thread doing group
//! commits, snapshot reads that never wait for it.

mod compact;
#[cfg(test)]
mod derived_replay_tests;
mod drain;
#[cfg(feature = "bench-fixtures")]
pub(crate) mod fixture;
#[cfg(test)]
mod frame_bytes_tests;
#[cfg(test)]
mod fuzz_seeds_tests;
mod job;
mod journal;
mod layout;
#[cfg(test)]
mod layout_reads_tests;
mod local;
#[cfg(test)]
mod merge_break_tests;
mod merge_step;
#[cfg(test)]
mod merge_tests;
mod meta;
mod open;
mod orphans;
mod overlay;
mod partition;
#[cfg(test)]
mod partitioned_tables_tests;
mod read;
mod read_only;
mod recover;
mod reserve;
mod salvage;
#[cfg(test)]
mod seal_checkpoint_tests;
mod snapshot;
#[cfg(test)]
mod snapshot_tests;
#[cfg(test)]
mod step_tables_tests;
mod sweep;
mod syncer;
mod tables;
#[cfg(test)]
mod test_requests;
#[cfg(test)]
mod test_writer;
mod twins;
#[cfg(test)]
mod twins_break_tests;
mod verify;
mod warm;
mod writer;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::Sender;
use parking_lot::{Mutex, RwLock};
use redb::Database;

use crate::clock::Clock;
use crate::error::{Corrupted, Error, OpenError, Result};
use crate::key::IdempotencyKey;
use crate::message::OutboxEntry;
use crate::policy::PurgeMode;
use crate::report::SweepCounts;
use crate::state::State;
use crate::store::config::StoreConfig;
use crate::store::ops::Ops;
use crate::store::pending::{closed, Pending};
use crate::store::poison::Poison;
use crate::store::record::{EntityState, Record};
use crate::store::reply::{self, Unheard};
use crate::store::{
    Backend, ClaimRequest, ClaimResult, Claimed, CompleteRequest, FinishStepRequest,
    InDoubtRequest, LocalResult, LocalWrite, Scanned, SettleRequest, SettleStepRequest, Settled,
    StepRecord, StepRequest, TransitionRequest,
};
use crate::transition::Transition;

pub(crate) use self::compact::compact;
pub(crate) use self::open::{
    open_backend, open_path, prepare, prepare_new_as, refuse_foreign, MigrationSteps, NewFormat,
};
pub(crate) use self::partition::catalog::SealRule as PartitionSealRule;
pub(crate) use self::read_only::RedbReader;
pub(crate) use self::reserve::DEFAULT_BYTES as DEFAULT_RECOVERY_RESERVE;
pub(crate) use self::salvage::salvage;

use self::job::Call;
use self::journal::JournalStorage;
use self::layout::Layout;
use self::overlay::Overlay;
use self::partition::catalog::SealRule;
use self::reserve::Reserve;
use self::snapshot::Snapshots;
use self::tables::{OpError, Tables};
use self::writer::{Msg, Writer};

/// A panic inside the storage library, caught at the engine's boundary. A
/// corrupt file can make redb panic (an `unwrap` on bytes it trusted)
/// instead of returning an error.
#[derive(Debug)]
pub(crate) struct LibraryPanic(pub(crate) String);

impl std::fmt::Display for LibraryPanic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the storage library panicked ({}); the database file is probably corrupt",
            self.0
        )
    }
}

impl std::error::Error for LibraryPanic {}

/// Runs a read, turning a panic inside redb into `Error::Storage`: the
/// caller gets an error, and the store keeps serving other keys.
pub(super) fn contained<T>(what: &'static str, read: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(read)).unwrap_or_else(|panic| {
        let message = writer::panic_message(panic.as_ref());
        tracing::error!(%message, context = what, "storage library panicked during a read");
        Err(Error::Storage {
            context: what,
            source: Box::new(LibraryPanic(message)),
        })
    })
}

/// Runs an open step, turning a panic inside redb into
/// `OpenError::Corrupt`.
pub(crate) fn open_contained<T>(
    path: &std::path::Path,
    open: impl FnOnce() -> Result<T, OpenError>,
) -> Result<T, OpenError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(open)).unwrap_or_else(|panic| {
        Err(OpenError::Corrupt {
            path: path.to_path_buf(),
            what: Corrupted::File,
            reason: format!(
                "the storage library panicked while opening it: {}",
                writer::panic_message(panic.as_ref())
            ),
        })
    })
}

/// An opened database, and where its journal lives (`None`: no journal,
/// every commit is durable in redb; for backends without a path).
pub(crate) struct Opened {
    pub(crate) db: Database,
    pub(crate) journal: Option<std::path::PathBuf>,
    /// The database file, for a read view after a failed reopen (`None`:
    /// opened on a backend).
    pub(crate) file: Option<std::path::PathBuf>,
}

impl Opened {
    /// A database without a journal.
    pub(crate) fn plain(db: Database) -> Opened {
        Opened {
            db,
            journal: None,
            file: None,
        }
    }

    /// The database file, or `<backend>`, for errors.
    pub(crate) fn name(&self) -> &std::path::Path {
        self.file
            .as_deref()
            .unwrap_or(std::path::Path::new("<backend>"))
    }

    /// The database file at `path`, with its journal beside it (see
    /// [`open_path`]; it gives back the recovery reserve), with a page
    /// cache of `cache_bytes` (`None`: redb's default).
    pub(crate) fn path(
        path: &std::path::Path,
        cache_bytes: Option<usize>,
    ) -> Result<Opened, OpenError> {
        let db = open_path(path, cache_bytes)?;
        Ok(Opened {
            db,
            journal: Some(JournalStorage::path_of(path)),
            file: Some(path.to_path_buf()),
        })
    }
}

/// Opens the database again after a storage failure: the same file, or a
/// backend over the same storage.
pub(crate) type Reopen = Arc<dyn Fn() -> Result<Opened, OpenError> + Send + Sync>;

/// Tells whether storage takes writes again (before a reopen is tried).
pub(crate) type Probe = Arc<dyn Fn() -> std::io::Result<()> + Send + Sync>;

/// Shortest time between two reopen attempts, in ms of the engine's clock.
const REOPEN_BACKOFF_MS: u64 = 1_000;
/// Longest: each reopen that fails (after its probe passed) doubles the
/// wait before the next attempt, up to this; one that works resets it.
const REOPEN_BACKOFF_MAX_MS: u64 = 30_000;

/// The engine's size settings the backend reads (see `EngineBuilder`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizes {
    /// Most operations per group commit.
    pub(crate) max_batch: usize,
    /// Bytes of changes after which a group takes no more operations.
    pub(crate) max_group_bytes: usize,
    /// Capacity of the writer's queue.
    pub(crate) queue_capacity: usize,
    /// Bytes of the recovery reserve (0: none; see `reserve.rs`).
    pub(crate) recovery_reserve: u64,
    /// Format 3: when the writer seals the hot partition.
    pub(crate) seal_rule: SealRule,
    /// A format-2 file is migrated to format 3 at open, in these steps
    /// (`EngineBuilder::migrate_to_format_3`); `None`: it stays format 2.
    pub(crate) migration: Option<MigrationSteps>,
}

/// What a writer thread needs, kept to start another one after a reopen.
struct WriterSettings {
    cfg: StoreConfig,
    clock: Arc<dyn Clock>,
    max_batch: usize,
    max_group_bytes: usize,
    queue_capacity: usize,
    /// Space kept beside the database file for recovery (`None`: opened
    /// on a backend, or a reserve of 0 bytes).
    reserve: Option<Reserve>,
    /// Journal bytes after which the writer checkpoints.
    checkpoint_bytes: u64,
    /// Format 3: when the writer seals the hot partition.
    seal_rule: SealRule,
    /// A format-2 file is migrated to format 3 at open, in these steps.
    migration: Option<MigrationSteps>,
}

/// The database and its writer thread, replaced as a whole when the
/// backend reopens after a storage failure.
struct Live {
    /// `None` only while being dropped, or after a reopen attempt failed
    /// once the old database was closed.
    db: Option<Arc<Database>>,
    tx: Sender<Msg>,
    poison: Arc<Poison>,
    writer: Option<JoinHandle<()>>,
    /// Acknowledged values redb has not committed yet (see `overlay.rs`).
    overlay: Arc<Overlay>,
    /// The read snapshot point reads share (see `snapshot.rs`); closed
    /// before `db` is.
    reads: Arc<Snapshots>,
    /// The file's format after the open's migrations: 3 with partitioned
    /// records, else 2.
    format: u32,
}

/// The redb backend.
///
/// A storage failure poisons it: writes are refused (replays, which only
/// read, go on). When it was opened from a path (or a backend factory), a
/// later write, or [`Backend::check`], reopens the database at most once a
/// second (after reopens that failed, up to every 30 s), once a probe says
/// storage takes writes again (for a path: a 64 KiB file written and
/// synced next to it): the recovery reserve is given back (`reserve.rs`),
/// redb recovers the file to its last commit, the journal is replayed and
/// checkpointed in the reserve's room, a new writer starts, the reserve is
/// taken again as far as there is room, and write service is back, with
/// every acknowledged write kept.
pub(crate) struct RedbStore {
    live: RwLock<Live>,
    settings: WriterSettings,
    /// How to reopen, and how to tell that storage works again first.
    reopen: Option<(Reopen, Probe)>,
    /// Clock reading (ms) of the last reopen attempt.
    last_reopen: Mutex<Option<u64>>,
    /// The wait (ms) before the next reopen attempt (see
    /// [`REOPEN_BACKOFF_MAX_MS`]).
    reopen_backoff_ms: std::sync::atomic::AtomicU64,
    /// The database file, for a read view while a reopen fails (see
    /// `open::open_read_view`).
    file: Option<std::path::PathBuf>,
    /// Notices nobody waits for that found the writer's queue full.
    detached: Arc<Detached>,
}

/// Jobs nobody waits for (the notice of a dropped claim, the release of a
/// claim whose caller went away) that found the writer's queue full: sent
/// (waiting) before the next call's own message, so `flush` covers them.
#[derive(Default)]
struct Detached {
    queue: Mutex<Vec<Msg>>,
    /// Notices pushed to `queue` and not yet in the writer's queue (taken
    /// by a caller that may still be waiting for room).
    pending: AtomicUsize,
    /// Held while notices go from `queue` into the writer's queue: a
    /// `flush` that finds notices pending waits here until another
    /// caller's notices are queued, so its own message comes after them.
    sending: Mutex<()>,
}

impl Detached {
    /// Queues `job` without ever blocking: it may run in `Drop` on an async
    /// worker, inside a local write on the writer thread, or on the writer
    /// or syncer thread handing on an unheard answer. With the queue full,
    /// the next call (or `flush`) sends it.
    fn send(&self, tx: &Sender<Msg>, job: Box<dyn job::Job>) {
        if let Err(crossbeam_channel::TrySendError::Full(msg)) = tx.try_send(Msg::Job(job)) {
            let mut queue = self.queue.lock();
            queue.push(msg);
            self.pending.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// The hook for a claim answer nobody heard (an async `begin` dropped while
/// its claim was being committed): the caller never learned it won, so no
/// work ran, and the claim is released at once instead of being left to
/// run out its lease and turn UNKNOWN.
fn release_unheard<T: Send + 'static>(
    key: IdempotencyKey,
    token_of: fn(&T) -> Option<u64>,
    tx: Sender<Msg>,
    detached: Arc<Detached>,
) -> Unheard<Result<T>> {
    Box::new(move |answer: Result<T>| {
        let Some(token) = answer.as_ref().ok().and_then(token_of) else {
            return;
        };
        tracing::warn!(%key, token, "claim won by a caller that went away; released");
        let job = Call::new(
            Box::new(move |t: &mut Tables<'_>| t.release(&key, token)),
            false,
            None,
        );
        detached.send(&tx, Box::new(job));
    })
}

impl RedbStore {
    /// Starts the writer thread on a prepared database (see [`prepare`]).
    /// `reopen` opens it again after a storage failure, once its probe
    /// says storage takes writes again.
    pub(crate) fn start(
        opened: Opened,
        cfg: StoreConfig,
        clock: Arc<dyn Clock>,
        sizes: Sizes,
        reopen: Option<(Reopen, Probe)>,
    ) -> Result<RedbStore, OpenError> {
        let Sizes {
            max_batch,
            max_group_bytes,
            queue_capacity,
            recovery_reserve,
            seal_rule,
            migration,
        } = sizes;
        let file = opened.file.clone();
        let reserve = file
            .as_deref()
            .filter(|_| recovery_reserve > 0)
            .map(|f| Reserve::beside(f, recovery_reserve));
        let checkpoint_bytes = reserve.as_ref().map_or(writer::CHECKPOINT_BYTES, |r| {
            reserve::checkpoint_bytes(r.target(), writer::CHECKPOINT_BYTES)
        });
        let settings = WriterSettings {
            cfg,
            clock,
            max_batch: max_batch.max(1),
            max_group_bytes: max_group_bytes.max(1),
            queue_capacity: queue_capacity.max(1),
            reserve,
            checkpoint_bytes,
            seal_rule,
            migration,
        };
        let live = spawn_writer(opened, &settings)?;
        take_reserve(&settings);
        let store = RedbStore {
            live: RwLock::new(live),
            settings,
            reopen,
            last_reopen: Mutex::new(None),
            reopen_backoff_ms: std::sync::atomic::AtomicU64::new(REOPEN_BACKOFF_MS),
            file,
            detached: Arc::new(Detached::default()),
        };
        store.claims_of_an_ended_process();
        Ok(store)
    }

    /// Moves the claims a process that has ended left PROCESSING to
    /// UNKNOWN (see `orphans.rs`); only the first open of a store does
    /// this. A failure here is logged, not fatal: those claims then wait
    /// for their lease as before, and a storage failure poisons the store
    /// as any write's would.
    fn claims_of_an_ended_process(&self) {
        let now_ms = self.settings.clock.now_ms();
        let found = contained("reading the database", || {
            orphans::any(&*self.db()?, now_ms)
        });
        let moved = match found {
            Ok(false) => return,
            Ok(true) => self.call(|t: &mut Tables<'_>| t.orphans_to_unknown()),
            Err(e) => Err(e),
        };
        match moved {
            Ok(moved) => tracing::warn!(
                moved,
                "claims left PROCESSING by a process that ended are UNKNOWN now \
                 (settled early by a resolver's positive answer, else at their lease end)"
            ),
            Err(e) => tracing::error!(error = %e, "could not mark the claims of an ended process"),
        }
    }

    /// Sends `op` to the writer and waits for its durable answer.
    fn call<T: Send + 'static>(
        &self,
        op: impl FnOnce(&mut Tables<'_>) -> Result<T, OpError> + Send + 'static,
    ) -> Result<T> {
        self.submit(Box::new(op), false)
    }

    fn submit<T: Send + 'static>(&self, op: job::Op<T>, isolated: bool) -> Result<T> {
        self.submit_pending(op, isolated, |_, _| None).wait()
    }

    /// Sends `op` to the writer; its answer comes through the returned
    /// [`Pending`]. `unheard` makes the hook for an answer nobody takes.
    ///
    /// Blocks the caller only while the writer's queue is full
    /// (backpressure: `queue_capacity` operations are waiting already), or
    /// to reopen a poisoned backend (see [`Backend::may_block`]).
    fn submit_pending<T: Send + 'static>(
        &self,
        op: job::Op<T>,
        isolated: bool,
        unheard: impl FnOnce(&Sender<Msg>, &Arc<Detached>) -> Option<Unheard<Result<T>>>,
    ) -> Pending<T> {
        let (tx, poison) = match self.writer() {
            Ok(writer) => writer,
            Err(e) => return Pending::ready(Err(e)),
        };
        self.send_detached(&tx);
        let (reply, answer) = reply::reply_with(unheard(&tx, &self.detached));
        let job = Call::new(op, isolated, Some(reply));
        if tx.send(Msg::Job(Box::new(job))).is_err() {
            return Pending::ready(Err(closed(&poison)));
        }
        Pending::reply(answer, poison)
    }

    /// [`Self::submit_pending`] of a plain operation.
    fn call_pending<T: Send + 'static>(
        &self,
        op: impl FnOnce(&mut Tables<'_>) -> Result<T, OpError> + Send + 'static,
    ) -> Pending<T> {
        self.submit_pending(Box::new(op), false, |_, _| None)
    }

    /// Queues the notices of dropped claims that found the queue full,
    /// waiting for room (never called on the writer thread: `writer`
    /// refuses that first).
    fn send_detached(&self, tx: &Sender<Msg>) {
        let detached = &*self.detached;
        if detached.pending.load(Ordering::Acquire) == 0 {
            return;
        }
        let _sending = detached.sending.lock();
        let waiting = std::mem::take(&mut *detached.queue.lock());
        let taken = waiting.len();
        for msg in waiting {
            if tx.send(msg).is_err() {
                break;
            }
        }
        // Only now: a flush that saw them pending waited for `_sending`.
        detached.pending.fetch_sub(taken, Ordering::AcqRel);
    }

    /// The writer's queue, reopening the database first if the backend is
    /// poisoned and a reopen is due.
    fn writer(&self) -> Result<(Sender<Msg>, Arc<Poison>)> {
        let (tx, poison) = {
            let live = self.live.read_recursive();
            (live.tx.clone(), live.poison.clone())
        };
        // An app's local write runs on the writer thread: a write from it
        // would wait for itself (and a reopen from it would join itself).
        if writer::on_writer_of(&poison) {
            return Err(Error::Reentrant);
        }
        if poison.cause().is_none() {
            return Ok((tx, poison));
        }
        self.try_reopen()?;
        let live = self.live.read_recursive();
        live.poison.check()?;
        Ok((live.tx.clone(), live.poison.clone()))
    }

    /// Reopens a poisoned backend when that is possible and due; otherwise
    /// (or when it fails) returns the poison.
    fn try_reopen(&self) -> Result<()> {
        let poisoned = || self.live.read_recursive().poison.check();
        let Some((reopen, probe)) = &self.reopen else {
            return poisoned();
        };
        {
            // One attempt at a time, at most one per backoff.
            let Some(mut last) = self.last_reopen.try_lock() else {
                return poisoned();
            };
            let now = self.settings.clock.now_ms();
            let backoff = self.reopen_backoff_ms.load(Ordering::Relaxed);
            if last.is_some_and(|at| now >= at && now - at < backoff) {
                return poisoned();
            }
            *last = Some(now);
        }
        if let Err(e) = probe() {
            tracing::warn!(error = %e, "storage still failing; not reopening yet");
            return poisoned();
        }
        // Storage takes writes again. The reopen replays the journal and
        // checkpoints, which needs room: the reserve gives it (the reopen
        // below releases it), and is taken again after.
        let mut live = self.live.write();
        let Some(cause) = live.poison.cause() else {
            return Ok(());
        };
        // Stop the old writer; it drops its handle of the database.
        let _ = live.tx.send(Msg::Shutdown);
        if let Some(writer) = live.writer.take() {
            if writer.join().is_err() {
                tracing::error!("writer thread panicked");
            }
        }
        // Reads hold the database only while they run; wait for them so the
        // old handle is closed before the file is opened again. The kept
        // snapshot goes first: it holds the old file open too.
        live.reads.close();
        if let Some(old) = live.db.take() {
            match wait_unique(old) {
                Ok(old) => close_database(old),
                Err(old) => {
                    live.db = Some(old);
                    live.reads = Arc::new(Snapshots::new(live.reads.layout().clone()));
                    return poisoned();
                }
            }
        }
        let reopened = open_contained(std::path::Path::new("<reopen>"), || {
            let opened = reopen()?;
            prepare(&opened.db, opened.name(), self.settings.cfg, false)?;
            spawn_writer(opened, &self.settings)
        });
        match reopened {
            Ok(fresh) => {
                tracing::warn!(%cause, "database reopened after a storage failure; writes work again");
                metrics::counter!("idempotency_reopened_total").increment(1);
                *live = fresh;
                drop(live);
                self.reopen_backoff_ms
                    .store(REOPEN_BACKOFF_MS, Ordering::Relaxed);
                take_reserve(&self.settings);
                Ok(())
            }
            Err(e) => {
                tracing::error!(error = %e, %cause, "reopening the database failed; writes stay refused");
                // The reserve stays given back: the room it left is for
                // the next attempt, not held away from it.
                let backoff = self.reopen_backoff_ms.load(Ordering::Relaxed);
                self.reopen_backoff_ms
                    .store((backoff * 2).min(REOPEN_BACKOFF_MAX_MS), Ordering::Relaxed);
                live.poison.reopen_failed(e.to_string());
                // Reads (replays) go on from a view that writes nothing,
                // until a later attempt reopens the file for writing.
                if let Some(file) = &self.file {
                    match open_contained(file, || open::open_read_view(file)) {
                        Ok(view) => {
                            // Nothing commits to the view: its snapshot
                            // never goes stale.
                            live.db = Some(Arc::new(view));
                            live.overlay = Arc::new(Overlay::default());
                            live.reads = Arc::new(Snapshots::new(live.reads.layout().clone()));
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "no read view either; reads fail until a reopen works");
                        }
                    }
                }
                live.poison.check()
            }
        }
    }

    /// The database, for reads, with the acknowledged values it has not
    /// committed yet and the kept read snapshot. After a failed reopen
    /// there is none until a later attempt succeeds.
    fn snapshot(&self) -> Result<View> {
        {
            let live = self.live.read_recursive();
            if let Some(db) = live.db.clone() {
                return Ok((db, live.overlay.clone(), live.reads.clone()));
            }
        }
        self.try_reopen()?;
        let live = self.live.read_recursive();
        match (&live.db, live.poison.cause()) {
            (Some(db), _) => Ok((db.clone(), live.overlay.clone(), live.reads.clone())),
            (None, Some(cause)) => Err(Error::Poisoned { cause }),
            (None, None) => Err(Error::Closed),
        }
    }

    /// The database, for a read over whole tables (lists, scans, counts):
    /// first the writer commits what its open transaction holds, so the
    /// read sees every write acknowledged before it. On a poisoned backend
    /// the read sees the last commit (acknowledged writes after it come
    /// back with the reopen that applies the journal).
    fn db(&self) -> Result<Arc<Database>> {
        self.committed().map(|(db, _)| db)
    }

    /// [`Self::db`], with the kept read snapshot (taken after the commit,
    /// it sees it).
    fn committed(&self) -> Result<(Arc<Database>, Arc<Snapshots>)> {
        let (db, overlay, reads) = self.snapshot()?;
        if overlay.held() {
            self.commit_open()?;
        }
        Ok((db, reads))
    }

    /// Asks the writer to commit its open transaction; waits for it.
    fn commit_open(&self) -> Result<()> {
        let (tx, poison) = {
            let live = self.live.read_recursive();
            (live.tx.clone(), live.poison.clone())
        };
        if poison.cause().is_some() || writer::on_writer_of(&poison) {
            return Ok(());
        }
        request_commit(&tx, &poison)
    }
}

/// What a read needs: the database, the acknowledged values it has not
/// committed yet, and the kept read snapshot.
type View = (Arc<Database>, Arc<Overlay>, Arc<Snapshots>);

/// Sends the writer a [`Msg::Commit`] and waits for its answer.
fn request_commit(tx: &Sender<Msg>, poison: &Poison) -> Result<()> {
    let (reply, answer) = reply::reply();
    if tx.send(Msg::Commit(reply)).is_err() {
        return Err(closed(poison));
    }
    answer.recv().unwrap_or_else(|| Err(closed(poison)))
}

/// Takes the recovery reserve (again), as far as the disk has room; short
/// of room the engine runs without it, and says so.
fn take_reserve(s: &WriterSettings) {
    let Some(reserve) = &s.reserve else { return };
    match reserve.take() {
        Ok(held) if held < reserve.target() => tracing::warn!(
            held,
            target = reserve.target(),
            "the disk is short of space: the recovery reserve holds less than its target"
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e,
            "no recovery reserve: the disk is short of space; a full disk may need space freed to recover"),
    }
}

/// Starts a writer thread on a prepared database, after applying what its
/// journal holds beyond the last checkpoint.
fn spawn_writer(opened: Opened, s: &WriterSettings) -> Result<Live, OpenError> {
    let name = opened.name().to_path_buf();
    let Opened { db, journal, .. } = opened;
    let journal = match journal {
        Some(path) => {
            let storage = JournalStorage::beside_path(&path).map_err(|e| OpenError::Storage {
                context: "opening the journal",
                source: Box::new(e),
            })?;
            Some(recover::open_journal(
                &db,
                &name,
                storage,
                s.checkpoint_bytes,
            )?)
        }
        None => None,
    };
    open::migrate_if_asked(&db, &name, s.migration, s.clock.now_ms())?;
    let seq = writer::read_sequences(&db)
        .map_err(|e| e.open_error(&name, "reading the engine's counters"))?;
    let catalog = open::open_catalog(&db, &name, s.clock.now_ms(), s.seal_rule)?;
    if let Some(catalog) = &catalog {
        warm::warm_hot_partition(&db, catalog.hot().partition);
    }
    let db = Arc::new(db);
    let (tx, rx) = crossbeam_channel::bounded(s.queue_capacity);
    let poison = Arc::new(Poison::default());
    let format = if catalog.is_some() { 3 } else { 2 };
    let (overlay, layout) = match &catalog {
        Some(catalog) => (
            Overlay::partitioned(),
            Layout::Partitioned(catalog.filters().clone()),
        ),
        None => (Overlay::default(), Layout::Single),
    };
    let overlay = Arc::new(overlay);
    let reads = Arc::new(Snapshots::new(layout));
    let writer = Writer {
        db: db.clone(),
        rx,
        clock: s.clock.clone(),
        cfg: s.cfg,
        poison: poison.clone(),
        max_batch: s.max_batch,
        max_group_bytes: s.max_group_bytes,
        seq,
        journal,
        checkpoint_bytes: s.checkpoint_bytes,
        reserve: s.reserve.clone(),
        overlay: overlay.clone(),
        reads: reads.clone(),
        catalog,
    };
    let writer = std::thread::Builder::new()
        .name("idempotency-writer".into())
        .spawn(move || writer.run())
        .map_err(|source| OpenError::ThreadStart {
            thread: "writer",
            source,
        })?;
    Ok(Live {
        db: Some(db),
        tx,
        poison,
        writer: Some(writer),
        overlay,
        reads,
        format,
    })
}

/// The only handle of `db`, once the reads using it are done (up to about
/// a second); the handle back if reads still hold it.
fn wait_unique(mut db: Arc<Database>) -> std::result::Result<Database, Arc<Database>> {
    for _ in 0..1_000 {
        match Arc::try_unwrap(db) {
            Ok(db) => return Ok(db),
            Err(shared) => db = shared,
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    Err(db)
}

/// Closes a database; after a panic inside redb its `Drop` may panic on
/// poisoned locks: contain that.
fn close_database(db: Database) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(db)));
}

/// Writes, syncs and removes a small file: whether the file system takes
/// writes again (a full disk has space).
pub(crate) fn probe_write(path: &std::path::Path) -> std::io::Result<()> {
    use std::io::Write;
    let result = std::fs::File::create(path).and_then(|mut f| {
        f.write_all(&vec![0_u8; 64 * 1024])?;
        f.sync_data()
    });
    let _ = std::fs::remove_file(path);
    result
}

impl Backend for RedbStore {
    fn check(&self) -> Result<()> {
        // From an app's local write (on the writer thread) the answer is
        // the poison as it stands: a reopen from there would join itself,
        // and `writer()` refuses that thread's writes with `Reentrant`.
        let poison = self.live.read_recursive().poison.clone();
        if writer::on_writer_of(&poison) {
            return poison.check();
        }
        self.writer().map(|_| ())
    }

    fn record(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        contained("reading the database", || {
            // The database handle outlives the snapshot taken from it.
            let (db, overlay, reads) = self.snapshot()?;
            read::record_seen(&reads, &*db, &overlay, key)
        })
    }

    fn in_doubt(&self, limit: usize, now_ms: u64) -> Result<Vec<(IdempotencyKey, Record)>> {
        contained("reading the database", || {
            let (db, reads) = self.committed()?;
            read::in_doubt(&*db, reads.layout(), limit, now_ms)
        })
    }

    fn scan(&self, visit: &mut (dyn FnMut(Scanned) -> bool + Send)) -> Result<()> {
        contained("reading the database", || {
            let (db, reads) = self.committed()?;
            read::scan(&*db, reads.layout(), visit)
        })
    }

    fn scan_in_key_order(&self, visit: &mut (dyn FnMut(Scanned) -> bool + Send)) -> Result<()> {
        contained("reading the database", || {
            let (db, reads) = self.committed()?;
            read::scan_in_key_order(&*db, reads.layout(), visit)
        })
    }

    fn oldest_in_doubt_ms(&self, now_ms: u64) -> Result<Option<u64>> {
        contained("reading the database", || {
            read::oldest_in_doubt(&*self.db()?, now_ms)
        })
    }

    fn sweep_due(&self, now_ms: u64) -> Result<bool> {
        contained("reading the database", || {
            read::sweep_due(&*self.db()?, now_ms, Some(self.settings.cfg.ttl_ms))
        })
    }

    fn outbox(&self, limit: usize) -> Result<Vec<OutboxEntry>> {
        contained("reading the database", || read::outbox(&*self.db()?, limit))
    }

    fn dead_letters(&self, limit: usize) -> Result<Vec<crate::dead_letter::DeadLetter>> {
        contained("reading the database", || {
            read::dead_letters(&*self.db()?, limit)
        })
    }

    fn outbox_len(&self) -> Result<u64> {
        contained("reading the database", || read::outbox_len(&*self.db()?))
    }

    fn entity(&self, entity: &str) -> Result<Option<EntityState>> {
        contained("reading the database", || {
            let (db, overlay, reads) = self.snapshot()?;
            read::entity_seen(&reads, &*db, &overlay, entity)
        })
    }

    fn steps(&self, key: &IdempotencyKey) -> Result<Vec<crate::store::StepRecord>> {
        let now_ms = self.settings.clock.now_ms();
        contained("reading the database", || {
            let (db, reads) = self.committed()?;
            read::steps(&*reads.current(&*db, "reading effect steps")?, key, now_ms)
        })
    }

    fn history(&self, key: &IdempotencyKey) -> Result<Vec<crate::store::HistoryRecord>> {
        contained("reading the database", || {
            let (db, reads) = self.committed()?;
            read::history(&*db, reads.layout(), key)
        })
    }

    fn reserve_step_pending(&self, req: StepRequest) -> Pending<StepRecord> {
        self.call_pending(move |t| t.reserve_step(req))
    }

    fn finish_step_pending(&self, req: FinishStepRequest) -> Pending<StepRecord> {
        self.call_pending(move |t| t.finish_step(req))
    }

    fn reserve_step(&self, req: StepRequest) -> Result<StepRecord> {
        self.reserve_step_pending(req).wait()
    }

    fn finish_step(&self, req: FinishStepRequest) -> Result<StepRecord> {
        self.finish_step_pending(req).wait()
    }

    fn settle_step_pending(&self, req: SettleStepRequest) -> Pending<StepRecord> {
        self.call_pending(move |t| t.settle_step(req))
    }

    fn settle_step(&self, req: SettleStepRequest) -> Result<StepRecord> {
        self.settle_step_pending(req).wait()
    }

    fn may_block(&self) -> bool {
        // Healthy: writes go to the writer's queue (4,096 deep by default)
        // and point reads are snapshot reads. Poisoned: the next write
        // tries a reopen on the caller's thread.
        self.live.read_recursive().poison.cause().is_some()
    }

    fn claim_pending(&self, req: ClaimRequest) -> Pending<ClaimResult> {
        let key = req.key.clone();
        let op = Box::new(move |t: &mut Tables<'_>| t.claim(&req));
        self.submit_pending(op, false, |tx, detached| {
            let token_of = |r: &ClaimResult| match r {
                ClaimResult::Claimed(c) => Some(c.token),
                ClaimResult::Held(_) => None,
            };
            Some(release_unheard(key, token_of, tx.clone(), detached.clone()))
        })
    }

    fn complete_pending(&self, req: CompleteRequest) -> Pending<()> {
        self.call_pending(move |t| t.complete(req))
    }

    fn release_pending(&self, key: IdempotencyKey, token: u64) -> Pending<()> {
        self.call_pending(move |t| t.release(&key, token))
    }

    fn mark_in_doubt_pending(&self, req: InDoubtRequest) -> Pending<()> {
        self.call_pending(move |t| t.mark_in_doubt(req))
    }

    fn settle_then_claim_pending(
        &self,
        req: SettleRequest,
        claim: ClaimRequest,
    ) -> Pending<Settled<Claimed>> {
        let key = claim.key.clone();
        let op = Box::new(move |t: &mut Tables<'_>| t.settle_then_claim(req, &claim));
        self.submit_pending(op, false, |tx, detached| {
            let token_of = |r: &Settled<Claimed>| match r {
                Settled::NotExecuted(c) => Some(c.token),
                Settled::Completed(_) | Settled::StillInDoubt(_) => None,
            };
            Some(release_unheard(key, token_of, tx.clone(), detached.clone()))
        })
    }

    fn claim(&self, req: ClaimRequest) -> Result<ClaimResult> {
        self.claim_pending(req).wait()
    }

    fn complete(&self, req: CompleteRequest) -> Result<()> {
        self.complete_pending(req).wait()
    }

    fn release(&self, key: IdempotencyKey, token: u64) -> Result<()> {
        self.release_pending(key, token).wait()
    }

    fn mark_in_doubt(&self, req: InDoubtRequest) -> Result<()> {
        self.mark_in_doubt_pending(req).wait()
    }

    fn mark_in_doubt_detached(&self, req: InDoubtRequest) {
        let (tx, poison) = {
            let live = self.live.read_recursive();
            (live.tx.clone(), live.poison.clone())
        };
        if poison.check().is_err() {
            return;
        }
        let job = Call::new(
            Box::new(move |t: &mut Tables<'_>| t.mark_in_doubt(req)),
            false,
            None,
        );
        self.detached.send(&tx, Box::new(job));
    }

    fn extend(&self, key: IdempotencyKey, token: u64, lease_ms: u64) -> Result<u64> {
        self.call(move |t| t.extend(&key, token, lease_ms))
    }

    fn settle(&self, req: SettleRequest) -> Result<Settled<()>> {
        self.call(move |t| t.settle(req))
    }

    fn settle_then_claim(
        &self,
        req: SettleRequest,
        claim: ClaimRequest,
    ) -> Result<Settled<Claimed>> {
        self.settle_then_claim_pending(req, claim).wait()
    }

    fn sweep(&self, limit: usize) -> Result<SweepCounts> {
        self.call(move |t| t.sweep(limit))
    }

    fn purge(&self, key: IdempotencyKey, mode: PurgeMode) -> Result<Option<State>> {
        self.call(move |t| t.purge(&key, mode))
    }

    fn transition(&self, req: TransitionRequest) -> Result<Transition> {
        self.call(move |t| t.transition(req))
    }

    fn mark_published(&self, seqs: Vec<u64>) -> Result<u64> {
        self.call(move |t| t.mark_published(&seqs))
    }

    fn dead_letter(&self, req: crate::store::DeadLetterRequest) -> Result<u64> {
        self.call(move |t| t.dead_letter(req))
    }

    fn redrive(&self, seq: u64) -> Result<Option<String>> {
        self.call(move |t| t.redrive(seq))
    }

    fn flush(&self) -> Result<()> {
        let (tx, poison) = self.writer()?;
        self.send_detached(&tx);
        request_commit(&tx, &poison)?;
        // The first commit's answer comes after every earlier group was
        // answered, so an answer nobody heard (an async `begin` dropped
        // mid-claim) has queued its release by now: a second commit covers
        // that release too.
        self.send_detached(&tx);
        request_commit(&tx, &poison)
    }

    fn local(&self, write: LocalWrite) -> Result<LocalResult> {
        self.submit(Box::new(move |t: &mut Tables<'_>| t.local(write)), true)
    }

    fn verify(&self) -> Result<(Vec<crate::verify::Damage>, u64)> {
        contained("verifying the database", || verify::verify(&*self.db()?))
    }

    fn close(&self) {
        let (tx, poison) = {
            let live = self.live.read_recursive();
            (live.tx.clone(), live.poison.clone())
        };
        let _ = tx.send(Msg::Shutdown);
        // The writer cannot wait for itself (the last handle can drop inside
        // a local write); it exits once it reads the shutdown.
        if writer::on_writer_of(&poison) {
            return;
        }
        let writer = self.live.write().writer.take();
        if let Some(writer) = writer {
            if writer.join().is_err() {
                tracing::error!("writer thread panicked");
            }
        }
    }

    fn redb_format(&self) -> Option<u32> {
        Some(self.live.read_recursive().format)
    }
}

impl Drop for RedbStore {
    fn drop(&mut self) {
        self.close();
        self.live.get_mut().reads.close();
        if let Some(db) = self.live.get_mut().db.take() {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(db)));
        }
    }
}

/// The `stored_structures` fuzz target's input: byte 0 picks the
/// structure (its low two bits) and byte 1 a partition number or the LSN a
/// journal's database is checkpointed at; the rest is the bytes. 0: a
/// journal's frames region as is; 1: frames the hook writes with correct
/// checksums (`journal::fuzz_hook`); 2: a partition row, as stored (bit 2
/// clear) or as a payload framed with a correct checksum (bit 2 set); 3: a
/// stored filter, its row's checksum computed over it. Returns whether the
/// structure decoded (a journal: whether any frame was read). Panics only
/// where a decoder broke its contract (a panic, or a value that does not
/// encode back).
#[cfg(any(test, fuzzing))]
pub(crate) fn fuzz_stored(input: &[u8]) -> bool {
    let [mode, number, bytes @ ..] = input else {
        return false;
    };
    let number = u64::from(*number);
    match mode & 3 {
        0 => journal::fuzz_hook::fuzz_read(false, number, bytes) > 0,
        1 => journal::fuzz_hook::fuzz_read(true, number, bytes) > 0,
        2 => partition::row::fuzz_decode(number, mode & 4 != 0, bytes),
        _ => partition::filter::fuzz_decode(number, bytes),
    }
}
