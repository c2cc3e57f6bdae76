//! The writer thread: every write goes through it, batched into group
//! commits.
//!
//! A caller sends a [`Job`] over a bounded channel and blocks on its own
//! reply channel. Each job is one operation with its own result type
//! ([`Call<T>`](super::job::Call)), so the protocol cannot carry an answer of the wrong kind.
//! The writer takes everything queued (up to `max_batch`), applies each job
//! in arrival order inside one redb write transaction, commits once with
//! `Durability::Immediate`, and only then answers every caller. So no caller
//! hears "claimed" or "completed" before its data is durable, and one fsync
//! serves the whole batch.
//!
//! With a journal (a database opened from a path) the work is pipelined:
//! 1. the writer applies a group in a redb write transaction that stays
//!    open across groups, appends the group's changes to the journal as
//!    one frame (written, not synced), and hands the group to the syncer
//!    thread (`syncer.rs`) at once, then goes on with the next group;
//! 2. the syncer makes every frame handed so far durable with one
//!    `fdatasync`, puts the groups' record and entity values in the
//!    [`Overlay`] (what point reads see before redb commits them), and
//!    only then answers their callers;
//! 3. every [`GROUPS_PER_COMMIT`] groups (or [`COMMIT_IDLE`] without work,
//!    or when a whole-table read asks: [`Msg::Commit`]) the writer waits
//!    until the open transaction's frames are durable and commits it with
//!    `Durability::None`, so nothing becomes visible in redb before it is
//!    durable, and empties the overlay.
//!
//! A checkpoint (a redb commit with `Durability::Immediate`) every
//! [`CHECKPOINT_BYTES`] of journal (or every half recovery reserve, if
//! less: `reserve.rs`), at a seal of the hot partition once a quarter of
//! that has passed ([`SEAL_CHECKPOINT_SHARE`]), after [`IDLE_CHECKPOINT`]
//! without work, before an isolated job and at shutdown lets the journal
//! start over. See
//! `journal.rs`.
//!
//! A refused op (fencing, bad state) fails alone. A job that is *isolated*
//! (an app's local write) gets a transaction of its own, rolled back when
//! refused. A storage error or a failed commit fails the whole batch and
//! poisons the backend: every later call says to reopen.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use crossbeam_channel::Receiver;
use redb::{Database, Durability, ReadableDatabase, WriteTransaction};

use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::store::config::StoreConfig;
use crate::store::poison::Poison;

use super::job::{fail_all, poison_backend, CommitAnswer, Job};
use super::journal::{Change, Frame, Journal, JournalError};
use super::meta::{self, Counter, MetaError};
use super::overlay::Overlay;
use super::partition::catalog::Catalog;
use super::snapshot::Snapshots;
use super::syncer::{Handed, Syncer};
use super::tables::{Sequences, Tables, META};
use crate::store::reply::ReplyTx;

/// Journal bytes after which the writer checkpoints. A checkpoint writes
/// every page dirtied since the last one, so a longer interval writes
/// fewer bytes per request: at the device, 4.4 KiB per request with
/// 32 MiB and 3.3 KiB with 128 MiB, at the same throughput (BENCHMARKS.md,
/// "fourth round"). 32 MiB bounds what an open after a crash replays,
/// and keeps the pages that replay writes within the check's in-memory
/// layer (`scratch_view.rs`, 256 MiB) even on a large database.
pub(super) const CHECKPOINT_BYTES: u64 = 32 << 20;
/// A seal of the hot partition (format 3) brings the checkpoint forward
/// once the journal holds this share of [`CHECKPOINT_BYTES`] (1/4): a
/// partition sealed by its key count (32,768 keys) takes about 28 MiB of
/// journal, so with a checkpoint at each seal each partition's leaves
/// reach the file once, in their final form; a quiet API's partitions,
/// sealed by time with few keys, do not add checkpoints.
pub(super) const SEAL_CHECKPOINT_SHARE: u64 = 4;
/// Time without work after which the writer checkpoints a dirty journal
/// (a short pause in traffic does not cost a checkpoint).
pub(super) const IDLE_CHECKPOINT: std::time::Duration = std::time::Duration::from_secs(5);

/// Group commits kept in one redb write transaction before it commits
/// (with a journal): a redb commit costs more CPU than applying a group,
/// and the journal already makes each group durable.
const GROUPS_PER_COMMIT: usize = 16;
/// Changes kept in one redb write transaction before it commits.
const CHANGES_PER_COMMIT: usize = 16_384;
/// Time without work after which the writer commits its open redb
/// transaction.
const COMMIT_IDLE: std::time::Duration = std::time::Duration::from_millis(2);

/// A message to the writer.
pub(super) enum Msg {
    Job(Box<dyn Job>),
    /// Commit what the open transaction holds, so every read (lists and
    /// scans too) sees every write acknowledged before this message.
    Commit(ReplyTx<Result<()>>),
    /// Finish the queued work and exit.
    Shutdown,
}

/// Why a batch could not commit.
enum CommitError {
    Storage(redb::Error),
    Journal(JournalError),
    /// The storage library (or the engine) panicked; the message.
    Panic(String),
    /// Syncing the journal failed (the syncer poisoned the backend).
    Synced(Arc<str>),
}

impl std::fmt::Display for CommitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CommitError::Storage(e) => e.fmt(f),
            CommitError::Journal(e) => e.fmt(f),
            CommitError::Panic(message) => write!(f, "the storage library panicked: {message}"),
            CommitError::Synced(cause) => cause.fmt(f),
        }
    }
}

impl<E: Into<redb::Error>> From<E> for CommitError {
    fn from(e: E) -> CommitError {
        CommitError::Storage(e.into())
    }
}

/// The writer thread's state.
pub(super) struct Writer {
    pub(super) db: Arc<Database>,
    pub(super) rx: Receiver<Msg>,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) cfg: StoreConfig,
    pub(super) poison: Arc<Poison>,
    pub(super) max_batch: usize,
    /// Bytes of changes after which a group takes no more jobs.
    pub(super) max_group_bytes: usize,
    pub(super) seq: Sequences,
    /// The write-ahead journal (`None`: every commit is durable in redb).
    pub(super) journal: Option<Journal>,
    /// Journal bytes after which it checkpoints: [`CHECKPOINT_BYTES`], or
    /// less so that a replay fits in the recovery reserve (`reserve.rs`).
    pub(super) checkpoint_bytes: u64,
    /// The recovery reserve, taken again after a checkpoint if it is short
    /// (`None`: none kept).
    pub(super) reserve: Option<super::reserve::Reserve>,
    /// Synced, acknowledged values redb has not committed yet.
    pub(super) overlay: Arc<Overlay>,
    /// The read snapshot point reads share: told of every commit, before
    /// the overlay is emptied and before anyone is answered.
    pub(super) reads: Arc<Snapshots>,
    /// Format 3: the partitions (`None`: format 2).
    pub(super) catalog: Option<Catalog>,
}

/// The engine's tables in `txn`: over `catalog`'s partitions in format 3.
fn tables<'t>(
    txn: &'t WriteTransaction,
    seq: Sequences,
    now: u64,
    cfg: StoreConfig,
    catalog: &'t mut Option<Catalog>,
) -> Result<Tables<'t>, redb::Error> {
    match catalog {
        Some(catalog) => Tables::open_partitioned(txn, seq, now, cfg, catalog),
        None => Tables::open(txn, seq, now, cfg),
    }
}

/// What `try_apply` applied of a group.
struct Applied {
    /// The frame's LSN (`None`: the jobs changed nothing).
    lsn: Option<u64>,
    changes: Vec<Change>,
    /// Bytes of keys and values in `changes`.
    bytes: usize,
    /// How many jobs, from the group's start, were applied.
    jobs: usize,
}

/// The redb write transaction kept open across group commits (with a
/// journal only).
struct OpenTxn {
    txn: WriteTransaction,
    /// Groups applied in it.
    groups: usize,
    /// Changes applied in it.
    changes: usize,
}

/// What the writer holds while it runs.
struct Running {
    syncer: Syncer,
    open: Option<OpenTxn>,
}

impl Writer {
    pub(super) fn run(mut self) {
        // A panic here must not leave callers believing writes succeed:
        // nobody is answered before a commit, and the poison stops the rest.
        let _guard = PoisonOnPanic(self.poison.clone());
        WRITER_OF.with(|w| w.set(Arc::as_ptr(&self.poison) as usize));
        let synced = self.journal.as_ref().map_or(0, Journal::last_lsn);
        let mut state = Running {
            syncer: Syncer::start(
                self.journal.as_ref().map(Journal::sync_handle),
                synced,
                self.overlay.clone(),
                self.poison.clone(),
            ),
            open: None,
        };
        let mut batch: Vec<Box<dyn Job>> = Vec::with_capacity(self.max_batch);
        let mut commit_waiters: Vec<ReplyTx<Result<()>>> = Vec::new();
        let mut shutdown = false;
        while !shutdown {
            let msg = match self.wait(&state) {
                Wait::Open => COMMIT_IDLE,
                Wait::Dirty => IDLE_CHECKPOINT,
                Wait::Forever => std::time::Duration::MAX,
            };
            let msg = match self.rx.recv_timeout(msg) {
                Ok(msg) => Ok(msg),
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    if state.open.is_some() {
                        let _ = self.commit_open(&mut state, None);
                    } else {
                        self.checkpoint(&mut state, false);
                    }
                    continue;
                }
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Err(()),
            };
            match msg {
                Ok(msg) => shutdown = sort(msg, &mut batch, &mut commit_waiters),
                Err(()) => break,
            }
            while !shutdown && batch.len() < self.max_batch {
                match self.rx.try_recv() {
                    Ok(msg) => shutdown = sort(msg, &mut batch, &mut commit_waiters),
                    Err(_) => break,
                }
            }
            self.process(std::mem::take(&mut batch), &mut state);
            if !commit_waiters.is_empty() {
                let result = self.commit_open(&mut state, None);
                // Answered through the syncer, after the groups before them.
                let answers: Vec<Box<dyn Job>> = commit_waiters
                    .drain(..)
                    .map(|reply| -> Box<dyn Job> {
                        Box::new(CommitAnswer {
                            reply,
                            result: match &result {
                                Ok(()) => Ok(()),
                                Err(_) => Err(self
                                    .poison
                                    .cause()
                                    .map_or(Error::Closed, |cause| Error::Poisoned { cause })),
                            },
                        })
                    })
                    .collect();
                state.syncer.hand(Handed {
                    lsn: None,
                    jobs: answers,
                    changes: Vec::new(),
                });
            }
        }
        // Everything in redb, and the file marked cleanly closed: the
        // journal holds nothing to apply.
        if self.journal.is_some() {
            self.checkpoint(&mut state, true);
        }
        // Every committed answer is out before the engine counts as closed.
        let Running { syncer, open } = state;
        drop(open);
        syncer.finish();
        // Callers still queued after shutdown hear that the engine closed.
        while let Ok(msg) = self.rx.try_recv() {
            match msg {
                Msg::Job(job) => job.fail(Error::Closed),
                Msg::Commit(reply) => reply.send(Err(Error::Closed)),
                Msg::Shutdown => {}
            }
        }
        // After a panic inside redb, dropping the database can panic on
        // its poisoned locks: contain it.
        let db = self.db;
        let _ = catch_unwind(AssertUnwindSafe(move || drop(db)));
    }

    /// How long the writer may wait for work before it has something to
    /// do on its own.
    fn wait(&self, state: &Running) -> Wait {
        if self.poison.cause().is_some() {
            return Wait::Forever;
        }
        match &self.journal {
            Some(_) if state.open.is_some() => Wait::Open,
            Some(journal) if journal.dirty() => Wait::Dirty,
            _ => Wait::Forever,
        }
    }

    /// Commits one batch in groups: a run of shared jobs is one group; an
    /// isolated job is a transaction of its own. Arrival order is kept.
    fn process(&mut self, batch: Vec<Box<dyn Job>>, state: &mut Running) {
        let mut jobs = batch.into_iter().peekable();
        while let Some(first) = jobs.next() {
            let isolated = first.isolated();
            let mut group = vec![first];
            if !isolated {
                while let Some(job) = jobs.next_if(|j| !j.isolated()) {
                    group.push(job);
                }
            }
            if let Some(cause) = self.poison.cause() {
                fail_all(group, &cause);
                continue;
            }
            if self.journal.is_some() && !isolated {
                self.journaled(group, state);
            } else {
                // An isolated job commits durably in redb, after everything
                // the open transaction holds.
                if isolated && self.commit_open(state, None).is_err() {
                    let cause = self.poison.cause().unwrap_or_else(|| "closed".into());
                    fail_all(group, &cause);
                    continue;
                }
                self.commit(group, isolated, state);
            }
        }
    }

    /// Applies a group in the open transaction and appends its frame; the
    /// syncer answers it once the frame is durable. A group whose changes
    /// reach `max_group_bytes` ends with the job that reached it; the rest
    /// goes on as the next group.
    fn journaled(&mut self, mut group: Vec<Box<dyn Job>>, state: &mut Running) {
        while !group.is_empty() {
            group = match self.journal_some(group, state) {
                Some(rest) => rest,
                None => return,
            };
        }
    }

    /// Applies and frames the longest prefix of `group` within
    /// `max_group_bytes` (at least one job); returns the jobs left over,
    /// `None` if the group failed (the engine is then poisoned and every
    /// job in `group` has its answer).
    fn journal_some(
        &mut self,
        mut group: Vec<Box<dyn Job>>,
        state: &mut Running,
    ) -> Option<Vec<Box<dyn Job>>> {
        let started = std::time::Instant::now();
        let hot_before = self.hot_partition();
        let attempt = catch_unwind(AssertUnwindSafe(|| self.try_apply(&mut group, state)));
        let failure = match attempt {
            Ok(Ok(Applied {
                lsn,
                changes,
                bytes,
                jobs,
            })) => {
                let rest = group.split_off(jobs.min(group.len()));
                #[allow(clippy::cast_precision_loss)] // batch sizes are small
                metrics::histogram!("idempotency_group_commit_ops").record(group.len() as f64);
                #[allow(clippy::cast_precision_loss)] // at most about 2 GiB
                metrics::histogram!("idempotency_group_commit_bytes").record(bytes as f64);
                metrics::histogram!("idempotency_group_commit_seconds")
                    .record(started.elapsed().as_secs_f64());
                state.syncer.hand(Handed {
                    lsn,
                    jobs: group,
                    changes,
                });
                let full = state.open.as_ref().is_some_and(|o| {
                    o.groups >= GROUPS_PER_COMMIT || o.changes >= CHANGES_PER_COMMIT
                });
                // Also right after a seal, once a part of the interval has
                // passed: the sealed partition's pages are then written in
                // their final form, once, where a checkpoint halfway through
                // its filling writes most of its leaves twice.
                let sealed = self.hot_partition() != hot_before;
                let checkpoint_due = self.journal.as_ref().is_some_and(|j| {
                    let since = j.since_checkpoint();
                    since >= self.checkpoint_bytes
                        || (sealed && since >= self.checkpoint_bytes / SEAL_CHECKPOINT_SHARE)
                });
                if checkpoint_due {
                    self.checkpoint(state, false);
                } else if full {
                    let _ = self.commit_open(state, None);
                }
                // A checkpoint or commit that failed poisoned the engine:
                // the rest hears so.
                if let Some(cause) = self.poison.cause() {
                    fail_all(rest, &cause);
                    return None;
                }
                return Some(rest);
            }
            Ok(Err(e)) => e,
            Err(panic) => CommitError::Panic(panic_message(panic.as_ref())),
        };
        // The open transaction is lost with everything in it; whatever of
        // it was acknowledged is in the journal, which a reopen applies.
        state.open = None;
        let cause = self.poison_with("group commit failed", &failure);
        fail_all(group, &cause);
        None
    }

    /// Applies jobs of `group` in the open transaction (begun if needed),
    /// in order, until their changes reach `max_group_bytes`, and appends
    /// their frame, unsynced.
    fn try_apply(
        &mut self,
        group: &mut [Box<dyn Job>],
        state: &mut Running,
    ) -> Result<Applied, CommitError> {
        if state.open.is_none() {
            let mut txn = self.db.begin_write()?;
            txn.set_durability(Durability::None)?;
            state.open = Some(OpenTxn {
                txn,
                groups: 0,
                changes: 0,
            });
        }
        let Some(open) = state.open.as_mut() else {
            return Err(CommitError::Panic("no open transaction".into()));
        };
        let (rx, others) = (&self.rx, group.len() > 1);
        let waiting = move || others || !rx.is_empty();
        let (after, changes, bytes, jobs, dropped, merged) = {
            let now = self.clock.now_ms();
            let mut tables = tables(&open.txn, self.seq, now, self.cfg, &mut self.catalog)?;
            tables.clients_waiting = Some(&waiting);
            tables.keep_changes();
            tables.seal_if_due()?;
            let mut jobs = 0;
            for job in group.iter_mut() {
                if jobs > 0 && tables.changes_bytes >= self.max_group_bytes {
                    break;
                }
                if let Some(e) = job.apply(&mut tables) {
                    return Err(e.into());
                }
                jobs += 1;
            }
            let changes = tables.changes.take().unwrap_or_default();
            let dropped = tables.take_dropped();
            let merged = tables.merge_bytes;
            (
                tables.seq,
                changes,
                tables.changes_bytes,
                jobs,
                dropped,
                merged,
            )
        };
        self.forget_dropped(dropped);
        if changes.is_empty() && after == self.seq {
            return Ok(Applied {
                lsn: None,
                changes,
                bytes,
                jobs,
            });
        }
        let Some(journal) = self.journal.as_mut() else {
            return Err(CommitError::Panic("no journal".into()));
        };
        let frame = Frame {
            next_token: after.token,
            next_outbox: after.outbox,
            changes,
        };
        let lsn = journal
            .append_unsynced(&frame, state.syncer.synced())
            .map_err(CommitError::Journal)?;
        // A merge's copies count toward the next checkpoint as if their
        // bytes were in the frame: they bound a recovery's replay, and the
        // merged sources' pages are reused only once a checkpoint has made
        // the copies durable (a merge between checkpoints grows the file).
        journal.charge(merged);
        self.seq = after;
        open.groups += 1;
        open.changes += frame.changes.len();
        Ok(Applied {
            lsn: Some(lsn),
            changes: frame.changes,
            bytes,
            jobs,
        })
    }

    /// Commits the open transaction once every frame in it is durable (a
    /// commit makes its data visible to every read); `checkpoint`: durably,
    /// as a checkpoint (`Some(true)`: the engine's last one, which also
    /// marks the file cleanly closed). A failure poisons the backend (the
    /// journal still holds every acknowledged group, and a reopen applies
    /// it); the error is what callers waiting on it hear.
    fn commit_open(&mut self, state: &mut Running, checkpoint: Option<bool>) -> Result<()> {
        if let Some(cause) = self.poison.cause() {
            state.open = None;
            return Err(Error::Poisoned { cause });
        }
        let attempt = catch_unwind(AssertUnwindSafe(|| self.try_commit_open(state, checkpoint)));
        let failure = match attempt {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e,
            Err(panic) => CommitError::Panic(panic_message(panic.as_ref())),
        };
        // A commit that failed part way may have changed the file.
        self.reads.committed();
        state.open = None;
        let what = if checkpoint.is_some() {
            "checkpoint failed"
        } else {
            "group commit failed"
        };
        let cause = self.poison_with(what, &failure);
        Err(Error::Poisoned { cause })
    }

    fn try_commit_open(
        &mut self,
        state: &mut Running,
        checkpoint: Option<bool>,
    ) -> Result<(), CommitError> {
        let Some(journal) = self.journal.as_mut() else {
            return Ok(());
        };
        let open = state.open.take();
        if open.is_none() && checkpoint.is_none() {
            return Ok(());
        }
        let started = std::time::Instant::now();
        state
            .syncer
            .wait_synced(journal.last_lsn())
            .map_err(CommitError::Synced)?;
        let txn = match open {
            Some(open) => open.txn,
            None => self.db.begin_write()?,
        };
        {
            let mut table = txn.open_table(META)?;
            meta::write_counter(&mut table, Counter::NextToken, self.seq.token)?;
            meta::write_counter(&mut table, Counter::NextOutboxSeq, self.seq.outbox)?;
            meta::write_counter(&mut table, Counter::JournalLsn, journal.last_lsn())?;
            if checkpoint == Some(true) {
                meta::write_clean(&mut table, true)?;
            }
        }
        let mut txn = txn;
        if checkpoint.is_some() {
            txn.set_durability(Durability::Immediate)?;
        }
        let committed = txn.commit();
        // Readers take a new snapshot first, then lose the overlay's
        // values: a read sees one or the other (`snapshot.rs`).
        self.reads.committed();
        committed?;
        // Every value the overlay held is now in redb's last commit.
        self.overlay.clear();
        if checkpoint.is_some() {
            journal.checkpointed().map_err(CommitError::Journal)?;
            metrics::histogram!("idempotency_checkpoint_seconds")
                .record(started.elapsed().as_secs_f64());
        }
        Ok(())
    }

    /// Applies `group` in a transaction of its own and commits it durably
    /// in redb (no journal, or an isolated job), then answers.
    /// On a storage error or a panic the backend is poisoned first, then
    /// every caller of the group hears it.
    fn commit(&mut self, mut group: Vec<Box<dyn Job>>, isolated: bool, state: &mut Running) {
        let started = std::time::Instant::now();
        let attempt = catch_unwind(AssertUnwindSafe(|| self.try_commit(&mut group, isolated)));
        let failure = match attempt {
            Ok(Ok(seq)) => {
                #[allow(clippy::cast_precision_loss)] // batch sizes are small
                metrics::histogram!("idempotency_group_commit_ops").record(group.len() as f64);
                metrics::histogram!("idempotency_group_commit_seconds")
                    .record(started.elapsed().as_secs_f64());
                self.seq = seq;
                state.syncer.hand(Handed {
                    lsn: None,
                    jobs: group,
                    changes: Vec::new(),
                });
                return;
            }
            Ok(Err(e)) => e,
            Err(panic) => CommitError::Panic(panic_message(panic.as_ref())),
        };
        self.reads.committed();
        let cause = self.poison_with("group commit failed", &failure);
        fail_all(group, &cause);
    }

    /// Poisons the backend with `what: failure`; returns the cause.
    fn poison_with(&self, what: &str, failure: &CommitError) -> Arc<str> {
        if let CommitError::Synced(cause) = failure {
            // The syncer has poisoned the backend already.
            return cause.clone();
        }
        poison_backend(&self.poison, format!("{what}: {failure}"))
    }

    /// Returns the counters after the commit (unchanged if an isolated job
    /// was refused and rolled back). The commit is durable in redb; with a
    /// journal it is also a checkpoint (the app's closure may have written
    /// its own tables, which the journal does not know).
    fn try_commit(
        &mut self,
        group: &mut [Box<dyn Job>],
        isolated: bool,
    ) -> Result<Sequences, CommitError> {
        let mut txn = self.db.begin_write()?;
        txn.set_durability(Durability::Immediate)?;
        let (rx, others) = (&self.rx, group.len() > 1);
        let waiting = move || others || !rx.is_empty();
        let after = {
            let now = self.clock.now_ms();
            let mut tables = tables(&txn, self.seq, now, self.cfg, &mut self.catalog)?;
            tables.clients_waiting = Some(&waiting);
            // Not before an isolated job, whose transaction may roll back.
            if !isolated {
                tables.seal_if_due()?;
            }
            for job in group.iter_mut() {
                if let Some(e) = job.apply(&mut tables) {
                    return Err(e.into());
                }
            }
            (tables.seq, tables.take_dropped())
        };
        let (after, dropped) = after;
        if isolated && group.iter().any(|job| job.refused()) {
            txn.abort()?;
            return Ok(self.seq);
        }
        {
            let mut table = txn.open_table(META)?;
            if after != self.seq {
                meta::write_counter(&mut table, Counter::NextToken, after.token)?;
                meta::write_counter(&mut table, Counter::NextOutboxSeq, after.outbox)?;
            }
            if let Some(journal) = &self.journal {
                meta::write_counter(&mut table, Counter::JournalLsn, journal.last_lsn())?;
            }
        }
        let committed = txn.commit();
        // Before the group is answered: a read after its answer sees it.
        self.reads.committed();
        committed?;
        self.forget_dropped(dropped);
        if let Some(journal) = &mut self.journal {
            journal.checkpointed().map_err(CommitError::Journal)?;
        }
        Ok(after)
    }

    /// Format 3: forgets partitions a transaction that will stand dropped.
    fn forget_dropped(&mut self, dropped: Vec<u64>) {
        if let Some(catalog) = self.catalog.as_mut() {
            for p in dropped {
                catalog.dropped(p);
            }
        }
    }

    /// The hot partition's number (format 3; `None` for format 2): a
    /// change across a group means the group sealed it.
    fn hot_partition(&self) -> Option<u64> {
        self.catalog.as_ref().map(|c| c.hot().partition)
    }

    /// Makes every commit so far durable in redb, so the journal can start
    /// over. A failure poisons the backend (the journal still holds
    /// everything, and a reopen applies it). `closing`: the engine's last
    /// checkpoint, which also marks the file cleanly closed (its journal
    /// is then not needed to open it).
    fn checkpoint(&mut self, state: &mut Running, closing: bool) {
        if self.poison.cause().is_some() {
            return;
        }
        if self.commit_open(state, Some(closing)).is_ok() && !closing {
            // Space may have come back since the reserve was last short.
            if let Some(reserve) = &self.reserve {
                if let Err(e) = reserve.take() {
                    tracing::debug!(error = %e, "recovery reserve still not held");
                }
            }
        }
    }
}

/// What the writer waits for when its queue is empty.
enum Wait {
    /// Acknowledged groups wait in the open transaction: commit them
    /// after [`COMMIT_IDLE`] without work.
    Open,
    /// The journal holds frames since the last checkpoint: checkpoint
    /// after [`IDLE_CHECKPOINT`].
    Dirty,
    Forever,
}

/// Puts a message where it belongs; whether it says to shut down.
fn sort(
    msg: Msg,
    batch: &mut Vec<Box<dyn Job>>,
    commit_waiters: &mut Vec<ReplyTx<Result<()>>>,
) -> bool {
    match msg {
        Msg::Job(job) => batch.push(job),
        Msg::Commit(reply) => commit_waiters.push(reply),
        Msg::Shutdown => return true,
    }
    false
}

pub(super) use crate::store::panic_message;

/// The counters stored in the meta table of a prepared database (format
/// 2: both are always there).
///
/// # Errors
///
/// [`MetaError::Damaged`] for a damaged or missing counter: never a
/// default, which would hand out fencing tokens again.
pub(super) fn read_sequences(db: &Database) -> Result<Sequences, MetaError> {
    let txn = db.begin_read()?;
    let table = txn.open_table(META)?;
    Ok(Sequences {
        token: meta::required_counter(&table, Counter::NextToken)?,
        outbox: meta::required_counter(&table, Counter::NextOutboxSeq)?,
    })
}

thread_local! {
    /// On a writer thread: the identity (its poison cell's address) of the
    /// backend it writes for. An app's local write runs on this thread, and
    /// a call from it back into the same backend's writer would wait for
    /// itself forever.
    static WRITER_OF: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Whether the current thread is the writer of the backend owning `poison`.
pub(super) fn on_writer_of(poison: &Arc<Poison>) -> bool {
    WRITER_OF.with(|w| w.get() == Arc::as_ptr(poison) as usize)
}

struct PoisonOnPanic(Arc<Poison>);

impl Drop for PoisonOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.set("the writer thread panicked".to_string());
        }
    }
}
