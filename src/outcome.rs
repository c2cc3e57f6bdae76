//! What a stored record tells a caller: a replay, an in-doubt record, and
//! how a claim holder reports a failure.

use std::time::Duration;

use crate::envelope::Envelope;
use crate::key::IdempotencyKey;
use crate::step::StepInfo;

/// Whether a stored response records a success or a final failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayKind {
    /// Stored by `complete`.
    Completed,
    /// Stored by `fail` with [`Failure::Final`].
    FinalFailure,
}

/// A stored response returned for a repeated request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replay {
    /// The response, after the app's upcasters ran on it.
    pub envelope: Envelope,
    /// `true` if `envelope.schema_version` is the engine's current response
    /// schema version (or none is configured). `false` means the envelope is
    /// older and no upcaster covers it: the app decides what to send.
    pub is_current: bool,
    /// The schema version the envelope was stored with.
    pub stored_schema_version: u32,
    /// The resource reference stored by `complete_with_resource` (e.g. a
    /// payment id), for apps whose contract is "a retry returns the
    /// resource's current state".
    pub resource: Option<String>,
    /// Success or final failure.
    pub kind: ReplayKind,
    /// When the outcome was recorded (ms since the Unix epoch).
    pub completed_at_ms: u64,
    /// The provider reference the original claim carried.
    pub reference: String,
}

/// An in-doubt record (state UNKNOWN): what an app needs to resolve it.
///
/// "In doubt" is the two-phase-commit term: the work may or may not have
/// happened, and only the outside world (the provider, by `reference`) can
/// tell.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InDoubt {
    /// The record's key.
    pub key: IdempotencyKey,
    /// The provider reference of the claim whose result is unknown.
    pub reference: String,
    /// The fencing token of that claim.
    pub fencing_token: u64,
    /// How many times a resolver has answered "still unknown".
    pub attempts: u32,
    /// When the claim was taken (ms since the Unix epoch).
    pub claimed_at_ms: u64,
    /// When the record became UNKNOWN (ms since the Unix epoch). For a
    /// PROCESSING record whose lease has run out but that no sweep has moved
    /// yet, the lease end.
    pub unknown_since_ms: u64,
    /// How long it has been UNKNOWN when this was read (whole milliseconds).
    pub age: Duration,
    /// From when a resolver may settle it (ms since the Unix epoch): the
    /// end of the original claim's lease. A claim that was dropped (not
    /// failed explicitly) may still have its work running until then, so a
    /// provider asked earlier could answer "not executed" for a call still
    /// in flight. Until this instant `recover_in_doubt` skips the record and,
    /// on an engine with a resolver, `begin` answers `Processing` (without
    /// one, `begin` answers `InDoubt` carrying this instant). An explicit
    /// `Failure::InDoubt` makes it settleable at once.
    pub resolvable_at_ms: u64,
    /// Why it became UNKNOWN (lease ran out, dropped claim, app's reason).
    pub reason: String,
    /// The key's effect steps, as read with the record (empty for an
    /// operation that reserved none). A key with steps is settled step by
    /// step: it stays in doubt while any step is `Unknown` (or `Reserved`
    /// under a claim that ended, which every view reports as `Unknown`).
    pub steps: Vec<StepInfo>,
}

impl InDoubt {
    /// Whether the key is resumable: it has effect steps and every one is
    /// settled (its provider's answer is known), so nothing is left to ask;
    /// the record stays UNKNOWN until the client's retry resumes it (the
    /// next `begin` with the same fingerprint), unless a resolver completes
    /// it from the steps. `recover_in_doubt` settles the other in-doubt
    /// records before these (see [`crate::Engine::recover_in_doubt`]).
    pub fn is_resumable(&self) -> bool {
        !self.steps.is_empty() && self.steps.iter().all(|s| s.state.is_settled())
    }
}

/// How a claimed operation failed (see [`crate::Engine::fail`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// Nothing happened downstream: the key is released and the next request
    /// with it executes afresh.
    Retryable,
    /// A final failure (a business failure, e.g. "insufficient funds"):
    /// stored and replayed like a success; the record's state is
    /// [`crate::State::FinalFailure`].
    Final(Envelope),
    /// Side effects may have happened (e.g. the provider call timed out): the
    /// record becomes UNKNOWN (in doubt) and waits for recovery; never
    /// re-executed.
    InDoubt {
        /// Shown to operators and resolvers.
        reason: String,
    },
}
