//! The store layer: where records live, behind one typed seam.
//!
//! [`Backend`] is the seam between the engine and storage. Every write
//! operation has its own request and its own typed result; a backend must
//! make each write durable before it returns, apply the state machine in
//! [`record`] and [`classify`] exactly, and refuse an operation (a fencing
//! refusal, a record in the wrong state) without changing anything. See
//! `docs/design.md` for what a backend must guarantee.
//!
//! The redb backend ([`redb::RedbStore`]) funnels every write through one
//! writer thread that group-commits batches.

pub(crate) mod classify;
pub(crate) mod codec;
#[cfg(test)]
mod codec_golden;
#[cfg(test)]
mod codec_props;
pub(crate) mod config;
mod local_tx;
pub(crate) mod ops;
pub(crate) mod pending;
pub(crate) mod poison;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
pub(crate) mod read_only;
pub(crate) mod record;
pub(crate) mod redb;
#[cfg(feature = "redis")]
pub(crate) mod redis;
mod refuse;
pub(crate) mod reply;
pub(crate) mod step;
pub(crate) mod step_ops;
#[cfg(test)]
mod step_ops_tests;
mod wire;

use crate::dead_letter::DeadLetter;
use crate::error::Result;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::message::{OutboxEntry, OutgoingMessage};
use crate::policy::PurgeMode;
use crate::report::SweepCounts;
use crate::state::State;
use crate::transition::Transition;

pub(crate) use self::classify::Held;
pub use self::local_tx::LocalTx;
pub(crate) use self::local_tx::{LocalTarget, LocalWrite};
pub(crate) use self::pending::Pending;
pub(crate) use self::record::{Completion, EntityState, Record, StoredResponse};
pub(crate) use self::step::{
    Actor, FinishStepRequest, HistoryRecord, SettleStepRequest, StepRecord, StepRequest,
};

/// A won claim, as the store recorded it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Claimed {
    pub(crate) token: u64,
    pub(crate) reference: String,
    pub(crate) claimed_at_ms: u64,
    pub(crate) lease_until_ms: u64,
    /// The key's effect steps as the claim finds them (kept from earlier
    /// claims of a resumed key; empty for a fresh key).
    pub(crate) steps: Vec<StepRecord>,
}

/// A record that holds its key, classified at `now_ms` (the instant the
/// classification was made, so answers derived from it read no other
/// clock).
#[derive(Clone, Debug)]
pub(crate) struct Found {
    pub(crate) record: Record,
    pub(crate) held: Held,
    pub(crate) now_ms: u64,
    /// The key's effect steps, as seen at `now_ms` (filled for a record in
    /// doubt; empty otherwise).
    #[cfg_attr(not(test), allow(dead_code))] // read by the engine's effect steps
    pub(crate) steps: Vec<StepRecord>,
}

/// The result of a claim attempt.
#[derive(Debug)]
pub(crate) enum ClaimResult {
    Claimed(Claimed),
    /// The key is held (a stale PROCESSING record was moved to UNKNOWN and
    /// is returned as in doubt).
    Held(Box<Found>),
}

/// What `begin`'s first step found (see `Backend::read_or_claim`). Only the
/// PostgreSQL and Redis backends claim in that step.
pub(crate) enum ReadOrClaim {
    /// The key had no record and is now claimed.
    #[cfg(any(feature = "postgres", feature = "redis"))]
    Claimed(Claimed),
    /// The key's record as a read saw it; `begin` decides from there.
    Read(Option<Record>),
}

/// A claim attempt.
#[derive(Clone, Debug)]
pub(crate) struct ClaimRequest {
    pub(crate) key: IdempotencyKey,
    pub(crate) fingerprint: Fingerprint,
    /// Lease length in ms, at least 1.
    pub(crate) lease_ms: u64,
}

/// Storing a claim's outcome.
#[derive(Clone, Debug)]
pub(crate) struct CompleteRequest {
    pub(crate) key: IdempotencyKey,
    pub(crate) token: u64,
    pub(crate) completion: Completion,
    pub(crate) response: StoredResponse,
    /// Outbox messages stored in the same transaction.
    pub(crate) messages: Vec<OutgoingMessage>,
    /// The claim's deferred step confirmations and rejections, stored in
    /// the same transaction before the outcome.
    pub(crate) finished: Vec<step::StepFinish>,
}

/// Giving a message up (see `Ops::dead_letter`).
#[derive(Clone, Debug)]
pub(crate) struct DeadLetterRequest {
    /// The inbox claim to complete as `FINAL_FAILURE` in the same write
    /// (`None`: a bad message, which never had a valid key).
    pub(crate) claim: Option<GiveUpClaim>,
    /// The outbox message this letter replaces, removed in the same write
    /// (an outbox message the relay could never publish). When it is no
    /// longer in the outbox (published and marked meanwhile), nothing is
    /// written and the answer is 0, never a letter's seq.
    pub(crate) outbox_seq: Option<u64>,
    pub(crate) letter: DeadLetter,
}

/// The claim a dead letter settles.
#[derive(Clone, Debug)]
pub(crate) struct GiveUpClaim {
    pub(crate) key: IdempotencyKey,
    pub(crate) token: u64,
    pub(crate) response: StoredResponse,
    pub(crate) finished: Vec<step::StepFinish>,
}

/// Who moves a PROCESSING record to UNKNOWN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Abandon {
    /// The holder failed it explicitly: it stopped acting, so a resolver may
    /// settle the record at once.
    Explicit,
    /// The claim was dropped: its work may still be running until the
    /// lease ends, so the lease end is kept as the resolvable instant.
    Dropped,
}

/// Moving a claim's PROCESSING record to UNKNOWN.
#[derive(Clone, Debug)]
pub(crate) struct InDoubtRequest {
    pub(crate) key: IdempotencyKey,
    pub(crate) token: u64,
    pub(crate) reason: String,
    pub(crate) by: Abandon,
}

/// How a resolver (or an operator) settled an in-doubt record.
#[derive(Clone, Debug)]
pub(crate) enum Settlement {
    Completed(StoredResponse),
    /// The work never ran: the record goes, with its steps and log
    /// (refused while a step is Reserved, Unknown or Confirmed: its call
    /// may have happened; settle the steps instead).
    NotExecuted,
    /// Every step is settled: the old record is replaced by the waiting
    /// claim's fresh PROCESSING record in ONE write, the steps and log
    /// KEPT, so the claim resumes with them (refused while a step is
    /// unsettled). Only `settle_then_claim` takes it: a key with steps is
    /// never left without its record. Answered as `Settled::NotExecuted`.
    Resume,
    StillInDoubt,
}

/// Settling the in-doubt record owned by `token`.
#[derive(Clone, Debug)]
pub(crate) struct SettleRequest {
    pub(crate) key: IdempotencyKey,
    pub(crate) token: u64,
    pub(crate) settlement: Settlement,
    /// Who settles (`Resolver` or `Operator`), for the evidence log.
    pub(crate) actor: Actor,
}

/// The result of a settlement. `N` is what "not executed" yields: nothing
/// for a plain settlement, a fresh claim for one made by a waiting `begin`.
#[derive(Debug)]
pub(crate) enum Settled<N> {
    /// Now COMPLETED with the resolver's response.
    Completed(Record),
    NotExecuted(N),
    /// Still UNKNOWN, with one more attempt counted.
    StillInDoubt(Record),
}

/// A compare-and-set of an entity's state.
#[derive(Clone, Debug)]
pub(crate) struct TransitionRequest {
    pub(crate) entity: String,
    pub(crate) from: Vec<String>,
    pub(crate) to: String,
}

/// One record as a scan meets it: its key (or the raw key bytes when they
/// are not a valid key) and its decoded value (or why it does not decode).
pub(crate) type Scanned = (
    std::result::Result<IdempotencyKey, Vec<u8>>,
    std::result::Result<Record, codec::DecodeError>,
);

/// The seam between the engine and storage.
///
/// Reads see a snapshot of the last commit and never wait for writes.
/// Writes are durable before they return; a refused write changes nothing
/// and returns the refusal (`Error::Fenced`, `Error::NotFound`,
/// `Error::InvalidState`, `Error::Corrupt`); a storage failure poisons
/// the backend, after which every call returns `Error::Poisoned`.
pub(crate) trait Backend: Send + Sync + 'static {
    /// `Error::Poisoned` once a write has failed.
    fn check(&self) -> Result<()>;

    // Reads.
    fn record(&self, key: &IdempotencyKey) -> Result<Option<Record>>;
    /// Up to `limit` records in doubt at `now_ms`, oldest first: UNKNOWN
    /// ones and PROCESSING ones whose lease has ended (read-time truth: no
    /// sweep is needed first). A record that does not decode is skipped
    /// (and logged).
    fn in_doubt(&self, limit: usize, now_ms: u64) -> Result<Vec<(IdempotencyKey, Record)>>;
    /// Calls `visit` with every record, in the backend's own order (the
    /// cheapest), until it returns false.
    fn scan(&self, visit: &mut (dyn FnMut(Scanned) -> bool + Send)) -> Result<()>;
    /// As [`Backend::scan`], in (scope, key) byte order: the order listings
    /// show on every backend. The default is `scan`, for a backend whose
    /// own order is that one.
    fn scan_in_key_order(&self, visit: &mut (dyn FnMut(Scanned) -> bool + Send)) -> Result<()> {
        self.scan(visit)
    }
    /// Since when (ms) the oldest record in doubt at `now_ms` has been in
    /// doubt: the oldest UNKNOWN record, or the earliest lease that ended.
    fn oldest_in_doubt_ms(&self, now_ms: u64) -> Result<Option<u64>>;
    /// Whether a lease or an expiry is due at `now_ms`.
    fn sweep_due(&self, now_ms: u64) -> Result<bool>;
    fn outbox(&self, limit: usize) -> Result<Vec<OutboxEntry>>;
    fn outbox_len(&self) -> Result<u64>;
    /// Up to `limit` dead letters, oldest first; one that does not decode
    /// is `Error::Corrupt`.
    fn dead_letters(&self, limit: usize) -> Result<Vec<DeadLetter>>;
    fn entity(&self, entity: &str) -> Result<Option<EntityState>>;
    /// The key's effect steps in name order, as seen now: a step still
    /// Reserved under a claim that no longer runs reads as Unknown.
    #[cfg_attr(not(test), allow(dead_code))] // called by the engine's effect steps
    fn steps(&self, key: &IdempotencyKey) -> Result<Vec<StepRecord>>;
    /// The key's evidence log, oldest first.
    #[cfg_attr(not(test), allow(dead_code))] // called by the engine's effect steps
    fn history(&self, key: &IdempotencyKey) -> Result<Vec<HistoryRecord>>;

    /// The read `begin` starts with. A backend whose every read is a
    /// network round trip may, when the key has no record, claim it in the
    /// same step (durably, as `claim` does, with `claim()`'s request); the
    /// default only reads, and never builds the request.
    fn read_or_claim(
        &self,
        key: &IdempotencyKey,
        claim: &dyn Fn() -> ClaimRequest,
    ) -> Result<ReadOrClaim> {
        let _ = claim;
        Ok(ReadOrClaim::Read(self.record(key)?))
    }

    /// Whether a call made now may block the calling thread on more than
    /// a local snapshot read: a backend whose every call is a network
    /// round trip (PostgreSQL), or a poisoned one whose next write tries a
    /// reopen (joins a thread, syncs a probe file). When false, a point
    /// read runs on the caller's thread without waiting for I/O beyond a
    /// page read from the file, and the `*_pending` writes are answered by
    /// the writer's reply without any thread waiting. (Asked only by the
    /// HTTP layer, through `Engine::calls_may_block`.)
    #[cfg_attr(not(feature = "http"), allow(dead_code))]
    fn may_block(&self) -> bool {
        true
    }

    // Writes, submitted: the answer comes with the durable commit. Dropping
    // the `Pending` does not cancel the write; a won claim nobody hears
    // about is released (its holder never learned it won, so no work ran).
    // The defaults do the synchronous call at once.
    fn claim_pending(&self, req: ClaimRequest) -> Pending<ClaimResult> {
        Pending::ready(self.claim(req))
    }
    fn complete_pending(&self, req: CompleteRequest) -> Pending<()> {
        Pending::ready(self.complete(req))
    }
    fn release_pending(&self, key: IdempotencyKey, token: u64) -> Pending<()> {
        Pending::ready(self.release(key, token))
    }
    fn mark_in_doubt_pending(&self, req: InDoubtRequest) -> Pending<()> {
        Pending::ready(self.mark_in_doubt(req))
    }
    fn settle_then_claim_pending(
        &self,
        req: SettleRequest,
        claim: ClaimRequest,
    ) -> Pending<Settled<Claimed>> {
        Pending::ready(self.settle_then_claim(req, claim))
    }

    #[cfg_attr(not(test), allow(dead_code))] // called by the engine's effect steps
    fn reserve_step_pending(&self, req: StepRequest) -> Pending<StepRecord> {
        Pending::ready(self.reserve_step(req))
    }
    #[cfg_attr(not(test), allow(dead_code))] // called by the engine's effect steps
    fn finish_step_pending(&self, req: FinishStepRequest) -> Pending<StepRecord> {
        Pending::ready(self.finish_step(req))
    }
    /// `settle_step` submitted: what `begin_async` awaits when it settles a
    /// resumed key's steps, so no runtime worker waits for the commit.
    fn settle_step_pending(&self, req: SettleStepRequest) -> Pending<StepRecord> {
        Pending::ready(self.settle_step(req))
    }

    // Writes, durable before they return.
    fn claim(&self, req: ClaimRequest) -> Result<ClaimResult>;
    /// Reserves an effect step for the claim (see `step_ops.rs`); the
    /// step as stored (Confirmed or Failed: an earlier claim's, to skip).
    #[cfg_attr(not(test), allow(dead_code))] // called by the engine's effect steps
    fn reserve_step(&self, req: StepRequest) -> Result<StepRecord>;
    /// Confirms or rejects a step the claim reserved.
    #[cfg_attr(not(test), allow(dead_code))] // called by the engine's effect steps
    fn finish_step(&self, req: FinishStepRequest) -> Result<StepRecord>;
    /// A resolver's or operator's answer about one step of a record in
    /// doubt.
    #[cfg_attr(not(test), allow(dead_code))] // called by the engine's effect steps
    fn settle_step(&self, req: SettleStepRequest) -> Result<StepRecord>;
    fn complete(&self, req: CompleteRequest) -> Result<()>;
    /// A retryable failure: deletes the claim's record.
    fn release(&self, key: IdempotencyKey, token: u64) -> Result<()>;
    fn mark_in_doubt(&self, req: InDoubtRequest) -> Result<()>;
    /// As `mark_in_doubt`, but never blocks and nobody hears the result (a
    /// claim dropped in `Drop`). Skipped when the queue is full: the lease
    /// running out has the same effect, later.
    fn mark_in_doubt_detached(&self, req: InDoubtRequest);
    /// Renews a lease to `lease_ms` from now; returns the new lease end.
    fn extend(&self, key: IdempotencyKey, token: u64, lease_ms: u64) -> Result<u64>;
    fn settle(&self, req: SettleRequest) -> Result<Settled<()>>;
    /// As `settle`; "not executed" claims the key afresh in the same write.
    fn settle_then_claim(
        &self,
        req: SettleRequest,
        claim: ClaimRequest,
    ) -> Result<Settled<Claimed>>;
    /// One bounded sweep step of at most `limit` records per index.
    fn sweep(&self, limit: usize) -> Result<SweepCounts>;
    /// Deletes one record; the state it was in (`None`: it did not decode).
    fn purge(&self, key: IdempotencyKey, mode: PurgeMode) -> Result<Option<State>>;
    fn transition(&self, req: TransitionRequest) -> Result<Transition>;
    /// Removes published outbox messages; how many were there.
    fn mark_published(&self, seqs: Vec<u64>) -> Result<u64>;
    /// Gives a message up (see `Ops::dead_letter`); its dead-letter seq.
    fn dead_letter(&self, req: DeadLetterRequest) -> Result<u64>;
    /// Moves a dead letter back to the outbox (see `Ops::redrive`).
    fn redrive(&self, seq: u64) -> Result<Option<String>>;
    /// Waits until every write queued before it is durable.
    fn flush(&self) -> Result<()>;
    /// The app's own write and the key's completion in one transaction.
    fn local(&self, write: LocalWrite) -> Result<LocalResult>;

    /// Scrubs the whole store: every value decodes, every key is valid, and
    /// every index entry matches its record and back. Returns the problems
    /// and how many records were checked.
    fn verify(&self) -> Result<(Vec<crate::verify::Damage>, u64)>;

    /// Finishes queued writes and stops; later calls return `Error::Closed`.
    fn close(&self);

    /// The on-disk format of a redb file (1, 2 or 3); `None` for a
    /// database server.
    fn redb_format(&self) -> Option<u32> {
        None
    }
}

/// The result of a local write.
#[derive(Debug)]
pub(crate) enum LocalResult {
    /// The app's write ran and committed with the key's COMPLETED record.
    Executed,
    /// The key was not free; the app's write did not run.
    Held(Box<Found>),
}

/// The text of a caught panic's payload (a panic inside a storage library,
/// contained at the engine's boundary).
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}
