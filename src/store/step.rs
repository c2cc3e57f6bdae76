//! Effect steps and the evidence log, as the store keeps them: one stored
//! [`StepRecord`] per (key, step name), one [`HistoryRecord`] per logged
//! transition, and the requests that change them (`store/ops.rs` applies
//! them, on every backend).
//!
//! A step's stable reference is `{reference of the claim that first
//! reserved it}/{name}`; it is stored in the step and never changes.

// The engine's effect steps (its own branch) call these; until then only
// the store's tests do.
#![cfg_attr(not(test), allow(dead_code))]

use crate::error::Error;
use crate::key::IdempotencyKey;

pub(crate) use crate::step::{
    MAX_EVIDENCE_BYTES, MAX_HISTORY_ENTRIES, MAX_STEPS_PER_KEY, MAX_STEP_NAME_BYTES,
};

/// Where a step stands (stored as `wire::StepStatusWire`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StepStatus {
    /// The reservation is durable; the call may be in flight.
    Reserved,
    /// The provider said yes (evidence: its answer).
    Confirmed,
    /// The provider said no (evidence: its answer).
    Failed,
    /// Its claim ended while the step was reserved: unknown until its
    /// provider is asked.
    Unknown,
    /// A resolver or operator learned the call never happened: the next
    /// claim's reserve runs it again under the same reference.
    NotExecuted,
}

impl StepStatus {
    /// The name the evidence log records (`from` and `to`).
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            StepStatus::Reserved => "reserved",
            StepStatus::Confirmed => "confirmed",
            StepStatus::Failed => "failed",
            StepStatus::Unknown => "unknown",
            StepStatus::NotExecuted => "not_executed",
        }
    }

    /// Whether the provider's answer is known.
    pub(crate) fn is_settled(self) -> bool {
        matches!(
            self,
            StepStatus::Confirmed | StepStatus::Failed | StepStatus::NotExecuted
        )
    }
}

/// One effect step of a key (stored as `wire::StepWire`, see `codec.rs`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StepRecord {
    pub(crate) name: String,
    /// `{reference of the claim that first reserved it}/{name}`.
    pub(crate) reference: String,
    pub(crate) status: StepStatus,
    /// The fencing token of the claim that last reserved it.
    pub(crate) token: u64,
    /// The provider's answer (Confirmed, Failed); empty otherwise.
    pub(crate) evidence: Vec<u8>,
    /// When it was last reserved (ms).
    pub(crate) reserved_at_ms: u64,
    /// When it was confirmed, failed or settled (ms).
    pub(crate) settled_at_ms: Option<u64>,
    /// Resolver answers of "still unknown" so far.
    pub(crate) attempts: u32,
    /// When a resolver was last asked about it (ms).
    pub(crate) last_asked_ms: Option<u64>,
}

impl StepRecord {
    /// The step as a view at `now_ms` reports it, given the record's
    /// claim: a step still Reserved under a claim that no longer runs
    /// (its record is UNKNOWN, or PROCESSING with its lease ended, or
    /// gone, or owned by another token) is Unknown (read-time truth: no
    /// sweep is needed first).
    // Named as the engine calls it; it consumes the step it rewrites.
    #[allow(clippy::wrong_self_convention)]
    pub(crate) fn as_seen(mut self, claim: Option<(u64, bool)>) -> StepRecord {
        if self.status == StepStatus::Reserved {
            let running = matches!(claim, Some((token, live)) if live && token == self.token);
            if !running {
                self.status = StepStatus::Unknown;
            }
        }
        self
    }
}

/// Who made a logged transition (stored as `wire::ActorWire`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Actor {
    /// The claim holding this fencing token.
    Claim { token: u64 },
    /// The app's resolver.
    Resolver,
    /// An operator, with the reason they gave.
    Operator { reason: String },
    /// The engine itself: a lease ran out.
    Sweeper,
}

/// One entry of a key's evidence log (stored as `wire::HistoryWire`).
/// Entries are appended and never rewritten; they go with the record (a
/// tombstone keeps a one-entry summary).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HistoryRecord {
    /// Position in the key's log, from 0, never reused while the log lives.
    pub(crate) seq: u32,
    pub(crate) at_ms: u64,
    pub(crate) actor: Actor,
    /// The step (`None`: the operation as a whole).
    pub(crate) step: Option<String>,
    /// The state before (a step's `StepStatus::as_str`, a record's
    /// `State`; empty for a step reserved for the first time).
    pub(crate) from: String,
    /// The state after (as `from`; `TOMBSTONE` for a tombstone's summary,
    /// `RESUMED` for a key resumed with its steps).
    pub(crate) to: String,
    /// The provider's answer, the response's body, or the summary's text.
    pub(crate) evidence: Vec<u8>,
}

/// Reserving step `name` for the claim holding `token`.
#[derive(Clone, Debug)]
pub(crate) struct StepRequest {
    pub(crate) key: IdempotencyKey,
    pub(crate) token: u64,
    pub(crate) name: String,
    /// The claim's deferred confirmations and rejections, written first in
    /// the same transaction (so they cost no commit wait of their own).
    pub(crate) finished: Vec<StepFinish>,
}

/// A confirmation (`confirmed`) or rejection of a step, as its claim
/// reports it: alone (`FinishStepRequest`) or deferred to the claim's next
/// write (`StepRequest::finished`, `CompleteRequest::finished`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StepFinish {
    pub(crate) name: String,
    pub(crate) confirmed: bool,
    pub(crate) evidence: Vec<u8>,
}

/// Confirming (`confirmed`) or rejecting a step the claim reserved.
#[derive(Clone, Debug)]
pub(crate) struct FinishStepRequest {
    pub(crate) key: IdempotencyKey,
    pub(crate) token: u64,
    pub(crate) name: String,
    pub(crate) confirmed: bool,
    pub(crate) evidence: Vec<u8>,
}

/// A resolver's or operator's answer about one step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum StepAnswer {
    /// The call happened; the provider's answer.
    Executed(Vec<u8>),
    /// The call never happened.
    NotExecuted,
    /// The provider cannot tell yet.
    StillUnknown,
}

/// Settling one step of the in-doubt record owned by `token`.
#[derive(Clone, Debug)]
pub(crate) struct SettleStepRequest {
    pub(crate) key: IdempotencyKey,
    /// The token of the UNKNOWN record (or of the PROCESSING one whose
    /// lease ended).
    pub(crate) token: u64,
    pub(crate) name: String,
    pub(crate) answer: StepAnswer,
    /// `Resolver` or `Operator`.
    pub(crate) actor: Actor,
}

/// Checks a step name: 1..=64 bytes of printable ASCII
/// (`u8::is_ascii_graphic`: no space, no control, bidi or other format
/// character that could make `idem show` print one name as another), no
/// '/'.
///
/// # Errors
/// `Error::InvalidStepName`.
pub(crate) fn check_name(name: &str) -> Result<(), Error> {
    let reason = if name.is_empty() {
        Some("it is empty")
    } else if name.len() > MAX_STEP_NAME_BYTES {
        Some("it is longer than 64 bytes")
    } else if !name.bytes().all(|b| b.is_ascii_graphic()) {
        Some("it contains a character that is not printable ASCII (a space, a control or a non-ASCII character)")
    } else if name.contains('/') {
        Some("it contains '/' (a step's reference is {claim reference}/{name})")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(Error::InvalidStepName {
            name: name.chars().take(64).collect(),
            reason,
        }),
        None => Ok(()),
    }
}

/// Checks evidence against [`MAX_EVIDENCE_BYTES`].
///
/// # Errors
/// `Error::EvidenceTooLarge`.
pub(crate) fn check_evidence(
    key: &IdempotencyKey,
    name: &str,
    evidence: &[u8],
) -> Result<(), Error> {
    if evidence.len() > MAX_EVIDENCE_BYTES {
        return Err(Error::EvidenceTooLarge {
            key: key.clone(),
            step: name.to_owned(),
            bytes: evidence.len(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_names_are_checked() {
        // Bidi and format characters would let `idem show` print one name
        // as another.
        for bad in [
            "",
            "a/b",
            "tab\there",
            &"x".repeat(65),
            "a b",
            "é",
            "charge\u{202e}",
            "\u{200b}charge",
        ] {
            assert!(
                matches!(check_name(bad), Err(Error::InvalidStepName { .. })),
                "{bad:?} accepted"
            );
        }
        for good in ["charge", "receipt-2", &"x".repeat(64), "a.b_c:d~1"] {
            assert!(check_name(good).is_ok(), "{good:?} refused");
        }
    }

    #[test]
    fn a_reserved_step_of_a_claim_that_ended_reads_as_unknown() {
        let step = StepRecord {
            name: "charge".into(),
            reference: "r/charge".into(),
            status: StepStatus::Reserved,
            token: 7,
            evidence: Vec::new(),
            reserved_at_ms: 1,
            settled_at_ms: None,
            attempts: 0,
            last_asked_ms: None,
        };
        assert_eq!(
            step.clone().as_seen(Some((7, true))).status,
            StepStatus::Reserved
        );
        assert_eq!(
            step.clone().as_seen(Some((7, false))).status,
            StepStatus::Unknown
        );
        assert_eq!(
            step.clone().as_seen(Some((8, true))).status,
            StepStatus::Unknown
        );
        assert_eq!(step.as_seen(None).status, StepStatus::Unknown);
    }
}
