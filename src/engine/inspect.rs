//! Read-only views for operators: record listings and statistics.

use std::time::Duration;

use crate::engine::core::Core;
use crate::envelope::Envelope;
use crate::error::{Corrupted, Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::state::State;
use crate::store::classify::state_at;
use crate::store::record::{hex, Record, RecordState};

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
    /// PROCESSING: when the lease runs out (ms since the Unix epoch).
    pub lease_until_ms: Option<u64>,
    /// COMPLETED, `FINAL_FAILURE`: when it expires; TOMBSTONE: when the
    /// tombstone runs out.
    pub expires_at_ms: Option<u64>,
    /// UNKNOWN: since when.
    pub unknown_since_ms: Option<u64>,
    /// UNKNOWN: resolver answers of "still unknown" so far. A record
    /// settled from UNKNOWN (resolver or operator) keeps the count it had;
    /// 0 for a record that was never UNKNOWN.
    pub attempts: u32,
    /// UNKNOWN: why it is in doubt. A record settled from UNKNOWN keeps
    /// this as the reason it *was* in doubt (history, not its state; `idem
    /// show` prints it as "was in doubt"); empty for a record that was
    /// never UNKNOWN.
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
            lease_until_ms: (rec.state == RecordState::Processing).then_some(rec.lease_until_ms),
            expires_at_ms: matches!(
                rec.state,
                RecordState::Completed | RecordState::FinalFailure | RecordState::Tombstone
            )
            .then_some(rec.expires_at_ms),
            unknown_since_ms: (rec.state == RecordState::Unknown).then_some(rec.unknown_since_ms),
            attempts: rec.attempts,
            reason: rec.reason.clone(),
            response: rec
                .response
                .as_ref()
                .map(crate::store::record::StoredResponse::envelope),
            resource: rec.response.as_ref().and_then(|r| r.resource.clone()),
        }
    }
}

/// Which records [`crate::Engine::records`] lists.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecordFilter {
    /// Only this scope.
    pub scope: Option<String>,
    /// Only this state (as stored: read-time expiry is not applied).
    pub state: Option<State>,
    /// At most this many records (all when `None`).
    pub limit: Option<usize>,
}

/// Counters since the engine opened, and gauges read from the database at
/// read time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Claims won.
    pub claims: u64,
    /// Replays answered.
    pub replays: u64,
    /// Fingerprint mismatches answered.
    pub mismatches: u64,
    /// Processing answers (another caller held the key).
    pub processing_answers: u64,
    /// UNKNOWN answers given to `begin`.
    pub in_doubt_answers: u64,
    /// Tombstoned answers.
    pub tombstone_answers: u64,
    /// Stale claims moved to UNKNOWN by sweeps.
    pub moved_to_unknown: u64,
    /// UNKNOWN records resolved (by a resolver or by hand).
    pub resolved: u64,
    /// Expired records deleted by sweeps.
    pub expired_deleted: u64,
    /// Expired records turned into tombstones by sweeps.
    pub tombstoned: u64,
    /// Records in the database by their state at read time (as requests see
    /// them: a PROCESSING record whose lease ended counts as UNKNOWN, an
    /// expired one as a TOMBSTONE or as `expired`): PROCESSING records.
    pub processing: u64,
    /// COMPLETED records.
    pub completed: u64,
    /// `FINAL_FAILURE` records.
    pub final_failures: u64,
    /// UNKNOWN records.
    pub unknown: u64,
    /// TOMBSTONE records.
    pub tombstones: u64,
    /// Records past their TTL (and any tombstone) that no sweep has deleted
    /// yet: every request treats them as absent.
    pub expired: u64,
    /// Records that failed to decode.
    pub corrupt: u64,
    /// How long the oldest in-doubt record (UNKNOWN, or PROCESSING with its
    /// lease ended) has been in doubt (whole milliseconds), if any.
    pub oldest_in_doubt_age: Option<Duration>,
}

/// The record stored for `key`, as stored.
pub(crate) fn record(core: &Core, key: &IdempotencyKey) -> Result<Option<RecordInfo>> {
    Ok(core
        .store
        .record(key)?
        .map(|rec| RecordInfo::new(key.clone(), &rec)))
}

/// Records in (scope, key) byte order on every backend; one that does not
/// decode is listed as an `Err`.
pub(crate) fn records(core: &Core, filter: &RecordFilter) -> Result<Vec<Result<RecordInfo>>> {
    let mut out = Vec::new();
    let limit = filter.limit.unwrap_or(usize::MAX);
    core.store.scan_in_key_order(&mut |(key, value)| {
        if out.len() >= limit {
            return false;
        }
        let key = match key {
            Ok(key) => key,
            Err(raw) => {
                out.push(Err(Error::Corrupt {
                    what: Corrupted::RecordKey(hex(&raw)),
                    reason: "not a valid scope and key".into(),
                }));
                return true;
            }
        };
        if filter.scope.as_deref().is_some_and(|s| s != key.scope()) {
            return true;
        }
        match value {
            Ok(rec) => {
                if filter.state.is_none_or(|s| s == State::from(rec.state)) {
                    out.push(Ok(RecordInfo::new(key, &rec)));
                }
            }
            Err(e) => out.push(Err(Error::Corrupt {
                what: Corrupted::Record(key),
                reason: e.to_string(),
            })),
        }
        true
    })?;
    Ok(out)
}

/// Counters since open, plus gauges counted from the database.
pub(crate) fn stats(core: &Core) -> Result<Stats> {
    let c = &core.counters;
    let mut stats = Stats {
        claims: c.claims.get(),
        replays: c.replays.get(),
        mismatches: c.mismatches.get(),
        processing_answers: c.processing_answers.get(),
        in_doubt_answers: c.in_doubt_answers.get(),
        tombstone_answers: c.tombstone_answers.get(),
        moved_to_unknown: c.moved_to_unknown.get(),
        resolved: c.resolved.get(),
        expired_deleted: c.expired_deleted.get(),
        tombstoned: c.tombstoned.get(),
        ..Stats::default()
    };
    let now_ms = core.clock.now_ms();
    let policy = core.cfg.store.expiry;
    core.store.scan(&mut |(_, value)| {
        let gauge = match value.map(|rec| state_at(&rec, now_ms, policy)) {
            Ok(Some(State::Processing)) => &mut stats.processing,
            Ok(Some(State::Completed)) => &mut stats.completed,
            Ok(Some(State::FinalFailure)) => &mut stats.final_failures,
            Ok(Some(State::Unknown)) => &mut stats.unknown,
            Ok(Some(State::Tombstone)) => &mut stats.tombstones,
            Ok(None) => &mut stats.expired,
            Err(_) => &mut stats.corrupt,
        };
        *gauge += 1;
        true
    })?;
    if let Some(since) = core.store.oldest_in_doubt_ms(now_ms)? {
        stats.oldest_in_doubt_age = Some(Duration::from_millis(now_ms.saturating_sub(since)));
    }
    Ok(stats)
}
