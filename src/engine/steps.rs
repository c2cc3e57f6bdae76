//! Settling an in-doubt key with effect steps, step by step.
//!
//! A key whose attempt died with steps is never settled as a whole: each
//! step that is not settled (`Unknown`, or `Reserved` under a claim that
//! ended) is put to the per-step resolver registered for its name
//! (`EngineBuilder::step_resolver`), else to `Resolver::resolve_step`, and
//! the answer is stored with a history entry. While any step stays
//! unsettled the key stays in doubt (`begin` answers `InDoubt`, never
//! `Claimed`). Once all are settled, the key either completes from the
//! steps' evidence (`Resolver::complete_from_steps`) or resumes: it is
//! released with its steps kept, and the next claim sees them.

use std::time::Duration;

use crate::engine::begin::Begin;
use crate::engine::core::Core;
use crate::engine::effects::step_infos;
use crate::engine::wait::block_on;
use crate::error::{Error, Result};
use crate::key::IdempotencyKey;
use crate::outcome::InDoubt;
use crate::resolver::{Resolution, Resolver};
use crate::step::{InDoubtStep, StepInfo, StepResolution, MAX_EVIDENCE_BYTES};
use crate::store::record::RecordState;
use crate::store::step::{Actor, SettleStepRequest, StepAnswer, StepRecord};
use crate::store::{ClaimRequest, Found, Record, SettleRequest, Settled, Settlement};

/// What settling a key's steps came to.
pub(crate) enum StepsSettled {
    /// Some step is still unsettled: the key stays in doubt.
    InDoubt(InDoubt),
    /// Every step is settled: store this for the key.
    Settle(Settlement),
}

impl Core {
    /// The record's claim for reading its steps at `now_ms`: its token, and
    /// whether its lease still runs on a PROCESSING record.
    pub(crate) fn claim_of(record: &Record, now_ms: u64) -> (u64, bool) {
        let live = record.state == RecordState::Processing && record.lease_until_ms > now_ms;
        (record.token, live)
    }

    /// `begin`'s path for an in-doubt key with steps whose claim can no
    /// longer run: settles its steps, then answers. `None`: another settler
    /// won the race; look again.
    pub(crate) async fn settle_steps_in_begin(
        &self,
        key: &IdempotencyKey,
        found: &Found,
        steps: Vec<StepRecord>,
        claim: ClaimRequest,
    ) -> Result<Option<Begin>> {
        let record = &found.record;
        let resolver = self.cfg.resolver.as_deref();
        let (settled, asked) = match self.settle_steps_async(key, record, steps, resolver).await {
            Ok(done) => done,
            Err(Error::Fenced { .. } | Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let now_ms = self.clock.now_ms();
        let req = match self.key_settlement(key, record, settled, resolver, now_ms)? {
            StepsSettled::InDoubt(in_doubt) => {
                self.counters.in_doubt_answers.add(1);
                return Ok(Some(Begin::InDoubt(in_doubt)));
            }
            StepsSettled::Settle(settlement) => SettleRequest {
                key: key.clone(),
                token: record.token,
                settlement,
                actor: if asked {
                    Actor::Resolver
                } else {
                    Actor::Sweeper
                },
            },
        };
        let c = &self.counters;
        match self.store.settle_then_claim_pending(req, claim).await {
            Ok(Settled::Completed(record)) => {
                c.resolved.add(1);
                c.replays.add(1);
                Ok(Some(Begin::Replay(self.replay(key, record)?)))
            }
            Ok(Settled::NotExecuted(claimed)) => {
                c.resolved.add(1);
                tracing::info!(key = %key, token = claimed.token, "in-doubt key resumed: its steps are settled");
                Ok(Some(Begin::Claimed(self.claim(key, claimed))))
            }
            Ok(Settled::StillInDoubt(record)) => {
                c.in_doubt_answers.add(1);
                let steps = self.store.steps(key)?;
                let infos = step_infos(Some(&record), steps, now_ms);
                Ok(Some(Begin::InDoubt(Self::in_doubt_of(
                    key.clone(),
                    &record,
                    infos,
                    now_ms,
                ))))
            }
            Err(Error::Fenced { .. } | Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Puts each unsettled step of the in-doubt `record` to its resolver
    /// and stores the answers. Returns the steps afterwards and whether any
    /// resolver was asked.
    ///
    /// # Errors
    ///
    /// `Fenced` / `NotFound` when the record changed meanwhile; storage
    /// errors.
    pub(crate) fn settle_steps(
        &self,
        key: &IdempotencyKey,
        record: &Record,
        steps: Vec<StepRecord>,
        resolver: Option<&dyn Resolver>,
    ) -> Result<(Vec<StepRecord>, bool)> {
        block_on(self.settle_steps_async(key, record, steps, resolver))
    }

    /// [`Core::settle_steps`], the one implementation: each answer's write
    /// is awaited (on redb the writer's reply wakes the task), so
    /// `begin_async` never holds a runtime worker for a commit. (The
    /// resolvers themselves are called inline, as everywhere.)
    pub(crate) async fn settle_steps_async(
        &self,
        key: &IdempotencyKey,
        record: &Record,
        steps: Vec<StepRecord>,
        resolver: Option<&dyn Resolver>,
    ) -> Result<(Vec<StepRecord>, bool)> {
        let now_ms = self.clock.now_ms();
        let claim = Self::claim_of(record, now_ms);
        let mut out = Vec::with_capacity(steps.len());
        let mut asked = false;
        for step in steps {
            let step = step.as_seen(Some(claim));
            if step.status.is_settled() {
                out.push(step);
                continue;
            }
            let Some(answer) = self.ask_step(key, record, &step, resolver, now_ms) else {
                out.push(step);
                continue;
            };
            asked = true;
            let settled = self
                .store
                .settle_step_pending(SettleStepRequest {
                    key: key.clone(),
                    token: record.token,
                    name: step.name.clone(),
                    answer,
                    actor: Actor::Resolver,
                })
                .naming(key, Some(&step.name));
            out.push(settled.await?);
        }
        Ok((out, asked))
    }

    /// The answer about one unsettled step: from the per-step resolver for
    /// its name, else `resolver`; `None` when neither exists.
    fn ask_step(
        &self,
        key: &IdempotencyKey,
        record: &Record,
        step: &StepRecord,
        resolver: Option<&dyn Resolver>,
        now_ms: u64,
    ) -> Option<StepAnswer> {
        let question = InDoubtStep {
            key: key.clone(),
            operation_reference: record.reference.clone(),
            name: step.name.clone(),
            reference: step.reference.clone(),
            attempts: step.attempts,
            age: Duration::from_millis(now_ms.saturating_sub(step.reserved_at_ms)),
        };
        let resolution = if let Some(per_step) = self.cfg.step_resolvers.get(&step.name) {
            per_step(&question)
        } else {
            resolver?.resolve_step(&question)
        };
        Some(match resolution {
            StepResolution::Executed(evidence) if evidence.len() > MAX_EVIDENCE_BYTES => {
                // One bad answer must not settle the step wrongly or stop
                // the others: it counts as "still unknown".
                tracing::error!(key = %key, step = %step.name, bytes = evidence.len(), "resolver's evidence is over the bound; step stays unknown");
                StepAnswer::StillUnknown
            }
            StepResolution::Executed(evidence) => StepAnswer::Executed(evidence),
            StepResolution::NotExecuted => StepAnswer::NotExecuted,
            StepResolution::StillUnknown => StepAnswer::StillUnknown,
        })
    }

    /// What the key comes to once its steps are as `steps` says: still in
    /// doubt (some step unsettled), completed from the steps' evidence (the
    /// resolver's `complete_from_steps`), or resumed.
    pub(crate) fn key_settlement(
        &self,
        key: &IdempotencyKey,
        record: &Record,
        steps: Vec<StepRecord>,
        resolver: Option<&dyn Resolver>,
        now_ms: u64,
    ) -> Result<StepsSettled> {
        let all_settled = steps.iter().all(|s| s.status.is_settled());
        let infos: Vec<StepInfo> = step_infos(Some(record), steps, now_ms);
        let in_doubt = Self::in_doubt_of(key.clone(), record, infos, now_ms);
        if !all_settled {
            return Ok(StepsSettled::InDoubt(in_doubt));
        }
        let completed = resolver.and_then(|r| r.complete_from_steps(&in_doubt, &in_doubt.steps));
        Ok(StepsSettled::Settle(match completed {
            Some(envelope) => self.settlement(key, Resolution::Completed(envelope))?,
            None => Settlement::Resume,
        }))
    }
}
