//! Effect steps: one durable entry per external call a claim makes, and the
//! evidence log that records every step transition and settlement.
//!
//! A handler that calls several providers (charge the card, send the
//! receipt) reserves a step before each call ([`crate::Claim::effect`]),
//! passes the step's stable reference to the provider as its idempotency
//! key, and confirms or rejects the step with the provider's answer as
//! evidence. After a crash the key's steps are settled one by one by asking
//! each provider ([`crate::Resolver::resolve_step`]), never by calling it
//! again; the next claim on the key sees them and skips the calls already
//! made. `docs/design.md` has the state diagram.

use std::time::Duration;

use crate::key::IdempotencyKey;

/// Longest step name accepted, in bytes. A name is 1 to 64 printable ASCII
/// characters (`u8::is_ascii_graphic`: letters, digits, punctuation; no
/// space, control, bidi or other non-ASCII character, so one name cannot be
/// printed as another) other than `/`; any other is refused with
/// [`crate::Error::InvalidStepName`].
pub const MAX_STEP_NAME_BYTES: usize = 64;

/// Most steps one key may hold (over all its claims); the 17th distinct
/// name is refused with [`crate::Error::TooManySteps`].
pub const MAX_STEPS_PER_KEY: usize = 16;

/// Largest evidence (a provider's answer, as bytes) a step stores.
pub const MAX_EVIDENCE_BYTES: usize = 4096;

/// Longest reason an operator may give when settling a key or a step by
/// hand ([`crate::Engine::resolve`], [`crate::Engine::resolve_step`]), in
/// bytes; a longer one is refused with [`crate::Error::ReasonTooLong`] (the
/// reason is stored in the evidence log, like evidence).
pub const MAX_REASON_BYTES: usize = 1024;

/// Most history entries one key keeps. A transition that would write
/// entry 257 is refused with [`crate::Error::HistoryFull`] and writes nothing (an
/// operator can still purge the key). A key with at most 16 steps, each
/// reserved, finished and settled a few times, stays far below it.
pub const MAX_HISTORY_ENTRIES: usize = 256;

/// Where one effect step stands.
///
/// ```text
/// reserve ──► Reserved ──confirm──► Confirmed
///                │  └────reject───► Failed
///                │ claim died / failed in doubt / lease ended
///                ▼
///             Unknown ──resolver/operator──► Confirmed (executed)
///                │                       └─► NotExecuted ──next claim's reserve──► Reserved
///                └── still unknown: stays Unknown (attempts + 1)
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StepState {
    /// Its reservation is durable; the call may be in flight.
    Reserved,
    /// The provider said yes; the evidence is its answer.
    Confirmed,
    /// The provider said no; the evidence is its answer.
    Failed,
    /// Its claim ended (crash, dropped claim, failure in doubt, lease run
    /// out) while the step was reserved: whether the call happened is
    /// unknown until its provider is asked.
    Unknown,
    /// A resolver or operator learned that the call never happened: the
    /// next claim's [`crate::Claim::effect`] reserves it again under the
    /// same reference.
    NotExecuted,
}

impl StepState {
    /// Whether the step is settled: its provider's answer is known
    /// (`Confirmed`, `Failed` or `NotExecuted`).
    pub fn is_settled(self) -> bool {
        matches!(
            self,
            StepState::Confirmed | StepState::Failed | StepState::NotExecuted
        )
    }

    /// The name shown to operators and in HTTP problem bodies:
    /// `reserved`, `confirmed`, `failed`, `unknown`, `not_executed`.
    pub fn as_str(self) -> &'static str {
        match self {
            StepState::Reserved => "reserved",
            StepState::Confirmed => "confirmed",
            StepState::Failed => "failed",
            StepState::Unknown => "unknown",
            StepState::NotExecuted => "not_executed",
        }
    }
}

impl std::fmt::Display for StepState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One effect step of a key, as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepInfo {
    /// The step's name, unique within its key.
    pub name: String,
    /// Its stable reference, `{reference of the claim that first reserved
    /// it}/{name}`: pass it to the provider as its idempotency key. It
    /// never changes, also when a later claim reserves the step again.
    pub reference: String,
    /// Where it stands.
    pub state: StepState,
    /// The provider's answer, for `Confirmed` and `Failed` steps (at most
    /// [`MAX_EVIDENCE_BYTES`]).
    pub evidence: Option<Vec<u8>>,
    /// When it was last reserved (ms since the Unix epoch).
    pub reserved_at_ms: u64,
    /// When it was confirmed, failed or settled (ms since the Unix epoch).
    pub settled_at_ms: Option<u64>,
    /// How many times a resolver answered "still unknown" about it.
    pub attempts: u32,
    /// How long since it was reserved, when this was read (whole ms).
    pub age: Duration,
}

/// What [`crate::Claim::effect`] answers: make the call, or skip it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use = "a Run answer means the call must be made and then confirmed or rejected"]
pub enum EffectStep {
    /// The reservation is durable: make the call, passing `reference` to the
    /// provider as its idempotency key, then confirm or reject the step.
    Run {
        /// The step's stable reference.
        reference: String,
    },
    /// An earlier attempt's call happened: skip it and use its evidence.
    Confirmed {
        /// The step's stable reference.
        reference: String,
        /// The provider's answer, as the earlier attempt recorded it.
        evidence: Vec<u8>,
    },
    /// An earlier attempt's provider said no.
    Failed {
        /// The step's stable reference.
        reference: String,
        /// The provider's answer, as the earlier attempt recorded it.
        evidence: Vec<u8>,
    },
}

impl EffectStep {
    /// The step's stable reference, whatever the answer.
    pub fn reference(&self) -> &str {
        match self {
            EffectStep::Run { reference }
            | EffectStep::Confirmed { reference, .. }
            | EffectStep::Failed { reference, .. } => reference,
        }
    }
}

/// What a resolver (or an operator) learned about one step in doubt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepResolution {
    /// The provider has the reference: the call happened; its answer is the
    /// evidence (at most [`MAX_EVIDENCE_BYTES`]). The step becomes
    /// `Confirmed`.
    Executed(Vec<u8>),
    /// The provider has no such reference: the call never happened. The
    /// step becomes `NotExecuted` and the next claim makes the call.
    NotExecuted,
    /// The provider cannot tell yet (or could not be reached): the step
    /// stays `Unknown`, its attempt count grows.
    StillUnknown,
}

/// A step in doubt, as a resolver is asked about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InDoubtStep {
    /// The key the step belongs to.
    pub key: IdempotencyKey,
    /// The reference of the claim whose attempt died (the operation's).
    pub operation_reference: String,
    /// The step's name.
    pub name: String,
    /// The step's stable reference: look it up at the provider.
    pub reference: String,
    /// How many times a resolver answered "still unknown" about it.
    pub attempts: u32,
    /// How long since it was reserved (whole ms).
    pub age: Duration,
}

/// Who made a change recorded in the evidence log.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Actor {
    /// The claim holding this fencing token (reserve, confirm, reject, a
    /// failure in doubt, a dropped claim).
    Claim {
        /// The claim's fencing token.
        fencing_token: u64,
    },
    /// A resolver (in `begin` or `recover_in_doubt`).
    Resolver,
    /// An operator, with the reason they gave (mandatory).
    Operator {
        /// Why they settled it.
        reason: String,
    },
    /// The engine itself: a lease ran out, or a record became a tombstone.
    Sweeper,
}

impl std::fmt::Display for Actor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Actor::Claim { fencing_token } => write!(f, "claim #{fencing_token}"),
            Actor::Resolver => f.write_str("resolver"),
            Actor::Operator { reason } => write!(f, "operator ({reason:?})"),
            Actor::Sweeper => f.write_str("sweeper"),
        }
    }
}

/// One entry of a key's evidence log. Entries are appended, never
/// rewritten; they expire with the key's record (a tombstone keeps one
/// summary entry).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistoryEntry {
    /// Its position in the key's log, from 0.
    pub seq: u32,
    /// When it was written (ms since the Unix epoch).
    pub at_ms: u64,
    /// Who made the change.
    pub actor: Actor,
    /// The step it is about; `None` for the operation as a whole.
    pub step: Option<String>,
    /// The state before (a step state's [`StepState::as_str`], or a record
    /// state such as `UNKNOWN`); empty for a step reserved for the first
    /// time (the CLI prints it as `new`).
    pub from: String,
    /// The state after: a step state, or for the operation a record state
    /// (`COMPLETED`, `FAILED`, `UNKNOWN` after a resumed claim's retryable
    /// failure), `RESUMED` (the next `begin` took the key
    /// over with its settled steps) or `TOMBSTONE` (a tombstone's summary).
    /// docs/design.md ("The evidence log") lists every transition logged.
    pub to: String,
    /// The evidence given with the change (a provider's answer; for a
    /// tombstone, a short text listing the steps and the entries dropped).
    pub evidence: Vec<u8>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settled_states() {
        assert!(StepState::Confirmed.is_settled());
        assert!(StepState::NotExecuted.is_settled());
        assert!(!StepState::Unknown.is_settled());
        assert!(!StepState::Reserved.is_settled());
        assert_eq!(StepState::NotExecuted.to_string(), "not_executed");
    }

    /// `error.rs` spells the bounds out in its messages (importing them
    /// would close an import cycle through `key.rs`): they must agree.
    #[test]
    fn error_messages_name_the_bounds() -> Result<(), crate::Error> {
        let key = IdempotencyKey::new("s", "k")?;
        let errors = [
            (
                crate::Error::EvidenceTooLarge {
                    key: key.clone(),
                    step: "x".into(),
                    bytes: 5000,
                },
                MAX_EVIDENCE_BYTES,
            ),
            (
                crate::Error::TooManySteps { key: key.clone() },
                MAX_STEPS_PER_KEY,
            ),
            (crate::Error::HistoryFull { key }, MAX_HISTORY_ENTRIES),
        ];
        for (e, bound) in errors {
            assert!(
                e.to_string().contains(&format!("({bound}"))
                    || e.to_string().contains(&format!("of {bound} bytes")),
                "{e}"
            );
        }
        Ok(())
    }
}
