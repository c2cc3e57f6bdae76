//! Each write operation, applied inside the batch's write transaction.
//!
//! An op checks everything that could refuse it *before* it writes, so a
//! refused op leaves its batch-mates' transaction untouched; only a storage
//! error (fatal for the whole batch) can interrupt an op midway. The state
//! changes themselves are the shared ones of `store/record.rs`.

use redb::ReadableTable;

use crate::config::PurgeMode;
use crate::error::Error;
use crate::key::IdempotencyKey;
use crate::message::OutboxEntry;
use crate::state::State;
use crate::store::classify::{classify, Class, Held};
use crate::store::codec;
use crate::store::record::{reference, EntityState, Record, RecordState};
use crate::store::{
    Abandon, ClaimRequest, ClaimResult, Claimed, CompleteRequest, Found, InDoubtRequest,
    SettleRequest, Settled, Settlement, TransitionRequest,
};
use crate::transition::Transition;

use super::tables::{OpError, Tables};

type OpResult<T> = std::result::Result<T, OpError>;

impl Tables<'_> {
    /// Claims the key, or reports what holds it. A stale PROCESSING record
    /// (lease run out) is moved to UNKNOWN first and reported in doubt.
    pub(super) fn claim(&mut self, req: &ClaimRequest) -> OpResult<ClaimResult> {
        let rkey = req.key.to_record_key();
        let existing = self.get(&req.key, &rkey)?;
        if let Some(rec) = &existing {
            match classify(rec, &req.fingerprint, self.now, self.cfg.expiry) {
                Class::Free => {}
                Class::Stale => {
                    tracing::warn!(key = %req.key, token = rec.token, "stale claim moved to UNKNOWN");
                    let new = rec.in_doubt(rec.stale_reason(), rec.lease_until_ms, self.now);
                    self.put(&rkey, Some(rec), &new)?;
                    return Ok(ClaimResult::Held(Box::new(self.found(new, Held::InDoubt))));
                }
                Class::Held(held) => {
                    return Ok(ClaimResult::Held(Box::new(self.found(rec.clone(), held))))
                }
            }
        }
        let claimed = self.new_claim(&req.key, &rkey, existing.as_ref(), req)?;
        Ok(ClaimResult::Claimed(claimed))
    }

    fn found(&self, record: Record, held: Held) -> Found {
        Found {
            record,
            held,
            now_ms: self.now,
        }
    }

    fn new_claim(
        &mut self,
        key: &IdempotencyKey,
        rkey: &[u8],
        old: Option<&Record>,
        req: &ClaimRequest,
    ) -> OpResult<Claimed> {
        let token = self.seq.token;
        self.seq.token += 1;
        let reference = reference(rkey, token);
        let lease_until_ms = self.now.saturating_add(req.lease_ms.max(1));
        let rec = Record::processing(
            req.fingerprint,
            token,
            reference.clone(),
            self.now,
            lease_until_ms,
        );
        self.put(rkey, old, &rec)?;
        tracing::debug!(key = %key, token, %reference, "claimed");
        Ok(Claimed {
            token,
            reference,
            claimed_at_ms: self.now,
            lease_until_ms,
        })
    }

    /// Stores a claim's outcome, with any outbox messages it carries.
    pub(super) fn complete(&mut self, req: CompleteRequest) -> OpResult<()> {
        let rkey = req.key.to_record_key();
        let rec = self.owned(&req.key, &rkey, req.token, "complete")?;
        let new = rec.completed(req.completion, req.response, self.now, self.cfg.ttl_ms);
        self.put(&rkey, Some(&rec), &new)?;
        for (n, msg) in req.messages.into_iter().enumerate() {
            let entry = OutboxEntry {
                seq: self.seq.outbox,
                id: format!("{}/{n}", rec.reference),
                topic: msg.topic,
                payload: msg.payload,
                created_at_ms: self.now,
            };
            self.outbox
                .insert(entry.seq, codec::encode_outbox(&entry).as_slice())?;
            self.seq.outbox += 1;
        }
        tracing::debug!(key = %req.key, token = req.token, completion = ?req.completion, was = ?rec.state, "completed");
        Ok(())
    }

    /// A retryable failure: the claim's record is deleted.
    pub(super) fn release(&mut self, key: &IdempotencyKey, token: u64) -> OpResult<()> {
        let rkey = key.to_record_key();
        let rec = self.owned(key, &rkey, token, "release")?;
        self.delete(&rkey, &rec)?;
        tracing::debug!(key = %key, token, "claim released (retryable failure)");
        Ok(())
    }

    /// PROCESSING → UNKNOWN for the claim's holder. An UNKNOWN record it
    /// still owns is left as it is.
    pub(super) fn mark_in_doubt(&mut self, req: InDoubtRequest) -> OpResult<()> {
        let rkey = req.key.to_record_key();
        let rec = self.owned(&req.key, &rkey, req.token, "mark unknown")?;
        if rec.state == RecordState::Processing {
            let lease_end = match req.by {
                Abandon::Explicit => rec.lease_until_ms.min(self.now),
                Abandon::Dropped => rec.lease_until_ms,
            };
            tracing::warn!(key = %req.key, token = rec.token, reason = %req.reason, "moved to UNKNOWN");
            let new = rec.in_doubt(req.reason, lease_end, self.now);
            self.put(&rkey, Some(&rec), &new)?;
        }
        Ok(())
    }

    /// Renews a PROCESSING record's lease; returns the new lease end.
    pub(super) fn extend(
        &mut self,
        key: &IdempotencyKey,
        token: u64,
        lease_ms: u64,
    ) -> OpResult<u64> {
        let rkey = key.to_record_key();
        let rec = self.owned(key, &rkey, token, "extend")?;
        if rec.state != RecordState::Processing {
            return Err(fenced(key, token, &rec));
        }
        let new = rec.extended(self.now.saturating_add(lease_ms), self.now);
        self.put(&rkey, Some(&rec), &new)?;
        Ok(new.lease_until_ms)
    }

    /// Settles an UNKNOWN record owned by `req.token`; "not executed"
    /// deletes it.
    pub(super) fn settle(&mut self, req: SettleRequest) -> OpResult<Settled<()>> {
        self.settle_with(req, |tables, _, rkey, rec| Ok(tables.delete(rkey, rec)?))
    }

    /// As [`Tables::settle`]; "not executed" claims the key afresh for a
    /// waiting `begin`.
    pub(super) fn settle_then_claim(
        &mut self,
        req: SettleRequest,
        claim: &ClaimRequest,
    ) -> OpResult<Settled<Claimed>> {
        self.settle_with(req, |tables, key, rkey, rec| {
            tables.new_claim(key, rkey, Some(rec), claim)
        })
    }

    fn settle_with<N>(
        &mut self,
        req: SettleRequest,
        not_executed: impl FnOnce(&mut Self, &IdempotencyKey, &[u8], &Record) -> OpResult<N>,
    ) -> OpResult<Settled<N>> {
        let key = &req.key;
        let rkey = key.to_record_key();
        let Some(rec) = self.get(key, &rkey)? else {
            return Err(OpError::Refused(Error::NotFound { key: key.clone() }));
        };
        // In doubt at this instant: UNKNOWN, or PROCESSING with its lease
        // ended (read-time truth; a sweep would have moved it already).
        let in_doubt = rec.state == RecordState::Unknown
            || (rec.state == RecordState::Processing && rec.lease_until_ms <= self.now);
        if rec.token != req.token || !in_doubt {
            return Err(fenced(key, req.token, &rec));
        }
        match req.settlement {
            Settlement::Completed(response) => {
                // The claim's token no longer owns it: a late complete from
                // the original holder is refused because the state is
                // COMPLETED.
                let new = rec.completed(
                    crate::store::Completion::Success,
                    response,
                    self.now,
                    self.cfg.ttl_ms,
                );
                self.put(&rkey, Some(&rec), &new)?;
                tracing::info!(key = %key, token = req.token, "in-doubt record resolved: completed");
                Ok(Settled::Completed(new))
            }
            Settlement::NotExecuted => {
                tracing::info!(key = %key, token = req.token, "in-doubt record resolved: not executed");
                Ok(Settled::NotExecuted(not_executed(self, key, &rkey, &rec)?))
            }
            Settlement::StillUnknown => {
                let new = match rec.state {
                    RecordState::Processing => {
                        rec.in_doubt(rec.stale_reason(), rec.lease_until_ms, self.now)
                    }
                    _ => rec.clone(),
                }
                .still_in_doubt(self.now);
                self.put(&rkey, Some(&rec), &new)?;
                Ok(Settled::StillInDoubt(new))
            }
        }
    }

    /// Deletes one record; returns the state it was in (`None` when it did
    /// not decode and was force-purged).
    pub(super) fn purge(
        &mut self,
        key: &IdempotencyKey,
        mode: PurgeMode,
    ) -> OpResult<Option<State>> {
        let rkey = key.to_record_key();
        let force = mode == PurgeMode::Force;
        let rec = match self.get_raw(&rkey)? {
            None => return Err(OpError::Refused(Error::NotFound { key: key.clone() })),
            Some(Ok(rec)) => rec,
            // A record that does not decode can only be removed by force;
            // its index entries are dropped by the next sweep that meets
            // them.
            Some(Err(e)) if force => {
                self.records.remove(rkey.as_slice())?;
                tracing::warn!(key = %key, error = %e, "corrupt record purged");
                return Ok(None);
            }
            Some(Err(e)) => {
                return Err(OpError::Refused(Error::CorruptRecord {
                    key: key.clone(),
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
        self.delete(&rkey, &rec)?;
        tracing::warn!(key = %key, state = %state, ?mode, "record purged");
        Ok(Some(state))
    }

    /// Compare-and-set of an entity's state.
    pub(super) fn transition(&mut self, req: TransitionRequest) -> OpResult<Transition> {
        let entity = req.entity.as_str();
        let current = match self.entities.get(entity)? {
            None => None,
            Some(v) => Some(codec::decode_entity(v.value()).map_err(|e| {
                OpError::Refused(Error::CorruptEntity {
                    entity: entity.to_owned(),
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
            updated_at_ms: self.now,
        };
        self.entities
            .insert(entity, codec::encode_entity(&new).as_slice())?;
        Ok(Transition::Applied {
            version: new.version,
        })
    }

    /// Removes published outbox messages; returns how many were there.
    pub(super) fn mark_published(&mut self, seqs: &[u64]) -> OpResult<u64> {
        let mut removed = 0;
        for &seq in seqs {
            if self.outbox.remove(seq)?.is_some() {
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// The record if `token` still owns it and it awaits an outcome
    /// (PROCESSING, or UNKNOWN that its own holder may still resolve).
    pub(super) fn owned(
        &self,
        key: &IdempotencyKey,
        rkey: &[u8],
        token: u64,
        action: &'static str,
    ) -> OpResult<Record> {
        match self.get(key, rkey)? {
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
}

fn fenced(key: &IdempotencyKey, token: u64, rec: &Record) -> OpError {
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
