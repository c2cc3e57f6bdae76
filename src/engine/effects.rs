//! Effect steps of a claim: the cloneable [`Effects`] handle that reserves,
//! confirms and rejects steps, and the views of stored steps and history.

use std::fmt;
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::key::IdempotencyKey;
use crate::state::State;
use crate::step::{Actor, EffectStep, HistoryEntry, StepInfo, StepState};
use crate::store::record::RecordState;
use crate::store::step::{
    check_evidence, check_name, Actor as StoredActor, FinishStepRequest, HistoryRecord, StepRecord,
    StepRequest, StepStatus,
};
use crate::store::{Backend, Pending, Record};

/// The effect-step calls of one claim, as a handle that can be cloned and
/// moved into other tasks (an async handler, a spawned future): what
/// [`crate::Claim::effects`] returns and what the HTTP layer puts into the
/// request extensions next to `ClaimInfo`.
///
/// Each call is one durable write, made with the claim's fencing token: it
/// rides the next group commit and is durable when the call returns. Once
/// the claim is completed, failed or fenced, the calls are refused with
/// [`Error::Fenced`]. The handle holds only a weak link to its engine; after
/// the engine is dropped the calls return [`Error::Closed`].
#[derive(Clone)]
pub struct Effects {
    inner: Arc<Inner>,
}

struct Inner {
    key: IdempotencyKey,
    token: u64,
    store: Weak<dyn Backend>,
}

impl Effects {
    pub(crate) fn new(key: IdempotencyKey, token: u64, store: Weak<dyn Backend>) -> Effects {
        Effects {
            inner: Arc::new(Inner { key, token, store }),
        }
    }

    /// The claim's key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.inner.key
    }

    /// The claim's fencing token.
    pub fn fencing_token(&self) -> u64 {
        self.inner.token
    }

    /// Reserves the step `name` durably before its call is made, or tells
    /// the handler that an earlier attempt's call already has an answer.
    ///
    /// - [`EffectStep::Run`]: the reservation is durable; make the call
    ///   with `reference` as the provider's idempotency key, then
    ///   [`Effects::confirm`] or [`Effects::reject`].
    /// - [`EffectStep::Confirmed`] / [`EffectStep::Failed`]: an earlier
    ///   claim on this key made the call and recorded its answer (or a
    ///   resolver learned it from the provider): skip the call.
    ///
    /// A step an earlier attempt left `NotExecuted` is reserved again under
    /// its old reference (`Run`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidStepName`] (empty, over
    /// [`crate::MAX_STEP_NAME_BYTES`], not printable ASCII, or a `/`);
    /// [`Error::StepReused`] if this claim already reserved `name`;
    /// [`Error::TooManySteps`] past [`crate::MAX_STEPS_PER_KEY`];
    /// [`Error::HistoryFull`]; [`Error::Fenced`] once the claim no longer
    /// owns a PROCESSING record (completed, failed, lease ended and
    /// recovered); [`Error::NotFound`] if the record is gone (expired);
    /// [`Error::Closed`], [`Error::Poisoned`], storage errors. A refused
    /// call writes nothing.
    pub fn effect(&self, name: &str) -> Result<EffectStep> {
        self.reserve(name)
            .wait()
            .and_then(|rec| self.effect_of(rec))
    }

    /// [`Effects::effect`] for async callers: the same write and errors,
    /// awaited without blocking the thread on redb (on PostgreSQL the write
    /// runs on the calling thread before the future is returned).
    ///
    /// # Errors
    ///
    /// As for [`Effects::effect`].
    pub async fn effect_async(&self, name: &str) -> Result<EffectStep> {
        let rec = self.reserve(name).await?;
        self.effect_of(rec)
    }

    /// Records that the provider said yes to the reserved step `name`,
    /// with its answer as `evidence`. Durable before it returns.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidStepName`]; [`Error::EvidenceTooLarge`] over
    /// [`crate::MAX_EVIDENCE_BYTES`]; [`Error::StepNotFound`] if this claim
    /// never reserved `name`; [`Error::InvalidState`] if the step is not
    /// `Reserved` by this claim; [`Error::Fenced`], [`Error::HistoryFull`],
    /// [`Error::Closed`], [`Error::Poisoned`], storage errors. A refused
    /// call writes nothing.
    pub fn confirm(&self, name: &str, evidence: &[u8]) -> Result<()> {
        self.finish(name, true, evidence).wait().map(drop)
    }

    /// [`Effects::confirm`] for async callers.
    ///
    /// # Errors
    ///
    /// As for [`Effects::confirm`].
    pub async fn confirm_async(&self, name: &str, evidence: &[u8]) -> Result<()> {
        self.finish(name, true, evidence).await.map(drop)
    }

    /// Records that the provider said no to the reserved step `name` (a
    /// declined card), with its answer as `evidence`. Durable before it
    /// returns. A failed step is settled: the operation may still complete
    /// (or fail finally) with a response that says so.
    ///
    /// # Errors
    ///
    /// As for [`Effects::confirm`].
    pub fn reject(&self, name: &str, evidence: &[u8]) -> Result<()> {
        self.finish(name, false, evidence).wait().map(drop)
    }

    /// [`Effects::reject`] for async callers.
    ///
    /// # Errors
    ///
    /// As for [`Effects::confirm`].
    pub async fn reject_async(&self, name: &str, evidence: &[u8]) -> Result<()> {
        self.finish(name, false, evidence).await.map(drop)
    }

    fn store(&self) -> Result<Arc<dyn Backend>> {
        self.inner.store.upgrade().ok_or(Error::Closed)
    }

    fn reserve(&self, name: &str) -> Pending<StepRecord> {
        let checked = check_name(name).and_then(|()| self.store());
        match checked {
            Ok(store) => store.reserve_step_pending(StepRequest {
                key: self.inner.key.clone(),
                token: self.inner.token,
                name: name.to_string(),
            }),
            Err(e) => Pending::ready(Err(e)),
        }
    }

    fn finish(&self, name: &str, confirmed: bool, evidence: &[u8]) -> Pending<StepRecord> {
        let checked = check_name(name)
            .and_then(|()| check_evidence(&self.inner.key, name, evidence))
            .and_then(|()| self.store());
        match checked {
            Ok(store) => store.finish_step_pending(FinishStepRequest {
                key: self.inner.key.clone(),
                token: self.inner.token,
                name: name.to_string(),
                confirmed,
                evidence: evidence.to_vec(),
            }),
            Err(e) => Pending::ready(Err(e)),
        }
    }

    /// What a reservation's stored step means to the handler.
    fn effect_of(&self, rec: StepRecord) -> Result<EffectStep> {
        let StepRecord {
            reference,
            status,
            evidence,
            ..
        } = rec;
        match status {
            StepStatus::Reserved => Ok(EffectStep::Run { reference }),
            StepStatus::Confirmed => Ok(EffectStep::Confirmed {
                reference,
                evidence,
            }),
            StepStatus::Failed => Ok(EffectStep::Failed {
                reference,
                evidence,
            }),
            // The store hands out a reservation, or an earlier answer;
            // anything else would be a store bug, refused rather than run.
            StepStatus::Unknown | StepStatus::NotExecuted => Err(Error::InvalidState {
                key: self.inner.key.clone(),
                action: "reserve an effect step that is in doubt",
                state: State::Unknown,
            }),
        }
    }
}

impl fmt::Debug for Effects {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Effects")
            .field("key", &self.inner.key)
            .field("fencing_token", &self.inner.token)
            .finish()
    }
}

/// A stored step as users see it at `now_ms`. Read-time truth: a step
/// `Reserved` under a claim that no longer holds a live lease on the
/// record (`record`: the key's record as read with the steps) is reported
/// as `Unknown`, as a sweep would store it.
pub(crate) fn step_info(record: Option<&Record>, rec: StepRecord, now_ms: u64) -> StepInfo {
    let claim = record.map(|r| {
        let live = r.state == RecordState::Processing && r.lease_until_ms > now_ms;
        (r.token, live)
    });
    let rec = rec.as_seen(claim);
    let state = state_of(rec.status);
    let evidence =
        matches!(state, StepState::Confirmed | StepState::Failed).then_some(rec.evidence);
    StepInfo {
        name: rec.name,
        reference: rec.reference,
        state,
        evidence,
        reserved_at_ms: rec.reserved_at_ms,
        settled_at_ms: rec.settled_at_ms,
        attempts: rec.attempts,
        age: Duration::from_millis(now_ms.saturating_sub(rec.reserved_at_ms)),
    }
}

pub(crate) fn state_of(status: StepStatus) -> StepState {
    match status {
        StepStatus::Reserved => StepState::Reserved,
        StepStatus::Confirmed => StepState::Confirmed,
        StepStatus::Failed => StepState::Failed,
        StepStatus::Unknown => StepState::Unknown,
        StepStatus::NotExecuted => StepState::NotExecuted,
    }
}

/// The views of a key's stored steps at `now_ms`.
pub(crate) fn step_infos(
    record: Option<&Record>,
    steps: Vec<StepRecord>,
    now_ms: u64,
) -> Vec<StepInfo> {
    steps
        .into_iter()
        .map(|s| step_info(record, s, now_ms))
        .collect()
}

/// A stored history entry as users see it.
pub(crate) fn history_entry(rec: HistoryRecord) -> HistoryEntry {
    HistoryEntry {
        seq: rec.seq,
        at_ms: rec.at_ms,
        actor: actor_of(rec.actor),
        step: rec.step,
        from: rec.from,
        to: rec.to,
        evidence: rec.evidence,
    }
}

fn actor_of(actor: StoredActor) -> Actor {
    match actor {
        StoredActor::Claim { token } => Actor::Claim {
            fencing_token: token,
        },
        StoredActor::Resolver => Actor::Resolver,
        StoredActor::Operator { reason } => Actor::Operator { reason },
        StoredActor::Sweeper => Actor::Sweeper,
    }
}
