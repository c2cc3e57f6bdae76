//! The engine core: the store behind its seam, the settings, the clock and
//! the counters, plus the logic every feature shares: claiming, the one
//! mapping from a stored record to what `begin` answers, replays, and
//! ending claims.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::clock::Clock;
use crate::engine::begin::Begin;
use crate::engine::claim::Claim;
use crate::engine::config::Config;
use crate::engine::early::Asked;
use crate::engine::effects::step_infos;
use crate::engine::wait::block_on;
use crate::envelope::Envelope;
use crate::error::{Corrupted, Error, Result, ReturnedClaim};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::message::OutgoingMessage;
use crate::outcome::{InDoubt, Replay, ReplayKind};
use crate::report::SweepCounts;
use crate::resolver::{Resolution, Resolver};
use crate::step::StepInfo;
use crate::store::classify::{classify, Class};
use crate::store::record::RecordState;
use crate::store::step::Actor;
use crate::store::{
    Abandon, Backend, ClaimRequest, ClaimResult, Claimed, CompleteRequest, Completion, Found, Held,
    InDoubtRequest, Pending, ReadOrClaim, Record, SettleRequest, Settled, Settlement,
    StoredResponse,
};

/// One counter since the engine was opened, also exported through the
/// `metrics` facade under `name` (any installed recorder picks it up; with
/// none installed the export is a no-op).
#[derive(Debug)]
pub(crate) struct Counter {
    name: &'static str,
    value: AtomicU64,
}

impl Counter {
    const fn new(name: &'static str) -> Counter {
        Counter {
            name,
            value: AtomicU64::new(0),
        }
    }

    pub(crate) fn add(&self, by: u64) {
        if by > 0 {
            self.value.fetch_add(by, Ordering::Relaxed);
            metrics::counter!(self.name).increment(by);
        }
    }

    pub(crate) fn get(&self) -> u64 {
        self.value.load(Ordering::Relaxed)
    }
}

/// Counters since the engine was opened. The metric names are listed in
/// `docs/metrics.md`.
#[derive(Debug)]
pub(crate) struct Counters {
    pub(crate) claims: Counter,
    pub(crate) replays: Counter,
    pub(crate) mismatches: Counter,
    pub(crate) processing_answers: Counter,
    pub(crate) in_doubt_answers: Counter,
    pub(crate) tombstone_answers: Counter,
    pub(crate) moved_to_unknown: Counter,
    pub(crate) resolved: Counter,
    pub(crate) expired_deleted: Counter,
    pub(crate) tombstoned: Counter,
}

impl Default for Counters {
    fn default() -> Counters {
        Counters {
            claims: Counter::new("idempotency_claims_total"),
            replays: Counter::new("idempotency_replays_total"),
            mismatches: Counter::new("idempotency_mismatches_total"),
            processing_answers: Counter::new("idempotency_processing_answers_total"),
            in_doubt_answers: Counter::new("idempotency_in_doubt_answers_total"),
            tombstone_answers: Counter::new("idempotency_tombstone_answers_total"),
            moved_to_unknown: Counter::new("idempotency_moved_to_unknown_total"),
            resolved: Counter::new("idempotency_resolved_total"),
            expired_deleted: Counter::new("idempotency_expired_deleted_total"),
            tombstoned: Counter::new("idempotency_tombstoned_total"),
        }
    }
}

/// State shared by the engine handle, its features and the sweeper.
pub(crate) struct Core {
    pub(crate) store: Arc<dyn Backend>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) cfg: Config,
    pub(crate) counters: Counters,
    /// When the resolver may next be asked about each dropped claim.
    pub(crate) asked: Asked,
}

impl Core {
    /// Claims `key`, or answers what holds it (see `Engine::begin`),
    /// parking this thread while a write commits.
    pub(crate) fn begin(
        &self,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        lease_ms: u64,
    ) -> Result<Begin> {
        block_on(self.begin_async(key, fingerprint, lease_ms))
    }

    /// `begin`, the one implementation: reads run at once on the polling
    /// thread, writes are awaited (the writer's reply wakes the task). A
    /// claim committed after this future was dropped is released by the
    /// store (see `Backend::claim_pending`).
    pub(crate) async fn begin_async(
        &self,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        lease_ms: u64,
    ) -> Result<Begin> {
        self.begin_unnamed(key, fingerprint, lease_ms)
            .await
            .map_err(|e| e.naming(key, None))
    }

    /// `begin_async` before a write error below it is given the key.
    async fn begin_unnamed(
        &self,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        lease_ms: u64,
    ) -> Result<Begin> {
        // No poison check here: a held key is answered from a read, which
        // works on a poisoned engine (replays go on while writes are
        // refused); a claim is a write, which the store refuses.
        // Built only for a write: a replay never copies the key.
        let claim = || ClaimRequest {
            key: key.clone(),
            fingerprint,
            lease_ms: lease_ms.max(1),
        };
        // Settling an in-doubt record can race with another settler; each
        // lost race looks again. Four rounds is plenty in practice.
        for _ in 0..4 {
            // A snapshot read answers most repeats without the writer.
            let now_ms = self.clock.now_ms();
            // Without a networked backend the only answer is a read.
            #[cfg_attr(
                not(any(feature = "postgres", feature = "redis")),
                allow(clippy::infallible_destructuring_match)
            )]
            let read = match self.store.read_or_claim(key, &claim)? {
                #[cfg(any(feature = "postgres", feature = "redis"))]
                ReadOrClaim::Claimed(claimed) => {
                    return Ok(Begin::Claimed(self.claim(key, claimed)))
                }
                ReadOrClaim::Read(read) => read,
            };
            let seen = match read.map(|record| {
                let class = classify(&record, &fingerprint, now_ms, self.cfg.store.expiry);
                (record, class)
            }) {
                Some((record, Class::Held(held))) => {
                    // Only a record in doubt needs its steps (one more
                    // read); a replay or a processing answer does not.
                    let steps = if matches!(held, Held::InDoubt) {
                        self.store.steps(key)?
                    } else {
                        Vec::new()
                    };
                    Some(Found {
                        record,
                        held,
                        now_ms,
                        steps,
                    })
                }
                _ => None,
            };
            let found = match seen {
                Some(found) => found,
                None => match self.store.claim_pending(claim()).await? {
                    ClaimResult::Claimed(claimed) => {
                        return Ok(Begin::Claimed(self.claim(key, claimed)))
                    }
                    ClaimResult::Held(found) => *found,
                },
            };
            match (&self.cfg.resolver, found.held) {
                // A key with effect steps is settled step by step, once
                // its claim can no longer run (with or without a resolver:
                // steps an operator settled resume the key).
                (_, Held::InDoubt)
                    if !found.steps.is_empty() && !found.record.may_still_run(found.now_ms) =>
                {
                    let steps = found.steps.clone();
                    if let Some(answer) = self
                        .settle_steps_in_begin(key, &found, steps, claim())
                        .await?
                    {
                        return Ok(answer);
                    }
                }
                (Some(resolver), Held::InDoubt) if found.steps.is_empty() => {
                    // A dropped claim whose lease still runs: only a
                    // positive answer settles it now (`engine/early.rs`).
                    let settled = if found.record.may_still_run(found.now_ms) {
                        self.settle_early(key, &found, &**resolver, claim()).await?
                    } else {
                        self.settle_in_begin(key, &found.record, &**resolver, claim())
                            .await?
                    };
                    if let Some(answer) = settled {
                        return Ok(answer);
                    }
                }
                _ => return self.answer(key, found),
            }
        }
        Ok(Begin::Processing {
            retry_after: Duration::from_millis(1),
        })
    }

    /// The one mapping from a held record to what `begin` answers, used by
    /// `begin`, local writes and the inbox. Reads no clock: `found.now_ms`
    /// is the instant the record was classified at. (On an engine with a
    /// resolver, `begin` first asks it about an in-doubt record: see
    /// [`Core::settle_in_begin`], and [`Core::settle_early`] for a dropped
    /// claim whose lease still runs.)
    pub(crate) fn answer(&self, key: &IdempotencyKey, found: Found) -> Result<Begin> {
        let c = &self.counters;
        let Found {
            record,
            held,
            now_ms,
            steps,
        } = found;
        Ok(match held {
            Held::Mismatch => {
                c.mismatches.add(1);
                tracing::info!(key = %key, "fingerprint mismatch");
                Begin::Mismatch
            }
            Held::Processing { retry_after_ms } => {
                c.processing_answers.add(1);
                Begin::Processing {
                    retry_after: Duration::from_millis(retry_after_ms.max(1)),
                }
            }
            Held::Done => {
                c.replays.add(1);
                Begin::Replay(self.replay(key, record)?)
            }
            Held::Tombstoned {
                expired_at_ms,
                reusable_at_ms,
            } => {
                c.tombstone_answers.add(1);
                Begin::Tombstoned {
                    expired_at_ms,
                    reusable_at_ms,
                }
            }
            // One rule for every dropped claim, with or without a resolver:
            // its work may still be running until its lease ends, so until
            // then the key is processing; after that it is in doubt.
            Held::InDoubt if record.may_still_run(now_ms) => {
                c.processing_answers.add(1);
                Begin::Processing {
                    retry_after: Duration::from_millis(
                        record.lease_until_ms.saturating_sub(now_ms).max(1),
                    ),
                }
            }
            Held::InDoubt => {
                c.in_doubt_answers.add(1);
                let steps = step_infos(Some(&record), steps, now_ms);
                Begin::InDoubt(Self::in_doubt_of(key.clone(), &record, steps, now_ms))
            }
        })
    }

    /// Asks the resolver about an in-doubt record whose lease has ended and
    /// stores its answer.
    async fn settle_in_begin(
        &self,
        key: &IdempotencyKey,
        record: &Record,
        resolver: &dyn Resolver,
        claim: ClaimRequest,
    ) -> Result<Option<Begin>> {
        let now_ms = self.clock.now_ms();
        let in_doubt = Self::in_doubt_of(key.clone(), record, Vec::new(), now_ms);
        let settlement = self.settlement(key, resolver.resolve(&in_doubt))?;
        let req = SettleRequest {
            key: key.clone(),
            token: record.token,
            settlement,
            actor: Actor::Resolver,
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
                Ok(Some(Begin::Claimed(self.claim(key, claimed))))
            }
            Ok(Settled::StillInDoubt(record)) => {
                c.in_doubt_answers.add(1);
                Ok(Some(Begin::InDoubt(Self::in_doubt_of(
                    key.clone(),
                    &record,
                    Vec::new(),
                    now_ms,
                ))))
            }
            Err(Error::Fenced { .. } | Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// A claim handle for what the store recorded.
    pub(crate) fn claim(&self, key: &IdempotencyKey, mut claimed: Claimed) -> Claim {
        self.counters.claims.add(1);
        let now_ms = self.clock.now_ms();
        // The claim's own record is PROCESSING under it: earlier steps are
        // settled ones (never reserved by this claim yet).
        let steps = step_infos(None, std::mem::take(&mut claimed.steps), now_ms);
        Claim::new(key.clone(), claimed, steps, Arc::downgrade(&self.store))
    }

    /// The replay of a COMPLETED or `FINAL_FAILURE` record, through the app's
    /// upcasters.
    pub(crate) fn replay(&self, key: &IdempotencyKey, rec: Record) -> Result<Replay> {
        let kind = if rec.state == RecordState::FinalFailure {
            ReplayKind::FinalFailure
        } else {
            ReplayKind::Completed
        };
        let resp = rec.response.ok_or_else(|| Error::Corrupt {
            what: Corrupted::Record(key.clone()),
            reason: "completed record has no stored response".into(),
        })?;
        let (stored, resource) = resp.into_envelope();
        let stored_schema_version = stored.schema_version;
        let (envelope, is_current) =
            self.cfg
                .upcasters
                .apply(stored)
                .map_err(|(from, reason)| Error::Upcast {
                    key: key.clone(),
                    from,
                    reason,
                })?;
        Ok(Replay {
            envelope,
            is_current,
            stored_schema_version,
            resource,
            kind,
            completed_at_ms: rec.updated_at_ms,
            reference: rec.reference,
        })
    }

    /// What a resolver or operator is told about an in-doubt record (with
    /// its steps, as seen at `now_ms`), read at `now_ms`.
    pub(crate) fn in_doubt_of(
        key: IdempotencyKey,
        rec: &Record,
        steps: Vec<StepInfo>,
        now_ms: u64,
    ) -> InDoubt {
        // A PROCESSING record whose lease ended is in doubt since its lease
        // end, before any sweep moves it.
        let (since, reason) = if rec.state == RecordState::Unknown {
            (rec.unknown_since_ms, rec.reason.clone())
        } else {
            (rec.lease_until_ms, rec.stale_reason())
        };
        InDoubt {
            key,
            reference: rec.reference.clone(),
            fencing_token: rec.token,
            attempts: rec.attempts,
            claimed_at_ms: rec.claimed_at_ms,
            unknown_since_ms: since,
            age: Duration::from_millis(now_ms.saturating_sub(since)),
            resolvable_at_ms: rec.lease_until_ms,
            reason,
            steps,
        }
    }

    /// Checks a resolution (a completed response must fit the size limit).
    pub(crate) fn settlement(
        &self,
        key: &IdempotencyKey,
        resolution: Resolution,
    ) -> Result<Settlement> {
        Ok(match resolution {
            Resolution::Completed(envelope) => {
                let size = envelope.size_bytes();
                self.check_size(key, size)?;
                Settlement::Completed(StoredResponse::new(envelope, None))
            }
            Resolution::NotExecuted => Settlement::NotExecuted,
            Resolution::StillInDoubt => Settlement::StillInDoubt,
        })
    }

    /// `Error::ResponseTooLarge` for a response of `size` bytes over the
    /// limit.
    pub(crate) fn check_size(&self, key: &IdempotencyKey, size: usize) -> Result<()> {
        let limit = self.cfg.store.max_response_bytes;
        if size > limit {
            return Err(Error::ResponseTooLarge {
                key: key.clone(),
                size,
                limit,
                claim: None,
            });
        }
        Ok(())
    }

    /// Whether `claim` was issued by this engine.
    pub(crate) fn own_claim(&self, claim: Claim) -> Result<Claim> {
        if claim.issued_by(&self.store) {
            Ok(claim)
        } else {
            Err(Error::ForeignClaim {
                key: claim.key().clone(),
            })
        }
    }

    /// Submits a claim's outcome; the answer comes when it is durable. A
    /// response over the size limit is checked before the claim is used:
    /// the claim comes back inside `Error::ResponseTooLarge`, untouched, so
    /// the caller can store a smaller answer (the record stays
    /// PROCESSING).
    pub(crate) fn finish(
        &self,
        claim: Claim,
        completion: Completion,
        envelope: Envelope,
        resource: Option<String>,
        messages: Vec<OutgoingMessage>,
    ) -> Pending<()> {
        match self.finish_checked(claim, completion, envelope, resource, messages) {
            Ok(pending) => pending,
            Err(e) => Pending::ready(Err(e)),
        }
    }

    fn finish_checked(
        &self,
        claim: Claim,
        completion: Completion,
        envelope: Envelope,
        resource: Option<String>,
        messages: Vec<OutgoingMessage>,
    ) -> Result<Pending<()>> {
        let mut claim = self.own_claim(claim)?;
        // Everything one completion stores: its journal frame must stay
        // far below 4 GiB whatever the caller passes.
        let size = messages
            .iter()
            .map(|m| m.topic.len().saturating_add(m.payload.len()))
            .fold(envelope.size_bytes(), usize::saturating_add)
            .saturating_add(resource.as_ref().map_or(0, String::len));
        let limit = self.cfg.store.max_response_bytes;
        if size > limit {
            return Err(Error::ResponseTooLarge {
                key: claim.key().clone(),
                size,
                limit,
                claim: Some(ReturnedClaim::new(claim)),
            });
        }
        let finished = claim.take_deferred();
        let (key, token) = claim.finish();
        let named = key.clone();
        Ok(self
            .store
            .complete_pending(CompleteRequest {
                key,
                token,
                completion,
                response: StoredResponse::new(envelope, resource),
                messages,
                finished,
            })
            .naming(&named, None))
    }

    /// Releases a claim (a retryable failure: nothing happened).
    pub(crate) fn release(&self, claim: Claim) -> Pending<()> {
        let mut claim = match self.own_claim(claim) {
            Ok(claim) => claim,
            Err(e) => return Pending::ready(Err(e)),
        };
        let (key, token) = claim.finish();
        self.store
            .release_pending(key.clone(), token)
            .naming(&key, None)
    }

    /// Moves a claim's record to UNKNOWN at its holder's request.
    pub(crate) fn abandon(&self, claim: Claim, reason: String) -> Pending<()> {
        let mut claim = match self.own_claim(claim) {
            Ok(claim) => claim,
            Err(e) => return Pending::ready(Err(e)),
        };
        let (key, token) = claim.finish();
        self.store
            .mark_in_doubt_pending(InDoubtRequest {
                key: key.clone(),
                token,
                reason,
                by: Abandon::Explicit,
            })
            .naming(&key, None)
    }

    /// One full sweep pass in bounded steps; stops early when `stop` says
    /// so (engine shutdown).
    pub(crate) fn sweep_pass(&self, stop: &dyn Fn() -> bool) -> Result<SweepCounts> {
        let mut total = SweepCounts::default();
        loop {
            // An idle engine must not pay a durable commit per tick.
            if !self.store.sweep_due(self.clock.now_ms())? {
                return Ok(total);
            }
            let step = self.store.sweep(self.cfg.sweep_batch)?;
            total.moved_to_unknown += step.moved_to_unknown;
            total.deleted += step.deleted;
            total.tombstoned += step.tombstoned;
            let c = &self.counters;
            c.moved_to_unknown.add(step.moved_to_unknown);
            c.expired_deleted.add(step.deleted);
            c.tombstoned.add(step.tombstoned);
            if !step.more || stop() {
                total.more = step.more;
                return Ok(total);
            }
        }
    }
}
