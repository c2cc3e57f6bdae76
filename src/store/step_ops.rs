//! The effect-step operations and the evidence log, written once for every
//! backend over a [`Txn`] (as `ops.rs` is for records).
//!
//! Rules (see `docs/design.md`):
//! - a step is reserved only by the claim that owns a PROCESSING record
//!   whose lease has not ended; a name is used once per claim
//!   (`StepReused`); an earlier claim's Confirmed or Failed step is handed
//!   back as it is (the handler skips the call); a `NotExecuted` step is
//!   reserved again under its old reference; at most
//!   [`MAX_STEPS_PER_KEY`] names per key;
//! - confirm / reject: the claim still owns the PROCESSING record and the
//!   step is Reserved by it;
//! - a step is settled (resolver or operator) only while its record is in
//!   doubt; a PROCESSING record whose lease ended moves to UNKNOWN in the
//!   same write, its Reserved steps to Unknown;
//! - every transition appends one entry to the key's log, except a
//!   resolver's "still unknown" answer (the step counts its attempts
//!   instead; an operator's is logged with its reason). A
//!   transition that would take the log past [`MAX_HISTORY_ENTRIES`] is
//!   refused (`HistoryFull`), except the engine's own moves to UNKNOWN and
//!   a claim's completion, which are never blocked: their entries are
//!   dropped past the bound (and logged).
//!
//! Every check that can refuse runs before the first write.

// The engine's effect steps (its own branch) call these; until then only
// the store's tests do.
#![cfg_attr(not(test), allow(dead_code))]

use std::fmt::Write as _;

use crate::error::{Corrupted, Error};
use crate::key::IdempotencyKey;
use crate::state::State;

use super::ops::{fenced, OpError, OpResult, Txn};
use super::record::{Record, RecordState};
use super::step::{
    check_evidence, check_name, Actor, FinishStepRequest, HistoryRecord, SettleStepRequest,
    StepAnswer, StepFinish, StepRecord, StepRequest, StepStatus, MAX_HISTORY_ENTRIES,
    MAX_STEPS_PER_KEY,
};

/// Every step of `key`; a step that does not decode refuses the op with
/// `Error::Corrupt` naming the key and the step.
pub(crate) fn steps_of<T: Txn>(
    t: &mut T,
    key: &IdempotencyKey,
) -> OpResult<Vec<StepRecord>, T::Fatal> {
    let mut steps = Vec::new();
    for (name, step) in t.load_steps(key).map_err(OpError::Fatal)? {
        match step {
            Ok(step) => steps.push(step),
            Err(e) => {
                return Err(OpError::Refused(Error::Corrupt {
                    what: Corrupted::Step {
                        key: key.clone(),
                        step: name,
                    },
                    reason: e.to_string(),
                }))
            }
        }
    }
    Ok(steps)
}

/// Every step of `key` that decodes (a damaged one is logged and left
/// alone): for the engine's own moves, which must not be blocked.
fn readable_steps<T: Txn>(t: &mut T, key: &IdempotencyKey) -> OpResult<Vec<StepRecord>, T::Fatal> {
    let mut steps = Vec::new();
    for (name, step) in t.load_steps(key).map_err(OpError::Fatal)? {
        match step {
            Ok(step) => steps.push(step),
            Err(e) => {
                tracing::error!(key = %key, step = %name, error = %e, "damaged effect step left as it is");
            }
        }
    }
    Ok(steps)
}

/// A log entry at `now` (its `seq` is given by [`log`]).
pub(crate) fn entry(
    now: u64,
    actor: Actor,
    step: Option<&str>,
    from: &str,
    to: &str,
    evidence: Vec<u8>,
) -> HistoryRecord {
    HistoryRecord {
        seq: 0,
        at_ms: now,
        actor,
        step: step.map(str::to_owned),
        from: from.to_owned(),
        to: to.to_owned(),
        evidence,
    }
}

/// Appends `entries` to `key`'s log, numbered on from its last entry. Past
/// [`MAX_HISTORY_ENTRIES`]: refused with `HistoryFull` (nothing written),
/// or, when `forced`, the entries that do not fit are dropped. Call it
/// before the op's other writes.
pub(crate) fn log<T: Txn>(
    t: &mut T,
    key: &IdempotencyKey,
    entries: Vec<HistoryRecord>,
    forced: bool,
) -> OpResult<(), T::Fatal> {
    if entries.is_empty() {
        return Ok(());
    }
    let span = t.history_span(key).map_err(OpError::Fatal)?;
    let (held, next) = match span {
        None => (0usize, 0u32),
        Some((first, last)) => (
            usize::try_from(last.saturating_sub(first))
                .unwrap_or(usize::MAX)
                .saturating_add(1),
            last.saturating_add(1),
        ),
    };
    let room = MAX_HISTORY_ENTRIES.saturating_sub(held);
    if entries.len() > room {
        if !forced {
            return Err(OpError::Refused(Error::HistoryFull { key: key.clone() }));
        }
        tracing::warn!(key = %key, dropped = entries.len() - room, "evidence log full: entries of an engine move dropped");
    }
    for (n, mut e) in entries.into_iter().take(room).enumerate() {
        e.seq = next.saturating_add(u32::try_from(n).unwrap_or(u32::MAX));
        t.append_history(key, &e).map_err(OpError::Fatal)?;
    }
    Ok(())
}

/// Deletes `key`'s steps and log (the record goes, or is replaced by a
/// fresh one).
pub(crate) fn drop_steps<T: Txn>(t: &mut T, key: &IdempotencyKey) -> OpResult<(), T::Fatal> {
    t.remove_steps(key).map_err(OpError::Fatal)?;
    t.remove_history(key).map_err(OpError::Fatal)
}

/// Writes `new` (an UNKNOWN record) over `old`, and moves every Reserved
/// step to Unknown in the same write, one log entry each (`actor`: the
/// claim for an explicit or dropped claim, `Sweeper` for a lease end).
/// Never refused for a full log.
pub(crate) fn to_unknown<T: Txn>(
    t: &mut T,
    key: &IdempotencyKey,
    old: &Record,
    new: &Record,
    actor: &Actor,
) -> OpResult<Vec<StepRecord>, T::Fatal> {
    let now = t.now();
    let mut steps = readable_steps(t, key)?;
    let mut entries = Vec::new();
    let mut moved = Vec::new();
    for step in &mut steps {
        if step.status == StepStatus::Reserved {
            step.status = StepStatus::Unknown;
            entries.push(entry(
                now,
                actor.clone(),
                Some(&step.name),
                "reserved",
                "unknown",
                Vec::new(),
            ));
            moved.push(step.clone());
        }
    }
    log(t, key, entries, true)?;
    t.store(key, Some(old), new).map_err(OpError::Fatal)?;
    for step in &moved {
        t.store_step(key, step).map_err(OpError::Fatal)?;
    }
    Ok(steps)
}

/// The record `token` holds as a running claim: PROCESSING, lease not
/// ended.
fn running<T: Txn>(
    t: &mut T,
    key: &IdempotencyKey,
    token: u64,
    action: &str,
) -> OpResult<Record, T::Fatal> {
    let now = t.now();
    match super::ops::Ops::get(t, key)? {
        Some(rec) if rec.token == token && rec.state == RecordState::Processing => {
            if rec.lease_until_ms <= now {
                return Err(OpError::Refused(Error::Fenced {
                    key: key.clone(),
                    token,
                    reason: format!("cannot {action}: the claim's lease has ended"),
                }));
            }
            Ok(rec)
        }
        Some(rec) => Err(fenced(key, token, &rec)),
        None => Err(OpError::Refused(Error::Fenced {
            key: key.clone(),
            token,
            reason: format!("cannot {action}: the record is gone (released, purged or expired)"),
        })),
    }
}

/// Applies a claim's confirmation or rejection `f` to `steps` (in
/// memory; nothing is written) and returns the changed step and its log
/// entry. The step must be one `token` reserved and still `Reserved` (or,
/// when `late` — a completion after the lease ended — `Unknown` under the
/// same token: the holder knows the answer).
pub(crate) fn apply_finish(
    key: &IdempotencyKey,
    token: u64,
    steps: &mut [StepRecord],
    f: StepFinish,
    now: u64,
    late: bool,
) -> Result<(StepRecord, HistoryRecord), Error> {
    check_name(&f.name)?;
    check_evidence(key, &f.name, &f.evidence)?;
    let Some(step) = steps.iter_mut().find(|s| s.name == f.name) else {
        return Err(Error::StepNotFound {
            key: key.clone(),
            step: f.name,
        });
    };
    if step.token != token {
        return Err(Error::InvalidState {
            key: key.clone(),
            action: "confirm or reject an effect step this claim did not reserve",
            state: State::Processing,
        });
    }
    let finishable =
        step.status == StepStatus::Reserved || (late && step.status == StepStatus::Unknown);
    if !finishable {
        return Err(Error::StepReused {
            key: key.clone(),
            step: f.name,
        });
    }
    let status = if f.confirmed {
        StepStatus::Confirmed
    } else {
        StepStatus::Failed
    };
    let from = step.status.as_str();
    step.status = status;
    step.evidence = f.evidence;
    step.settled_at_ms = Some(now);
    let e = entry(
        now,
        Actor::Claim { token },
        Some(&step.name),
        from,
        status.as_str(),
        step.evidence.clone(),
    );
    Ok((step.clone(), e))
}

/// Applies `finished` to `steps` in order (in memory); the changed steps
/// and their log entries. The first refusal refuses them all.
pub(crate) fn apply_finishes(
    key: &IdempotencyKey,
    token: u64,
    steps: &mut [StepRecord],
    finished: Vec<StepFinish>,
    now: u64,
    late: bool,
) -> Result<(Vec<StepRecord>, Vec<HistoryRecord>), Error> {
    let mut changed = Vec::new();
    let mut entries = Vec::new();
    for f in finished {
        let (step, e) = apply_finish(key, token, steps, f, now, late)?;
        changed.retain(|s: &StepRecord| s.name != step.name);
        changed.push(step);
        entries.push(e);
    }
    Ok((changed, entries))
}

/// Reserves step `req.name` for the claim `req.token`, after writing the
/// claim's deferred confirmations (`req.finished`) in the same
/// transaction.
pub(crate) fn reserve_step<T: Txn>(t: &mut T, req: StepRequest) -> OpResult<StepRecord, T::Fatal> {
    check_name(&req.name).map_err(OpError::Refused)?;
    let now = t.now();
    let key = &req.key;
    let rec = running(t, key, req.token, "reserve an effect step")?;
    let mut steps = steps_of(t, key)?;
    let (mut changed, mut entries) =
        apply_finishes(key, req.token, &mut steps, req.finished, now, false)
            .map_err(OpError::Refused)?;
    let existing = steps.iter().find(|s| s.name == req.name).cloned();
    let reserved =
        match existing {
            Some(s) if s.token == req.token => {
                return Err(OpError::Refused(Error::StepReused {
                    key: key.clone(),
                    step: req.name,
                }))
            }
            // An earlier claim's call happened (or was refused): skip it.
            Some(s) if matches!(s.status, StepStatus::Confirmed | StepStatus::Failed) => Err(s),
            // Reserved afresh under its first reference.
            Some(s) if s.status == StepStatus::NotExecuted => Ok((
                reservation(s.name, s.reference, req.token, now),
                StepStatus::NotExecuted.as_str(),
            )),
            Some(_) => return Err(OpError::Refused(Error::InvalidState {
                key: key.clone(),
                action:
                    "reserve an effect step whose earlier call is still unknown (settle it first)",
                state: State::Processing,
            })),
            None if steps.len() >= MAX_STEPS_PER_KEY => {
                return Err(OpError::Refused(Error::TooManySteps { key: key.clone() }))
            }
            None => Ok((
                reservation(
                    req.name.clone(),
                    format!("{}/{}", rec.reference, req.name),
                    req.token,
                    now,
                ),
                "",
            )),
        };
    let answer = match reserved {
        Ok((step, from)) => {
            entries.push(entry(
                now,
                Actor::Claim { token: req.token },
                Some(&step.name),
                from,
                "reserved",
                Vec::new(),
            ));
            changed.push(step.clone());
            tracing::debug!(key = %key, token = req.token, step = %step.name, reference = %step.reference, "effect step reserved");
            step
        }
        Err(earlier) => earlier,
    };
    log(t, key, entries, false)?;
    for step in &changed {
        t.store_step(key, step).map_err(OpError::Fatal)?;
    }
    Ok(answer)
}

/// Confirms (`req.confirmed`) or rejects a step the claim reserved.
pub(crate) fn finish_step<T: Txn>(
    t: &mut T,
    req: FinishStepRequest,
) -> OpResult<StepRecord, T::Fatal> {
    let key = &req.key;
    check_evidence(key, &req.name, &req.evidence).map_err(OpError::Refused)?;
    let now = t.now();
    // The claim's holder may still report a call's outcome after its lease
    // ended and the record went UNKNOWN (nobody claimed it since): its own
    // step then settles from Unknown, as a late `complete` carrying the same
    // confirmation does; the record stays UNKNOWN.
    let late = match super::ops::Ops::get(t, key)? {
        Some(rec) if rec.token == req.token && rec.state == RecordState::Processing => false,
        Some(rec) if rec.token == req.token && rec.state == RecordState::Unknown => true,
        Some(rec) => return Err(fenced(key, req.token, &rec)),
        None => return Err(OpError::Refused(Error::Fenced {
            key: key.clone(),
            token: req.token,
            reason:
                "cannot confirm an effect step: the record is gone (released, purged or expired)"
                    .into(),
        })),
    };
    let mut steps = steps_of(t, key)?;
    let finish = StepFinish {
        name: req.name,
        confirmed: req.confirmed,
        evidence: req.evidence,
    };
    let (new, e) =
        apply_finish(key, req.token, &mut steps, finish, now, late).map_err(OpError::Refused)?;
    log(t, key, vec![e], false)?;
    t.store_step(key, &new).map_err(OpError::Fatal)?;
    tracing::debug!(key = %key, token = req.token, step = %new.name, status = new.status.as_str(), "effect step finished");
    Ok(new)
}

/// A resolver's or operator's answer about one step of a record in doubt.
/// A step already settled is returned as it is (nothing written).
pub(crate) fn settle_step<T: Txn>(
    t: &mut T,
    req: SettleStepRequest,
) -> OpResult<StepRecord, T::Fatal> {
    let key = &req.key;
    if let StepAnswer::Executed(evidence) = &req.answer {
        check_evidence(key, &req.name, evidence).map_err(OpError::Refused)?;
    }
    let now = t.now();
    let Some(rec) = super::ops::Ops::get(t, key)? else {
        return Err(OpError::Refused(Error::NotFound { key: key.clone() }));
    };
    let stale = rec.state == RecordState::Processing && rec.lease_until_ms <= now;
    if rec.token != req.token || !(rec.state == RecordState::Unknown || stale) {
        return Err(fenced(key, req.token, &rec));
    }
    if req.answer == StepAnswer::NotExecuted && rec.may_still_run(now) {
        return Err(OpError::Refused(Error::InvalidState {
            key: key.clone(),
            action: "settle an effect step as not executed before the dropped claim's lease ends \
                     (its call may still be running)",
            state: State::from(rec.state),
        }));
    }
    let mut steps = steps_of(t, key)?;
    let Some(at) = steps.iter().position(|s| s.name == req.name) else {
        return Err(OpError::Refused(Error::StepNotFound {
            key: key.clone(),
            step: req.name,
        }));
    };
    // The record is in doubt: a Reserved step's call is unknown.
    let mut entries = Vec::new();
    let mut moved = Vec::new();
    for (i, step) in steps.iter_mut().enumerate() {
        if step.status == StepStatus::Reserved {
            step.status = StepStatus::Unknown;
            if stale {
                entries.push(entry(
                    now,
                    Actor::Sweeper,
                    Some(&step.name),
                    "reserved",
                    "unknown",
                    Vec::new(),
                ));
            }
            if i != at {
                moved.push(step.clone());
            }
        }
    }
    let step = steps.swap_remove(at);
    if step.status.is_settled() {
        return Ok(step);
    }
    let new = match req.answer {
        StepAnswer::Executed(evidence) => StepRecord {
            status: StepStatus::Confirmed,
            evidence,
            settled_at_ms: Some(now),
            last_asked_ms: Some(now),
            ..step
        },
        StepAnswer::NotExecuted => StepRecord {
            status: StepStatus::NotExecuted,
            evidence: Vec::new(),
            settled_at_ms: Some(now),
            last_asked_ms: Some(now),
            ..step
        },
        StepAnswer::StillUnknown => StepRecord {
            attempts: step.attempts.saturating_add(1),
            last_asked_ms: Some(now),
            ..step
        },
    };
    // A resolver's "still unknown" only counts attempts; an operator's
    // leaves a trace with its reason.
    let by_operator = matches!(req.actor, Actor::Operator { .. });
    if new.status != StepStatus::Unknown || by_operator {
        entries.push(entry(
            now,
            req.actor.clone(),
            Some(&new.name),
            "unknown",
            new.status.as_str(),
            new.evidence.clone(),
        ));
    }
    log(t, key, entries, false)?;
    if stale {
        let unknown = rec.in_doubt(rec.stale_reason(), rec.lease_until_ms, now);
        t.store(key, Some(&rec), &unknown).map_err(OpError::Fatal)?;
        if rec.state == RecordState::Processing {
            tracing::warn!(key = %key, token = rec.token, "stale claim moved to UNKNOWN");
        }
    }
    for step in &moved {
        t.store_step(key, step).map_err(OpError::Fatal)?;
    }
    t.store_step(key, &new).map_err(OpError::Fatal)?;
    tracing::info!(key = %key, step = %new.name, status = new.status.as_str(), attempts = new.attempts, "effect step settled");
    Ok(new)
}

/// The summary entry a tombstone keeps of `key`'s log: each step's name
/// and final state, and how many entries were dropped.
pub(crate) fn tombstone_summary(steps: &[StepRecord], dropped: usize) -> Vec<u8> {
    let mut text = String::new();
    for step in steps {
        if !text.is_empty() {
            text.push_str("; ");
        }
        text.push_str(&step.name);
        text.push_str(": ");
        text.push_str(step.status.as_str());
    }
    if !text.is_empty() {
        text.push_str("; ");
    }
    // Writing to a String cannot fail.
    let _ = write!(text, "{dropped} log entries dropped");
    text.into_bytes()
}

/// Turns `key`'s steps and log into the one summary entry a tombstone
/// keeps (nothing when the key had neither).
pub(crate) fn summarize_for_tombstone<T: Txn>(
    t: &mut T,
    key: &IdempotencyKey,
    from: &str,
) -> OpResult<(), T::Fatal> {
    let now = t.now();
    let steps = readable_steps(t, key)?;
    let span = t.history_span(key).map_err(OpError::Fatal)?;
    if steps.is_empty() && span.is_none() {
        return Ok(());
    }
    let dropped = span.map_or(0, |(first, last)| {
        usize::try_from(last.saturating_sub(first))
            .unwrap_or(usize::MAX)
            .saturating_add(1)
    });
    let summary = entry(
        now,
        Actor::Sweeper,
        None,
        from,
        State::Tombstone.as_str(),
        tombstone_summary(&steps, dropped),
    );
    drop_steps(t, key)?;
    let seq = span.map_or(0, |(_, last)| last.saturating_add(1));
    t.append_history(key, &HistoryRecord { seq, ..summary })
        .map_err(OpError::Fatal)
}

/// Step `name` freshly reserved at `now` (ms) by the claim holding `token`,
/// under `reference`: no evidence, no resolver attempts yet.
fn reservation(name: String, reference: String, token: u64, now: u64) -> StepRecord {
    StepRecord {
        name,
        reference,
        status: StepStatus::Reserved,
        token,
        evidence: Vec::new(),
        reserved_at_ms: now,
        settled_at_ms: None,
        attempts: 0,
        last_asked_ms: None,
    }
}
