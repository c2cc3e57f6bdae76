//! What the store keeps per key, per outbox message and per entity, and the
//! pure state changes between records. Every backend stores these values
//! and changes them only through the functions here, so the state machine
//! is written once.

use crate::envelope::Envelope;
use crate::fingerprint::{Fingerprint, FINGERPRINT_ALGORITHM_VERSION};
use crate::state::State;

/// Record states (stored as `wire::StateWire`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RecordState {
    Processing = 0,
    Completed = 1,
    FinalFailure = 2,
    Unknown = 3,
    Tombstone = 4,
}

impl From<RecordState> for State {
    fn from(s: RecordState) -> State {
        match s {
            RecordState::Processing => State::Processing,
            RecordState::Completed => State::Completed,
            RecordState::FinalFailure => State::FinalFailure,
            RecordState::Unknown => State::Unknown,
            RecordState::Tombstone => State::Tombstone,
        }
    }
}

/// A stored response: the envelope and the resource (stored as
/// `wire::ResponseWire`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StoredResponse {
    pub(crate) schema_version: u32,
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, Vec<u8>)>,
    pub(crate) body: Vec<u8>,
    pub(crate) resource: Option<String>,
}

impl StoredResponse {
    pub(crate) fn new(env: Envelope, resource: Option<String>) -> StoredResponse {
        StoredResponse {
            schema_version: env.schema_version,
            status: env.status,
            headers: env.headers,
            body: env.body,
            resource,
        }
    }

    pub(crate) fn envelope(&self) -> Envelope {
        Envelope {
            schema_version: self.schema_version,
            status: self.status,
            headers: self.headers.clone(),
            body: self.body.clone(),
        }
    }

    /// The stored envelope and resource, moved out.
    pub(crate) fn into_envelope(self) -> (Envelope, Option<String>) {
        let envelope = Envelope {
            schema_version: self.schema_version,
            status: self.status,
            headers: self.headers,
            body: self.body,
        };
        (envelope, self.resource)
    }
}

/// How a claim's outcome is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Completion {
    Success,
    FinalFailure,
}

/// One idempotency record (stored as `wire::RecordWire`, see `codec.rs`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) state: RecordState,
    pub(crate) fingerprint: [u8; 32],
    pub(crate) fingerprint_version: u8,
    /// The fencing token of the claim that owns (or owned) the record.
    pub(crate) token: u64,
    /// Provider reference of that claim.
    pub(crate) reference: String,
    pub(crate) claimed_at_ms: u64,
    pub(crate) updated_at_ms: u64,
    /// PROCESSING: the lease runs out at this instant (stale from then on).
    /// UNKNOWN: the original lease end, from which a resolver may settle it.
    pub(crate) lease_until_ms: u64,
    /// COMPLETED / `FINAL_FAILURE`: expires at this instant.
    /// TOMBSTONE: the tombstone runs out at this instant.
    /// 0 for PROCESSING and UNKNOWN, which never expire.
    pub(crate) expires_at_ms: u64,
    /// TOMBSTONE: when the original record expired.
    pub(crate) expired_at_ms: u64,
    /// UNKNOWN: when the record became UNKNOWN.
    pub(crate) unknown_since_ms: u64,
    /// UNKNOWN: resolver answers of "still unknown" so far.
    pub(crate) attempts: u32,
    /// UNKNOWN: why.
    pub(crate) reason: String,
    /// COMPLETED / `FINAL_FAILURE` (TOMBSTONE drops it).
    pub(crate) response: Option<StoredResponse>,
}

impl Record {
    /// A fresh claim's PROCESSING record.
    pub(crate) fn processing(
        fingerprint: Fingerprint,
        token: u64,
        reference: String,
        now_ms: u64,
        lease_until_ms: u64,
    ) -> Record {
        Record {
            state: RecordState::Processing,
            fingerprint: *fingerprint.as_bytes(),
            fingerprint_version: FINGERPRINT_ALGORITHM_VERSION,
            token,
            reference,
            claimed_at_ms: now_ms,
            updated_at_ms: now_ms,
            lease_until_ms,
            expires_at_ms: 0,
            expired_at_ms: 0,
            unknown_since_ms: 0,
            attempts: 0,
            reason: String::new(),
            response: None,
        }
    }

    /// Same fingerprint under the same algorithm version. A record written
    /// under another fingerprint version cannot be compared and counts as a
    /// mismatch (the safe answer: never a replay of a different request).
    ///
    /// The 32 bytes are compared in constant time: `blake3::Hash`'s
    /// equality is documented as constant-time (it runs the
    /// `constant_time_eq` crate's 32-byte comparison), so how long a
    /// mismatch takes does not tell a client how many leading bytes of a
    /// stored fingerprint its request matched.
    pub(crate) fn fingerprint_matches(&self, fp: &Fingerprint) -> bool {
        let same = blake3::Hash::from_bytes(self.fingerprint) == *fp.as_bytes();
        self.fingerprint_version == FINGERPRINT_ALGORITHM_VERSION && same
    }

    /// The record with its outcome stored: COMPLETED or `FINAL_FAILURE`,
    /// expiring `ttl_ms` after `now`.
    pub(crate) fn completed(
        &self,
        how: Completion,
        response: StoredResponse,
        now: u64,
        ttl_ms: u64,
    ) -> Record {
        let mut new = self.clone();
        new.state = match how {
            Completion::Success => RecordState::Completed,
            Completion::FinalFailure => RecordState::FinalFailure,
        };
        new.updated_at_ms = now;
        new.expires_at_ms = now.saturating_add(ttl_ms);
        new.response = Some(response);
        new
    }

    /// PROCESSING → UNKNOWN. `lease_end` is kept as the instant from which
    /// a resolver may settle the record (see `InDoubt::resolvable_at_ms`).
    pub(crate) fn in_doubt(&self, reason: String, lease_end: u64, now: u64) -> Record {
        let mut new = self.clone();
        new.state = RecordState::Unknown;
        new.lease_until_ms = lease_end;
        new.unknown_since_ms = now;
        new.updated_at_ms = now;
        new.reason = reason;
        new
    }

    /// The record with its lease renewed to `lease_until_ms`.
    pub(crate) fn extended(&self, lease_until_ms: u64, now: u64) -> Record {
        let mut new = self.clone();
        new.lease_until_ms = lease_until_ms;
        new.updated_at_ms = now;
        new
    }

    /// An UNKNOWN record after one more "still unknown" answer.
    pub(crate) fn still_in_doubt(&self, now: u64) -> Record {
        let mut new = self.clone();
        new.attempts = new.attempts.saturating_add(1);
        new.updated_at_ms = now;
        new
    }

    /// An expired COMPLETED / `FINAL_FAILURE` record kept as a tombstone
    /// until `until`: key and fingerprint stay, the response goes.
    pub(crate) fn tombstone(&self, until: u64, now: u64) -> Record {
        let mut new = self.clone();
        new.state = RecordState::Tombstone;
        new.expired_at_ms = self.expires_at_ms;
        new.expires_at_ms = until;
        new.response = None;
        new.updated_at_ms = now;
        new
    }

    /// Whether an UNKNOWN record's work may still be running at `now`: its
    /// claim was dropped before its lease ended (a dropped claim keeps its
    /// lease end) and that lease has not ended yet. A record that went
    /// UNKNOWN because its lease ran out never counts as running again,
    /// even if the clock steps back.
    pub(crate) fn may_still_run(&self, now: u64) -> bool {
        self.state == RecordState::Unknown
            && self.unknown_since_ms < self.lease_until_ms
            && now < self.lease_until_ms
    }

    /// The index a sound record is found through (`"leases"`,
    /// `"recovery"` or `"expiry"`), and the instant (ms) it is ordered by
    /// there: what sweeps and the recovery queue look it up by.
    pub(crate) fn index(&self) -> (&'static str, u64) {
        match self.state {
            RecordState::Processing => ("leases", self.lease_until_ms),
            RecordState::Unknown => ("recovery", self.unknown_since_ms),
            _ => ("expiry", self.expires_at_ms),
        }
    }

    /// Why a PROCESSING record whose lease ran out is in doubt. The
    /// instant is not repeated here: the record keeps it (`lease_until_ms`,
    /// shown as a date by `idem show`).
    pub(crate) fn stale_reason(&self) -> String {
        let lease_ms = self.lease_until_ms.saturating_sub(self.claimed_at_ms);
        format!("its lease ({lease_ms} ms) ran out without an outcome")
    }
}

/// An entity's stored state (stored as `wire::EntityWire`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct EntityState {
    pub(crate) state: String,
    pub(crate) version: u64,
    pub(crate) updated_at_ms: u64,
}

/// The provider reference of a claim: `idem_<token hex>_<20 hex digits>`,
/// a blake3 hash of the record key and token. Stable for the claim, distinct
/// across keys, scopes and tokens, and printable ASCII (safe as a payment
/// provider's idempotency key or transaction id).
pub(crate) fn reference(record_key: &[u8], token: u64) -> String {
    // Deriving the context's key costs a hash of its own: done once (a
    // fresh hasher, cloned, is the same hasher). On the writer thread,
    // once per claim.
    static CONTEXT: std::sync::OnceLock<blake3::Hasher> = std::sync::OnceLock::new();
    let mut h = CONTEXT
        .get_or_init(|| {
            blake3::Hasher::new_derive_key("idempotency 2026-11-29 provider reference v1")
        })
        .clone();
    h.update(&(record_key.len() as u64).to_le_bytes());
    h.update(record_key);
    h.update(&token.to_le_bytes());
    let hash = h.finalize();
    let mut out = format!("idem_{token:x}_");
    push_hex(&mut out, &hash.as_bytes()[..10]);
    out
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    push_hex(&mut s, bytes);
    s
}

/// Appends the lower-case hex of `bytes` to `out` (a table, not `fmt`:
/// `write!` per byte was a tenth of a claim's CPU on the writer).
pub(crate) fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    out.reserve(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_match_only_in_full_and_under_the_same_version() {
        let stored = [7u8; 32];
        let mut rec = Record::processing(Fingerprint::from_bytes(stored), 1, "r".into(), 0, 1);
        assert!(rec.fingerprint_matches(&Fingerprint::from_bytes(stored)));
        for i in [0, 15, 31] {
            let mut other = stored;
            other[i] ^= 1;
            assert!(
                !rec.fingerprint_matches(&Fingerprint::from_bytes(other)),
                "byte {i} differs"
            );
        }
        rec.fingerprint_version = FINGERPRINT_ALGORITHM_VERSION.wrapping_add(1);
        assert!(!rec.fingerprint_matches(&Fingerprint::from_bytes(stored)));
    }
}
