//! Effect steps of a claim: the cloneable [`Effects`] handle that reserves,
//! confirms and rejects steps, and the views of stored steps and history.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::key::IdempotencyKey;
use crate::state::State;
use crate::step::{Actor, EffectStep, HistoryEntry, StepInfo, StepState};
use crate::store::record::RecordState;
use crate::store::step::{
    check_evidence, check_name, Actor as StoredActor, FinishStepRequest, HistoryRecord, StepFinish,
    StepRecord, StepRequest, StepStatus,
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
    /// Confirmations and rejections waiting for the claim's next write.
    deferred: Mutex<Vec<StepFinish>>,
    /// Steps this handle reserved (`Run`) and has not finished yet.
    running: Mutex<Vec<String>>,
}

impl Effects {
    pub(crate) fn new(key: IdempotencyKey, token: u64, store: Weak<dyn Backend>) -> Effects {
        Effects {
            inner: Arc::new(Inner {
                key,
                token,
                store,
                deferred: Mutex::new(Vec::new()),
                running: Mutex::new(Vec::new()),
            }),
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
        let (pending, sent) = self.reserve(name);
        let rec = pending.wait();
        self.sent(&sent, rec.is_ok());
        self.effect_of(rec?)
    }

    /// [`Effects::effect`] for async callers: the same write and errors,
    /// awaited without blocking the thread on redb (on PostgreSQL the write
    /// runs on the calling thread before the future is returned).
    ///
    /// # Errors
    ///
    /// As for [`Effects::effect`].
    pub async fn effect_async(&self, name: &str) -> Result<EffectStep> {
        let (pending, sent) = self.reserve(name);
        let rec = pending.await;
        self.sent(&sent, rec.is_ok());
        self.effect_of(rec?)
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
        self.finish(name, true, evidence).wait()?;
        self.take_running(name);
        Ok(())
    }

    /// [`Effects::confirm`] for async callers.
    ///
    /// # Errors
    ///
    /// As for [`Effects::confirm`].
    pub async fn confirm_async(&self, name: &str, evidence: &[u8]) -> Result<()> {
        self.finish(name, true, evidence).await?;
        self.take_running(name);
        Ok(())
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
        self.finish(name, false, evidence).wait()?;
        self.take_running(name);
        Ok(())
    }

    /// [`Effects::reject`] for async callers.
    ///
    /// # Errors
    ///
    /// As for [`Effects::confirm`].
    pub async fn reject_async(&self, name: &str, evidence: &[u8]) -> Result<()> {
        self.finish(name, false, evidence).await?;
        self.take_running(name);
        Ok(())
    }

    /// Records that the provider said yes to the reserved step `name`, to
    /// be written with the claim's next write: the next
    /// [`Effects::effect`] or the claim's completion
    /// ([`crate::Engine::complete`], `fail` with `Failure::Final`), in the
    /// same transaction. It saves the confirmation's own commit wait: a
    /// request with two steps waits for 4 commits (`begin`, two `effect`s,
    /// `complete`) instead of 6.
    ///
    /// Until that write the confirmation is not durable. If the process
    /// dies first, or the claim fails in doubt or is dropped, the step is
    /// left `Reserved` and becomes `Unknown` with its claim: it is then
    /// settled by asking its provider (never by calling again), as any
    /// step whose answer was lost. Use [`Effects::confirm`] when the
    /// evidence must be on disk before going on.
    ///
    /// # Errors
    ///
    /// Checked now, without a write: [`Error::InvalidStepName`],
    /// [`Error::EvidenceTooLarge`], [`Error::StepReused`] if `name` is
    /// already waiting. The rest ([`Error::StepNotFound`] for a step this
    /// claim never reserved, ...) refuses the write that carries it, which
    /// then writes nothing.
    pub fn confirm_deferred(&self, name: &str, evidence: &[u8]) -> Result<()> {
        self.defer(name, true, evidence)
    }

    /// [`Effects::confirm_deferred`] for a provider that said no: the step
    /// becomes `Failed` with the claim's next write.
    ///
    /// # Errors
    ///
    /// As for [`Effects::confirm_deferred`].
    pub fn reject_deferred(&self, name: &str, evidence: &[u8]) -> Result<()> {
        self.defer(name, false, evidence)
    }

    fn defer(&self, name: &str, confirmed: bool, evidence: &[u8]) -> Result<()> {
        check_name(name)?;
        check_evidence(&self.inner.key, name, evidence)?;
        // Only a step this handle reserved and has not finished: anything
        // else would make the claim's next write refuse.
        if !self.take_running(name) {
            return Err(Error::StepNotFound {
                key: self.inner.key.clone(),
                step: name.to_string(),
            });
        }
        self.deferred().push(StepFinish {
            name: name.to_string(),
            confirmed,
            evidence: evidence.to_vec(),
        });
        Ok(())
    }

    /// Whether this handle reserved `name` (a `Run` answer) and has not
    /// finished it; forgets it.
    fn take_running(&self, name: &str) -> bool {
        let mut running = self
            .inner
            .running
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let was = running.iter().any(|n| n == name);
        running.retain(|n| n != name);
        was
    }

    fn deferred(&self) -> std::sync::MutexGuard<'_, Vec<StepFinish>> {
        // The list is only pushed to and drained; a panic elsewhere leaves
        // it whole.
        self.inner
            .deferred
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The deferred finishes to send with the claim's completion (taken:
    /// the claim ends with that write, whatever its answer).
    pub(crate) fn take_deferred(&self) -> Vec<StepFinish> {
        std::mem::take(&mut *self.deferred())
    }

    /// After a write that carried `sent`: once it is durable they are no
    /// longer waiting; a refused write leaves them waiting.
    fn sent(&self, sent: &[StepFinish], durable: bool) {
        if durable && !sent.is_empty() {
            self.deferred().retain(|f| !sent.contains(f));
        }
    }

    fn store(&self) -> Result<Arc<dyn Backend>> {
        self.inner.store.upgrade().ok_or(Error::Closed)
    }

    /// The reservation's write, carrying the deferred finishes (returned
    /// beside it, to be dropped from the list once it is durable).
    fn reserve(&self, name: &str) -> (Pending<StepRecord>, Vec<StepFinish>) {
        let checked = check_name(name).and_then(|()| self.store());
        match checked {
            Ok(store) => {
                let sent = self.deferred().clone();
                let pending = store
                    .reserve_step_pending(StepRequest {
                        key: self.inner.key.clone(),
                        token: self.inner.token,
                        name: name.to_string(),
                        finished: sent.clone(),
                    })
                    .naming(&self.inner.key, Some(name));
                (pending, sent)
            }
            Err(e) => (Pending::ready(Err(e)), Vec::new()),
        }
    }

    fn finish(&self, name: &str, confirmed: bool, evidence: &[u8]) -> Pending<StepRecord> {
        let waiting = || {
            if self.deferred().iter().any(|f| f.name == name) {
                Err(Error::StepReused {
                    key: self.inner.key.clone(),
                    step: name.to_string(),
                })
            } else {
                Ok(())
            }
        };
        let checked = check_name(name)
            .and_then(|()| check_evidence(&self.inner.key, name, evidence))
            .and_then(|()| waiting())
            .and_then(|()| self.store());
        match checked {
            Ok(store) => store
                .finish_step_pending(FinishStepRequest {
                    key: self.inner.key.clone(),
                    token: self.inner.token,
                    name: name.to_string(),
                    confirmed,
                    evidence: evidence.to_vec(),
                })
                .naming(&self.inner.key, Some(name)),
            Err(e) => Pending::ready(Err(e)),
        }
    }

    /// What a reservation's stored step means to the handler.
    fn effect_of(&self, rec: StepRecord) -> Result<EffectStep> {
        let StepRecord {
            name,
            reference,
            status,
            evidence,
            ..
        } = rec;
        match status {
            StepStatus::Reserved => {
                self.inner
                    .running
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(name);
                Ok(EffectStep::Run { reference })
            }
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
