//! The engine handle: `begin`, `complete`, `fail`, recovery and sweeping.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use redb::{Database, ReadableDatabase, ReadableTable};

use crate::builder::{Config, EngineBuilder};
use crate::claim::Claim;
use crate::clock::duration_ms;
use crate::codec::{self, DiskState, Record, StoredResponse};
use crate::envelope::Envelope;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::ops::{classify, Class, Op, Reply, Settle, SweepCounts};
use crate::outbox::OutgoingMessage;
use crate::outcome::{Begin, Failure, Pending, Replay, ReplayKind};
use crate::poison::Poison;
use crate::recovery::{RecoveryReport, Resolution, Resolver};
use crate::sweeper::Sweeper;
use crate::tables::{RECORDS, RECOVERY};
use crate::writer::{Msg, Request};
use crate::Clock;

/// The idempotency engine: one redb file, one writer thread doing group
/// commits, one background sweeper.
///
/// `Engine` is `Send + Sync`; share it between threads by reference or in an
/// `Arc`. All calls block the calling thread (from async code, call them via
/// `spawn_blocking`).
///
/// # Close semantics
///
/// Dropping the engine stops the sweeper (finishing its current bounded
/// step), lets the writer commit every operation already queued, joins both
/// threads and closes the database file. Claims still alive afterwards
/// return [`Error::Closed`]; their records stay PROCESSING until the lease
/// runs out and then count as UNKNOWN, as after a crash.
pub struct Engine {
    pub(crate) shared: Arc<Shared>,
    writer: Option<JoinHandle<()>>,
    sweeper: Option<Sweeper>,
}

/// State shared by the engine handle, its claims and the sweeper.
pub(crate) struct Shared {
    pub(crate) db: Arc<Database>,
    tx: Sender<Msg>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) poison: Arc<Poison>,
    pub(crate) cfg: Config,
    pub(crate) counters: Counters,
}

/// Counters since the engine was opened.
#[derive(Default, Debug)]
pub(crate) struct Counters {
    pub(crate) claims: AtomicU64,
    pub(crate) replays: AtomicU64,
    pub(crate) mismatches: AtomicU64,
    pub(crate) in_progress: AtomicU64,
    pub(crate) unknown_answers: AtomicU64,
    pub(crate) expired_answers: AtomicU64,
    pub(crate) moved_to_unknown: AtomicU64,
    pub(crate) resolved: AtomicU64,
    pub(crate) expired_deleted: AtomicU64,
    pub(crate) tombstoned: AtomicU64,
}

fn bump(c: &AtomicU64, by: u64) {
    c.fetch_add(by, Ordering::Relaxed);
}

impl Engine {
    /// A builder with the documented defaults.
    pub fn builder() -> EngineBuilder {
        EngineBuilder::default()
    }

    pub(crate) fn start(
        db: Database,
        cfg: Config,
        clock: Arc<dyn Clock>,
        sweep_interval: Option<Duration>,
    ) -> Result<Engine> {
        let db = Arc::new(db);
        let (tx, rx) = crossbeam_channel::bounded(cfg.queue_capacity);
        let poison = Arc::new(Poison::default());
        let writer = crate::writer::Writer {
            db: db.clone(),
            rx,
            clock: clock.clone(),
            cfg: cfg.write,
            poison: poison.clone(),
            max_batch: cfg.max_batch,
        };
        let writer = std::thread::Builder::new()
            .name("idempotency-writer".into())
            .spawn(move || writer.run())
            .map_err(|e| Error::Internal(format!("cannot start the writer thread: {e}")))?;
        let shared = Arc::new(Shared {
            db,
            tx,
            clock,
            poison,
            cfg,
            counters: Counters::default(),
        });
        let mut engine = Engine {
            shared: shared.clone(),
            writer: Some(writer),
            sweeper: None,
        };
        if let Some(interval) = sweep_interval {
            let sweeper = Sweeper::start(shared, interval)
                .map_err(|e| Error::Internal(format!("cannot start the sweeper thread: {e}")))?;
            engine.sweeper = Some(sweeper);
        }
        Ok(engine)
    }

    /// Starts a request: atomically claims `key`, or reports what already
    /// holds it. Uses the engine's default lease.
    ///
    /// The fingerprint is compared before the record's state decides
    /// anything, so a key reused with a different request is always
    /// [`Begin::Mismatch`], whatever state its record is in.
    ///
    /// A `Claimed` answer is durable (committed with fsync) before it is
    /// returned. Other answers come from a read transaction, without waiting
    /// for the writer, unless the record must change (an expired record is
    /// replaced, a stale lease becomes UNKNOWN).
    ///
    /// # Errors
    ///
    /// A corrupt record for this key ([`Error::CorruptRecord`]), an upcaster
    /// failure on replay ([`Error::Upcast`]), a resolver answer over
    /// `max_response_bytes` ([`Error::ResponseTooLarge`]; the record stays
    /// UNKNOWN), storage errors, [`Error::Poisoned`].
    pub fn begin(&self, key: &IdempotencyKey, fingerprint: Fingerprint) -> Result<Begin> {
        self.begin_with_lease(key, fingerprint, self.shared.cfg.lease)
    }

    /// [`Engine::begin`] with a lease for this claim only (a withdrawal that
    /// may take an hour needs a longer lease than a 200 ms write). A zero
    /// lease counts as 1 ms.
    ///
    /// # Errors
    ///
    /// As for [`Engine::begin`].
    pub fn begin_with_lease(
        &self,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> Result<Begin> {
        let s = &self.shared;
        s.poison.check()?;
        let lease_ms = duration_ms(lease).max(1);
        // Settling an UNKNOWN record can race with another settler; each
        // lost race re-reads the key. Four rounds is plenty in practice.
        for _ in 0..4 {
            if let Some(rec) = s.read_record(key)? {
                let class = classify(&rec, &fingerprint, s.clock.now_ms(), s.cfg.write.expiry);
                if !matches!(class, Class::Absent | Class::Stale) {
                    if let Some(answer) = self.answer(key, rec, class, fingerprint, lease_ms)? {
                        return Ok(answer);
                    }
                    continue;
                }
            }
            let op = Op::Begin {
                key: key.clone(),
                fingerprint,
                lease_ms,
            };
            match s.submit(op)? {
                Reply::Existing { record, class } => {
                    if let Some(answer) = self.answer(key, *record, class, fingerprint, lease_ms)? {
                        return Ok(answer);
                    }
                }
                reply => return Ok(Begin::Claimed(self.claim_from(key, reply)?)),
            }
        }
        Ok(Begin::InProgress {
            retry_after: Duration::from_millis(1),
        })
    }

    /// Maps a non-claimable record to the caller's answer. `None`: the record
    /// changed under us; look again.
    fn answer(
        &self,
        key: &IdempotencyKey,
        rec: Record,
        class: Class,
        fingerprint: Fingerprint,
        lease_ms: u64,
    ) -> Result<Option<Begin>> {
        let c = &self.shared.counters;
        let answer = match class {
            Class::Absent | Class::Stale => return Ok(None),
            Class::Mismatch => {
                bump(&c.mismatches, 1);
                tracing::info!(key = %key, "fingerprint mismatch");
                Begin::Mismatch
            }
            Class::Live { retry_after_ms } => {
                bump(&c.in_progress, 1);
                Begin::InProgress {
                    retry_after: Duration::from_millis(retry_after_ms.max(1)),
                }
            }
            Class::Done => {
                bump(&c.replays, 1);
                Begin::Replay(self.shared.replay(key, &rec)?)
            }
            Class::Tombstoned {
                expired_at_ms,
                reusable_at_ms,
            } => {
                bump(&c.expired_answers, 1);
                Begin::Expired {
                    expired_at_ms,
                    reusable_at_ms,
                }
            }
            Class::Unknown => match &self.shared.cfg.resolver {
                // A dropped claim's work may still be running until its lease
                // ends: asking the provider now could hear "not executed" for
                // a call still in flight. Until then it is in progress.
                Some(_) if rec.lease_until_ms > self.shared.clock.now_ms() => {
                    bump(&c.in_progress, 1);
                    Begin::InProgress {
                        retry_after: Duration::from_millis(
                            rec.lease_until_ms - self.shared.clock.now_ms(),
                        )
                        .max(Duration::from_millis(1)),
                    }
                }
                Some(resolver) => {
                    let resolver = resolver.clone();
                    return self.settle_in_begin(key, &rec, &*resolver, fingerprint, lease_ms);
                }
                None => {
                    bump(&c.unknown_answers, 1);
                    Begin::Unknown(self.shared.pending_of(key.clone(), &rec))
                }
            },
        };
        Ok(Some(answer))
    }

    /// Queries the resolver for an UNKNOWN record met by `begin`, then
    /// replays, claims afresh, or reports it still unknown.
    fn settle_in_begin(
        &self,
        key: &IdempotencyKey,
        rec: &Record,
        resolver: &dyn Resolver,
        fingerprint: Fingerprint,
        lease_ms: u64,
    ) -> Result<Option<Begin>> {
        let s = &self.shared;
        let pending = s.pending_of(key.clone(), rec);
        let settle = s.settlement(key, resolver.resolve(&pending))?;
        let op = Op::Settle {
            key: key.clone(),
            token: rec.token,
            settle,
            then_claim: Some((fingerprint, lease_ms)),
        };
        match s.submit(op) {
            Ok(Reply::Existing {
                record,
                class: Class::Done,
            }) => {
                bump(&s.counters.resolved, 1);
                bump(&s.counters.replays, 1);
                Ok(Some(Begin::Replay(s.replay(key, &record)?)))
            }
            Ok(Reply::Existing { record, .. }) => {
                bump(&s.counters.unknown_answers, 1);
                Ok(Some(Begin::Unknown(s.pending_of(key.clone(), &record))))
            }
            Ok(reply) => {
                bump(&s.counters.resolved, 1);
                Ok(Some(Begin::Claimed(self.claim_from(key, reply)?)))
            }
            // Someone else settled it meanwhile: look again.
            Err(Error::Fenced { .. } | Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn claim_from(&self, key: &IdempotencyKey, reply: Reply) -> Result<Claim> {
        match reply {
            Reply::Claimed {
                token,
                reference,
                now_ms,
                lease_until_ms,
            } => {
                bump(&self.shared.counters.claims, 1);
                Ok(Claim {
                    key: key.clone(),
                    token,
                    reference,
                    claimed_at_ms: now_ms,
                    lease_until_ms,
                    engine: Arc::downgrade(&self.shared),
                    finished: false,
                })
            }
            other => Err(self.shared.unexpected(other)),
        }
    }

    /// Stores the claim's response; later `begin`s with the same key and
    /// fingerprint replay it until the TTL runs out. Durable before it
    /// returns.
    ///
    /// A late `complete` by a claim whose lease ran out still succeeds while
    /// its token owns the record (the result is known now, even if the record
    /// went UNKNOWN meanwhile).
    ///
    /// # Errors
    ///
    /// - [`Error::ResponseTooLarge`] if `envelope.size_bytes()` exceeds
    ///   `max_response_bytes`: nothing is stored, and because the work has run
    ///   but its result cannot be kept, the record becomes UNKNOWN (never
    ///   re-executed). Check the size first to choose otherwise.
    /// - [`Error::Fenced`] if the token no longer owns the record; the stored
    ///   record is untouched.
    /// - [`Error::ForeignClaim`], [`Error::Poisoned`], [`Error::Closed`],
    ///   storage errors.
    pub fn complete(&self, claim: Claim, envelope: Envelope) -> Result<()> {
        self.finish_with(claim, Some(envelope), None, false, Vec::new())
    }

    /// [`Engine::complete`], also storing a resource reference (e.g. a payment
    /// id) for apps whose contract is "a retry returns the resource's current
    /// state" rather than the original response. Replays carry it in
    /// [`Replay::resource`].
    ///
    /// # Errors
    ///
    /// As for [`Engine::complete`].
    pub fn complete_with_resource(
        &self,
        claim: Claim,
        envelope: Envelope,
        resource: impl Into<String>,
    ) -> Result<()> {
        self.finish_with(
            claim,
            Some(envelope),
            Some(resource.into()),
            false,
            Vec::new(),
        )
    }

    /// Ends a claim without success; see [`Failure`] for the three kinds.
    ///
    /// # Errors
    ///
    /// As for [`Engine::complete`] (the size limit applies to a
    /// [`Failure::Final`] envelope).
    pub fn fail(&self, claim: Claim, failure: Failure) -> Result<()> {
        match failure {
            Failure::Final(envelope) => {
                self.finish_with(claim, Some(envelope), None, true, Vec::new())
            }
            Failure::Retryable => self.finish_with(claim, None, None, false, Vec::new()),
            Failure::Unknown { reason } => {
                let mut claim = self.own_claim(claim)?;
                claim.finished = true;
                let op = Op::MarkUnknown {
                    key: claim.key.clone(),
                    token: claim.token,
                    reason,
                    holder_done: true,
                };
                self.shared.submit(op).map(drop)
            }
        }
    }

    pub(crate) fn own_claim(&self, claim: Claim) -> Result<Claim> {
        if std::ptr::eq(claim.engine.as_ptr(), Arc::as_ptr(&self.shared)) {
            Ok(claim)
        } else {
            Err(Error::ForeignClaim {
                key: claim.key.clone(),
            })
        }
    }

    pub(crate) fn finish_with(
        &self,
        claim: Claim,
        envelope: Option<Envelope>,
        resource: Option<String>,
        final_failure: bool,
        outbox: Vec<OutgoingMessage>,
    ) -> Result<()> {
        let mut claim = self.own_claim(claim)?;
        let s = &self.shared;
        let Some(envelope) = envelope else {
            claim.finished = true;
            let op = Op::Release {
                key: claim.key.clone(),
                token: claim.token,
            };
            return s.submit(op).map(drop);
        };
        let size = envelope.size_bytes() + resource.as_ref().map_or(0, String::len);
        if size > s.cfg.write.max_response_bytes {
            claim.finished = true;
            let reason = format!(
                "response of {size} bytes refused (limit {} bytes)",
                s.cfg.write.max_response_bytes
            );
            s.submit(Op::MarkUnknown {
                key: claim.key.clone(),
                token: claim.token,
                reason,
                holder_done: true,
            })?;
            return Err(Error::ResponseTooLarge {
                key: claim.key.clone(),
                size,
                limit: s.cfg.write.max_response_bytes,
            });
        }
        claim.finished = true;
        let op = Op::Complete {
            key: claim.key.clone(),
            token: claim.token,
            response: StoredResponse::new(envelope, resource),
            final_failure,
            outbox,
        };
        s.submit(op).map(drop)
    }

    /// Settles up to `limit` UNKNOWN records from the recovery queue, oldest
    /// first, by asking `resolver` about each.
    ///
    /// # Errors
    ///
    /// Storage errors and [`Error::Poisoned`]. Not errors: a record settled
    /// concurrently by someone else is counted in `skipped`; a resolver
    /// answer the engine refuses (a `Completed` envelope over
    /// `max_response_bytes`) leaves that record UNKNOWN, is counted in
    /// `still_unknown`, and recovery goes on with the next record.
    pub fn recover_pending(&self, resolver: &dyn Resolver, limit: usize) -> Result<RecoveryReport> {
        let s = &self.shared;
        let mut report = RecoveryReport::default();
        let now = s.clock.now_ms();
        for pending in self.pending(limit)? {
            // A dropped claim's work may still be running until its lease
            // ends; it is not safe to settle yet.
            if pending.resolvable_at_ms > now {
                report.still_unknown += 1;
                continue;
            }
            // One bad answer (an envelope over the size limit) must not stop
            // the rest of the queue: the record stays UNKNOWN.
            let settle = match s.settlement(&pending.key, resolver.resolve(&pending)) {
                Ok(settle) => settle,
                Err(e) => {
                    tracing::error!(key = %pending.key, error = %e, "resolver answer refused");
                    report.still_unknown += 1;
                    continue;
                }
            };
            let op = Op::Settle {
                key: pending.key.clone(),
                token: pending.fencing_token,
                settle,
                then_claim: None,
            };
            match s.submit(op) {
                Ok(Reply::Existing {
                    class: Class::Done, ..
                }) => {
                    bump(&s.counters.resolved, 1);
                    report.completed += 1;
                }
                Ok(Reply::Existing { .. }) => report.still_unknown += 1,
                Ok(_) => {
                    bump(&s.counters.resolved, 1);
                    report.not_executed += 1;
                }
                Err(Error::Fenced { .. } | Error::NotFound { .. }) => report.skipped += 1,
                Err(e) => return Err(e),
            }
        }
        Ok(report)
    }

    /// Settles one UNKNOWN record by hand (what `idem resolve` does).
    ///
    /// [`Resolution::NotExecuted`] is refused until the record's
    /// [`Pending::resolvable_at_ms`] (a dropped claim's work may still be
    /// running until its lease ends, and a retry would then execute it a
    /// second time); `Completed` and `StillUnknown` are taken at once. Check
    /// with the provider first. A PROCESSING record whose lease ran out
    /// must first become UNKNOWN (a sweep, or a `begin` on the key) before
    /// it can be resolved here.
    ///
    /// # Errors
    ///
    /// [`Error::NotFound`] if there is no record; [`Error::InvalidState`] if
    /// it is not UNKNOWN, or for `NotExecuted` before `resolvable_at_ms`;
    /// [`Error::Fenced`] if it changed meanwhile;
    /// [`Error::ResponseTooLarge`]; storage errors.
    pub fn resolve(&self, key: &IdempotencyKey, resolution: Resolution) -> Result<()> {
        let s = &self.shared;
        let rec = s
            .read_record(key)?
            .ok_or_else(|| Error::NotFound { key: key.clone() })?;
        if rec.state != DiskState::Unknown {
            return Err(Error::InvalidState {
                key: key.clone(),
                action: "resolve",
                state: rec.state.into(),
            });
        }
        if resolution == Resolution::NotExecuted && rec.lease_until_ms > s.clock.now_ms() {
            return Err(Error::InvalidState {
                key: key.clone(),
                action: "settle as not executed before the dropped claim's lease ends \
                         (its work may still be running)",
                state: rec.state.into(),
            });
        }
        let settle = s.settlement(key, resolution)?;
        // "Still unknown" settles nothing: not counted as resolved, as in
        // `recover_pending` and `begin`.
        let resolved = !matches!(settle, Settle::StillUnknown);
        s.submit(Op::Settle {
            key: key.clone(),
            token: rec.token,
            settle,
            then_claim: None,
        })?;
        if resolved {
            bump(&s.counters.resolved, 1);
        }
        Ok(())
    }

    /// Deletes one record. COMPLETED, FAILED_FINAL and TOMBSTONE records go
    /// freely (the next request with the key executes again). PROCESSING and
    /// UNKNOWN records need `force`: deleting them lets a retry run work that
    /// may already be running or have run — a possible double execution.
    /// A record that does not decode can be deleted only with `force`.
    /// Returns the state the record was in (`None` for a corrupt record).
    ///
    /// # Errors
    ///
    /// [`Error::NotFound`], [`Error::InvalidState`] or
    /// [`Error::CorruptRecord`] (without `force`), storage errors.
    pub fn purge(&self, key: &IdempotencyKey, force: bool) -> Result<Option<crate::State>> {
        match self.shared.submit(Op::Purge {
            key: key.clone(),
            force,
        })? {
            Reply::Purged { state } => Ok(state),
            other => Err(self.shared.unexpected(other)),
        }
    }

    /// Runs one full sweep pass now, in bounded steps: stale PROCESSING
    /// records move to UNKNOWN, expired records are deleted or tombstoned.
    /// UNKNOWN records are never deleted.
    ///
    /// # Errors
    ///
    /// Storage errors and [`Error::Poisoned`].
    pub fn sweep_now(&self) -> Result<SweepCounts> {
        self.shared.sweep_pass(None)
    }

    /// Waits until every write queued before this call has committed
    /// durably, including the notices of dropped claims (which are sent
    /// without waiting). Costs one commit.
    ///
    /// # Errors
    ///
    /// [`Error::Poisoned`], [`Error::Closed`], storage errors.
    pub fn flush(&self) -> Result<()> {
        self.shared.submit(Op::Flush).map(drop)
    }

    /// Up to `limit` UNKNOWN records from the recovery queue, oldest first.
    /// A record that does not decode is skipped (and logged); see
    /// [`Engine::records`] to list it.
    ///
    /// # Errors
    ///
    /// Storage errors.
    pub fn pending(&self, limit: usize) -> Result<Vec<Pending>> {
        let s = &self.shared;
        let ctx = "reading the recovery queue";
        // One snapshot for both tables, so every queue entry has its record.
        let txn = s.db.begin_read().map_err(|e| Error::storage(ctx, e))?;
        let queue = txn
            .open_table(RECOVERY)
            .map_err(|e| Error::storage(ctx, e))?;
        let records = txn
            .open_table(RECORDS)
            .map_err(|e| Error::storage(ctx, e))?;
        let mut out = Vec::new();
        for entry in queue.iter().map_err(|e| Error::storage(ctx, e))? {
            if out.len() >= limit {
                break;
            }
            let (k, _) = entry.map_err(|e| Error::storage(ctx, e))?;
            let (_, rkey) = k.value();
            let Some(key) = IdempotencyKey::from_record_key(rkey) else {
                continue;
            };
            let Some(v) = records.get(rkey).map_err(|e| Error::storage(ctx, e))? else {
                continue;
            };
            // One corrupt record must not hide the rest of the queue;
            // `records()` lists it with its error.
            match decode_for(&key, v.value()) {
                Ok(rec) => out.push(s.pending_of(key, &rec)),
                Err(e) => tracing::error!(error = %e, "skipping a corrupt UNKNOWN record"),
            }
        }
        Ok(out)
    }

    /// The clock the engine reads.
    pub fn clock(&self) -> &dyn Clock {
        &*self.shared.clock
    }

    /// The largest response (body plus headers, see
    /// [`Envelope::size_bytes`]) `complete` accepts, in bytes.
    pub fn max_response_bytes(&self) -> usize {
        self.shared.cfg.write.max_response_bytes
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(sweeper) = self.sweeper.take() {
            sweeper.stop();
        }
        let _ = self.shared.tx.send(Msg::Shutdown);
        if let Some(writer) = self.writer.take() {
            if writer.join().is_err() {
                tracing::error!("writer thread panicked");
            }
        }
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("config", &self.shared.cfg)
            .field("poisoned", &self.shared.poison.cause())
            .finish()
    }
}

pub(crate) fn decode_for(key: &IdempotencyKey, bytes: &[u8]) -> Result<Record> {
    codec::decode(bytes).map_err(|e| Error::CorruptRecord {
        key: key.to_string(),
        reason: e.to_string(),
    })
}

impl Shared {
    /// Sends an op to the writer and waits for its durable answer.
    pub(crate) fn submit(&self, op: Op) -> Result<Reply> {
        self.poison.check()?;
        if crate::writer::on_writer_of(&self.poison) {
            return Err(Error::Reentrant);
        }
        let (reply, answer) = crossbeam_channel::bounded(1);
        let req = Request {
            op,
            reply: Some(reply),
        };
        if self.tx.send(Msg::Op(req)).is_err() {
            return Err(self.closed());
        }
        answer.recv().unwrap_or_else(|_| Err(self.closed()))
    }

    /// Sends an op nobody waits for (a dropped claim). Never blocks: it may
    /// run in `Drop` on an async worker or inside a local write on the
    /// writer thread. If the queue is full the op is skipped, which delays
    /// but does not change the outcome: the lease runs out and the record
    /// counts as UNKNOWN.
    pub(crate) fn submit_detached(&self, op: Op) {
        if self.poison.check().is_ok() {
            let _ = self.tx.try_send(Msg::Op(Request { op, reply: None }));
        }
    }

    fn closed(&self) -> Error {
        match self.poison.cause() {
            Some(cause) => Error::Poisoned { cause },
            None => Error::Closed,
        }
    }

    /// An op answered with a reply of the wrong kind: a bug, reported rather
    /// than panicking.
    pub(crate) fn unexpected(&self, reply: Reply) -> Error {
        let cause = format!("unexpected writer reply {reply:?}");
        tracing::error!(%cause, "internal error");
        Error::Internal(cause)
    }

    /// One engine table in a fresh read transaction (a snapshot of the
    /// last commit). `ctx` says what for, in errors.
    pub(crate) fn read_table<K: redb::Key + 'static, V: redb::Value + 'static>(
        &self,
        table: redb::TableDefinition<K, V>,
        ctx: &'static str,
    ) -> Result<redb::ReadOnlyTable<K, V>> {
        let txn = self.db.begin_read().map_err(|e| Error::storage(ctx, e))?;
        txn.open_table(table).map_err(|e| Error::storage(ctx, e))
    }

    pub(crate) fn read_record(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        let ctx = "reading a record";
        let table = self.read_table(RECORDS, ctx)?;
        let value = table
            .get(key.to_record_key().as_slice())
            .map_err(|e| Error::storage(ctx, e))?;
        value.map(|v| decode_for(key, v.value())).transpose()
    }

    pub(crate) fn replay(&self, key: &IdempotencyKey, rec: &Record) -> Result<Replay> {
        let resp = rec.response.as_ref().ok_or_else(|| Error::CorruptRecord {
            key: key.to_string(),
            reason: "completed record has no stored response".into(),
        })?;
        let stored = resp.envelope();
        let stored_schema_version = stored.schema_version;
        let (envelope, is_current) =
            self.cfg
                .upcasters
                .apply(stored)
                .map_err(|(from, reason)| Error::Upcast {
                    key: key.clone(),
                    from,
                    reason,
                })?;
        Ok(Replay {
            envelope,
            is_current,
            stored_schema_version,
            resource: resp.resource.clone(),
            kind: if rec.state == DiskState::FailedFinal {
                ReplayKind::FinalFailure
            } else {
                ReplayKind::Completed
            },
            completed_at_ms: rec.updated_at_ms,
            reference: rec.reference.clone(),
        })
    }

    pub(crate) fn pending_of(&self, key: IdempotencyKey, rec: &Record) -> Pending {
        let since = if rec.state == DiskState::Unknown {
            rec.unknown_since_ms
        } else {
            rec.lease_until_ms
        };
        Pending {
            key,
            reference: rec.reference.clone(),
            fencing_token: rec.token,
            attempts: rec.attempts,
            claimed_at_ms: rec.claimed_at_ms,
            unknown_since_ms: since,
            resolvable_at_ms: rec.lease_until_ms,
            age_ms: self.clock.now_ms().saturating_sub(since),
            reason: rec.reason.clone(),
        }
    }

    pub(crate) fn settlement(
        &self,
        key: &IdempotencyKey,
        resolution: Resolution,
    ) -> Result<Settle> {
        Ok(match resolution {
            Resolution::Completed(envelope) => {
                let size = envelope.size_bytes();
                if size > self.cfg.write.max_response_bytes {
                    return Err(Error::ResponseTooLarge {
                        key: key.clone(),
                        size,
                        limit: self.cfg.write.max_response_bytes,
                    });
                }
                Settle::Completed(StoredResponse::new(envelope, None))
            }
            Resolution::NotExecuted => Settle::NotExecuted,
            Resolution::StillUnknown => Settle::StillUnknown,
        })
    }

    /// Whether a lease or an expiry is due: the oldest entry of either
    /// index is at or before now.
    fn sweep_due(&self) -> Result<bool> {
        let ctx = "checking for sweep work";
        let now = self.clock.now_ms();
        for table in [crate::tables::LEASES, crate::tables::EXPIRY] {
            let index = self.read_table(table, ctx)?;
            let first = index.first().map_err(|e| Error::storage(ctx, e))?;
            if first.is_some_and(|(k, _)| k.value().0 <= now) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// One full sweep pass in bounded steps; stops early if `stop` has a
    /// message waiting (engine shutdown).
    pub(crate) fn sweep_pass(&self, stop: Option<&Receiver<()>>) -> Result<SweepCounts> {
        let mut total = SweepCounts::default();
        loop {
            // An idle engine must not pay a durable commit per tick.
            if !self.sweep_due()? {
                return Ok(total);
            }
            let step = match self.submit(Op::Sweep {
                limit: self.cfg.sweep_batch,
            })? {
                Reply::Swept(c) => c,
                other => return Err(self.unexpected(other)),
            };
            total.moved_to_unknown += step.moved_to_unknown;
            total.deleted += step.deleted;
            total.tombstoned += step.tombstoned;
            let c = &self.counters;
            bump(&c.moved_to_unknown, step.moved_to_unknown);
            bump(&c.expired_deleted, step.deleted);
            bump(&c.tombstoned, step.tombstoned);
            if !step.more || stop.is_some_and(|s| !s.is_empty()) {
                total.more = step.more;
                return Ok(total);
            }
        }
    }
}
