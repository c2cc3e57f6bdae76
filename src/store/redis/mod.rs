//! The Redis / Valkey backend: the same records, state machine and
//! operations as the redb and PostgreSQL backends (`store/ops.rs`), on one
//! Redis server that several app servers share.
//!
//! # Why optimistic transactions
//!
//! Redis has no row locks and no interactive transactions; what it has is
//! atomic scripts. Porting each operation (claim, complete, settle, steps,
//! sweeps, inbox, outbox, entities) to its own Lua script would write the
//! state machine a third time, in a language the shared rules are not in.
//! Instead each operation runs the shared Rust code against an optimistic
//! transaction (`txn.rs`): reads are plain commands that remember the bytes
//! they saw, writes are buffered, and the commit is ONE generic script
//! (`script.rs`) that checks every remembered read still holds and only
//! then applies every write, or writes nothing and reports a conflict, on
//! which the operation runs again on fresh reads (bounded; a typed error
//! after 64 conflicts in a row). So every transition is one atomic
//! server-side script, and the rules decide on Redis exactly as on redb
//! and PostgreSQL. A refusal decided on several reads is checked the same
//! way (the guards, no writes) before it is returned.
//!
//! Two paths skip the reads, so a request costs two scripts, as a
//! hand-written "Lua claim + completion SET" does (`claim.rs`): a fresh
//! claim is one claim-or-read script that draws the token inside it, and
//! the completion of a claim this engine holds is one guarded script
//! against the bytes it wrote (remembered, not read back).
//!
//! Fencing tokens come from one counter key (`INCR`), drawn after the op
//! has read the record, so a token exceeds the token of any record the
//! guard then proves unchanged; they grow per key across every engine.
//! A claim over a record that is there (takeover, resume, re-claim) also
//! takes one above that record's token when the counter is not (it was
//! deleted, evicted or restored older), and its commit raises the counter,
//! so tokens never go backwards for a key that has a record. A key with
//! no record left (purged, expired without a tombstone, never claimed)
//! carries no token to compare with: after a counter reset its next claim
//! may draw a token an earlier, long-gone holder had. `verify` reports a
//! counter below a stored record's token.
//! A PROCESSING record never carries a Redis expiry: a lease that runs out
//! makes it UNKNOWN (read-time truth, then the sweeper). COMPLETED records
//! and tombstones expire by the engine's TTL rules, through the expiry
//! index and the sweeper. Values carry the codec's checksum framing.
//!
//! Time comes from the builder's clock: engines sharing a server must have
//! clocks that agree (NTP), as leases and expiry are decided by them.
//!
//! A write's answer lost mid-script gets PostgreSQL's lost-COMMIT
//! treatment: its connection is ended on the server (`CLIENT KILL`), then
//! one key the write changes is read back: the new bytes, it ran; the old
//! ones, it did not (and runs again); anything else, the call reports the
//! outcome unknown. Never a blind resend.

mod claim;
mod conn;
mod keys;
mod local;
mod open;
mod read;
mod script;
mod shared;
mod sweep;
mod tls;
mod txn;
mod verify;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::Sender;
use parking_lot::Mutex;

use crate::clock::Clock;
use crate::error::{Error, OpenError, Result};
use crate::key::IdempotencyKey;
use crate::message::OutboxEntry;
use crate::policy::PurgeMode;
use crate::report::SweepCounts;
use crate::state::State;
use crate::store::config::StoreConfig;
use crate::store::ops::Ops;
use crate::store::record::{EntityState, Record};
use crate::store::{
    Backend, ClaimRequest, ClaimResult, Claimed, CompleteRequest, FinishStepRequest, HistoryRecord,
    InDoubtRequest, LocalResult, LocalWrite, ReadOrClaim, Scanned, SettleRequest,
    SettleStepRequest, Settled, StepRecord, StepRequest, TransitionRequest,
};
use crate::transition::Transition;

pub(crate) use self::conn::Password;
pub(crate) use self::keys::DEFAULT_PREFIX;
pub use self::local::RedisLocal;
pub(crate) use self::open::{Mode, RedisOptions};
pub(crate) use self::tls::TlsFiles;

use self::claim::Remembered;
use self::shared::Shared;

/// Dropped claims waiting to be marked UNKNOWN by the background thread.
const DETACHED_QUEUE: usize = 1_024;

/// Work for the dropped-claims thread.
enum Detached {
    Mark(InDoubtRequest),
    /// Answer once everything queued before is done (`Engine::flush`).
    Flush(Sender<()>),
}

/// The Redis backend.
pub(crate) struct RedisStore {
    shared: Arc<Shared>,
    remembered: Remembered,
    closed: AtomicBool,
    /// Dropped claims: `mark_in_doubt_detached` must never block, so a
    /// thread of its own does the write.
    detached: Mutex<Option<Sender<Detached>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl RedisStore {
    /// Connects, checks the server (see `open.rs`), and stores or reads
    /// the expiry settings. Returns the store and the settings.
    pub(crate) fn open(
        opts: &RedisOptions,
        cfg: StoreConfig,
        stored_expiry: bool,
        clock: Arc<dyn Clock>,
    ) -> std::result::Result<(RedisStore, StoreConfig), OpenError> {
        let keys = keys::Keys::new(&opts.prefix)?;
        let manager = conn::Manager {
            client: conn::client(&opts.url, &opts.tls, opts.password.as_ref())?,
            connect_timeout: opts.connect_timeout,
            command_timeout: opts.command_timeout,
        };
        // One connection first, outside the pool: a refused port, a wrong
        // password or a server that is not Redis fails the open at once
        // with what happened (the pool would retry until its timeout).
        let mut first = manager
            .connect()
            .map_err(|e| conn::connect_failed(&e, &opts.url, &opts.tls))?;
        open::check_server(&mut first, opts)?;
        let cfg = open::prepare(&mut first, &keys, cfg, stored_expiry, opts.mode)?;
        drop(first);
        let pool = r2d2::Pool::builder()
            .max_size(opts.pool_size.max(1))
            .min_idle(Some(1))
            .test_on_check_out(false)
            .connection_timeout(opts.connect_timeout.saturating_mul(5))
            .build(manager)
            .map_err(|e| OpenError::Storage {
                context: "connecting to Redis",
                source: Box::new(e),
            })?;
        let index = [
            keys.lease.clone(),
            keys.recovery.clone(),
            keys.expiry.clone(),
            keys.all.clone(),
        ];
        let shared = Arc::new(Shared {
            pool,
            keys,
            index,
            cfg,
            clock,
            script: script::guarded(),
            claim_script: redis::Script::new(claim::CLAIM),
            settle_held_script: redis::Script::new(script::SETTLE_HELD),
            wait_replicas: opts.wait_replicas,
            command_timeout: opts.command_timeout,
        });
        let (tx, rx) = crossbeam_channel::bounded::<Detached>(DETACHED_QUEUE);
        let worker_shared = shared.clone();
        let worker = std::thread::Builder::new()
            .name("idempotency-redis-dropped-claims".into())
            .spawn(move || {
                for work in rx {
                    let req = match work {
                        Detached::Mark(req) => req,
                        Detached::Flush(done) => {
                            let _ = done.send(());
                            continue;
                        }
                    };
                    let key = req.key.clone();
                    let marked = worker_shared.write("marking a dropped claim UNKNOWN", |t| {
                        t.mark_in_doubt(req.clone())
                    });
                    if let Err(e) = marked {
                        tracing::warn!(%key, error = %e, "could not mark a dropped claim UNKNOWN; its lease running out has the same effect");
                    }
                }
            })
            .map_err(|source| OpenError::ThreadStart {
                thread: "dropped-claims",
                source,
            })?;
        Ok((
            RedisStore {
                shared,
                remembered: Remembered::default(),
                closed: AtomicBool::new(false),
                detached: Mutex::new(Some(tx)),
                worker: Mutex::new(Some(worker)),
            },
            cfg,
        ))
    }

    fn open_check(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    fn write<T>(
        &self,
        context: &'static str,
        op: impl FnMut(&mut txn::RedisTxn<'_>) -> crate::store::ops::OpResult<T, txn::Fault>,
    ) -> Result<T> {
        self.open_check()?;
        self.shared.write(context, op)
    }
}

impl Backend for RedisStore {
    fn check(&self) -> Result<()> {
        self.open_check()
    }

    fn record(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        self.open_check()?;
        self.shared.record(key)
    }

    fn in_doubt(&self, limit: usize, now_ms: u64) -> Result<Vec<(IdempotencyKey, Record)>> {
        self.open_check()?;
        self.shared.in_doubt(limit, now_ms)
    }

    fn scan(&self, visit: &mut (dyn FnMut(Scanned) -> bool + Send)) -> Result<()> {
        self.open_check()?;
        self.shared.scan(visit)
    }

    fn oldest_in_doubt_ms(&self, now_ms: u64) -> Result<Option<u64>> {
        self.open_check()?;
        self.shared.oldest_in_doubt_ms(now_ms)
    }

    fn sweep_due(&self, now_ms: u64) -> Result<bool> {
        self.open_check()?;
        self.shared.sweep_due(now_ms)
    }

    fn outbox(&self, limit: usize) -> Result<Vec<OutboxEntry>> {
        self.open_check()?;
        self.shared.outbox(limit)
    }

    fn dead_letters(&self, limit: usize) -> Result<Vec<crate::dead_letter::DeadLetter>> {
        self.open_check()?;
        self.shared.dead_letters(limit)
    }

    fn outbox_len(&self) -> Result<u64> {
        self.open_check()?;
        self.shared.outbox_len()
    }

    fn entity(&self, entity: &str) -> Result<Option<EntityState>> {
        self.open_check()?;
        self.shared.entity(entity)
    }

    fn steps(&self, key: &IdempotencyKey) -> Result<Vec<StepRecord>> {
        self.open_check()?;
        self.shared.steps(key, self.shared.clock.now_ms())
    }

    fn history(&self, key: &IdempotencyKey) -> Result<Vec<HistoryRecord>> {
        self.open_check()?;
        self.shared.history(key)
    }

    fn read_or_claim(
        &self,
        key: &IdempotencyKey,
        claim: &dyn Fn() -> ClaimRequest,
    ) -> Result<ReadOrClaim> {
        self.open_check()?;
        let req = claim();
        debug_assert_eq!(&req.key, key);
        self.shared.claim_or_read(&req, &self.remembered)
    }

    fn claim(&self, req: ClaimRequest) -> Result<ClaimResult> {
        self.open_check()?;
        if let ReadOrClaim::Claimed(claimed) = self.shared.claim_or_read(&req, &self.remembered)? {
            return Ok(ClaimResult::Claimed(claimed));
        }
        self.write("claiming a key", |t| t.claim(&req))
    }

    fn reserve_step(&self, req: StepRequest) -> Result<StepRecord> {
        self.remembered.forget(&req.key);
        self.write("reserving an effect step", |t| t.reserve_step(req.clone()))
    }

    fn finish_step(&self, req: FinishStepRequest) -> Result<StepRecord> {
        self.remembered.forget(&req.key);
        self.write("confirming an effect step", |t| t.finish_step(req.clone()))
    }

    fn settle_step(&self, req: SettleStepRequest) -> Result<StepRecord> {
        self.remembered.forget(&req.key);
        self.write("settling an effect step", |t| t.settle_step(req.clone()))
    }

    fn complete(&self, req: CompleteRequest) -> Result<()> {
        self.open_check()?;
        let context = "storing an outcome";
        let assumed = self.remembered.take(&req.key, req.token);
        let key = req.key.clone();
        self.shared.write_with(
            context,
            |t| {
                if let Some(value) = &assumed {
                    t.assume_record(&key, value.clone());
                }
            },
            &mut |t| t.complete(req.clone()),
        )
    }

    fn release(&self, key: IdempotencyKey, token: u64) -> Result<()> {
        self.remembered.forget(&key);
        self.write("releasing a claim", |t| t.release(&key, token))
    }

    fn mark_in_doubt(&self, req: InDoubtRequest) -> Result<()> {
        self.remembered.forget(&req.key);
        self.write("marking a claim UNKNOWN", |t| t.mark_in_doubt(req.clone()))
    }

    fn mark_in_doubt_detached(&self, req: InDoubtRequest) {
        self.remembered.forget(&req.key);
        if let Some(tx) = self.detached.lock().as_ref() {
            // Never blocks; when the queue is full the lease running out
            // has the same effect, later.
            let _ = tx.try_send(Detached::Mark(req));
        }
    }

    fn extend(&self, key: IdempotencyKey, token: u64, lease_ms: u64) -> Result<u64> {
        self.remembered.forget(&key);
        self.write("extending a lease", |t| t.extend(&key, token, lease_ms))
    }

    fn settle(&self, req: SettleRequest) -> Result<Settled<()>> {
        self.remembered.forget(&req.key);
        self.write("settling an in-doubt record", |t| t.settle(req.clone()))
    }

    fn settle_then_claim(
        &self,
        req: SettleRequest,
        claim: ClaimRequest,
    ) -> Result<Settled<Claimed>> {
        self.remembered.forget(&req.key);
        self.write("settling an in-doubt record", |t| {
            t.settle_then_claim(req.clone(), &claim)
        })
    }

    fn sweep(&self, limit: usize) -> Result<SweepCounts> {
        self.write("sweeping", |t| t.sweep(limit))
    }

    fn purge(&self, key: IdempotencyKey, mode: PurgeMode) -> Result<Option<State>> {
        self.remembered.forget(&key);
        self.write("purging a record", |t| t.purge(&key, mode))
    }

    fn transition(&self, req: TransitionRequest) -> Result<Transition> {
        self.write("changing an entity's state", |t| t.transition(req.clone()))
    }

    fn dead_letter(&self, req: crate::store::DeadLetterRequest) -> Result<u64> {
        if let Some(claim) = &req.claim {
            self.remembered.forget(&claim.key);
        }
        self.write("giving a message up to the dead letters", |t| {
            t.dead_letter(req.clone())
        })
    }

    fn redrive(&self, seq: u64) -> Result<Option<String>> {
        self.write("redriving a dead letter", |t| t.redrive(seq))
    }

    fn mark_published(&self, seqs: Vec<u64>) -> Result<u64> {
        self.write("removing published outbox messages", |t| {
            t.mark_published(&seqs)
        })
    }

    fn flush(&self) -> Result<()> {
        // Every write is durable before it returns (with appendfsync
        // always), except the notices of dropped claims: wait for those.
        self.open_check()?;
        let queue = self.detached.lock().clone();
        if let Some(queue) = queue {
            let (done, finished) = crossbeam_channel::bounded(1);
            if queue.send(Detached::Flush(done)).is_ok() {
                let _ = finished.recv();
            }
        }
        Ok(())
    }

    fn local(&self, write: LocalWrite) -> Result<LocalResult> {
        self.open_check()?;
        self.remembered.forget(&write.key);
        self.shared.local(write)
    }

    fn verify(&self) -> Result<(Vec<crate::verify::Damage>, u64)> {
        self.open_check()?;
        self.shared.verify()
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        drop(self.detached.lock().take());
        if let Some(worker) = self.worker.lock().take() {
            if worker.join().is_err() {
                tracing::error!("the dropped-claims thread panicked");
            }
        }
    }
}

impl Drop for RedisStore {
    fn drop(&mut self) {
        self.close();
    }
}
