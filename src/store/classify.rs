//! What a stored record means for a `begin` with a given fingerprint at a
//! given instant ("read-time truth": decided when read, not only by
//! sweeps). Every backend and every caller classifies through here.

use crate::fingerprint::Fingerprint;
use crate::policy::ExpiryPolicy;
use crate::state::State;

use super::record::{Record, RecordState};

/// The classification of a record for a claim attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    /// No record, or one whose TTL (and tombstone) has run out: claimable.
    Free,
    /// PROCESSING whose lease has run out: it is in doubt, and a claim
    /// attempt moves it to UNKNOWN.
    Stale,
    /// The key is held: the claim attempt is answered from the record.
    Held(Held),
}

/// What holds a key that cannot be claimed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Held {
    /// Same key, different fingerprint (checked before the state).
    Mismatch,
    /// PROCESSING with lease left.
    Processing { retry_after_ms: u64 },
    /// COMPLETED or `FINAL_FAILURE` within its TTL.
    Done,
    /// UNKNOWN.
    InDoubt,
    /// Expired, tombstoned until `reusable_at_ms`.
    Tombstoned {
        expired_at_ms: u64,
        reusable_at_ms: u64,
    },
}

/// The state `rec` is in at `now` as every request sees it (read-time
/// truth): a PROCESSING record whose lease has ended is UNKNOWN, an expired
/// COMPLETED or `FINAL_FAILURE` record is a TOMBSTONE while the policy keeps
/// one; `None` for a record past its TTL (and any tombstone), which requests
/// treat as absent until a sweep deletes it.
pub(crate) fn state_at(rec: &Record, now: u64, policy: ExpiryPolicy) -> Option<State> {
    Some(match rec.state {
        RecordState::Processing if rec.lease_until_ms > now => State::Processing,
        RecordState::Processing | RecordState::Unknown => State::Unknown,
        RecordState::Completed | RecordState::FinalFailure if now >= rec.expires_at_ms => {
            let keep_ms = policy.keep_ms()?;
            if now >= rec.expires_at_ms.saturating_add(keep_ms) {
                return None;
            }
            State::Tombstone
        }
        RecordState::Tombstone if now >= rec.expires_at_ms => return None,
        state => State::from(state),
    })
}

/// Classifies `rec` for a claim attempt with fingerprint `fp` at `now`
/// (ms). Order: expiry first, then the fingerprint, then the state.
pub(crate) fn classify(rec: &Record, fp: &Fingerprint, now: u64, policy: ExpiryPolicy) -> Class {
    // Expiry comes first: a record past its TTL (and any tombstone) is
    // absent, whatever its fingerprint. `(expired at, reusable at)`:
    let tombstone = match rec.state {
        RecordState::Completed | RecordState::FinalFailure if now >= rec.expires_at_ms => {
            match policy.keep_ms() {
                None => return Class::Free,
                Some(keep_ms) => {
                    Some((rec.expires_at_ms, rec.expires_at_ms.saturating_add(keep_ms)))
                }
            }
        }
        RecordState::Tombstone => Some((rec.expired_at_ms, rec.expires_at_ms)),
        _ => None,
    };
    if tombstone.is_some_and(|(_, reusable_at_ms)| now >= reusable_at_ms) {
        return Class::Free;
    }
    // Then the fingerprint, before the state decides anything.
    if !rec.fingerprint_matches(fp) {
        return Class::Held(Held::Mismatch);
    }
    if let Some((expired_at_ms, reusable_at_ms)) = tombstone {
        return Class::Held(Held::Tombstoned {
            expired_at_ms,
            reusable_at_ms,
        });
    }
    match rec.state {
        RecordState::Processing if rec.lease_until_ms > now => Class::Held(Held::Processing {
            retry_after_ms: rec.lease_until_ms.saturating_sub(now),
        }),
        RecordState::Processing => Class::Stale,
        RecordState::Unknown => Class::Held(Held::InDoubt),
        RecordState::Completed | RecordState::FinalFailure | RecordState::Tombstone => {
            Class::Held(Held::Done)
        }
    }
}
