//! Each write operation, written once for every backend.
//!
//! A backend opens one write transaction and hands it over as a [`Txn`]:
//! load a record (locking it where the backend locks rows), store one,
//! remove one, draw a fencing token, append to the outbox, read and write
//! an entity. [`Ops`] then applies each operation on top of it, with the
//! state changes of `store/record.rs`, so redb and `PostgreSQL` refuse,
//! claim and settle by the same rules.
//!
//! An op checks everything that could refuse it *before* it writes, so a
//! refused op leaves its transaction untouched; only a storage error
//! (`OpError::Fatal`) can interrupt an op midway.

use crate::dead_letter::{redrive_id, DeadLetter};
use crate::error::{Corrupted, Error};
use crate::key::IdempotencyKey;
use crate::message::OutgoingMessage;
use crate::policy::PurgeMode;
use crate::state::State;
use crate::store::config::StoreConfig;
use crate::transition::Transition;

use super::classify::{classify, Class, Held};
use super::codec::DecodeError;
use super::record::{reference, EntityState, Record, RecordState};
use super::step::{Actor, FinishStepRequest, SettleStepRequest, StepRequest, StepStatus};
use super::step::{HistoryRecord, StepRecord};
use super::step_ops::{self, apply_finishes, drop_steps, entry, log, steps_of, to_unknown};
use super::{
    Abandon, ClaimRequest, ClaimResult, Claimed, CompleteRequest, DeadLetterRequest, Found,
    InDoubtRequest, SettleRequest, Settled, Settlement, TransitionRequest,
};

/// An op failed: either it alone was refused (nothing written), or storage
/// failed (`F`, the backend's error) and its transaction must be abandoned.
#[derive(Debug)]
pub(crate) enum OpError<F> {
    Refused(Error),
    Fatal(F),
}

pub(crate) type OpResult<T, F> = std::result::Result<T, OpError<F>>;

/// A value as loaded: absent, decoded, or bytes that do not decode.
pub(crate) type Loaded<T> = Option<std::result::Result<T, DecodeError>>;

/// One write transaction of a backend, as the ops see it. Every method
/// maps the backend's error to `Self::Fatal`.
pub(crate) trait Txn {
    type Fatal;

    /// The transaction's one reading of the clock, in ms.
    fn now(&self) -> u64;
    fn cfg(&self) -> StoreConfig;

    /// The record of `key`, locked for the rest of the transaction where
    /// the backend locks rows.
    fn load(&mut self, key: &IdempotencyKey) -> Result<Loaded<Record>, Self::Fatal>;
    /// Writes `new` over `old` (`None`: there was no record).
    fn store(
        &mut self,
        key: &IdempotencyKey,
        old: Option<&Record>,
        new: &Record,
    ) -> Result<(), Self::Fatal>;
    /// Deletes the record `old` of `key` (`None`: its bytes did not decode).
    fn remove(&mut self, key: &IdempotencyKey, old: Option<&Record>) -> Result<(), Self::Fatal>;
    /// The next fencing token: greater than every token handed out before,
    /// for any key.
    fn next_token(&mut self) -> Result<u64, Self::Fatal>;
    /// Appends an outbox message with its id, created at `now`.
    fn push_outbox(&mut self, id: String, message: OutgoingMessage) -> Result<(), Self::Fatal>;
    /// Removes outbox message `seq`; whether it was there.
    fn remove_outbox(&mut self, seq: u64) -> Result<bool, Self::Fatal>;
    /// Appends `letter` to the dead-letter list with the next sequence
    /// number, dead at `now` (its `seq` and `dead_at_ms` are ignored);
    /// returns the sequence number.
    fn push_dead_letter(&mut self, letter: DeadLetter) -> Result<u64, Self::Fatal>;
    /// Dead letter `seq` as stored.
    fn load_dead_letter(&mut self, seq: u64) -> Result<Loaded<DeadLetter>, Self::Fatal>;
    /// Removes dead letter `seq`.
    fn remove_dead_letter(&mut self, seq: u64) -> Result<(), Self::Fatal>;
    /// An entity's state, locked like a record.
    fn load_entity(&mut self, entity: &str) -> Result<Loaded<EntityState>, Self::Fatal>;
    fn store_entity(&mut self, entity: &str, state: &EntityState) -> Result<(), Self::Fatal>;

    /// Every effect step of `key`, in name order: the stored name and the
    /// decoded step (or why it does not decode).
    fn load_steps(&mut self, key: &IdempotencyKey) -> Result<Vec<LoadedStep>, Self::Fatal>;
    /// Writes `step` under `(key, step.name)`.
    fn store_step(&mut self, key: &IdempotencyKey, step: &StepRecord) -> Result<(), Self::Fatal>;
    /// Deletes every step of `key`.
    fn remove_steps(&mut self, key: &IdempotencyKey) -> Result<(), Self::Fatal>;
    /// The first and last sequence numbers of `key`'s evidence log (`None`:
    /// empty). Entries are contiguous: a log is only ever appended to or
    /// deleted as a whole.
    fn history_span(&mut self, key: &IdempotencyKey) -> Result<Option<(u32, u32)>, Self::Fatal>;
    /// Appends `entry` under `(key, entry.seq)`.
    fn append_history(
        &mut self,
        key: &IdempotencyKey,
        entry: &HistoryRecord,
    ) -> Result<(), Self::Fatal>;
    /// Deletes `key`'s whole evidence log.
    fn remove_history(&mut self, key: &IdempotencyKey) -> Result<(), Self::Fatal>;

    /// Deletes `key`'s steps and log only while `key` has no record: a
    /// purge of steps left without one (see [`Ops::purge`]). A store whose
    /// transactions see every write of their own reads at once (redb's
    /// single writer, Redis's checked reads) needs nothing more than the
    /// two deletes; PostgreSQL overrides it with one statement that checks
    /// the record's absence on the snapshot it deletes from.
    fn remove_orphan_steps(&mut self, key: &IdempotencyKey) -> Result<(), Self::Fatal> {
        self.remove_steps(key)?;
        self.remove_history(key)
    }
}

/// A step as loaded: its stored name and its decoded value.
pub(crate) type LoadedStep = (String, std::result::Result<StepRecord, DecodeError>);

/// The operations, over any [`Txn`].
pub(crate) trait Ops: Txn + Sized {
    /// The record for `key`; a value that does not decode is refused with
    /// `Error::Corrupt`.
    fn get(&mut self, key: &IdempotencyKey) -> OpResult<Option<Record>, Self::Fatal> {
        match self.load(key).map_err(OpError::Fatal)? {
            None => Ok(None),
            Some(Ok(rec)) => Ok(Some(rec)),
            Some(Err(e)) => Err(OpError::Refused(Error::Corrupt {
                what: Corrupted::Record(key.clone()),
                reason: e.to_string(),
            })),
        }
    }

    fn put(
        &mut self,
        key: &IdempotencyKey,
        old: Option<&Record>,
        new: &Record,
    ) -> OpResult<(), Self::Fatal> {
        self.store(key, old, new).map_err(OpError::Fatal)
    }

    fn delete(&mut self, key: &IdempotencyKey, old: &Record) -> OpResult<(), Self::Fatal> {
        self.remove(key, Some(old)).map_err(OpError::Fatal)
    }

    /// The answer for a held key; a record in doubt comes with its steps
    /// (as seen: a Reserved step of its ended claim reads as Unknown).
    fn found(
        &mut self,
        key: &IdempotencyKey,
        record: Record,
        held: Held,
    ) -> OpResult<Found, Self::Fatal> {
        let now = self.now();
        let steps = if held == Held::InDoubt {
            let claim = Some((
                record.token,
                record.state == RecordState::Processing && record.lease_until_ms > now,
            ));
            steps_of(self, key)?
                .into_iter()
                .map(|s| s.as_seen(claim))
                .collect()
        } else {
            Vec::new()
        };
        Ok(Found {
            record,
            held,
            now_ms: now,
            steps,
        })
    }

    /// Reserves an effect step (see `step_ops.rs`).
    fn reserve_step(&mut self, req: StepRequest) -> OpResult<super::StepRecord, Self::Fatal> {
        step_ops::reserve_step(self, req)
    }

    /// Confirms or rejects an effect step (see `step_ops.rs`).
    fn finish_step(&mut self, req: FinishStepRequest) -> OpResult<super::StepRecord, Self::Fatal> {
        step_ops::finish_step(self, req)
    }

    /// Settles one effect step of a record in doubt (see `step_ops.rs`).
    fn settle_step(&mut self, req: SettleStepRequest) -> OpResult<super::StepRecord, Self::Fatal> {
        step_ops::settle_step(self, req)
    }

    /// Claims the key, or reports what holds it. A stale PROCESSING record
    /// (lease run out) is moved to UNKNOWN first and reported in doubt.
    fn claim(&mut self, req: &ClaimRequest) -> OpResult<ClaimResult, Self::Fatal> {
        let now = self.now();
        let existing = self.get(&req.key)?;
        if let Some(rec) = &existing {
            match classify(rec, &req.fingerprint, now, self.cfg().expiry) {
                Class::Free => {}
                Class::Stale => {
                    tracing::warn!(key = %req.key, token = rec.token, "stale claim moved to UNKNOWN");
                    let new = rec.in_doubt(rec.stale_reason(), rec.lease_until_ms, now);
                    to_unknown(self, &req.key, rec, &new, &Actor::Sweeper)?;
                    let found = self.found(&req.key, new, Held::InDoubt)?;
                    return Ok(ClaimResult::Held(Box::new(found)));
                }
                Class::Held(held) => {
                    let found = self.found(&req.key, rec.clone(), held)?;
                    return Ok(ClaimResult::Held(Box::new(found)));
                }
            }
        }
        // An expired record's steps and log go with it. A key with steps
        // always has a record (a released resume stays UNKNOWN); steps
        // without one exist only in a store written before that rule (see
        // `purge`), and the new claim sees them as before.
        let steps = if existing.is_some() {
            drop_steps(self, &req.key)?;
            Vec::new()
        } else {
            steps_of(self, &req.key)?
        };
        let claimed = self.new_claim(existing.as_ref(), req, steps)?;
        Ok(ClaimResult::Claimed(claimed))
    }

    /// Writes a fresh PROCESSING record for `req.key` over `old`.
    fn new_claim(
        &mut self,
        old: Option<&Record>,
        req: &ClaimRequest,
        steps: Vec<super::StepRecord>,
    ) -> OpResult<Claimed, Self::Fatal> {
        let token = self.next_token().map_err(OpError::Fatal)?;
        let (rec, mut claimed) = fresh_claim(req, token, self.now());
        claimed.steps = steps;
        self.put(&req.key, old, &rec)?;
        tracing::debug!(key = %req.key, token, reference = %claimed.reference, "claimed");
        Ok(claimed)
    }

    /// Stores a claim's outcome, with any outbox messages it carries.
    fn complete(&mut self, req: CompleteRequest) -> OpResult<(), Self::Fatal> {
        let rec = self.owned(&req.key, req.token, "complete")?;
        let mut steps = steps_of(self, &req.key)?;
        let now = self.now();
        // The claim's deferred confirmations land first, in this write (a
        // completion after the lease ended may also settle its own steps
        // the lease end moved to Unknown).
        let (finished, entries) = apply_finishes(
            &req.key,
            req.token,
            &mut steps,
            req.finished,
            now,
            rec.state != RecordState::Processing,
        )
        .map_err(OpError::Refused)?;
        // A step this claim reserved and never finished: its call's outcome
        // is unknown to the holder too (Unknown once the lease ended and
        // the record went UNKNOWN: a late complete would leave it unsettled
        // under a COMPLETED record forever).
        if steps.iter().any(|s| {
            matches!(s.status, StepStatus::Reserved | StepStatus::Unknown) && s.token == req.token
        }) {
            return Err(OpError::Refused(Error::InvalidState {
                key: req.key.clone(),
                action:
                    "complete while an effect step is still reserved or unknown (confirm or reject it first)",
                state: State::from(rec.state),
            }));
        }
        let cfg = self.cfg();
        let new = rec.completed(req.completion, req.response, now, cfg.ttl_ms);
        // Refused (nothing written) when the log has no room for them.
        log(self, &req.key, entries, false)?;
        for step in &finished {
            self.store_step(&req.key, step).map_err(OpError::Fatal)?;
        }
        if !steps.is_empty() {
            // The log says who completed a key that made calls; never
            // blocked by a full log.
            let e = entry(
                now,
                Actor::Claim { token: req.token },
                None,
                State::from(rec.state).as_str(),
                State::from(new.state).as_str(),
                Vec::new(),
            );
            log(self, &req.key, vec![e], true)?;
        }
        self.put(&req.key, Some(&rec), &new)?;
        for (n, msg) in req.messages.into_iter().enumerate() {
            self.push_outbox(format!("{}/{n}", rec.reference), msg)
                .map_err(OpError::Fatal)?;
        }
        tracing::debug!(key = %req.key, token = req.token, completion = ?req.completion, was = ?rec.state, "completed");
        Ok(())
    }

    /// A retryable failure: the claim's record is deleted, with its steps
    /// when they are all its own. A key with an earlier claim's settled
    /// steps (a resumed claim) never loses its record: it goes UNKNOWN,
    /// resumable, so the next `begin` is checked against its fingerprint.
    fn release(&mut self, key: &IdempotencyKey, token: u64) -> OpResult<(), Self::Fatal> {
        let rec = self.owned(key, token, "release")?;
        let steps = steps_of(self, key)?;
        // Work may have happened: a reserved call (Unknown once a lease
        // end moved it), or one this claim confirmed. Such a claim fails
        // in doubt instead.
        if steps.iter().any(|s| {
            matches!(s.status, StepStatus::Reserved | StepStatus::Unknown)
                || (s.status == StepStatus::Confirmed && s.token == token)
        }) {
            return Err(OpError::Refused(Error::InvalidState {
                key: key.clone(),
                action:
                    "release (fail retryable) a claim with a reserved or confirmed effect step \
                         (fail it in doubt instead)",
                state: State::from(rec.state),
            }));
        }
        if steps.iter().all(|s| s.token == token) {
            // Steps only this claim made (none confirmed) go with it.
            self.delete(key, &rec)?;
            drop_steps(self, key)?;
            tracing::debug!(key = %key, token, "claim released (retryable failure)");
            return Ok(());
        }
        // An earlier claim's settled steps stay for the next claim of the
        // same request, so the record stays too: a record-less key would
        // hand them to a request with another fingerprint, and nothing
        // would expire them. Every step is settled here (none Reserved,
        // this claim's own are Failed or NotExecuted): resumable at once.
        let now = self.now();
        let new = rec.in_doubt(
            "released to resume: a resumed claim failed retryable".to_owned(),
            rec.lease_until_ms.min(now),
            now,
        );
        // Never blocked by a full log (an engine move).
        let e = entry(
            now,
            Actor::Claim { token },
            None,
            State::from(rec.state).as_str(),
            State::Unknown.as_str(),
            Vec::new(),
        );
        log(self, key, vec![e], true)?;
        self.put(key, Some(&rec), &new)?;
        tracing::debug!(key = %key, token, "resumed claim released: UNKNOWN, resumable");
        Ok(())
    }

    /// PROCESSING → UNKNOWN for the claim's holder. An UNKNOWN record it
    /// still owns is left as it is.
    fn mark_in_doubt(&mut self, req: InDoubtRequest) -> OpResult<(), Self::Fatal> {
        let now = self.now();
        let rec = self.owned(&req.key, req.token, "mark unknown")?;
        if rec.state == RecordState::Processing {
            let lease_end = match req.by {
                Abandon::Explicit => rec.lease_until_ms.min(now),
                Abandon::Dropped => rec.lease_until_ms,
            };
            tracing::warn!(key = %req.key, token = rec.token, reason = %req.reason, "moved to UNKNOWN");
            let new = rec.in_doubt(req.reason, lease_end, now);
            to_unknown(
                self,
                &req.key,
                &rec,
                &new,
                &Actor::Claim { token: req.token },
            )?;
        }
        Ok(())
    }

    /// Renews a PROCESSING record's lease; returns the new lease end.
    fn extend(
        &mut self,
        key: &IdempotencyKey,
        token: u64,
        lease_ms: u64,
    ) -> OpResult<u64, Self::Fatal> {
        let now = self.now();
        let rec = self.owned(key, token, "extend")?;
        if rec.state != RecordState::Processing {
            return Err(fenced(key, token, &rec));
        }
        let new = rec.extended(now.saturating_add(lease_ms), now);
        self.put(key, Some(&rec), &new)?;
        Ok(new.lease_until_ms)
    }

    /// Settles an UNKNOWN record owned by `req.token`; "not executed"
    /// deletes it. A dropped claim (UNKNOWN, its lease still running) may
    /// be settled as completed at once, but not as "not executed" before
    /// its lease ends (`Error::InvalidState`).
    fn settle(&mut self, req: SettleRequest) -> OpResult<Settled<()>, Self::Fatal> {
        if matches!(req.settlement, Settlement::Resume) {
            // A resumable key keeps its UNKNOWN record until a claim
            // replaces it (`settle_then_claim`): never record-less steps.
            let state = match self.get(&req.key)? {
                Some(rec) => State::from(rec.state),
                None => return Err(OpError::Refused(Error::NotFound { key: req.key })),
            };
            return Err(OpError::Refused(Error::InvalidState {
                key: req.key,
                action: "resume a key without a claim to hand it to (the next begin resumes it)",
                state,
            }));
        }
        self.settle_with(req, |t, key, rec, keep| {
            t.delete(key, rec)?;
            if !keep {
                drop_steps(t, key)?;
            }
            Ok(())
        })
    }

    /// As [`Ops::settle`]; "not executed" claims the key afresh for a
    /// waiting `begin`.
    fn settle_then_claim(
        &mut self,
        req: SettleRequest,
        claim: &ClaimRequest,
    ) -> OpResult<Settled<Claimed>, Self::Fatal> {
        self.settle_with(req, |t, key, rec, keep| {
            let steps = if keep {
                steps_of(t, key)?
            } else {
                drop_steps(t, key)?;
                Vec::new()
            };
            t.new_claim(Some(rec), claim, steps)
        })
    }

    fn settle_with<N>(
        &mut self,
        req: SettleRequest,
        not_executed: impl FnOnce(&mut Self, &IdempotencyKey, &Record, bool) -> OpResult<N, Self::Fatal>,
    ) -> OpResult<Settled<N>, Self::Fatal> {
        let now = self.now();
        let key = &req.key;
        let Some(rec) = self.get(key)? else {
            return Err(OpError::Refused(Error::NotFound { key: key.clone() }));
        };
        // In doubt at this instant: UNKNOWN, or PROCESSING with its lease
        // ended (read-time truth; a sweep would have moved it already).
        let in_doubt = rec.state == RecordState::Unknown
            || (rec.state == RecordState::Processing && rec.lease_until_ms <= now);
        if rec.token != req.token || !in_doubt {
            return Err(fenced(key, req.token, &rec));
        }
        // A dropped claim's work may still run until its lease ends: "not
        // executed" could be overtaken by it, so it waits for the lease
        // end (a second claim must never run beside the first). A positive
        // answer is final whenever it comes, and settles the key at once.
        if matches!(req.settlement, Settlement::NotExecuted | Settlement::Resume)
            && rec.may_still_run(now)
        {
            return Err(OpError::Refused(Error::InvalidState {
                key: key.clone(),
                action: "settle as not executed before the dropped claim's lease ends \
                         (its work may still be running)",
                state: State::from(rec.state),
            }));
        }
        let steps = steps_of(self, key)?;
        let from = State::Unknown.as_str();
        match req.settlement {
            Settlement::Completed(response) => {
                // The claim's token no longer owns it: a late complete from
                // the original holder is refused because the state is
                // COMPLETED.
                let ttl_ms = self.cfg().ttl_ms;
                let evidence = response
                    .body
                    .iter()
                    .take(super::step::MAX_EVIDENCE_BYTES)
                    .copied()
                    .collect();
                let e = entry(
                    now,
                    req.actor,
                    None,
                    from,
                    State::Completed.as_str(),
                    evidence,
                );
                let new = rec.completed(super::Completion::Success, response, now, ttl_ms);
                let mut entries = stale_entries(&rec, &steps, now);
                entries.push(e);
                log(self, key, entries, false)?;
                self.put(key, Some(&rec), &new)?;
                self.steps_to_unknown(key, &steps)?;
                tracing::info!(key = %key, token = req.token, "in-doubt record resolved: completed");
                Ok(Settled::Completed(new))
            }
            Settlement::NotExecuted => {
                // A step whose call happened or may have happened: "not
                // executed" for the whole key would drop it and re-run the
                // call under a new reference.
                if steps.iter().any(|s| {
                    matches!(
                        s.status,
                        StepStatus::Confirmed | StepStatus::Reserved | StepStatus::Unknown
                    )
                }) {
                    return Err(OpError::Refused(Error::InvalidState {
                        key: key.clone(),
                        action: "settle as not executed a key with a confirmed or unsettled \
                                 effect step (settle its steps instead; the key then resumes)",
                        state: State::from(rec.state),
                    }));
                }
                tracing::info!(key = %key, token = req.token, "in-doubt record resolved: not executed");
                Ok(Settled::NotExecuted(not_executed(self, key, &rec, false)?))
            }
            Settlement::Resume => {
                if steps.iter().any(|s| !s.status.is_settled()) {
                    return Err(OpError::Refused(Error::InvalidState {
                        key: key.clone(),
                        action: "resume a key whose effect steps are not all settled",
                        state: State::from(rec.state),
                    }));
                }
                let e = entry(now, req.actor, None, from, "RESUMED", Vec::new());
                log(self, key, vec![e], false)?;
                tracing::info!(key = %key, token = req.token, "in-doubt record resolved: resumed with its steps");
                Ok(Settled::NotExecuted(not_executed(self, key, &rec, true)?))
            }
            Settlement::StillInDoubt => {
                let new = match rec.state {
                    RecordState::Processing => {
                        rec.in_doubt(rec.stale_reason(), rec.lease_until_ms, now)
                    }
                    _ => rec.clone(),
                }
                .still_in_doubt(now);
                let mut entries = stale_entries(&rec, &steps, now);
                // An operator's "still unknown" leaves a trace with its
                // reason (a resolver's counts attempts instead).
                let by_operator = matches!(req.actor, Actor::Operator { .. });
                if by_operator {
                    entries.push(entry(now, req.actor, None, from, from, Vec::new()));
                }
                log(self, key, entries, !by_operator)?;
                self.put(key, Some(&rec), &new)?;
                self.steps_to_unknown(key, &steps)?;
                Ok(Settled::StillInDoubt(new))
            }
        }
    }

    /// Stores the steps of an in-doubt record that were still Reserved as
    /// Unknown (their claim ended); see [`stale_entries`] for their log.
    fn steps_to_unknown(
        &mut self,
        key: &IdempotencyKey,
        steps: &[super::StepRecord],
    ) -> OpResult<(), Self::Fatal> {
        for step in steps.iter().filter(|s| s.status == StepStatus::Reserved) {
            let moved = super::StepRecord {
                status: StepStatus::Unknown,
                ..step.clone()
            };
            self.store_step(key, &moved).map_err(OpError::Fatal)?;
        }
        Ok(())
    }

    /// Deletes one record; returns the state it was in (`None` when it did
    /// not decode and was force-purged).
    fn purge(
        &mut self,
        key: &IdempotencyKey,
        mode: PurgeMode,
    ) -> OpResult<Option<State>, Self::Fatal> {
        let force = mode == PurgeMode::Force;
        match self.load(key).map_err(OpError::Fatal)? {
            // Steps and a log without a record: only a store written by
            // main from 7534400 (steps) to the commit that made a released
            // resume keep its UNKNOWN record can hold them (a resumed
            // claim's release deleted the record then). Nothing else
            // writes this state; force still clears such a store.
            None if force && !steps_of(self, key)?.is_empty() => {
                // On a store that reads per statement (PostgreSQL, READ
                // COMMITTED), a claim that committed after the first read
                // can own the steps just seen: its record is visible now
                // (a claim commits its record before any step), and locked
                // by this read; such a key is purged as any other.
                match self.load(key).map_err(OpError::Fatal)? {
                    None => {
                        self.remove_orphan_steps(key).map_err(OpError::Fatal)?;
                        tracing::warn!(key = %key, "effect steps and log without a record purged");
                        Ok(None)
                    }
                    Some(loaded) => self.purge_loaded(key, loaded, force),
                }
            }
            None => Err(OpError::Refused(Error::NotFound { key: key.clone() })),
            Some(loaded) => self.purge_loaded(key, loaded, force),
        }
    }

    /// [`Ops::purge`] of a key whose record was loaded (and locked).
    fn purge_loaded(
        &mut self,
        key: &IdempotencyKey,
        loaded: std::result::Result<Record, DecodeError>,
        force: bool,
    ) -> OpResult<Option<State>, Self::Fatal> {
        let rec = match loaded {
            Ok(rec) => rec,
            // A record that does not decode can only be removed by force.
            Err(e) if force => {
                self.remove(key, None).map_err(OpError::Fatal)?;
                drop_steps(self, key)?;
                tracing::warn!(key = %key, error = %e, "corrupt record purged");
                return Ok(None);
            }
            Err(e) => {
                return Err(OpError::Refused(Error::Corrupt {
                    what: Corrupted::Record(key.clone()),
                    reason: format!("{e} (purge with force to delete it)"),
                }))
            }
        };
        let state = State::from(rec.state);
        if !force && matches!(rec.state, RecordState::Processing | RecordState::Unknown) {
            return Err(OpError::Refused(Error::InvalidState {
                key: key.clone(),
                action: "purge without force",
                state,
            }));
        }
        self.delete(key, &rec)?;
        drop_steps(self, key)?;
        tracing::warn!(
            target: crate::AUDIT_TARGET,
            key = %key,
            state = %state,
            force,
            "record purged"
        );
        Ok(Some(state))
    }

    /// Compare-and-set of an entity's state.
    fn transition(&mut self, req: TransitionRequest) -> OpResult<Transition, Self::Fatal> {
        let entity = req.entity.as_str();
        let current = match self.load_entity(entity).map_err(OpError::Fatal)? {
            None => None,
            Some(loaded) => Some(loaded.map_err(|e| {
                OpError::Refused(Error::Corrupt {
                    what: Corrupted::Entity(entity.to_owned()),
                    reason: e.to_string(),
                })
            })?),
        };
        let (allowed, version) = match &current {
            Some(cur) if cur.state == req.to => {
                return Ok(Transition::AlreadyInState {
                    version: cur.version,
                })
            }
            Some(cur) => (req.from.contains(&cur.state), cur.version),
            None => (req.from.is_empty(), 0),
        };
        if !allowed {
            return Ok(Transition::Conflict {
                current: current.map(|c| c.state),
                version,
            });
        }
        let new = EntityState {
            state: req.to,
            version: version + 1,
            updated_at_ms: self.now(),
        };
        self.store_entity(entity, &new).map_err(OpError::Fatal)?;
        Ok(Transition::Applied {
            version: new.version,
        })
    }

    /// Gives a message up: the claim (if any) is completed as
    /// `FINAL_FAILURE`, so a redelivery is a duplicate, the outbox message
    /// it replaces (if any) is removed, and the letter is appended to the
    /// dead-letter list, in one write.
    fn dead_letter(&mut self, req: DeadLetterRequest) -> OpResult<u64, Self::Fatal> {
        if let Some(seq) = req.outbox_seq {
            if !self.remove_outbox(seq).map_err(OpError::Fatal)? {
                return Ok(0);
            }
        }
        if let Some(claim) = req.claim {
            self.complete(CompleteRequest {
                key: claim.key,
                token: claim.token,
                completion: super::Completion::FinalFailure,
                response: claim.response,
                messages: Vec::new(),
                finished: claim.finished,
            })?;
        }
        self.push_dead_letter(req.letter).map_err(OpError::Fatal)
    }

    /// Moves dead letter `seq` back to the outbox under a new id (see
    /// `dead_letter::redrive_id`), in one write; the new outbox id, or
    /// `None` when there is no such dead letter.
    fn redrive(&mut self, seq: u64) -> OpResult<Option<String>, Self::Fatal> {
        // Checked before anything is written: a letter that does not
        // decode is refused and stays listed.
        let letter = match self.load_dead_letter(seq).map_err(OpError::Fatal)? {
            None => return Ok(None),
            Some(Ok(letter)) => letter,
            Some(Err(e)) => {
                return Err(OpError::Refused(Error::Corrupt {
                    what: Corrupted::DeadLetter(seq),
                    reason: e.to_string(),
                }))
            }
        };
        let unique = self.next_token().map_err(OpError::Fatal)?;
        let id = redrive_id(&letter, unique);
        self.remove_dead_letter(seq).map_err(OpError::Fatal)?;
        self.push_outbox(
            id.clone(),
            OutgoingMessage::new(letter.topic, letter.payload),
        )
        .map_err(OpError::Fatal)?;
        tracing::info!(seq, id = %id, "dead letter redriven to the outbox");
        Ok(Some(id))
    }

    /// Removes published outbox messages; returns how many were there.
    fn mark_published(&mut self, seqs: &[u64]) -> OpResult<u64, Self::Fatal> {
        let mut removed = 0;
        for &seq in seqs {
            if self.remove_outbox(seq).map_err(OpError::Fatal)? {
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// The record if `token` still owns it and it awaits an outcome
    /// (PROCESSING, or UNKNOWN that its own holder may still resolve).
    fn owned(
        &mut self,
        key: &IdempotencyKey,
        token: u64,
        action: &'static str,
    ) -> OpResult<Record, Self::Fatal> {
        match self.get(key)? {
            Some(rec)
                if rec.token == token
                    && matches!(rec.state, RecordState::Processing | RecordState::Unknown) =>
            {
                Ok(rec)
            }
            Some(rec) => Err(fenced(key, token, &rec)),
            None => Err(OpError::Refused(Error::Fenced {
                key: key.clone(),
                token,
                reason: format!(
                    "cannot {action}: the record is gone (released, purged or expired)"
                ),
            })),
        }
    }

    /// What a sweep does with one due record at `now`: a stale PROCESSING
    /// record moves to UNKNOWN, an expired one becomes a tombstone (while
    /// the policy keeps one) or is deleted. Returns what it did; `None`
    /// when the record was not due after all.
    fn sweep_record(
        &mut self,
        key: &IdempotencyKey,
        rec: &Record,
    ) -> OpResult<Option<Swept>, Self::Fatal> {
        let now = self.now();
        match rec.state {
            RecordState::Processing if rec.lease_until_ms <= now => {
                tracing::warn!(key = %key, token = rec.token, "stale claim moved to UNKNOWN");
                let new = rec.in_doubt(rec.stale_reason(), rec.lease_until_ms, now);
                to_unknown(self, key, rec, &new, &Actor::Sweeper)?;
                Ok(Some(Swept::MovedToUnknown))
            }
            RecordState::Completed | RecordState::FinalFailure | RecordState::Tombstone
                if rec.expires_at_ms <= now =>
            {
                let keep = match rec.state {
                    RecordState::Completed | RecordState::FinalFailure => self
                        .cfg()
                        .expiry
                        .keep_ms()
                        .map(|keep_ms| rec.expires_at_ms.saturating_add(keep_ms))
                        .filter(|&until| until > now),
                    _ => None,
                };
                if let Some(until) = keep {
                    let new = rec.tombstone(until, now);
                    if rec.state != RecordState::Tombstone {
                        step_ops::summarize_for_tombstone(
                            self,
                            key,
                            State::from(rec.state).as_str(),
                        )?;
                    }
                    self.put(key, Some(rec), &new)?;
                    Ok(Some(Swept::Tombstoned))
                } else {
                    self.delete(key, rec)?;
                    drop_steps(self, key)?;
                    Ok(Some(Swept::Deleted))
                }
            }
            _ => Ok(None),
        }
    }
}

impl<T: Txn> Ops for T {}

/// The PROCESSING record of a claim with `token` made at `now`, and the
/// claim as its caller hears of it.
pub(crate) fn fresh_claim(req: &ClaimRequest, token: u64, now: u64) -> (Record, Claimed) {
    let reference = reference(req.key.record_key(), token);
    let lease_until_ms = now.saturating_add(req.lease_ms.max(1));
    let rec = Record::processing(
        req.fingerprint,
        token,
        reference.clone(),
        now,
        lease_until_ms,
    );
    let claimed = Claimed {
        token,
        reference,
        claimed_at_ms: now,
        lease_until_ms,
        steps: Vec::new(),
    };
    (rec, claimed)
}

/// The log entries of the Reserved steps of the in-doubt record `rec`,
/// moving to Unknown (actor: the sweeper when its lease ended unnoticed,
/// else its claim).
fn stale_entries(rec: &Record, steps: &[super::StepRecord], now: u64) -> Vec<super::HistoryRecord> {
    let actor = if rec.state == RecordState::Processing {
        Actor::Sweeper
    } else {
        Actor::Claim { token: rec.token }
    };
    steps
        .iter()
        .filter(|s| s.status == StepStatus::Reserved)
        .map(|s| {
            entry(
                now,
                actor.clone(),
                Some(&s.name),
                "reserved",
                "unknown",
                Vec::new(),
            )
        })
        .collect()
}

/// What a sweep did with one record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Swept {
    MovedToUnknown,
    Tombstoned,
    Deleted,
}

pub(crate) fn fenced<F>(key: &IdempotencyKey, token: u64, rec: &Record) -> OpError<F> {
    let state = State::from(rec.state);
    let reason = if rec.token == token {
        format!("the record is already {state}")
    } else {
        format!("the record now belongs to token {} ({state})", rec.token)
    };
    OpError::Refused(Error::Fenced {
        key: key.clone(),
        token,
        reason,
    })
}
