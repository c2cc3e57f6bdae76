//! Read-only views for operators: record listings and statistics.

use redb::ReadableTable;

use crate::codec::{DiskState, Record};
use crate::engine::{decode_for, Engine};
use crate::envelope::Envelope;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::outcome::State;
use crate::tables::{RECORDS, RECOVERY};

/// One stored record, as shown to operators.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordInfo {
    /// The record's key.
    pub key: IdempotencyKey,
    /// Its state.
    pub state: State,
    /// The request fingerprint.
    pub fingerprint: Fingerprint,
    /// Fingerprint algorithm version it was computed with.
    pub fingerprint_version: u8,
    /// Fencing token of the claim that owns (or owned) it.
    pub fencing_token: u64,
    /// Provider reference of that claim.
    pub reference: String,
    /// When the claim was taken (ms since the Unix epoch).
    pub claimed_at_ms: u64,
    /// Last change (ms since the Unix epoch).
    pub updated_at_ms: u64,
    /// PROCESSING: when the lease runs out.
    pub lease_until_ms: Option<u64>,
    /// COMPLETED, FAILED_FINAL: when it expires; TOMBSTONE: when the
    /// tombstone runs out.
    pub expires_at_ms: Option<u64>,
    /// UNKNOWN: since when.
    pub unknown_since_ms: Option<u64>,
    /// UNKNOWN: resolver attempts so far.
    pub attempts: u32,
    /// UNKNOWN: why.
    pub reason: String,
    /// The stored response, as stored (no upcasting).
    pub response: Option<Envelope>,
    /// The stored resource reference.
    pub resource: Option<String>,
}

impl RecordInfo {
    fn new(key: IdempotencyKey, rec: &Record) -> RecordInfo {
        let state = State::from(rec.state);
        RecordInfo {
            key,
            state,
            fingerprint: Fingerprint::from_bytes(rec.fingerprint),
            fingerprint_version: rec.fingerprint_version,
            fencing_token: rec.token,
            reference: rec.reference.clone(),
            claimed_at_ms: rec.claimed_at_ms,
            updated_at_ms: rec.updated_at_ms,
            lease_until_ms: (rec.state == DiskState::Processing).then_some(rec.lease_until_ms),
            expires_at_ms: matches!(
                rec.state,
                DiskState::Completed | DiskState::FailedFinal | DiskState::Tombstone
            )
            .then_some(rec.expires_at_ms),
            unknown_since_ms: (rec.state == DiskState::Unknown).then_some(rec.unknown_since_ms),
            attempts: rec.attempts,
            reason: rec.reason.clone(),
            response: rec.response.as_ref().map(|r| r.envelope()),
            resource: rec.response.as_ref().and_then(|r| r.resource.clone()),
        }
    }
}

/// Which records [`Engine::records`] lists.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecordFilter {
    /// Only this scope.
    pub scope: Option<String>,
    /// Only this state (as stored: read-time expiry is not applied).
    pub state: Option<State>,
    /// At most this many records (all when `None`).
    pub limit: Option<usize>,
}

/// Counters since the engine opened, and gauges read from the database.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Claims won.
    pub claims: u64,
    /// Replays answered.
    pub replays: u64,
    /// Fingerprint mismatches answered.
    pub mismatches: u64,
    /// In-progress answers.
    pub in_progress: u64,
    /// UNKNOWN answers given to `begin`.
    pub unknown_answers: u64,
    /// Expired (tombstone) answers.
    pub expired_answers: u64,
    /// Stale claims moved to UNKNOWN by sweeps.
    pub moved_to_unknown: u64,
    /// UNKNOWN records resolved (by a resolver or by hand).
    pub resolved: u64,
    /// Expired records deleted by sweeps.
    pub expired_deleted: u64,
    /// Expired records turned into tombstones by sweeps.
    pub tombstoned: u64,
    /// Records in the database by state, as stored.
    pub processing: u64,
    /// COMPLETED records.
    pub completed: u64,
    /// FAILED_FINAL records.
    pub failed_final: u64,
    /// UNKNOWN records.
    pub unknown: u64,
    /// TOMBSTONE records.
    pub tombstones: u64,
    /// Records that failed to decode.
    pub corrupt: u64,
    /// Age of the oldest UNKNOWN record in milliseconds, if any.
    pub oldest_unknown_age_ms: Option<u64>,
}

impl Engine {
    /// The record stored for `key`, as stored (read-time expiry is not
    /// applied: an expired record not yet swept is shown with its
    /// `expires_at_ms`).
    ///
    /// # Errors
    ///
    /// [`Error::CorruptRecord`], storage errors.
    pub fn record(&self, key: &IdempotencyKey) -> Result<Option<RecordInfo>> {
        Ok(self
            .shared
            .read_record(key)?
            .map(|rec| RecordInfo::new(key.clone(), &rec)))
    }

    /// Lists records in key order (grouped by scope). A record that does not
    /// decode is listed as an `Err` naming its key, so one bad record does not
    /// hide the rest.
    ///
    /// # Errors
    ///
    /// Storage errors.
    pub fn records(&self, filter: &RecordFilter) -> Result<Vec<Result<RecordInfo>>> {
        let ctx = "listing records";
        let table = self.shared.read_table(RECORDS, ctx)?;
        let mut out = Vec::new();
        let limit = filter.limit.unwrap_or(usize::MAX);
        for entry in table.iter().map_err(|e| Error::storage(ctx, e))? {
            if out.len() >= limit {
                break;
            }
            let (k, v) = entry.map_err(|e| Error::storage(ctx, e))?;
            let Some(key) = IdempotencyKey::from_record_key(k.value()) else {
                out.push(Err(Error::CorruptRecord {
                    key: crate::ops::hex(k.value()),
                    reason: "record key is not a valid scope and key".into(),
                }));
                continue;
            };
            if filter.scope.as_deref().is_some_and(|s| s != key.scope()) {
                continue;
            }
            match decode_for(&key, v.value()) {
                Ok(rec) => {
                    if filter.state.is_none_or(|s| s == State::from(rec.state)) {
                        out.push(Ok(RecordInfo::new(key, &rec)));
                    }
                }
                Err(e) => out.push(Err(e)),
            }
        }
        Ok(out)
    }

    /// Counters since open, plus gauges counted from the database (a full
    /// scan of the records table: meant for operators, not hot paths).
    ///
    /// # Errors
    ///
    /// Storage errors.
    pub fn stats(&self) -> Result<Stats> {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &self.shared.counters;
        let mut stats = Stats {
            claims: c.claims.load(Relaxed),
            replays: c.replays.load(Relaxed),
            mismatches: c.mismatches.load(Relaxed),
            in_progress: c.in_progress.load(Relaxed),
            unknown_answers: c.unknown_answers.load(Relaxed),
            expired_answers: c.expired_answers.load(Relaxed),
            moved_to_unknown: c.moved_to_unknown.load(Relaxed),
            resolved: c.resolved.load(Relaxed),
            expired_deleted: c.expired_deleted.load(Relaxed),
            tombstoned: c.tombstoned.load(Relaxed),
            ..Stats::default()
        };
        let ctx = "computing stats";
        let table = self.shared.read_table(RECORDS, ctx)?;
        for entry in table.iter().map_err(|e| Error::storage(ctx, e))? {
            let (_, v) = entry.map_err(|e| Error::storage(ctx, e))?;
            match crate::codec::decode(v.value()).map(|r| r.state) {
                Ok(DiskState::Processing) => stats.processing += 1,
                Ok(DiskState::Completed) => stats.completed += 1,
                Ok(DiskState::FailedFinal) => stats.failed_final += 1,
                Ok(DiskState::Unknown) => stats.unknown += 1,
                Ok(DiskState::Tombstone) => stats.tombstones += 1,
                Err(_) => stats.corrupt += 1,
            }
        }
        let queue = self.shared.read_table(RECOVERY, ctx)?;
        if let Some((k, _)) = queue.first().map_err(|e| Error::storage(ctx, e))? {
            let since = k.value().0;
            stats.oldest_unknown_age_ms = Some(self.shared.clock.now_ms().saturating_sub(since));
        }
        Ok(stats)
    }
}
