//! The writer thread: every write goes through it, batched into group
//! commits.
//!
//! A caller sends a [`Job`] over a bounded channel and blocks on its own
//! reply channel. Each job is one operation with its own result type
//! ([`Call<T>`]), so the protocol cannot carry an answer of the wrong kind.
//! The writer takes everything queued (up to `max_batch`), applies each job
//! in arrival order inside one redb write transaction, commits once with
//! `Durability::Immediate`, and only then answers every caller. So no caller
//! hears "claimed" or "completed" before its data is durable, and one fsync
//! serves the whole batch.
//!
//! With a journal (a database opened from a path), the batch's changes are
//! appended to the journal as one frame with one `fdatasync` before redb
//! commits them with `Durability::None`; a checkpoint (a redb commit with
//! `Durability::Immediate`) every [`CHECKPOINT_BYTES`] of journal, after
//! [`IDLE_CHECKPOINT`] without work, before an isolated job and at shutdown
//! lets the journal start over. See `journal.rs`.
//!
//! A refused op (fencing, bad state) fails alone. A job that is *isolated*
//! (an app's local write) gets a transaction of its own, rolled back when
//! refused. A storage error or a failed commit fails the whole batch and
//! poisons the backend: every later call says to reopen.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use crossbeam_channel::Receiver;
use redb::{Database, Durability, ReadableDatabase};

use crate::clock::Clock;
use crate::config::StoreConfig;
use crate::error::{Error, Result};
use crate::store::poison::Poison;

use super::journal::{Frame, Journal, JournalError};
use super::reply::ReplyTx;
use super::tables::{
    OpError, Sequences, Tables, META, META_JOURNAL_CLEAN, META_JOURNAL_LSN, META_NEXT_OUTBOX,
    META_NEXT_TOKEN,
};

/// Journal bytes after which the writer checkpoints. A checkpoint writes
/// every page dirtied since the last one; 32 MiB measured fewer bytes per
/// request than 128 MiB (3.3 KiB against 7.3 KiB, BENCHMARKS.md).
pub(super) const CHECKPOINT_BYTES: u64 = 32 << 20;
/// Time without work after which the writer checkpoints a dirty journal
/// (a short pause in traffic does not cost a checkpoint).
pub(super) const IDLE_CHECKPOINT: std::time::Duration = std::time::Duration::from_secs(5);

/// A message to the writer.
pub(super) enum Msg {
    Job(Box<dyn Job>),
    /// Finish the queued work and exit.
    Shutdown,
}

/// One queued operation. It stays in the writer's hands from the moment
/// it is applied until it is answered, so a storage failure or a panic
/// anywhere in its batch can poison the backend *before* its caller hears
/// anything.
pub(super) trait Job: Send {
    /// Whether it needs a transaction of its own, rolled back if refused.
    fn isolated(&self) -> bool;
    /// Applies the operation (once) and keeps its result for `deliver`.
    /// Returns the storage error that sank the batch, if any.
    fn apply(&mut self, tables: &mut Tables<'_>) -> Option<redb::Error>;
    /// Whether the applied operation was refused (an isolated job is then
    /// rolled back).
    fn refused(&self) -> bool;
    /// The transaction committed: sends the kept result.
    fn deliver(self: Box<Self>);
    /// Sends `error` instead (the batch failed, or the backend is poisoned
    /// or closing).
    fn fail(self: Box<Self>, error: Error);
}

/// An operation on the tables producing a `T`.
pub(super) type Op<T> = Box<dyn FnOnce(&mut Tables<'_>) -> Result<T, OpError> + Send>;

/// A typed job: the operation and where its `Result<T>` goes (`None`:
/// nobody waits, as for a dropped claim).
pub(super) struct Call<T> {
    op: Option<Op<T>>,
    isolated: bool,
    reply: Option<ReplyTx<Result<T>>>,
    result: Option<Result<T>>,
}

impl<T> Call<T> {
    pub(super) fn new(op: Op<T>, isolated: bool, reply: Option<ReplyTx<Result<T>>>) -> Call<T> {
        Call {
            op: Some(op),
            isolated,
            reply,
            result: None,
        }
    }
}

impl<T: Send + 'static> Job for Call<T> {
    fn isolated(&self) -> bool {
        self.isolated
    }

    fn apply(&mut self, tables: &mut Tables<'_>) -> Option<redb::Error> {
        let op = self.op.take()?;
        match op(tables) {
            Ok(value) => self.result = Some(Ok(value)),
            Err(OpError::Refused(e)) => self.result = Some(Err(e)),
            Err(OpError::Fatal(e)) => return Some(e),
        }
        None
    }

    fn refused(&self) -> bool {
        matches!(self.result, Some(Err(_)))
    }

    fn deliver(self: Box<Self>) {
        if let (Some(to), Some(result)) = (self.reply, self.result) {
            to.send(result);
        }
    }

    fn fail(self: Box<Self>, error: Error) {
        if let Some(to) = self.reply {
            to.send(Err(error));
        }
    }
}

/// Why a batch could not commit.
enum CommitError {
    Storage(redb::Error),
    Journal(JournalError),
    /// The storage library (or the engine) panicked; the message.
    Panic(String),
}

impl std::fmt::Display for CommitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CommitError::Storage(e) => e.fmt(f),
            CommitError::Journal(e) => e.fmt(f),
            CommitError::Panic(message) => write!(f, "the storage library panicked: {message}"),
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
    pub(super) seq: Sequences,
    /// The write-ahead journal (`None`: every commit is durable in redb).
    pub(super) journal: Option<Journal>,
}

impl Writer {
    pub(super) fn run(mut self) {
        // A panic here must not leave callers believing writes succeed:
        // nobody is answered before a commit, and the poison stops the rest.
        let _guard = PoisonOnPanic(self.poison.clone());
        WRITER_OF.with(|w| w.set(Arc::as_ptr(&self.poison) as usize));
        let notifier = Notifier::start();
        let mut batch: Vec<Box<dyn Job>> = Vec::with_capacity(self.max_batch);
        let mut shutdown = false;
        while !shutdown {
            let dirty = self.journal.as_ref().is_some_and(Journal::dirty);
            let msg = if dirty {
                match self.rx.recv_timeout(IDLE_CHECKPOINT) {
                    Ok(msg) => Ok(msg),
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                        self.checkpoint(false);
                        continue;
                    }
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Err(()),
                }
            } else {
                self.rx.recv().map_err(|_| ())
            };
            match msg {
                Ok(Msg::Job(job)) => batch.push(job),
                Ok(Msg::Shutdown) | Err(()) => break,
            }
            while batch.len() < self.max_batch {
                match self.rx.try_recv() {
                    Ok(Msg::Job(job)) => batch.push(job),
                    Ok(Msg::Shutdown) => {
                        shutdown = true;
                        break;
                    }
                    Err(_) => break,
                }
            }
            self.process(std::mem::take(&mut batch), &notifier);
        }
        // Everything in redb, and the file marked cleanly closed: the
        // journal holds nothing to apply.
        if self.journal.is_some() {
            self.checkpoint(true);
        }
        // Every committed answer is out before the engine counts as closed.
        notifier.finish();
        // Callers still queued after shutdown hear that the engine closed.
        while let Ok(msg) = self.rx.try_recv() {
            if let Msg::Job(job) = msg {
                job.fail(Error::Closed);
            }
        }
        // After a panic inside redb, dropping the database can panic on
        // its poisoned locks: contain it.
        let db = self.db;
        let _ = catch_unwind(AssertUnwindSafe(move || drop(db)));
    }

    /// Commits one batch in groups: a run of shared jobs is one
    /// transaction; an isolated job is a transaction of its own. Arrival
    /// order is kept.
    fn process(&mut self, batch: Vec<Box<dyn Job>>, notifier: &Notifier) {
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
                for job in group {
                    job.fail(Error::Poisoned {
                        cause: cause.clone(),
                    });
                }
                continue;
            }
            self.commit(group, isolated, notifier);
        }
    }

    /// Applies `group` in one transaction and commits it, then answers.
    /// On a storage error or a panic the backend is poisoned first, then
    /// every caller of the group hears it.
    fn commit(&mut self, mut group: Vec<Box<dyn Job>>, isolated: bool, notifier: &Notifier) {
        let started = std::time::Instant::now();
        let attempt = catch_unwind(AssertUnwindSafe(|| self.try_commit(&mut group, isolated)));
        let failure = match attempt {
            Ok(Ok(seq)) => {
                #[allow(clippy::cast_precision_loss)] // batch sizes are small
                metrics::histogram!("idempotency_group_commit_ops").record(group.len() as f64);
                metrics::histogram!("idempotency_group_commit_seconds")
                    .record(started.elapsed().as_secs_f64());
                self.seq = seq;
                notifier.deliver(group);
                if self
                    .journal
                    .as_ref()
                    .is_some_and(|j| j.since_checkpoint() >= CHECKPOINT_BYTES)
                {
                    self.checkpoint(false);
                }
                return;
            }
            Ok(Err(e)) => e,
            Err(panic) => CommitError::Panic(panic_message(panic.as_ref())),
        };
        let cause = self.poison_with("group commit failed", &failure);
        for job in group {
            job.fail(Error::Poisoned {
                cause: cause.clone(),
            });
        }
    }

    /// Poisons the backend with `what: failure`; returns the cause.
    fn poison_with(&self, what: &str, failure: &CommitError) -> Arc<str> {
        let cause: Arc<str> = format!("{what}: {failure}").into();
        tracing::error!(%cause, "engine poisoned");
        metrics::counter!("idempotency_poisoned_total").increment(1);
        self.poison.set(cause.to_string());
        cause
    }

    /// Returns the counters after the commit (unchanged if an isolated job
    /// was refused and rolled back).
    ///
    /// With a journal, a shared group's changes become one frame, appended
    /// and synced before redb commits them without a sync; an isolated job
    /// (whose closure may write the app's own tables, which the journal
    /// does not know) commits durably in redb instead, which is also a
    /// checkpoint.
    fn try_commit(
        &mut self,
        group: &mut [Box<dyn Job>],
        isolated: bool,
    ) -> Result<Sequences, CommitError> {
        let journaled = self.journal.is_some() && !isolated;
        let mut txn = self.db.begin_write()?;
        txn.set_durability(if journaled {
            Durability::None
        } else {
            Durability::Immediate
        })?;
        let (after, changes) = {
            let mut tables = Tables::open(&txn, self.seq, self.clock.now_ms(), self.cfg)?;
            if journaled {
                tables.keep_changes();
            }
            for job in group.iter_mut() {
                if let Some(e) = job.apply(&mut tables) {
                    return Err(e.into());
                }
            }
            (tables.seq, tables.changes.take().unwrap_or_default())
        };
        if isolated && group.iter().any(|job| job.refused()) {
            txn.abort()?;
            return Ok(self.seq);
        }
        if journaled && changes.is_empty() && after == self.seq {
            // Nothing changed: nothing to make durable.
            txn.abort()?;
            return Ok(after);
        }
        {
            let mut meta = txn.open_table(META)?;
            if after != self.seq {
                meta.insert(META_NEXT_TOKEN, after.token.to_le_bytes().as_slice())?;
                meta.insert(META_NEXT_OUTBOX, after.outbox.to_le_bytes().as_slice())?;
            }
            if let Some(journal) = &mut self.journal {
                let lsn = if journaled {
                    let frame = Frame {
                        next_token: after.token,
                        next_outbox: after.outbox,
                        changes,
                    };
                    journal.append(&frame).map_err(CommitError::Journal)?
                } else {
                    journal.last_lsn()
                };
                meta.insert(META_JOURNAL_LSN, lsn.to_le_bytes().as_slice())?;
            }
        }
        txn.commit()?;
        if !journaled {
            if let Some(journal) = &mut self.journal {
                journal.checkpointed().map_err(CommitError::Journal)?;
            }
        }
        Ok(after)
    }

    /// Makes every commit so far durable in redb, so the journal can start
    /// over. A failure poisons the backend (the journal still holds
    /// everything, and a reopen applies it).
    fn checkpoint(&mut self, closing: bool) {
        if self.poison.cause().is_some() {
            return;
        }
        let attempt = catch_unwind(AssertUnwindSafe(|| self.checkpoint_now(closing)));
        let failure = match attempt {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e,
            Err(panic) => CommitError::Panic(panic_message(panic.as_ref())),
        };
        self.poison_with("checkpoint failed", &failure);
    }

    /// `closing`: the engine's last checkpoint, which also marks the file
    /// cleanly closed (its journal is then not needed to open it).
    fn checkpoint_now(&mut self, closing: bool) -> Result<(), CommitError> {
        let Some(journal) = &mut self.journal else {
            return Ok(());
        };
        let started = std::time::Instant::now();
        let mut txn = self.db.begin_write()?;
        txn.set_durability(Durability::Immediate)?;
        {
            let mut meta = txn.open_table(META)?;
            meta.insert(
                META_JOURNAL_LSN,
                journal.last_lsn().to_le_bytes().as_slice(),
            )?;
            if closing {
                meta.insert(META_JOURNAL_CLEAN, [1_u8].as_slice())?;
            }
        }
        txn.commit()?;
        journal.checkpointed().map_err(CommitError::Journal)?;
        metrics::histogram!("idempotency_checkpoint_seconds")
            .record(started.elapsed().as_secs_f64());
        Ok(())
    }
}

pub(super) use crate::store::panic_message;

/// Wakes the callers of committed groups on a thread of its own, so the
/// writer goes on to the next group at once: waking 64 parked threads costs
/// the writer more CPU than the commit it answers (see BENCHMARKS.md). Only
/// committed (durable) answers go through it; failures are sent by the
/// writer itself. Without the thread (it could not start), the writer
/// delivers inline.
struct Notifier {
    tx: Option<crossbeam_channel::Sender<Vec<Box<dyn Job>>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Notifier {
    fn start() -> Notifier {
        let (tx, rx) = crossbeam_channel::unbounded::<Vec<Box<dyn Job>>>();
        let thread = std::thread::Builder::new()
            .name("idempotency-notify".into())
            .spawn(move || {
                for group in rx {
                    for job in group {
                        job.deliver();
                    }
                }
            });
        match thread {
            Ok(thread) => Notifier {
                tx: Some(tx),
                thread: Some(thread),
            },
            Err(e) => {
                tracing::warn!(error = %e, "no notifier thread; the writer answers callers itself");
                Notifier {
                    tx: None,
                    thread: None,
                }
            }
        }
    }

    /// Answers every job of a committed group.
    fn deliver(&self, group: Vec<Box<dyn Job>>) {
        let group = match &self.tx {
            Some(tx) => match tx.send(group) {
                Ok(()) => return,
                Err(crossbeam_channel::SendError(group)) => group,
            },
            None => group,
        };
        for job in group {
            job.deliver();
        }
    }

    /// Waits until every handed-over answer is delivered.
    fn finish(mut self) {
        drop(self.tx.take());
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("notifier thread panicked");
            }
        }
    }
}

/// The counters stored in the meta table (1 for a new database).
pub(super) fn read_sequences(db: &Database) -> Result<Sequences, redb::Error> {
    let txn = db.begin_read()?;
    let meta = txn.open_table(META)?;
    let read = |name| -> Result<u64, redb::Error> {
        Ok(meta
            .get(name)?
            .and_then(|v| <[u8; 8]>::try_from(v.value()).ok())
            .map_or(1, u64::from_le_bytes))
    };
    Ok(Sequences {
        token: read(META_NEXT_TOKEN)?,
        outbox: read(META_NEXT_OUTBOX)?,
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
