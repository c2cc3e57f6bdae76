//! The engine handle: every public operation, each delegating to the core
//! or to the feature that implements it.

use std::sync::Arc;
use std::time::Duration;

use crate::clock::{duration_ms, Clock};
use crate::engine::begin::Begin;
use crate::engine::builder::EngineBuilder;
use crate::engine::claim::Claim;
use crate::engine::core::Core;
use crate::engine::inbox::Inbox;
use crate::engine::inspect::{RecordFilter, RecordInfo, Stats};
use crate::engine::local::LocalRun;
use crate::engine::outbox::Outbox;
use crate::engine::sweeper::Sweeper;
use crate::engine::wait::DurableWrite;
use crate::engine::{entity, inspect, local, recovery};
use crate::envelope::Envelope;
use crate::error::{BoxError, Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::message::OutgoingMessage;
use crate::outcome::{Failure, InDoubt};
use crate::policy::PurgeMode;
use crate::report::{RecoveryReport, SweepCounts};
use crate::resolver::{Resolution, Resolver};
use crate::state::State;
use crate::store::{Completion, LocalTx};
use crate::transition::Transition;
use crate::verify::VerifyReport;

/// The idempotency engine: one store (a redb file), one writer thread doing
/// group commits, one background sweeper.
///
/// `Engine` is `Send + Sync`; share it between threads by reference or in an
/// `Arc`. The plain calls block the calling thread. From async code use
/// [`Engine::begin_async`], [`Engine::complete_async`] and
/// [`Engine::fail_async`], which share their implementation with the plain
/// calls and wait for the writer without blocking a thread (on redb; on
/// PostgreSQL they block too, so run them via `spawn_blocking`); call the
/// other methods via `spawn_blocking`.
///
/// # Close semantics
///
/// Dropping the engine stops the sweeper (finishing its current bounded
/// step), lets the writer commit every operation already queued, joins both
/// threads and closes the database file. Claims still alive afterwards
/// return [`Error::Closed`]; their records stay PROCESSING until the lease
/// runs out and then count as UNKNOWN, as after a crash.
pub struct Engine {
    core: Arc<Core>,
    sweeper: Option<Sweeper>,
}

impl Engine {
    /// A builder with the documented defaults.
    pub fn builder() -> EngineBuilder {
        EngineBuilder::default()
    }

    pub(crate) fn new(core: Arc<Core>, sweeper: Option<Sweeper>) -> Engine {
        Engine { core, sweeper }
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
    /// A corrupt record for this key ([`Error::Corrupt`] with
    /// [`Corrupted::Record`](crate::Corrupted::Record)), an upcaster
    /// failure on replay ([`Error::Upcast`]), a resolver answer over
    /// `max_response_bytes` ([`Error::ResponseTooLarge`]; the record stays
    /// UNKNOWN), storage errors, [`Error::Poisoned`].
    pub fn begin(&self, key: &IdempotencyKey, fingerprint: Fingerprint) -> Result<Begin> {
        self.core.begin(key, fingerprint, self.core.cfg.lease_ms())
    }

    /// [`Engine::begin`] with a lease for this claim only (a withdrawal that
    /// may take an hour needs a longer lease than a 200 ms write). Counted
    /// in whole milliseconds; a zero lease counts as 1 ms.
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
        self.core.begin(key, fingerprint, duration_ms(lease).max(1))
    }

    /// [`Engine::begin`] for async callers: the same answers and errors
    /// (one implementation underneath), without a blocking-pool thread.
    ///
    /// What runs where, on the redb backend:
    ///
    /// - The read that answers a repeated key (a replay, a processing or
    ///   mismatch answer) runs on the polling thread: a snapshot read of
    ///   redb's last commit plus the in-memory overlay of acknowledged
    ///   writes. It does no I/O beyond reading a page of the database file
    ///   that redb's cache does not hold (a `pread`, normally served by the
    ///   OS page cache), and never waits for the writer.
    /// - A claim (a write) is queued to the writer thread and awaited: the
    ///   writer's reply wakes the task once the claim is durable; no
    ///   thread waits for it.
    /// - The calling thread can wait only while the writer's queue is full
    ///   ([`EngineBuilder::queue_capacity`] operations queued), or while a
    ///   poisoned engine attempts its reopen (at most once a second; see
    ///   [`Engine::poisoned`]).
    /// - With a [`Resolver`], an in-doubt record whose lease has ended is
    ///   put to the resolver on the polling thread, as `begin` does.
    ///
    /// On the PostgreSQL backend every step is a synchronous call on the
    /// polling thread: call it from `spawn_blocking` there (the HTTP layer
    /// does).
    ///
    /// Dropping the future while a claim is being committed does not leak
    /// the claim: nobody can have acted on it, so the engine releases it
    /// (the key is free again) as soon as the commit answers.
    ///
    /// # Errors
    ///
    /// As for [`Engine::begin`].
    pub async fn begin_async(
        &self,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
    ) -> Result<Begin> {
        self.core
            .begin_async(key, fingerprint, self.core.cfg.lease_ms())
            .await
    }

    /// [`Engine::begin_with_lease`] for async callers; see
    /// [`Engine::begin_async`].
    ///
    /// # Errors
    ///
    /// As for [`Engine::begin`].
    pub async fn begin_with_lease_async(
        &self,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> Result<Begin> {
        self.core
            .begin_async(key, fingerprint, duration_ms(lease).max(1))
            .await
    }

    /// Whether a call made now may block the calling thread on more than a
    /// snapshot read and a queue send (see [`Engine::begin_async`]): on
    /// PostgreSQL, or while the engine is poisoned. The HTTP layer asks it
    /// to choose between awaiting the engine and tokio's blocking pool.
    #[cfg(feature = "http")]
    pub(crate) fn calls_may_block(&self) -> bool {
        self.core.store.may_block()
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
    ///   `max_response_bytes`: nothing is stored, and the claim comes back
    ///   unused inside the error (the record stays PROCESSING), so a smaller
    ///   answer can be stored with it; dropping the error drops the claim,
    ///   which then counts as a dropped claim (in doubt, never re-executed).
    /// - [`Error::Fenced`] if the token no longer owns the record; the stored
    ///   record is untouched.
    /// - [`Error::InvalidState`] while one of the claim's effect steps is
    ///   still reserved (confirm or reject it first): nothing is stored and
    ///   the claim is used up; its record stays PROCESSING until the lease
    ///   ends, then the step is settled by asking its provider.
    /// - [`Error::ForeignClaim`], [`Error::Poisoned`], [`Error::Closed`],
    ///   storage errors.
    pub fn complete(&self, claim: Claim, envelope: Envelope) -> Result<()> {
        self.core
            .finish(claim, Completion::Success, envelope, None, Vec::new())
            .wait()
    }

    /// [`Engine::complete`] for async callers: the same checks, the same
    /// write and the same errors, without blocking the calling thread.
    ///
    /// The write is queued before this returns (a full writer queue, or
    /// the reopen attempt of a poisoned engine, is the only wait on the
    /// calling thread); the returned [`DurableWrite`] resolves once it is
    /// durable, woken by the engine's writer thread, with no thread of a
    /// blocking pool involved. Dropping it does not cancel the write: the
    /// claim's outcome is recorded all the same.
    ///
    /// On the PostgreSQL backend the write runs on the calling thread
    /// before this returns (its client is synchronous): call it from
    /// `spawn_blocking` there, as the HTTP layer does.
    ///
    /// # Errors
    ///
    /// As for [`Engine::complete`], from the future.
    pub fn complete_async(&self, claim: Claim, envelope: Envelope) -> DurableWrite {
        DurableWrite::new(
            self.core
                .finish(claim, Completion::Success, envelope, None, Vec::new()),
        )
    }

    /// [`Engine::complete_with_messages`] for async callers, as
    /// [`Engine::complete_async`] is for [`Engine::complete`]: the outcome
    /// and the outbox `messages` in one write, queued before this returns,
    /// durable when the returned [`DurableWrite`] resolves.
    ///
    /// # Errors
    ///
    /// As for [`Engine::complete_with_messages`], from the future.
    pub fn complete_with_messages_async(
        &self,
        claim: Claim,
        envelope: Envelope,
        messages: Vec<OutgoingMessage>,
    ) -> DurableWrite {
        DurableWrite::new(
            self.core
                .finish(claim, Completion::Success, envelope, None, messages),
        )
    }

    /// [`Engine::complete`], also storing a resource reference (e.g. a payment
    /// id) for apps whose contract is "a retry returns the resource's current
    /// state" rather than the original response. Replays carry it in
    /// [`crate::Replay::resource`]. Its bytes count against
    /// `max_response_bytes`.
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
        let resource = Some(resource.into());
        self.core
            .finish(claim, Completion::Success, envelope, resource, Vec::new())
            .wait()
    }

    /// [`Engine::complete`] that also stores outbox `messages` in the same
    /// transaction. Their ids are `<claim reference>/<n>`. Their topics and
    /// payloads count against `max_response_bytes`, with the response.
    ///
    /// # Errors
    ///
    /// As for [`Engine::complete`].
    pub fn complete_with_messages(
        &self,
        claim: Claim,
        envelope: Envelope,
        messages: Vec<OutgoingMessage>,
    ) -> Result<()> {
        self.core
            .finish(claim, Completion::Success, envelope, None, messages)
            .wait()
    }

    /// Ends a claim without success; see [`Failure`] for the three kinds.
    ///
    /// # Errors
    ///
    /// As for [`Engine::complete`] (the size limit applies to a
    /// [`Failure::Final`] envelope).
    pub fn fail(&self, claim: Claim, failure: Failure) -> Result<()> {
        self.fail_async(claim, failure).wait()
    }

    /// [`Engine::fail`] for async callers: the same write and errors,
    /// queued before this returns, durable when the returned
    /// [`DurableWrite`] resolves (see [`Engine::complete_async`] for what
    /// waits where, and for PostgreSQL). Dropping the future does not
    /// cancel the write.
    ///
    /// # Errors
    ///
    /// As for [`Engine::fail`], from the future.
    pub fn fail_async(&self, claim: Claim, failure: Failure) -> DurableWrite {
        DurableWrite::new(match failure {
            Failure::Final(envelope) => {
                self.core
                    .finish(claim, Completion::FinalFailure, envelope, None, Vec::new())
            }
            Failure::Retryable => self.core.release(claim),
            Failure::InDoubt { reason } => self.core.abandon(claim, reason),
        })
    }

    /// Completes `claim` and runs the app's own write in the same durable
    /// transaction: `write` gets the transaction (open your tables on
    /// [`LocalTx::redb`], or run your statements on `LocalTx::postgres`
    /// with the `postgres` feature; queue outbox messages with
    /// [`LocalTx::send`]) and returns the envelope to store for replay.
    /// Either the app's rows, the outbox messages and the COMPLETED record
    /// all commit, or none does.
    ///
    /// On redb the closure runs on the engine's writer thread (hence `Send +
    /// 'static`); keep it short: it holds the write lock. On PostgreSQL it
    /// runs on the caller's thread, holding the key's row lock.
    ///
    /// # Errors
    ///
    /// - [`Error::LocalWrite`] if `write` returns an error or panics: the
    ///   transaction is rolled back and the key is released (nothing
    ///   happened, so the next delivery or request executes afresh).
    /// - [`Error::ResponseTooLarge`]: rolled back and released likewise.
    /// - [`Error::Fenced`] if the claim no longer owns the record: rolled
    ///   back, so a fenced holder can never commit its local effect.
    /// - [`Error::ForeignClaim`], [`Error::Poisoned`], [`Error::Closed`],
    ///   storage errors.
    pub fn complete_local<F>(&self, claim: Claim, write: F) -> Result<()>
    where
        F: FnOnce(&mut LocalTx<'_>) -> Result<Envelope, BoxError> + Send + 'static,
    {
        local::complete_local(&self.core, claim, write)
    }

    /// Runs `write` exactly once for `key`, with no claim in between: in one
    /// write transaction the engine checks the key, runs the app's write
    /// (see [`Engine::complete_local`]) and stores the COMPLETED record with
    /// the envelope `write` returns. A crash anywhere leaves nothing: no
    /// app rows, no record, so a retry simply runs it. Use it when the
    /// work is entirely local (a ledger row in the same file).
    ///
    /// Returns [`LocalRun::Executed`], or [`LocalRun::Skipped`] with what
    /// `begin` would have answered (replay, processing, mismatch, in doubt,
    /// tombstoned) when the key is not free; the resolver is not consulted.
    ///
    /// # Errors
    ///
    /// [`Error::LocalWrite`] (rolled back; nothing stored),
    /// [`Error::ResponseTooLarge`], [`Error::Corrupt`] (a corrupt record),
    /// storage errors.
    pub fn execute_local<F>(
        &self,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        write: F,
    ) -> Result<LocalRun>
    where
        F: FnOnce(&mut LocalTx<'_>) -> Result<Envelope, BoxError> + Send + 'static,
    {
        local::execute_local(&self.core, key, fingerprint, write)
    }

    /// Up to `limit` in-doubt records, oldest first by the instant they
    /// came into doubt: UNKNOWN records from the recovery queue, and
    /// PROCESSING records whose lease has ended (they count as UNKNOWN at
    /// read time, before any sweep moves them). A record that does not
    /// decode is skipped (and logged); see [`Engine::records`] to list it.
    /// Each carries its effect steps ([`InDoubt::steps`]), with the
    /// attempts and age of any a provider keeps answering "still unknown"
    /// about (what `idem unknown` shows).
    ///
    /// # Errors
    ///
    /// Storage errors; [`Error::Corrupt`] for a step that does not decode.
    pub fn in_doubt(&self, limit: usize) -> Result<Vec<InDoubt>> {
        recovery::in_doubt(&self.core, limit)
    }

    /// Settles up to `limit` in-doubt records (as listed by
    /// [`Engine::in_doubt`]), oldest first, by asking `resolver` about each
    /// (for a key with effect steps: about each unsettled step, asking the
    /// [`EngineBuilder::step_resolver`] for its name first; a key whose
    /// steps all settle completes from them or stays UNKNOWN, resumable on
    /// the client's retry, counted in [`RecoveryReport::resumed`]).
    ///
    /// Resumable keys ([`InDoubt::is_resumable`]: every step settled,
    /// waiting for the client's retry) do not count against `limit` while
    /// other in-doubt records wait: the run settles up to `limit` of the
    /// others first, then looks at resumable ones with what is left of
    /// `limit`. So keys that are never retried cannot keep newer in-doubt
    /// keys from recovery; the run reads past them (one record and one
    /// steps read each, no write).
    ///
    /// # Errors
    ///
    /// Storage errors and [`Error::Poisoned`]. Not errors: a record settled
    /// concurrently by someone else is counted in `skipped`; a resolver
    /// answer the engine refuses (a `Completed` envelope over
    /// `max_response_bytes`) leaves that record UNKNOWN, is counted in
    /// `still_in_doubt`, and recovery goes on with the next record.
    pub fn recover_in_doubt(
        &self,
        resolver: &dyn Resolver,
        limit: usize,
    ) -> Result<RecoveryReport> {
        recovery::recover(&self.core, resolver, limit)
    }

    /// Settles one in-doubt record by hand (what `idem resolve` does),
    /// recording `reason` and the answer in the key's evidence log
    /// ([`Engine::history`]).
    ///
    /// [`Resolution::NotExecuted`] is refused until the record's
    /// [`InDoubt::resolvable_at_ms`] (a dropped claim's work may still be
    /// running until its lease ends, and a retry would then execute it a
    /// second time); `Completed` and `StillInDoubt` are taken at once. Check
    /// with the provider first. A PROCESSING record whose lease has ended
    /// counts as UNKNOWN (read-time truth, as in `begin`): it is resolved
    /// here without waiting for a sweep. For a key with effect steps,
    /// prefer [`Engine::resolve_step`]: settling the whole key overrides
    /// what its steps say.
    ///
    /// # Errors
    ///
    /// [`Error::ReasonRequired`] for a blank `reason`;
    /// [`Error::ReasonTooLong`] for one over [`crate::MAX_REASON_BYTES`];
    /// [`Error::NotFound`] if there is no record; [`Error::InvalidState`] if it is not UNKNOWN,
    /// or for `NotExecuted` before `resolvable_at_ms` (or, on a key with
    /// steps, while a step is Reserved, Unknown or Confirmed: its call
    /// happened or may have; settle the steps instead);
    /// [`Error::Fenced`] if it changed meanwhile;
    /// [`Error::ResponseTooLarge`]; [`Error::HistoryFull`]; storage errors.
    /// Nothing is written on an error.
    pub fn resolve(
        &self,
        key: &IdempotencyKey,
        resolution: Resolution,
        reason: &str,
    ) -> Result<()> {
        check_reason_len(key, reason)?;
        recovery::resolve(&self.core, key, resolution, reason).map_err(|e| e.naming(key, None))
    }

    /// Settles one effect step of an in-doubt key by hand (what `idem
    /// resolve --step` does), after checking with its provider; `reason`
    /// and the answer go into the evidence log. When this settles the key's
    /// last unsettled step, the key settles too: completed from the steps
    /// if the engine's resolver builds a response from them
    /// ([`Resolver::complete_from_steps`]), else it stays UNKNOWN,
    /// resumable: the next `begin` with the same fingerprint resumes it
    /// in one write and skips the confirmed steps.
    ///
    /// # Errors
    ///
    /// [`Error::ReasonRequired`]; [`Error::ReasonTooLong`];
    /// [`Error::InvalidStepName`];
    /// [`Error::EvidenceTooLarge`]; [`Error::NotFound`] (no record);
    /// [`Error::StepNotFound`] if the key has no step `name`;
    /// [`Error::InvalidState`] if the key is not in doubt, or for
    /// `NotExecuted` before its claim's lease ends; [`Error::Fenced`] if
    /// it changed meanwhile; [`Error::HistoryFull`]; storage errors.
    /// Nothing is written on an error (once the step's answer is stored,
    /// a failure to complete the key from its steps is logged, not
    /// returned: the key stays in doubt).
    pub fn resolve_step(
        &self,
        key: &IdempotencyKey,
        name: &str,
        resolution: crate::StepResolution,
        reason: &str,
    ) -> Result<()> {
        check_reason_len(key, reason)?;
        recovery::resolve_step(&self.core, key, name, resolution, reason)
            .map_err(|e| e.naming(key, Some(name)))
    }

    /// The key's effect steps, in the order the store keeps them (by name).
    /// A step reserved under a claim that no longer runs is reported as
    /// `Unknown` (read-time truth). Empty for a key without steps. Steps
    /// never outlive their record: they go with it when it is purged,
    /// expires or is settled as not executed.
    ///
    /// # Errors
    ///
    /// [`Error::Corrupt`] (a step or the record does not decode), storage
    /// errors.
    pub fn steps(&self, key: &IdempotencyKey) -> Result<Vec<crate::StepInfo>> {
        recovery::steps(&self.core, key)
    }

    /// The key's evidence log, oldest first: every step transition and
    /// every settlement, with when, who ([`crate::Actor`]), the states
    /// before and after, and the evidence. At most
    /// [`crate::MAX_HISTORY_ENTRIES`] entries; it expires with the record
    /// (a tombstone keeps one summary entry). Empty for a key without one.
    ///
    /// # Errors
    ///
    /// [`Error::Corrupt`] (an entry does not decode), storage errors.
    pub fn history(&self, key: &IdempotencyKey) -> Result<Vec<crate::HistoryEntry>> {
        recovery::history(&self.core, key)
    }

    /// Whether a retry of this in-doubt key can be answered without an
    /// operator. A key without steps: the engine has a [`Resolver`]. A key
    /// with steps: every step not yet settled (`Reserved` or `Unknown`) has
    /// someone to ask, a per-step resolver for its name or the engine's
    /// [`Resolver`]. The engine cannot tell whether that resolver
    /// implements [`Resolver::resolve_step`] (its default answers "still
    /// unknown"), so a `Resolver` counts as covering every step: an app
    /// whose resolver does not answer for steps registers per-step
    /// resolvers instead.
    #[cfg(feature = "http")]
    pub(crate) fn settles_in_doubt(&self, in_doubt: &InDoubt) -> bool {
        let cfg = &self.core.cfg;
        if cfg.resolver.is_some() {
            return true;
        }
        !in_doubt.steps.is_empty()
            && in_doubt
                .steps
                .iter()
                .filter(|s| {
                    matches!(
                        s.state,
                        crate::StepState::Reserved | crate::StepState::Unknown
                    )
                })
                .all(|s| cfg.step_resolvers.contains_key(&s.name))
    }

    /// Deletes one record. COMPLETED, `FINAL_FAILURE` and TOMBSTONE records
    /// go under either mode (the next request with the key executes again).
    /// PROCESSING and UNKNOWN records, and records that do not decode, need
    /// [`PurgeMode::Force`]: deleting them lets a retry run work that may
    /// already be running or have run — a possible double execution.
    /// Returns the state the record was in (`None` for a corrupt record).
    ///
    /// A key's effect steps and evidence log go with its record. A store
    /// written before a resumed claim's retryable failure kept the record
    /// (it now stays UNKNOWN) may hold steps without a record:
    /// [`PurgeMode::Force`] deletes those and returns `None`; the key's
    /// next claim then runs every call again.
    ///
    /// # Errors
    ///
    /// [`Error::NotFound`]; under [`PurgeMode::FinishedOnly`],
    /// [`Error::InvalidState`] or [`Error::Corrupt`] (a corrupt record);
    /// storage errors.
    pub fn purge(&self, key: &IdempotencyKey, mode: PurgeMode) -> Result<Option<State>> {
        self.core
            .store
            .purge(key.clone(), mode)
            .map_err(|e| e.naming(key, None))
    }

    /// Runs one full sweep pass now, in bounded steps: stale PROCESSING
    /// records move to UNKNOWN, expired records are deleted or tombstoned.
    /// UNKNOWN records are never deleted.
    ///
    /// # Errors
    ///
    /// Storage errors and [`Error::Poisoned`].
    pub fn sweep_now(&self) -> Result<SweepCounts> {
        self.core.sweep_pass(&|| false)
    }

    /// Waits until every write queued before this call has committed
    /// durably, including the notices of dropped claims (which are sent
    /// without waiting). Costs one commit.
    ///
    /// # Errors
    ///
    /// [`Error::Poisoned`], [`Error::Closed`], storage errors.
    pub fn flush(&self) -> Result<()> {
        self.core.store.flush()
    }

    /// Moves `entity` to state `to` if its current state is one of `from`.
    /// An entity that does not exist yet is created when `from` is empty.
    /// One write transaction (compare-and-set through the writer), so racing
    /// transitions never lose an update: exactly one wins and the others get
    /// `Conflict` with the winner's state (or `AlreadyInState`).
    ///
    /// Rules, in order: current state == `to` → `AlreadyInState`; current in
    /// `from` (or absent with `from` empty) → `Applied`; else `Conflict`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidEntity`] for an empty or over-long (more than
    /// [`crate::MAX_ENTITY_BYTES`] bytes) entity id or state name, or one
    /// with a control character;
    /// [`Error::Corrupt`] (a corrupt entity state); storage errors.
    pub fn transition(&self, entity: &str, from: &[&str], to: &str) -> Result<Transition> {
        entity::transition(&self.core, entity, from, to)
    }

    /// The entity's current state and version, if it exists.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidEntity`] for an id `transition` would refuse;
    /// storage errors; [`Error::Corrupt`] (a corrupt entity state).
    pub fn entity_state(&self, entity: &str) -> Result<Option<(String, u64)>> {
        entity::state(&self.core, entity)
    }

    /// Up to `limit` dead letters, oldest first: messages an inbox gave
    /// up on ([`Inbox::fail_cleanly`] on the last allowed delivery,
    /// [`Inbox::reject`]). Messages in doubt are never here (see
    /// [`Engine::in_doubt`]).
    ///
    /// # Errors
    ///
    /// Storage errors; [`Error::Corrupt`] for a dead letter that does not
    /// decode.
    pub fn dead_letters(&self, limit: usize) -> Result<Vec<crate::DeadLetter>> {
        self.core.store.dead_letters(limit)
    }

    /// The delivery on which a cleanly failing message goes to the dead
    /// letters ([`crate::EngineBuilder::dead_letter_after`]), >= 1. A
    /// broker's own delivery limit must not be below it, or the broker
    /// stops delivering such a message before it gets there.
    pub fn dead_letter_after(&self) -> u32 {
        self.core.cfg.dead_letter_after
    }

    /// Moves dead letter `seq` back for redelivery: removed from the list
    /// and put in the outbox (same topic and payload) in one write, under
    /// a new message id `<id>~redrive<seq>.<unique>@<dead_at_ms>.<digest>`
    /// (`unique`: a number the store never hands out twice, its next
    /// fencing token; the digest: 12 hex digits of the letter's content;
    /// `dead-letter` in place of `<id>` when the id is empty, has control
    /// characters or would make the new id longer than
    /// [`crate::MAX_KEY_BYTES`]),
    /// so neither the broker's dedup window nor the original's
    /// `FINAL_FAILURE` inbox mark drops it, nor another redrive, even of an
    /// identical letter with the same seq and time. Returns that id, or
    /// `None` if there is no such letter.
    ///
    /// # Errors
    ///
    /// Storage errors; [`Error::Corrupt`] for a dead letter that does not
    /// decode (it stays listed).
    pub fn redrive(&self, seq: u64) -> Result<Option<String>> {
        self.core.store.redrive(seq)
    }

    /// The outbox relay API.
    pub fn outbox(&self) -> Outbox<'_> {
        Outbox::new(&self.core)
    }

    /// The inbox of `consumer` (a name for the consuming service or
    /// handler). Message ids are scoped per consumer, under the reserved
    /// scope `@inbox:<consumer>`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`] if `consumer` is empty, or `@inbox:<consumer>`
    /// is longer than 255 bytes or has control characters.
    pub fn inbox(&self, consumer: &str) -> Result<Inbox<'_>> {
        Inbox::new(&self.core, consumer)
    }

    /// The record stored for `key`, as stored (read-time expiry is not
    /// applied: an expired record not yet swept is shown with its
    /// `expires_at_ms`).
    ///
    /// # Errors
    ///
    /// [`Error::Corrupt`] (a corrupt record), storage errors.
    pub fn record(&self, key: &IdempotencyKey) -> Result<Option<RecordInfo>> {
        inspect::record(&self.core, key)
    }

    /// Lists records in key order (grouped by scope). A record that does not
    /// decode is listed as an `Err` naming its key ([`Error::Corrupt`] with
    /// [`Corrupted::Record`](crate::Corrupted::Record), or with
    /// [`Corrupted::RecordKey`](crate::Corrupted::RecordKey) when the key
    /// bytes themselves are bad), so one bad record does not hide the rest.
    ///
    /// # Errors
    ///
    /// Storage errors.
    pub fn records(&self, filter: &RecordFilter) -> Result<Vec<Result<RecordInfo>>> {
        inspect::records(&self.core, filter)
    }

    /// Counters since open, plus gauges counted from the database (a full
    /// scan of the records table: meant for operators, not hot paths).
    ///
    /// # Errors
    ///
    /// Storage errors.
    pub fn stats(&self) -> Result<Stats> {
        inspect::stats(&self.core)
    }

    /// Scrubs the whole database in one read snapshot: every record, outbox
    /// message and entity decodes and passes its checksum (over its key
    /// and its bytes), every record key is a valid key, every record (and
    /// entity) is found by a lookup of its own key, every index entry
    /// (lease, recovery, expiry) matches its record and back, and every
    /// effect step and log entry decodes and has its record beside it
    /// ([`crate::Damage::StepsWithoutRecord`]). So a record
    /// whose key bytes were damaged, which requests can no longer reach
    /// (they would run its work again), shows up here: as a value failing
    /// its checksum and an index entry without its record. A full scan: for
    /// operators (`idem verify`), not hot paths. Works on a read-only
    /// engine. `docs/operations.md` ("Damaged files") says what is detected when.
    ///
    /// On an engine opened read-only from a file
    /// ([`crate::EngineBuilder::open_read_only`], `idem verify`) it first runs
    /// redb's page check, the one every writable open runs, without writing
    /// to the file: a file a writable open refuses is never reported sound.
    /// A failing page is reported as [`crate::Damage::FailedPageCheck`]
    /// (the first one redb meets), with a
    /// [`crate::Damage::EntriesOnDamagedPage`] per engine table that has
    /// entries on it. A writable engine ran that check when it opened the
    /// file; its `verify` scrubs only (the file changes under it).
    ///
    /// Values of record format 1 (no checksum: PostgreSQL rows written by
    /// an older build) are checked only for decoding.
    ///
    /// # Errors
    ///
    /// Storage errors (a panic inside redb on a damaged file included).
    pub fn verify(&self) -> Result<VerifyReport> {
        let (damage, records) = self.core.store.verify()?;
        Ok(VerifyReport { records, damage })
    }

    /// The on-disk format of the engine's redb file: `3` (time-partitioned
    /// records, what a new file gets), `2` (one records table; kept by an
    /// existing file until it is opened with
    /// [`EngineBuilder::migrate_to_format_3`]), or `1` (only through
    /// [`EngineBuilder::open_read_only`], which reads a format-1 file as it
    /// is; a writable open migrates it to 2). `None` on PostgreSQL and
    /// Redis, whose layouts have no format number here.
    ///
    /// `docs/format.md` describes each format. Reads no storage; never fails.
    #[must_use]
    pub fn redb_format(&self) -> Option<u32> {
        self.core.store.redb_format()
    }

    /// Why the engine is poisoned, if it is: a write failed (a full disk,
    /// an I/O error) or the storage library panicked, so every later write
    /// is refused with [`Error::Poisoned`] while reads (replays) go on.
    /// `None` while healthy.
    ///
    /// An engine opened from a file (or with
    /// [`EngineBuilder::open_with_backend_factory`](crate::EngineBuilder::open_with_backend_factory))
    /// comes back by itself: this call, a write or the sweeper checks at
    /// most once a second (of the engine's clock) whether storage takes
    /// writes again, and if so reopens the database; this then returns
    /// `None`. One opened with `open_with_backend` stays poisoned until
    /// the app opens a new engine. An engine on PostgreSQL is never
    /// poisoned (a failed write fails alone).
    pub fn poisoned(&self) -> Option<String> {
        self.core.store.check().err().map(|e| e.to_string())
    }

    /// The clock the engine reads.
    pub fn clock(&self) -> &dyn Clock {
        &*self.core.clock
    }

    /// The largest response (body plus headers, see
    /// [`Envelope::size_bytes`]) `complete` accepts, in bytes.
    pub fn max_response_bytes(&self) -> usize {
        self.core.cfg.store.max_response_bytes
    }

    /// The default claim lease (see [`EngineBuilder::lease`]).
    pub fn lease(&self) -> Duration {
        self.core.cfg.lease
    }

    /// How many operations the writer's queue holds before callers wait
    /// (see [`EngineBuilder::queue_capacity`]).
    pub fn queue_capacity(&self) -> usize {
        self.core.cfg.queue_capacity
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(sweeper) = self.sweeper.take() {
            sweeper.stop();
        }
        self.core.store.close();
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("config", &self.core.cfg)
            .field(
                "poisoned",
                &self.core.store.check().err().map(|e: Error| e.to_string()),
            )
            .finish()
    }
}

/// Refuses an operator's reason over [`crate::MAX_REASON_BYTES`]: it is
/// stored in the key's evidence log, whose size per key is bounded. (A
/// blank reason is refused by `recovery`.)
fn check_reason_len(key: &IdempotencyKey, reason: &str) -> Result<()> {
    if reason.len() > crate::MAX_REASON_BYTES {
        return Err(Error::ReasonTooLong {
            key: key.clone(),
            bytes: reason.len(),
        });
    }
    Ok(())
}
