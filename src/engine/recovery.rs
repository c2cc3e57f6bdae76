//! Recovery: listing in-doubt (UNKNOWN) records and settling them through a
//! resolver or by hand, as a whole or (for a key with effect steps) step by
//! step (`engine/steps.rs`).

use crate::engine::core::Core;
use crate::engine::effects::{history_entry, step_infos};
use crate::engine::steps::StepsSettled;
use crate::error::{Error, Result};
use crate::key::IdempotencyKey;
use crate::outcome::InDoubt;
use crate::report::RecoveryReport;
use crate::resolver::{Resolution, Resolver};
use crate::step::{HistoryEntry, StepInfo, StepResolution};
use crate::store::record::RecordState;
use crate::store::step::{check_evidence, check_name, Actor, SettleStepRequest, StepAnswer};
use crate::store::{Record, SettleRequest, Settled, Settlement};

/// Checks an operator's reason: not blank (the evidence log records it).
fn check_reason(reason: &str) -> Result<()> {
    if reason.trim().is_empty() {
        return Err(Error::ReasonRequired);
    }
    Ok(())
}

/// Up to `limit` in-doubt records, oldest first, each with its steps.
pub(crate) fn in_doubt(core: &Core, limit: usize) -> Result<Vec<InDoubt>> {
    let now_ms = core.clock.now_ms();
    core.store
        .in_doubt(limit, now_ms)?
        .into_iter()
        .map(|(key, rec)| {
            let steps = step_infos(Some(&rec), core.store.steps(&key)?, now_ms);
            Ok(Core::in_doubt_of(key, &rec, steps, now_ms))
        })
        .collect()
}

/// Settles up to `limit` in-doubt records by asking `resolver` about each
/// (about each unsettled step, for a key with steps).
pub(crate) fn recover(
    core: &Core,
    resolver: &dyn Resolver,
    limit: usize,
) -> Result<RecoveryReport> {
    let mut report = RecoveryReport::default();
    let now_ms = core.clock.now_ms();
    let (others, resumable) = recovery_queue(core, limit)?;
    let spare = limit.saturating_sub(others.len());
    for in_doubt in others.into_iter().chain(resumable.into_iter().take(spare)) {
        // A dropped claim's work may still be running until its lease
        // ends; it is not safe to settle yet.
        if in_doubt.resolvable_at_ms > now_ms {
            report.still_in_doubt += 1;
            continue;
        }
        let settled = if in_doubt.steps.is_empty() {
            settle_whole(core, resolver, &in_doubt)
        } else {
            settle_by_steps(core, resolver, &in_doubt)
        };
        match settled {
            Ok(Recovered::Completed) => {
                core.counters.resolved.add(1);
                report.completed += 1;
            }
            Ok(Recovered::NotExecuted) => {
                core.counters.resolved.add(1);
                report.not_executed += 1;
            }
            // Every step settled: the record stays UNKNOWN until the
            // client's retry resumes it (not resolved yet).
            Ok(Recovered::Resumable) => report.resumed += 1,
            // Still in doubt, a refused answer (see `settle_whole`), or a
            // step still unknown.
            Ok(Recovered::StillInDoubt) => report.still_in_doubt += 1,
            Err(Error::Fenced { .. } | Error::NotFound { .. }) => report.skipped += 1,
            Err(e) => return Err(e.naming(&in_doubt.key, None)),
        }
    }
    Ok(report)
}

/// What recovery works on: up to `limit` in-doubt records that are not
/// resumable, oldest first, and the resumable ones ahead of or among them
/// (for whatever of `limit` the others leave). A resumable key waits for
/// its client's retry and may never get one; it sits at the front of the
/// queue, so counting it against `limit` would let `limit` such keys hide
/// every newer in-doubt key from recovery for good. The listing is read
/// again, twice as long each time, until it holds `limit` others or ends:
/// a run reads past every resumable key ahead of them (a record and a steps
/// read each, no write).
fn recovery_queue(core: &Core, limit: usize) -> Result<(Vec<InDoubt>, Vec<InDoubt>)> {
    if limit == 0 {
        return Ok((Vec::new(), Vec::new()));
    }
    let mut fetch = limit;
    loop {
        let listed = in_doubt(core, fetch)?;
        let ended = listed.len() < fetch;
        let (resumable, mut others): (Vec<InDoubt>, Vec<InDoubt>) =
            listed.into_iter().partition(InDoubt::is_resumable);
        if others.len() >= limit || ended || fetch == usize::MAX {
            others.truncate(limit);
            return Ok((others, resumable));
        }
        fetch = fetch.saturating_mul(2);
    }
}

/// What recovery did with one in-doubt record.
enum Recovered {
    Completed,
    NotExecuted,
    /// Every step is settled: the next `begin` with its fingerprint
    /// resumes it.
    Resumable,
    StillInDoubt,
}

impl From<Settled<()>> for Recovered {
    fn from(settled: Settled<()>) -> Self {
        match settled {
            Settled::Completed(_) => Recovered::Completed,
            Settled::NotExecuted(()) => Recovered::NotExecuted,
            Settled::StillInDoubt(_) => Recovered::StillInDoubt,
        }
    }
}

/// Settles a record without steps as a whole. `None`: the resolver's
/// answer was refused (an envelope over the size limit); one bad answer
/// must not stop the rest of the queue, so the record stays UNKNOWN.
fn settle_whole(core: &Core, resolver: &dyn Resolver, in_doubt: &InDoubt) -> Result<Recovered> {
    let settlement = match core.settlement(&in_doubt.key, resolver.resolve(in_doubt)) {
        Ok(settlement) => settlement,
        Err(e) => {
            tracing::error!(key = %in_doubt.key, error = %e, "resolver answer refused");
            return Ok(Recovered::StillInDoubt);
        }
    };
    let settled = core.store.settle(SettleRequest {
        key: in_doubt.key.clone(),
        token: in_doubt.fencing_token,
        settlement,
        actor: Actor::Resolver,
    })?;
    Ok(settled.into())
}

/// Settles a record with steps: each unsettled step, then (all settled)
/// the key: completed from the steps, or left UNKNOWN and resumable (the
/// client's retry resumes it; the record is never deleted here, so its
/// fingerprint is still checked and its steps go with it).
fn settle_by_steps(core: &Core, resolver: &dyn Resolver, in_doubt: &InDoubt) -> Result<Recovered> {
    let key = &in_doubt.key;
    let Some(record) = core.store.record(key)? else {
        return Err(Error::NotFound { key: key.clone() });
    };
    if record.token != in_doubt.fencing_token {
        return Err(Error::Fenced {
            key: key.clone(),
            token: in_doubt.fencing_token,
            reason: "the record changed while recovery ran".into(),
        });
    }
    let steps = core.store.steps(key)?;
    let (steps, _) = core.settle_steps(key, &record, steps, Some(resolver))?;
    let now_ms = core.clock.now_ms();
    let settlement = match core.key_settlement(key, &record, steps, Some(resolver), now_ms) {
        Ok(StepsSettled::InDoubt(_)) => return Ok(Recovered::StillInDoubt),
        Ok(StepsSettled::Settle(Settlement::Resume)) => return Ok(Recovered::Resumable),
        Ok(StepsSettled::Settle(settlement)) => settlement,
        Err(e @ Error::ResponseTooLarge { .. }) => {
            tracing::error!(key = %key, error = %e, "resolver's response from steps refused");
            return Ok(Recovered::StillInDoubt);
        }
        Err(e) => return Err(e),
    };
    let settled = core.store.settle(SettleRequest {
        key: key.clone(),
        token: record.token,
        settlement,
        actor: Actor::Resolver,
    })?;
    Ok(settled.into())
}

/// The key's record if it is in doubt at `now_ms` (UNKNOWN, or PROCESSING
/// with its lease ended: read-time truth, the settlement moves it in the
/// same write).
fn in_doubt_record(core: &Core, key: &IdempotencyKey, action: &'static str) -> Result<Record> {
    let rec = core
        .store
        .record(key)?
        .ok_or_else(|| Error::NotFound { key: key.clone() })?;
    let now_ms = core.clock.now_ms();
    let in_doubt = rec.state == RecordState::Unknown
        || (rec.state == RecordState::Processing && rec.lease_until_ms <= now_ms);
    if !in_doubt {
        return Err(Error::InvalidState {
            key: key.clone(),
            action,
            state: rec.state.into(),
        });
    }
    Ok(rec)
}

/// `NotExecuted` is refused before the dropped claim's lease ends.
fn check_not_running(core: &Core, key: &IdempotencyKey, rec: &Record) -> Result<()> {
    if rec.lease_until_ms > core.clock.now_ms() {
        return Err(Error::InvalidState {
            key: key.clone(),
            action: "settle as not executed before the dropped claim's lease ends \
                     (its work may still be running)",
            state: rec.state.into(),
        });
    }
    Ok(())
}

/// Settles one in-doubt record by hand (what `idem resolve` does), with the
/// operator's reason recorded in the evidence log.
pub(crate) fn resolve(
    core: &Core,
    key: &IdempotencyKey,
    resolution: Resolution,
    reason: &str,
) -> Result<()> {
    check_reason(reason)?;
    let rec = in_doubt_record(core, key, "resolve")?;
    if resolution == Resolution::NotExecuted {
        check_not_running(core, key, &rec)?;
    }
    let settlement = core.settlement(key, resolution)?;
    // "Still unknown" settles nothing: not counted as resolved, as in
    // `recover` and `begin`.
    let resolved = !matches!(settlement, Settlement::StillInDoubt);
    core.store.settle(SettleRequest {
        key: key.clone(),
        token: rec.token,
        settlement,
        actor: Actor::Operator {
            reason: reason.to_string(),
        },
    })?;
    if resolved {
        core.counters.resolved.add(1);
    }
    Ok(())
}

/// Settles one step of an in-doubt key by hand; when that settles the
/// key's last unsettled step and the engine's resolver completes the key
/// from the steps, the key completes too; otherwise it stays UNKNOWN,
/// resumable (the client's retry resumes it).
pub(crate) fn resolve_step(
    core: &Core,
    key: &IdempotencyKey,
    name: &str,
    resolution: StepResolution,
    reason: &str,
) -> Result<()> {
    check_reason(reason)?;
    check_name(name)?;
    let answer = match resolution {
        StepResolution::Executed(evidence) => {
            check_evidence(key, name, &evidence)?;
            StepAnswer::Executed(evidence)
        }
        StepResolution::NotExecuted => StepAnswer::NotExecuted,
        StepResolution::StillUnknown => StepAnswer::StillUnknown,
    };
    let rec = in_doubt_record(core, key, "resolve a step of")?;
    if answer == StepAnswer::NotExecuted {
        check_not_running(core, key, &rec)?;
    }
    let actor = Actor::Operator {
        reason: reason.to_string(),
    };
    core.store.settle_step(SettleStepRequest {
        key: key.clone(),
        token: rec.token,
        name: name.to_string(),
        answer,
        actor: actor.clone(),
    })?;
    // The step's answer is stored: from here on nothing returns an
    // error (the documented contract is all or nothing). A key whose
    // steps are now all settled stays UNKNOWN and resumes on the client's
    // retry, unless the engine's resolver completes it from the steps.
    let now_ms = core.clock.now_ms();
    let resolver = core.cfg.resolver.as_deref();
    let settlement = core
        .store
        .steps(key)
        .and_then(|steps| core.key_settlement(key, &rec, steps, resolver, now_ms));
    match settlement {
        Ok(StepsSettled::InDoubt(_) | StepsSettled::Settle(Settlement::Resume)) => {}
        Ok(StepsSettled::Settle(settlement)) => {
            match core.store.settle(SettleRequest {
                key: key.clone(),
                token: rec.token,
                settlement,
                actor,
            }) {
                Ok(_) => core.counters.resolved.add(1),
                // Settled by someone else meanwhile (a `begin` that
                // resumed it): the step's answer is stored all the same.
                Err(Error::Fenced { .. } | Error::NotFound { .. }) => {}
                Err(e) => {
                    tracing::error!(key = %key, error = %e, "step settled; completing the key from its steps failed (it stays in doubt)");
                }
            }
        }
        Err(e) => {
            tracing::error!(key = %key, error = %e, "step settled; settling the key from its steps failed (it stays in doubt)");
        }
    }
    Ok(())
}

/// The key's steps, as seen now.
pub(crate) fn steps(core: &Core, key: &IdempotencyKey) -> Result<Vec<StepInfo>> {
    let record = core.store.record(key)?;
    let now_ms = core.clock.now_ms();
    Ok(step_infos(record.as_ref(), core.store.steps(key)?, now_ms))
}

/// The key's evidence log, oldest first.
pub(crate) fn history(core: &Core, key: &IdempotencyKey) -> Result<Vec<HistoryEntry>> {
    Ok(core
        .store
        .history(key)?
        .into_iter()
        .map(history_entry)
        .collect())
}
