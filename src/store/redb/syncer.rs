//! The syncer thread: makes the writer's journal frames durable and
//! answers their callers, while the writer applies the next groups.
//!
//! The writer hands over each group once its frame is written (not yet
//! synced). The syncer takes everything handed over so far, calls
//! `fdatasync` once for all of it, then, in order, puts each group's record
//! and entity values in the [`Overlay`] and answers its callers. So no
//! caller hears an answer before its frame is durable, one sync serves as
//! many groups as arrived meanwhile, and the writer never waits for the
//! disk except before a redb commit ([`Syncer::wait_synced`]), which must
//! never make visible what is not durable yet.
//!
//! Groups without a frame (a database without a journal commits durably in
//! redb itself; a group that changed nothing) are answered in their turn,
//! without a sync. A failed sync poisons the backend: the failing groups'
//! callers, and every group handed over after them, hear the poison (after
//! a failed `fdatasync` nothing later can be trusted to be durable).

use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use crate::error::Error;
use crate::store::poison::Poison;

use super::job::{fail_all, poison_backend, Job};
use super::journal::{Change, JournalSync};
use super::overlay::Overlay;

/// One group, handed over by the writer.
pub(super) struct Handed {
    /// The LSN of the group's journal frame; `None`: nothing to sync.
    pub(super) lsn: Option<u64>,
    pub(super) jobs: Vec<Box<dyn Job>>,
    /// The group's changes, for the overlay (empty without a journal:
    /// redb has committed them already).
    pub(super) changes: Vec<Change>,
}

/// How far syncing got.
#[derive(Default)]
struct Progress {
    /// Every frame up to this LSN is durable.
    synced: u64,
    /// Why syncing stopped for good.
    failed: Option<Arc<str>>,
}

#[derive(Default)]
struct Shared {
    progress: Mutex<Progress>,
    changed: Condvar,
}

/// The writer's handle of the syncer thread.
pub(super) struct Syncer {
    tx: Option<crossbeam_channel::Sender<Handed>>,
    thread: Option<std::thread::JoinHandle<()>>,
    shared: Arc<Shared>,
    /// Without a thread (it could not start): the writer does the work.
    inline: Option<Worker>,
}

/// What the thread owns.
#[derive(Clone)]
struct Worker {
    sync: Option<JournalSync>,
    overlay: Arc<Overlay>,
    poison: Arc<Poison>,
    shared: Arc<Shared>,
}

impl Syncer {
    /// Starts the thread. `sync` is the journal's (`None`: no journal);
    /// every frame up to `synced` is durable already. Without a thread
    /// (it could not start) the writer does the work inline.
    pub(super) fn start(
        sync: Option<JournalSync>,
        synced: u64,
        overlay: Arc<Overlay>,
        poison: Arc<Poison>,
    ) -> Syncer {
        let shared = Arc::new(Shared::default());
        shared.progress.lock().synced = synced;
        let worker = Worker {
            sync,
            overlay,
            poison,
            shared: shared.clone(),
        };
        let (tx, rx) = crossbeam_channel::unbounded::<Handed>();
        let thread = std::thread::Builder::new()
            .name("idempotency-sync".into())
            .spawn({
                let worker = worker.clone();
                move || worker.run(&rx)
            });
        match thread {
            Ok(thread) => Syncer {
                tx: Some(tx),
                thread: Some(thread),
                shared,
                inline: None,
            },
            Err(e) => {
                tracing::warn!(error = %e, "no syncer thread; the writer syncs and answers callers itself");
                Syncer {
                    tx: None,
                    thread: None,
                    shared,
                    inline: Some(worker),
                }
            }
        }
    }

    /// Hands a group over: it is synced (if it has a frame) and answered
    /// after every group handed before it.
    pub(super) fn hand(&self, group: Handed) {
        let group = match &self.tx {
            Some(tx) => match tx.send(group) {
                Ok(()) => return,
                Err(crossbeam_channel::SendError(group)) => group,
            },
            None => group,
        };
        if let Some(worker) = &self.inline {
            worker.serve(vec![group]);
        } else {
            for job in group.jobs {
                job.fail(Error::Closed);
            }
        }
    }

    /// The LSN up to which every frame is durable.
    pub(super) fn synced(&self) -> u64 {
        self.shared.progress.lock().synced
    }

    /// Waits until every frame up to `lsn` is durable; the reason if
    /// syncing failed.
    pub(super) fn wait_synced(&self, lsn: u64) -> Result<(), Arc<str>> {
        let mut progress = self.shared.progress.lock();
        loop {
            if let Some(cause) = &progress.failed {
                return Err(cause.clone());
            }
            if progress.synced >= lsn {
                return Ok(());
            }
            self.shared.changed.wait(&mut progress);
        }
    }

    /// Waits until every handed-over group is synced and answered.
    pub(super) fn finish(mut self) {
        drop(self.tx.take());
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("syncer thread panicked");
            }
        }
    }
}

impl Worker {
    fn run(&self, rx: &crossbeam_channel::Receiver<Handed>) {
        while let Ok(first) = rx.recv() {
            let mut groups = vec![first];
            groups.extend(rx.try_iter());
            self.serve(groups);
        }
    }

    /// One sync for all of `groups`, then their answers in order.
    fn serve(&self, groups: Vec<Handed>) {
        let last = groups.iter().filter_map(|g| g.lsn).max();
        let failed = self.shared.progress.lock().failed.clone();
        let failed = match (failed, last, &self.sync) {
            (Some(cause), _, _) => Some(cause),
            (None, Some(_), Some(sync)) => self.sync(sync).err(),
            (None, _, _) => None,
        };
        if let Some(cause) = failed {
            for group in groups {
                fail_all(group.jobs, &cause);
            }
            return;
        }
        // The overlay first: once `synced` covers a group, the writer may
        // commit it to redb and empty the overlay.
        let mut answers = Vec::with_capacity(groups.len());
        for group in groups {
            self.overlay.apply(group.changes);
            answers.push(group.jobs);
        }
        if let Some(last) = last {
            self.shared.progress.lock().synced = last;
            self.shared.changed.notify_all();
        }
        for job in answers.into_iter().flatten() {
            job.deliver();
        }
    }

    /// Syncs the journal; on failure poisons the backend and records why.
    fn sync(&self, sync: &JournalSync) -> Result<(), Arc<str>> {
        let attempt = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sync.sync()));
        let reason = match attempt {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e.to_string(),
            Err(panic) => format!(
                "syncing the journal panicked: {}",
                crate::store::panic_message(panic.as_ref())
            ),
        };
        let cause = poison_backend(&self.poison, format!("group commit failed: {reason}"));
        self.shared.progress.lock().failed = Some(cause.clone());
        self.shared.changed.notify_all();
        Err(cause)
    }
}
