//! A record rewritten, as a format-3 journal logs it
//! (`Change::PutRecordDelta`): only the fields that differ from the record
//! stored before. A completion so logs its state, times and response, not
//! again the fingerprint, token, reference and instants its claim logged.
//!
//! Replay decodes the stored record, sets the delta's fields and encodes
//! the result, which is byte for byte the value the live path stored: the
//! codec's encoding is a function of the record's fields, and the writer
//! logs a delta only once it has checked that the stored bytes are the
//! encoding of the record it changed (`Tables::derivable`), which is the
//! record replay finds there (a frame is applied to the state it was
//! written from).
//!
//! The delta is serialized by postcard as part of the frame: a list of
//! [`Field`]s, each its variant index and value. Variant order is the
//! format (append only, as `Change`'s).

use serde::{Deserialize, Serialize};

use crate::store::record::{Record, RecordState, StoredResponse};

/// The fields that changed from a stored record to its next value, in
/// field order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(in crate::store::redb) struct RecordDelta(Vec<Field>);

/// One changed field of a [`Record`], with its new value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Field {
    /// The state, as `RecordState`'s discriminant (0 = PROCESSING …
    /// 4 = TOMBSTONE).
    State(u8),
    Fingerprint([u8; 32]),
    FingerprintVersion(u8),
    Token(u64),
    Reference(String),
    ClaimedAt(u64),
    UpdatedAt(u64),
    LeaseUntil(u64),
    ExpiresAt(u64),
    ExpiredAt(u64),
    UnknownSince(u64),
    Attempts(u32),
    Reason(String),
    Response(Option<Response>),
}

/// A stored response, whole (a delta replaces it or removes it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Response {
    schema_version: u32,
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    #[serde(with = "crate::store::wire::byte_buf")]
    body: Vec<u8>,
    resource: Option<String>,
}

impl From<&StoredResponse> for Response {
    fn from(r: &StoredResponse) -> Response {
        Response {
            schema_version: r.schema_version,
            status: r.status,
            headers: r.headers.clone(),
            body: r.body.clone(),
            resource: r.resource.clone(),
        }
    }
}

impl From<Response> for StoredResponse {
    fn from(r: Response) -> StoredResponse {
        StoredResponse {
            schema_version: r.schema_version,
            status: r.status,
            headers: r.headers,
            body: r.body,
            resource: r.resource,
        }
    }
}

/// A delta that cannot be applied: it names a state no record has.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::store::redb) struct BadDelta(u8);

impl std::fmt::Display for BadDelta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "a record delta names state {}, which no record has",
            self.0
        )
    }
}

impl std::error::Error for BadDelta {}

fn state_of(byte: u8) -> Result<RecordState, BadDelta> {
    Ok(match byte {
        0 => RecordState::Processing,
        1 => RecordState::Completed,
        2 => RecordState::FinalFailure,
        3 => RecordState::Unknown,
        4 => RecordState::Tombstone,
        other => return Err(BadDelta(other)),
    })
}

impl RecordDelta {
    /// The fields of `new` that differ from `old`.
    pub(in crate::store::redb) fn between(old: &Record, new: &Record) -> RecordDelta {
        let mut fields = Vec::new();
        let mut differs = |changed: bool, field: &dyn Fn() -> Field| {
            if changed {
                fields.push(field());
            }
        };
        differs(old.state != new.state, &|| Field::State(new.state as u8));
        differs(old.fingerprint != new.fingerprint, &|| {
            Field::Fingerprint(new.fingerprint)
        });
        differs(old.fingerprint_version != new.fingerprint_version, &|| {
            Field::FingerprintVersion(new.fingerprint_version)
        });
        differs(old.token != new.token, &|| Field::Token(new.token));
        differs(old.reference != new.reference, &|| {
            Field::Reference(new.reference.clone())
        });
        differs(old.claimed_at_ms != new.claimed_at_ms, &|| {
            Field::ClaimedAt(new.claimed_at_ms)
        });
        differs(old.updated_at_ms != new.updated_at_ms, &|| {
            Field::UpdatedAt(new.updated_at_ms)
        });
        differs(old.lease_until_ms != new.lease_until_ms, &|| {
            Field::LeaseUntil(new.lease_until_ms)
        });
        differs(old.expires_at_ms != new.expires_at_ms, &|| {
            Field::ExpiresAt(new.expires_at_ms)
        });
        differs(old.expired_at_ms != new.expired_at_ms, &|| {
            Field::ExpiredAt(new.expired_at_ms)
        });
        differs(old.unknown_since_ms != new.unknown_since_ms, &|| {
            Field::UnknownSince(new.unknown_since_ms)
        });
        differs(old.attempts != new.attempts, &|| {
            Field::Attempts(new.attempts)
        });
        differs(old.reason != new.reason, &|| {
            Field::Reason(new.reason.clone())
        });
        differs(old.response != new.response, &|| {
            Field::Response(new.response.as_ref().map(Response::from))
        });
        RecordDelta(fields)
    }

    /// `base` with the delta's fields set.
    ///
    /// # Errors
    ///
    /// [`BadDelta`] when the delta names a state no record has (a frame
    /// that checks but was not written by this engine).
    pub(in crate::store::redb) fn apply(&self, mut base: Record) -> Result<Record, BadDelta> {
        for field in &self.0 {
            match field {
                Field::State(s) => base.state = state_of(*s)?,
                Field::Fingerprint(f) => base.fingerprint = *f,
                Field::FingerprintVersion(v) => base.fingerprint_version = *v,
                Field::Token(t) => base.token = *t,
                Field::Reference(r) => base.reference.clone_from(r),
                Field::ClaimedAt(t) => base.claimed_at_ms = *t,
                Field::UpdatedAt(t) => base.updated_at_ms = *t,
                Field::LeaseUntil(t) => base.lease_until_ms = *t,
                Field::ExpiresAt(t) => base.expires_at_ms = *t,
                Field::ExpiredAt(t) => base.expired_at_ms = *t,
                Field::UnknownSince(t) => base.unknown_since_ms = *t,
                Field::Attempts(a) => base.attempts = *a,
                Field::Reason(r) => base.reason.clone_from(r),
                Field::Response(r) => base.response = r.clone().map(StoredResponse::from),
            }
        }
        Ok(base)
    }

    /// Bytes of the strings and byte strings it carries, and 8 a field
    /// (what makes a frame large: `Change::size_bytes`).
    pub(in crate::store::redb) fn size_bytes(&self) -> usize {
        self.0
            .iter()
            .map(|field| match field {
                Field::Fingerprint(_) => 32,
                Field::Reference(s) | Field::Reason(s) => s.len(),
                Field::Response(Some(r)) => r
                    .headers
                    .iter()
                    .map(|(name, value)| name.len().saturating_add(value.len()))
                    .fold(r.body.len(), usize::saturating_add)
                    .saturating_add(r.resource.as_ref().map_or(0, String::len)),
                _ => 0,
            })
            .fold(0, |sum, n| sum.saturating_add(n).saturating_add(8))
    }
}

/// The encoded record a live write stored, kept beside its delta for the
/// overlay (`overlay.rs`: readers see the value before redb commits it).
/// Never in the journal: a frame read back holds an empty one, and replay
/// rebuilds the value from the stored record. Equal to every other, so a
/// change read back equals the change written.
#[derive(Clone, Default)]
pub(in crate::store::redb) struct Unlogged(pub(in crate::store::redb) Vec<u8>);

impl PartialEq for Unlogged {
    fn eq(&self, _: &Unlogged) -> bool {
        true
    }
}

impl Eq for Unlogged {}

impl std::fmt::Debug for Unlogged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Unlogged({} bytes)", self.0.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::Envelope;
    use crate::fingerprint::Fingerprint;
    use crate::store::record::Completion;

    fn claim() -> Record {
        Record::processing(
            Fingerprint::from_bytes([7; 32]),
            41,
            "ref-41".into(),
            1_790_000_000_000,
            1_790_000_030_000,
        )
    }

    #[test]
    fn a_completion_carries_only_what_it_changed() -> Result<(), Box<dyn std::error::Error>> {
        let old = claim();
        let response = StoredResponse::new(Envelope::new(1, 201, vec![b'x'; 300]), None);
        let new = old.completed(Completion::Success, response, 1_790_000_000_500, 86_400_000);
        let delta = RecordDelta::between(&old, &new);
        let kinds: Vec<_> = delta
            .0
            .iter()
            .map(|f| {
                format!("{f:?}")
                    .split('(')
                    .next()
                    .unwrap_or_default()
                    .to_owned()
            })
            .collect();
        assert_eq!(kinds, ["State", "UpdatedAt", "ExpiresAt", "Response"]);
        assert_eq!(delta.apply(old.clone())?, new);
        let read: RecordDelta = postcard::from_bytes(&postcard::to_allocvec(&delta)?)?;
        assert_eq!(read.apply(old)?, new);
        Ok(())
    }

    #[test]
    fn every_field_goes_through_a_delta() -> Result<(), Box<dyn std::error::Error>> {
        let old = claim();
        let new = Record {
            state: RecordState::Tombstone,
            fingerprint: [9; 32],
            fingerprint_version: 9,
            token: 1 << 40,
            reference: "ref-other".into(),
            claimed_at_ms: 1,
            updated_at_ms: 2,
            lease_until_ms: 3,
            expires_at_ms: 4,
            expired_at_ms: 5,
            unknown_since_ms: 6,
            attempts: 7,
            reason: "why".into(),
            response: Some(StoredResponse {
                schema_version: 3,
                status: 404,
                headers: vec![("h".into(), b"v".to_vec())],
                body: b"body".to_vec(),
                resource: Some("/r".into()),
            }),
        };
        let delta = RecordDelta::between(&old, &new);
        assert_eq!(delta.0.len(), 14);
        let read: RecordDelta = postcard::from_bytes(&postcard::to_allocvec(&delta)?)?;
        assert_eq!(read.apply(old.clone())?, new);
        // And back, which removes the response.
        assert_eq!(RecordDelta::between(&new, &old).apply(new)?, old);
        assert_eq!(RecordDelta::between(&old, &old), RecordDelta::default());
        Ok(())
    }

    #[test]
    fn a_state_no_record_has_is_refused() {
        let delta = RecordDelta(vec![Field::State(5)]);
        assert_eq!(delta.apply(claim()), Err(BadDelta(5)));
    }
}
