//! The redb backend: one database file, one writer thread doing group
//! commits, snapshot reads that never wait for it.

mod local;
mod open;
mod read;
mod read_only;
mod sweep;
mod tables;
mod verify;
mod writer;

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::Sender;
use parking_lot::Mutex;
use redb::Database;

use crate::clock::Clock;
use crate::config::{PurgeMode, StoreConfig};
use crate::error::{Error, OpenError, Result};
use crate::key::IdempotencyKey;
use crate::message::OutboxEntry;
use crate::report::SweepCounts;
use crate::state::State;
use crate::store::ops::Ops;
use crate::store::poison::Poison;
use crate::store::record::{EntityState, Record};
use crate::store::{
    Backend, ClaimRequest, ClaimResult, Claimed, CompleteRequest, InDoubtRequest, LocalResult,
    LocalWrite, Scanned, SettleRequest, Settled, TransitionRequest,
};
use crate::transition::Transition;

pub(crate) use self::open::{open_backend, open_path, prepare};
pub(crate) use self::read_only::RedbReader;

use self::tables::{OpError, Tables};
use self::writer::{Call, Msg, Writer};

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
            detail: writer::panic_message(panic.as_ref()),
        })
    })
}

/// The redb backend.
pub(crate) struct RedbStore {
    /// `None` only while being dropped (see `Drop`).
    db: Option<Arc<Database>>,
    tx: Sender<Msg>,
    poison: Arc<Poison>,
    writer: Mutex<Option<JoinHandle<()>>>,
}

impl RedbStore {
    /// Starts the writer thread on a prepared database (see [`prepare`]).
    pub(crate) fn start(
        db: Database,
        cfg: StoreConfig,
        clock: Arc<dyn Clock>,
        max_batch: usize,
        queue_capacity: usize,
    ) -> Result<RedbStore, OpenError> {
        let seq = writer::read_sequences(&db).map_err(|e| OpenError::Storage {
            context: "reading the engine's counters",
            source: Box::new(e),
        })?;
        let db = Arc::new(db);
        let (tx, rx) = crossbeam_channel::bounded(queue_capacity.max(1));
        let poison = Arc::new(Poison::default());
        let writer = Writer {
            db: db.clone(),
            rx,
            clock,
            cfg,
            poison: poison.clone(),
            max_batch: max_batch.max(1),
            seq,
        };
        let writer = std::thread::Builder::new()
            .name("idempotency-writer".into())
            .spawn(move || writer.run())
            .map_err(|source| OpenError::ThreadStart {
                thread: "writer",
                source,
            })?;
        Ok(RedbStore {
            db: Some(db),
            tx,
            poison,
            writer: Mutex::new(Some(writer)),
        })
    }

    /// Sends `op` to the writer and waits for its durable answer.
    fn call<T: Send + 'static>(
        &self,
        op: impl FnOnce(&mut Tables<'_>) -> Result<T, OpError> + Send + 'static,
    ) -> Result<T> {
        self.submit(Box::new(op), false)
    }

    fn submit<T: Send + 'static>(&self, op: writer::Op<T>, isolated: bool) -> Result<T> {
        self.poison.check()?;
        if writer::on_writer_of(&self.poison) {
            return Err(Error::Reentrant);
        }
        let (reply, answer) = crossbeam_channel::bounded(1);
        let job = Call::new(op, isolated, Some(reply));
        if self.tx.send(Msg::Job(Box::new(job))).is_err() {
            return Err(self.closed());
        }
        answer.recv().unwrap_or_else(|_| Err(self.closed()))
    }

    /// The database, for reads.
    fn db(&self) -> Result<&Database> {
        self.db.as_deref().ok_or(Error::Closed)
    }

    /// Why a call could not reach the writer.
    fn closed(&self) -> Error {
        match self.poison.cause() {
            Some(cause) => Error::Poisoned { cause },
            None => Error::Closed,
        }
    }
}

impl Backend for RedbStore {
    fn check(&self) -> Result<()> {
        self.poison.check()
    }

    fn record(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        contained("reading the database", || read::record(self.db()?, key))
    }

    fn in_doubt(&self, limit: usize, now_ms: u64) -> Result<Vec<(IdempotencyKey, Record)>> {
        contained("reading the database", || {
            read::in_doubt(self.db()?, limit, now_ms)
        })
    }

    fn scan(&self, visit: &mut dyn FnMut(Scanned) -> bool) -> Result<()> {
        contained("reading the database", || read::scan(self.db()?, visit))
    }

    fn oldest_in_doubt_ms(&self, now_ms: u64) -> Result<Option<u64>> {
        contained("reading the database", || {
            read::oldest_in_doubt(self.db()?, now_ms)
        })
    }

    fn sweep_due(&self, now_ms: u64) -> Result<bool> {
        contained("reading the database", || {
            read::sweep_due(self.db()?, now_ms)
        })
    }

    fn outbox(&self, limit: usize) -> Result<Vec<OutboxEntry>> {
        contained("reading the database", || read::outbox(self.db()?, limit))
    }

    fn outbox_len(&self) -> Result<u64> {
        contained("reading the database", || read::outbox_len(self.db()?))
    }

    fn entity(&self, entity: &str) -> Result<Option<EntityState>> {
        contained("reading the database", || read::entity(self.db()?, entity))
    }

    fn claim(&self, req: ClaimRequest) -> Result<ClaimResult> {
        self.call(move |t| t.claim(&req))
    }

    fn complete(&self, req: CompleteRequest) -> Result<()> {
        self.call(move |t| t.complete(req))
    }

    fn release(&self, key: IdempotencyKey, token: u64) -> Result<()> {
        self.call(move |t| t.release(&key, token))
    }

    fn mark_in_doubt(&self, req: InDoubtRequest) -> Result<()> {
        self.call(move |t| t.mark_in_doubt(req))
    }

    fn mark_in_doubt_detached(&self, req: InDoubtRequest) {
        if self.poison.check().is_err() {
            return;
        }
        let job = Call::new(
            Box::new(move |t: &mut Tables<'_>| t.mark_in_doubt(req)),
            false,
            None,
        );
        // Never blocks: it may run in `Drop` on an async worker or inside a
        // local write on the writer thread itself.
        let _ = self.tx.try_send(Msg::Job(Box::new(job)));
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
        self.call(move |t| t.settle_then_claim(req, &claim))
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

    fn flush(&self) -> Result<()> {
        self.call(|_| Ok(()))
    }

    fn local(&self, write: LocalWrite) -> Result<LocalResult> {
        self.submit(Box::new(move |t: &mut Tables<'_>| t.local(write)), true)
    }

    fn verify(&self) -> Result<(Vec<crate::verify::Problem>, u64)> {
        contained("verifying the database", || verify::verify(self.db()?))
    }

    fn close(&self) {
        let _ = self.tx.send(Msg::Shutdown);
        // The writer cannot wait for itself (the last handle can drop inside
        // a local write); it exits once it reads the shutdown.
        if writer::on_writer_of(&self.poison) {
            return;
        }
        if let Some(writer) = self.writer.lock().take() {
            if writer.join().is_err() {
                tracing::error!("writer thread panicked");
            }
        }
    }
}

impl Drop for RedbStore {
    fn drop(&mut self) {
        self.close();
        // After a panic inside redb its own locks may be poisoned, and its
        // `Drop` panics on them: contain that too.
        if let Some(db) = self.db.take() {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(db)));
        }
    }
}
