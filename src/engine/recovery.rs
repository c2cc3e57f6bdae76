//! Recovery: listing in-doubt (UNKNOWN) records and settling them through a
//! resolver or by hand.

use crate::engine::core::Core;
use crate::error::{Error, Result};
use crate::key::IdempotencyKey;
use crate::outcome::InDoubt;
use crate::report::RecoveryReport;
use crate::resolver::{Resolution, Resolver};
use crate::store::record::RecordState;
use crate::store::{SettleRequest, Settled, Settlement};

/// Up to `limit` in-doubt records, oldest first.
pub(crate) fn in_doubt(core: &Core, limit: usize) -> Result<Vec<InDoubt>> {
    let now_ms = core.clock.now_ms();
    Ok(core
        .store
        .in_doubt(limit, now_ms)?
        .into_iter()
        .map(|(key, rec)| Core::in_doubt_of(key, &rec, now_ms))
        .collect())
}

/// Settles up to `limit` in-doubt records by asking `resolver` about each.
pub(crate) fn recover(
    core: &Core,
    resolver: &dyn Resolver,
    limit: usize,
) -> Result<RecoveryReport> {
    let mut report = RecoveryReport::default();
    let now_ms = core.clock.now_ms();
    for in_doubt in in_doubt(core, limit)? {
        // A dropped claim's work may still be running until its lease
        // ends; it is not safe to settle yet.
        if in_doubt.resolvable_at_ms > now_ms {
            report.still_in_doubt += 1;
            continue;
        }
        // One bad answer (an envelope over the size limit) must not stop
        // the rest of the queue: the record stays UNKNOWN.
        let settlement = match core.settlement(&in_doubt.key, resolver.resolve(&in_doubt)) {
            Ok(settlement) => settlement,
            Err(e) => {
                tracing::error!(key = %in_doubt.key, error = %e, "resolver answer refused");
                report.still_in_doubt += 1;
                continue;
            }
        };
        let req = SettleRequest {
            key: in_doubt.key.clone(),
            token: in_doubt.fencing_token,
            settlement,
            actor: crate::store::Actor::Resolver,
        };
        match core.store.settle(req) {
            Ok(Settled::Completed(_)) => {
                core.counters.resolved.add(1);
                report.completed += 1;
            }
            Ok(Settled::NotExecuted(())) => {
                core.counters.resolved.add(1);
                report.not_executed += 1;
            }
            Ok(Settled::StillInDoubt(_)) => report.still_in_doubt += 1,
            Err(Error::Fenced { .. } | Error::NotFound { .. }) => report.skipped += 1,
            Err(e) => return Err(e),
        }
    }
    Ok(report)
}

/// Settles one in-doubt record by hand (what `idem resolve` does).
pub(crate) fn resolve(core: &Core, key: &IdempotencyKey, resolution: Resolution) -> Result<()> {
    let rec = core
        .store
        .record(key)?
        .ok_or_else(|| Error::NotFound { key: key.clone() })?;
    // Read-time truth: a PROCESSING record whose lease has ended is in
    // doubt already; the settlement moves it in the same write.
    let now_ms = core.clock.now_ms();
    let in_doubt = rec.state == RecordState::Unknown
        || (rec.state == RecordState::Processing && rec.lease_until_ms <= now_ms);
    if !in_doubt {
        return Err(Error::InvalidState {
            key: key.clone(),
            action: "resolve",
            state: rec.state.into(),
        });
    }
    if resolution == Resolution::NotExecuted && rec.lease_until_ms > now_ms {
        return Err(Error::InvalidState {
            key: key.clone(),
            action: "settle as not executed before the dropped claim's lease ends \
                     (its work may still be running)",
            state: rec.state.into(),
        });
    }
    let settlement = core.settlement(key, resolution)?;
    // "Still unknown" settles nothing: not counted as resolved, as in
    // `recover` and `begin`.
    let resolved = !matches!(settlement, Settlement::StillInDoubt);
    core.store.settle(SettleRequest {
        key: key.clone(),
        token: rec.token,
        settlement,
        actor: crate::store::Actor::Operator {
            reason: String::new(),
        },
    })?;
    if resolved {
        core.counters.resolved.add(1);
    }
    Ok(())
}
