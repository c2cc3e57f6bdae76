//! What `begin` answers, and what a claim holder reports back.

use std::fmt;
use std::time::Duration;

use crate::claim::Claim;
use crate::envelope::Envelope;
use crate::key::IdempotencyKey;

/// The state of a stored record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum State {
    /// A claim holds the key and its work is running (or its holder crashed
    /// and the lease has not run out yet).
    Processing,
    /// The work finished; the response is stored for replay.
    Completed,
    /// The work ended in a business failure that is stored and replayed
    /// like a success (e.g. "insufficient funds").
    FailedFinal,
    /// Side effects may have happened but the result was never recorded
    /// (crash, timeout, dropped claim, lease ran out). Never re-executed and
    /// never deleted by expiry: it waits for recovery.
    Unknown,
    /// The record expired under a tombstone policy: key and fingerprint are
    /// kept so a reuse is answered [`Begin::Expired`].
    Tombstone,
}

impl State {
    /// Upper-case name as shown by the CLI (`PROCESSING`, `COMPLETED`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            State::Processing => "PROCESSING",
            State::Completed => "COMPLETED",
            State::FailedFinal => "FAILED_FINAL",
            State::Unknown => "UNKNOWN",
            State::Tombstone => "TOMBSTONE",
        }
    }

    /// Parses a name as printed by [`State::as_str`] (case-insensitive).
    pub fn parse(name: &str) -> Option<State> {
        [
            State::Processing,
            State::Completed,
            State::FailedFinal,
            State::Unknown,
            State::Tombstone,
        ]
        .into_iter()
        .find(|s| s.as_str().eq_ignore_ascii_case(name))
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The answer to [`crate::Engine::begin`]: exactly one of these.
///
/// Suggested HTTP mapping (from the IETF `Idempotency-Key` draft, with
/// 409 for mismatch as Stripe does; the draft itself suggests 422):
///
/// | outcome | HTTP |
/// |---|---|
/// | `Claimed` | run the handler |
/// | `Replay` | the stored status, headers and body |
/// | `InProgress` | 409 Conflict with `Retry-After` |
/// | `Mismatch` | 409 Conflict, problem+json: key reused with a different request |
/// | `Unknown` | 503 with `Retry-After` until recovery settles it |
/// | `Expired` | 409 Conflict, problem+json: key expired and may not be reused yet |
#[derive(Debug)]
#[must_use = "a Claimed outcome must be completed or failed"]
pub enum Begin {
    /// This caller won the atomic insert of a PROCESSING record, durably.
    /// Run the work, then complete or fail the claim.
    Claimed(Claim),
    /// The key completed earlier with the same fingerprint.
    Replay(Replay),
    /// Another caller holds the claim. Retry after `retry_after` (the
    /// remaining lease; never zero).
    InProgress {
        /// Remaining lease of the current holder.
        retry_after: Duration,
    },
    /// The key was used before with a different fingerprint. The work must
    /// not run, and no stored response is revealed.
    Mismatch,
    /// The key's work may have had side effects whose result was never
    /// recorded. It is never executed again by `begin`; resolve it with a
    /// [`crate::Resolver`] (query the provider by `reference`).
    Unknown(Pending),
    /// The key expired and is tombstoned: it may not be reused until
    /// `reusable_at_ms`. The work does not run.
    Expired {
        /// When the original record expired (ms since the Unix epoch).
        expired_at_ms: u64,
        /// When the tombstone runs out and the key may be reused.
        reusable_at_ms: u64,
    },
}

/// Whether a stored response records a success or a final business failure.
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

/// An UNKNOWN record: what an app needs to resolve it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
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
    /// When the record became UNKNOWN (ms since the Unix epoch).
    pub unknown_since_ms: u64,
    /// How long it has been UNKNOWN, in milliseconds, when this was read.
    pub age_ms: u64,
    /// From when a resolver may settle it (ms since the Unix epoch): the
    /// end of the original claim's lease. A claim that was dropped (not
    /// failed explicitly) may still have its work running until then, so a
    /// provider asked earlier could answer "not executed" for a call still
    /// in flight. Until this instant `recover_pending` skips the record and,
    /// on an engine with a resolver, `begin` answers `InProgress` (without
    /// one, `begin` answers `Unknown` carrying this instant). An explicit
    /// `Failure::Unknown` makes it settleable at once.
    pub resolvable_at_ms: u64,
    /// Why it became UNKNOWN (lease ran out, dropped claim, app's reason).
    pub reason: String,
}

/// How a claimed operation failed (see [`crate::Engine::fail`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// Nothing happened downstream: the key is released and the next request
    /// with it executes afresh.
    Retryable,
    /// A business failure (e.g. insufficient funds): stored and replayed
    /// like a success.
    Final(Envelope),
    /// Side effects may have happened (e.g. the provider call timed out): the
    /// record becomes UNKNOWN and waits for recovery; never re-executed.
    Unknown {
        /// Shown to operators and resolvers.
        reason: String,
    },
}
