//! The write operations and how each is applied inside a write transaction.
//!
//! Every write the engine makes is an [`Op`] applied here by the writer
//! thread. An op checks everything that could refuse it *before* it writes,
//! so a refused op leaves its batch-mates' transaction untouched; only a
//! storage error (fatal for the whole batch) can interrupt an op midway.

use redb::{ReadableTable, Table, WriteTransaction};

use crate::codec::{self, DiskState, Record, StoredResponse};
use crate::entity::{EntityState, Transition};
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::local::LocalOp;
use crate::outbox::{OutboxEntry, OutgoingMessage};
use crate::tables::{ENTITIES, EXPIRY, LEASES, OUTBOX, RECORDS, RECOVERY};

/// What happens to a COMPLETED or FAILED_FINAL record once its TTL has run
/// out. See the README's expiry table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ExpiryPolicy {
    /// The record is deleted: reusing the key is a new request. The default.
    #[default]
    Forget,
    /// Key and fingerprint are kept for this many more milliseconds; a reuse
    /// in that time gets [`crate::Begin::Expired`], never a second execution.
    Tombstone {
        /// How long the tombstone lasts after expiry, in milliseconds.
        keep_ms: u64,
    },
}

/// What a stored record means for a `begin` with a given fingerprint at a
/// given instant ("read-time truth": decided when read, not only by sweeps).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    /// No record, or one whose TTL (and tombstone) has run out.
    Absent,
    /// Same key, different fingerprint (checked before the state).
    Mismatch,
    /// PROCESSING with lease left.
    Live { retry_after_ms: u64 },
    /// PROCESSING whose lease has run out: it answers as UNKNOWN.
    Stale,
    /// COMPLETED or FAILED_FINAL within its TTL.
    Done,
    /// UNKNOWN.
    Unknown,
    /// Expired, tombstoned until `reusable_at_ms`.
    Tombstoned {
        expired_at_ms: u64,
        reusable_at_ms: u64,
    },
}

pub(crate) fn classify(rec: &Record, fp: &Fingerprint, now: u64, policy: ExpiryPolicy) -> Class {
    // Expiry comes first: a record past its TTL (and any tombstone) is
    // absent, whatever its fingerprint. `(expired at, reusable at)`:
    let tombstone = match rec.state {
        DiskState::Completed | DiskState::FailedFinal if now >= rec.expires_at_ms => match policy {
            ExpiryPolicy::Forget => return Class::Absent,
            ExpiryPolicy::Tombstone { keep_ms } => {
                Some((rec.expires_at_ms, rec.expires_at_ms.saturating_add(keep_ms)))
            }
        },
        DiskState::Tombstone => Some((rec.expired_at_ms, rec.expires_at_ms)),
        _ => None,
    };
    if tombstone.is_some_and(|(_, reusable_at_ms)| now >= reusable_at_ms) {
        return Class::Absent;
    }
    // Then the fingerprint, before the state decides anything.
    if !rec.fingerprint_matches(fp) {
        return Class::Mismatch;
    }
    if let Some((expired_at_ms, reusable_at_ms)) = tombstone {
        return Class::Tombstoned {
            expired_at_ms,
            reusable_at_ms,
        };
    }
    match rec.state {
        DiskState::Processing if rec.lease_until_ms > now => Class::Live {
            retry_after_ms: rec.lease_until_ms - now,
        },
        DiskState::Processing => Class::Stale,
        DiskState::Unknown => Class::Unknown,
        DiskState::Completed | DiskState::FailedFinal | DiskState::Tombstone => Class::Done,
    }
}

/// How a resolver (or an operator) settled an UNKNOWN record.
#[derive(Clone, Debug)]
pub(crate) enum Settle {
    Completed(StoredResponse),
    NotExecuted,
    StillUnknown,
}

/// One write operation.
#[derive(Debug)]
pub(crate) enum Op {
    /// Claim the key, or report what holds it.
    Begin {
        key: IdempotencyKey,
        fingerprint: Fingerprint,
        lease_ms: u64,
    },
    /// Store the outcome of a claim (success or final failure), with any
    /// outbox messages it carries.
    Complete {
        key: IdempotencyKey,
        token: u64,
        response: StoredResponse,
        final_failure: bool,
        outbox: Vec<OutgoingMessage>,
    },
    /// Retryable failure: release the key.
    Release { key: IdempotencyKey, token: u64 },
    /// Unknown failure, dropped claim: PROCESSING → UNKNOWN.
    MarkUnknown {
        key: IdempotencyKey,
        token: u64,
        reason: String,
        /// The holder says it stopped acting (an explicit `fail`), so a
        /// resolver may settle the record at once. A dropped claim keeps its
        /// lease: its work may still be running until the lease ends.
        holder_done: bool,
    },
    /// Renew a lease.
    Extend {
        key: IdempotencyKey,
        token: u64,
        lease_ms: u64,
    },
    /// Settle an UNKNOWN record owned by `token`; optionally claim it afresh
    /// for a waiting `begin` when it turns out not executed.
    Settle {
        key: IdempotencyKey,
        token: u64,
        settle: Settle,
        then_claim: Option<(Fingerprint, u64)>,
    },
    /// One bounded sweep step.
    Sweep { limit: usize },
    /// Delete one record.
    Purge { key: IdempotencyKey, force: bool },
    /// Compare-and-set an entity's state.
    Transition {
        entity: String,
        from: Vec<String>,
        to: String,
    },
    /// Remove published outbox messages.
    MarkPublished { seqs: Vec<u64> },
    /// Nothing: answered once everything queued before it has committed.
    Flush,
    /// The app's own write plus a completion, in a transaction of its own
    /// (the writer runs it; `Store::apply` never sees it).
    Local(LocalOp),
}

/// What an applied op answers.
#[derive(Debug)]
pub(crate) enum Reply {
    Claimed {
        token: u64,
        reference: String,
        now_ms: u64,
        lease_until_ms: u64,
    },
    /// `Begin` found a record that is not claimable (or `Settle` left one).
    Existing {
        record: Box<Record>,
        class: Class,
    },
    Done,
    Lease {
        until_ms: u64,
    },
    Swept(SweepCounts),
    /// `None`: the record was corrupt (force-purged).
    Purged {
        state: Option<crate::State>,
    },
    Transition(Transition),
    Count(u64),
}

/// What one sweep step did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepCounts {
    /// Stale PROCESSING records moved to UNKNOWN.
    pub moved_to_unknown: u64,
    /// Expired records deleted.
    pub deleted: u64,
    /// Expired records turned into tombstones.
    pub tombstoned: u64,
    /// Whether the step stopped at its limit with more work left.
    pub more: bool,
}

/// An op failed: either it alone was refused, or storage failed and the
/// whole batch must be abandoned.
#[derive(Debug)]
pub(crate) enum OpError {
    Refused(Error),
    Fatal(redb::Error),
}

impl<E: Into<redb::Error>> From<E> for OpError {
    fn from(e: E) -> OpError {
        OpError::Fatal(e.into())
    }
}

/// Engine settings the writer needs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WriteConfig {
    pub(crate) ttl_ms: u64,
    pub(crate) expiry: ExpiryPolicy,
    pub(crate) max_response_bytes: usize,
}

/// Counters the writer hands out, persisted in the meta table at each
/// commit that changes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Sequences {
    /// Next fencing token (global, so tokens grow per key even across
    /// expiry and release).
    pub(crate) token: u64,
    /// Next outbox sequence number.
    pub(crate) outbox: u64,
}

/// The engine's tables inside one write transaction, plus the batch's state.
pub(crate) struct Store<'t> {
    records: Table<'t, &'static [u8], &'static [u8]>,
    leases: Table<'t, (u64, &'static [u8]), ()>,
    recovery: Table<'t, (u64, &'static [u8]), ()>,
    expiry: Table<'t, (u64, &'static [u8]), ()>,
    outbox: Table<'t, u64, &'static [u8]>,
    entities: Table<'t, &'static str, &'static [u8]>,
    pub(crate) seq: Sequences,
    pub(crate) now: u64,
    cfg: WriteConfig,
}

impl<'t> Store<'t> {
    pub(crate) fn open(
        txn: &'t WriteTransaction,
        seq: Sequences,
        now: u64,
        cfg: WriteConfig,
    ) -> Result<Store<'t>, redb::Error> {
        Ok(Store {
            records: txn.open_table(RECORDS)?,
            leases: txn.open_table(LEASES)?,
            recovery: txn.open_table(RECOVERY)?,
            expiry: txn.open_table(EXPIRY)?,
            outbox: txn.open_table(OUTBOX)?,
            entities: txn.open_table(ENTITIES)?,
            seq,
            now,
            cfg,
        })
    }

    pub(crate) fn apply(&mut self, op: Op) -> Result<Reply, OpError> {
        match op {
            Op::Begin {
                key,
                fingerprint,
                lease_ms,
            } => self.begin(&key, fingerprint, lease_ms),
            Op::Complete {
                key,
                token,
                response,
                final_failure,
                outbox,
            } => self.complete(&key, token, response, final_failure, outbox),
            Op::Release { key, token } => {
                let rkey = key.to_record_key();
                let rec = self.owned(&key, &rkey, token, "release")?;
                self.delete(&rkey, &rec)?;
                tracing::debug!(key = %key, token, "claim released (retryable failure)");
                Ok(Reply::Done)
            }
            Op::MarkUnknown {
                key,
                token,
                reason,
                holder_done,
            } => {
                let rkey = key.to_record_key();
                let rec = self.owned(&key, &rkey, token, "mark unknown")?;
                if rec.state == DiskState::Processing {
                    let lease_end = if holder_done {
                        rec.lease_until_ms.min(self.now)
                    } else {
                        rec.lease_until_ms
                    };
                    self.mark_unknown(&key, &rkey, rec, reason, lease_end)?;
                }
                Ok(Reply::Done)
            }
            Op::Extend {
                key,
                token,
                lease_ms,
            } => {
                let rkey = key.to_record_key();
                let rec = self.owned(&key, &rkey, token, "extend")?;
                if rec.state != DiskState::Processing {
                    return Err(fenced(&key, token, &rec));
                }
                let mut new = rec.clone();
                new.lease_until_ms = self.now.saturating_add(lease_ms);
                new.updated_at_ms = self.now;
                self.put(&rkey, Some(&rec), &new)?;
                Ok(Reply::Lease {
                    until_ms: new.lease_until_ms,
                })
            }
            Op::Settle {
                key,
                token,
                settle,
                then_claim,
            } => self.settle(&key, token, settle, then_claim),
            Op::Sweep { limit } => self.sweep(limit).map(Reply::Swept),
            Op::Purge { key, force } => {
                let rkey = key.to_record_key();
                let rec = match self.get_raw(&rkey)? {
                    None => return Err(OpError::Refused(Error::NotFound { key })),
                    Some(Ok(rec)) => rec,
                    // A record that does not decode can only be removed by
                    // force; its index entries are dropped by the next sweep
                    // that meets them.
                    Some(Err(e)) if force => {
                        self.records.remove(rkey.as_slice())?;
                        tracing::warn!(key = %key, error = %e, "corrupt record purged");
                        return Ok(Reply::Purged { state: None });
                    }
                    Some(Err(e)) => {
                        return Err(OpError::Refused(Error::CorruptRecord {
                            key: key.to_string(),
                            reason: format!("{e} (purge with force to delete it)"),
                        }))
                    }
                };
                let state = rec.state.into();
                if !force && matches!(rec.state, DiskState::Processing | DiskState::Unknown) {
                    return Err(OpError::Refused(Error::InvalidState {
                        key,
                        action: "purge without --force",
                        state,
                    }));
                }
                self.delete(&rkey, &rec)?;
                tracing::warn!(key = %key, state = %state, force, "record purged");
                Ok(Reply::Purged { state: Some(state) })
            }
            Op::Transition { entity, from, to } => self.transition(&entity, &from, to),
            Op::Flush => Ok(Reply::Done),
            Op::MarkPublished { seqs } => {
                let mut removed = 0;
                for seq in seqs {
                    if self.outbox.remove(seq)?.is_some() {
                        removed += 1;
                    }
                }
                Ok(Reply::Count(removed))
            }
            Op::Local(local) => Err(OpError::Refused(Error::Internal(format!(
                "local op for {} reached a shared batch",
                local.key
            )))),
        }
    }

    fn transition(&mut self, entity: &str, from: &[String], to: String) -> Result<Reply, OpError> {
        let current = match self.entities.get(entity)? {
            None => None,
            Some(v) => Some(codec::decode_entity(v.value()).map_err(|e| {
                OpError::Refused(Error::CorruptRecord {
                    key: format!("entity {entity:?}"),
                    reason: e.to_string(),
                })
            })?),
        };
        let (allowed, version) = match &current {
            Some(cur) if cur.state == to => {
                return Ok(Reply::Transition(Transition::AlreadyInState {
                    version: cur.version,
                }))
            }
            Some(cur) => (from.contains(&cur.state), cur.version),
            None => (from.is_empty(), 0),
        };
        if !allowed {
            return Ok(Reply::Transition(Transition::Conflict {
                current: current.map(|c| c.state),
                version,
            }));
        }
        let new = EntityState {
            state: to,
            version: version + 1,
            updated_at_ms: self.now,
        };
        self.entities
            .insert(entity, codec::encode_entity(&new).as_slice())?;
        Ok(Reply::Transition(Transition::Applied {
            version: new.version,
        }))
    }

    fn begin(
        &mut self,
        key: &IdempotencyKey,
        fingerprint: Fingerprint,
        lease_ms: u64,
    ) -> Result<Reply, OpError> {
        let rkey = key.to_record_key();
        let existing = self.get(key, &rkey)?;
        if let Some(rec) = &existing {
            match classify(rec, &fingerprint, self.now, self.cfg.expiry) {
                Class::Absent => {}
                Class::Stale => {
                    let reason = format!(
                        "lease ran out at {} ms without an outcome",
                        rec.lease_until_ms
                    );
                    let lease_end = rec.lease_until_ms;
                    let rec = self.mark_unknown(key, &rkey, rec.clone(), reason, lease_end)?;
                    return Ok(Reply::Existing {
                        record: Box::new(rec),
                        class: Class::Unknown,
                    });
                }
                class => {
                    return Ok(Reply::Existing {
                        record: Box::new(rec.clone()),
                        class,
                    })
                }
            }
        }
        self.claim(key, &rkey, existing.as_ref(), fingerprint, lease_ms)
    }

    fn claim(
        &mut self,
        key: &IdempotencyKey,
        rkey: &[u8],
        old: Option<&Record>,
        fingerprint: Fingerprint,
        lease_ms: u64,
    ) -> Result<Reply, OpError> {
        let token = self.seq.token;
        self.seq.token += 1;
        let reference = reference(rkey, token);
        let lease_until_ms = self.now.saturating_add(lease_ms.max(1));
        let rec = Record::processing(
            fingerprint,
            token,
            reference.clone(),
            self.now,
            lease_until_ms,
        );
        self.put(rkey, old, &rec)?;
        tracing::debug!(key = %key, token, %reference, "claimed");
        Ok(Reply::Claimed {
            token,
            reference,
            now_ms: self.now,
            lease_until_ms,
        })
    }

    fn complete(
        &mut self,
        key: &IdempotencyKey,
        token: u64,
        response: StoredResponse,
        final_failure: bool,
        outbox: Vec<OutgoingMessage>,
    ) -> Result<Reply, OpError> {
        let rkey = key.to_record_key();
        let rec = self.owned(key, &rkey, token, "complete")?;
        let mut new = rec.clone();
        new.state = if final_failure {
            DiskState::FailedFinal
        } else {
            DiskState::Completed
        };
        new.updated_at_ms = self.now;
        new.expires_at_ms = self.now.saturating_add(self.cfg.ttl_ms);
        new.response = Some(response);
        self.put(&rkey, Some(&rec), &new)?;
        for (n, msg) in outbox.into_iter().enumerate() {
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
        tracing::debug!(key = %key, token, final_failure, was = ?rec.state, "completed");
        Ok(Reply::Done)
    }

    fn settle(
        &mut self,
        key: &IdempotencyKey,
        token: u64,
        settle: Settle,
        then_claim: Option<(Fingerprint, u64)>,
    ) -> Result<Reply, OpError> {
        let rkey = key.to_record_key();
        let Some(rec) = self.get(key, &rkey)? else {
            return Err(OpError::Refused(Error::NotFound { key: key.clone() }));
        };
        if rec.token != token || rec.state != DiskState::Unknown {
            return Err(fenced(key, token, &rec));
        }
        match settle {
            Settle::Completed(response) => {
                let mut new = rec.clone();
                new.state = DiskState::Completed;
                new.updated_at_ms = self.now;
                new.expires_at_ms = self.now.saturating_add(self.cfg.ttl_ms);
                new.response = Some(response);
                // The claim's token no longer owns it: a late complete from the
                // original holder is refused because the state is COMPLETED.
                self.put(&rkey, Some(&rec), &new)?;
                tracing::info!(key = %key, token, "unknown resolved: completed");
                Ok(Reply::Existing {
                    record: Box::new(new),
                    class: Class::Done,
                })
            }
            Settle::NotExecuted => {
                tracing::info!(key = %key, token, "unknown resolved: not executed");
                match then_claim {
                    Some((fp, lease_ms)) => self.claim(key, &rkey, Some(&rec), fp, lease_ms),
                    None => {
                        self.delete(&rkey, &rec)?;
                        Ok(Reply::Done)
                    }
                }
            }
            Settle::StillUnknown => {
                let mut new = rec.clone();
                new.attempts = new.attempts.saturating_add(1);
                new.updated_at_ms = self.now;
                self.put(&rkey, Some(&rec), &new)?;
                Ok(Reply::Existing {
                    record: Box::new(new),
                    class: Class::Unknown,
                })
            }
        }
    }

    fn sweep(&mut self, limit: usize) -> Result<SweepCounts, OpError> {
        let now = self.now;
        let mut counts = SweepCounts::default();
        let upper = (now.saturating_add(1), &[][..]);
        // Stale PROCESSING → UNKNOWN. Lease ends are exclusive: a lease ending
        // at `now` has run out.
        let stale = first_keys(&self.leases, upper, limit)?;
        counts.more |= stale.len() == limit;
        for (at, rkey) in stale {
            match self.get_raw(&rkey)? {
                Some(Ok(rec))
                    if rec.state == DiskState::Processing && rec.lease_until_ms <= now =>
                {
                    let key = IdempotencyKey::from_record_key(&rkey);
                    let shown = key.as_ref().map_or_else(|| hex(&rkey), ToString::to_string);
                    let reason = format!(
                        "lease ran out at {} ms without an outcome",
                        rec.lease_until_ms
                    );
                    tracing::warn!(key = %shown, token = rec.token, "stale claim moved to UNKNOWN");
                    let lease_end = rec.lease_until_ms;
                    self.unknown_record(&rkey, rec, reason, lease_end)?;
                    counts.moved_to_unknown += 1;
                }
                // An index entry that does not match its record: drop it so
                // the sweep cannot spin on it.
                _ => {
                    self.leases.remove((at, rkey.as_slice()))?;
                }
            }
        }
        let expired = first_keys(&self.expiry, upper, limit)?;
        counts.more |= expired.len() == limit;
        for (at, rkey) in expired {
            match self.get_raw(&rkey)? {
                Some(Ok(rec)) if rec.expires_at_ms == at && rec.expires_at_ms <= now => {
                    let keep = match (rec.state, self.cfg.expiry) {
                        (
                            DiskState::Completed | DiskState::FailedFinal,
                            ExpiryPolicy::Tombstone { keep_ms },
                        ) => Some(rec.expires_at_ms.saturating_add(keep_ms)).filter(|&t| t > now),
                        _ => None,
                    };
                    match keep {
                        Some(until) => {
                            let mut new = rec.clone();
                            new.state = DiskState::Tombstone;
                            new.expired_at_ms = rec.expires_at_ms;
                            new.expires_at_ms = until;
                            new.response = None;
                            new.updated_at_ms = now;
                            self.put(&rkey, Some(&rec), &new)?;
                            counts.tombstoned += 1;
                        }
                        None => {
                            self.delete(&rkey, &rec)?;
                            counts.deleted += 1;
                        }
                    }
                }
                _ => {
                    self.expiry.remove((at, rkey.as_slice()))?;
                }
            }
        }
        Ok(counts)
    }

    /// The record if `token` still owns it and it awaits an outcome
    /// (PROCESSING, or UNKNOWN that its own holder may still resolve).
    fn owned(
        &self,
        key: &IdempotencyKey,
        rkey: &[u8],
        token: u64,
        action: &'static str,
    ) -> Result<Record, OpError> {
        match self.get(key, rkey)? {
            Some(rec)
                if rec.token == token
                    && matches!(rec.state, DiskState::Processing | DiskState::Unknown) =>
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

    fn mark_unknown(
        &mut self,
        key: &IdempotencyKey,
        rkey: &[u8],
        rec: Record,
        reason: String,
        lease_end: u64,
    ) -> Result<Record, OpError> {
        tracing::warn!(key = %key, token = rec.token, %reason, "moved to UNKNOWN");
        self.unknown_record(rkey, rec, reason, lease_end)
    }

    /// PROCESSING → UNKNOWN. `lease_end` is kept as the instant from which a
    /// resolver may settle the record (see `Pending::resolvable_at_ms`).
    fn unknown_record(
        &mut self,
        rkey: &[u8],
        rec: Record,
        reason: String,
        lease_end: u64,
    ) -> Result<Record, OpError> {
        let mut new = rec.clone();
        new.state = DiskState::Unknown;
        new.lease_until_ms = lease_end;
        new.unknown_since_ms = self.now;
        new.updated_at_ms = self.now;
        new.reason = reason;
        self.put(rkey, Some(&rec), &new)?;
        Ok(new)
    }

    fn get(&self, key: &IdempotencyKey, rkey: &[u8]) -> Result<Option<Record>, OpError> {
        match self.get_raw(rkey)? {
            None => Ok(None),
            Some(Ok(rec)) => Ok(Some(rec)),
            Some(Err(e)) => Err(OpError::Refused(Error::CorruptRecord {
                key: key.to_string(),
                reason: e.to_string(),
            })),
        }
    }

    fn get_raw(
        &self,
        rkey: &[u8],
    ) -> Result<Option<Result<Record, codec::DecodeError>>, redb::StorageError> {
        Ok(self.records.get(rkey)?.map(|v| codec::decode(v.value())))
    }

    /// Writes `new` over `old`, moving the record between index tables.
    fn put(
        &mut self,
        rkey: &[u8],
        old: Option<&Record>,
        new: &Record,
    ) -> Result<(), redb::StorageError> {
        if let Some(old) = old {
            self.unindex(rkey, old)?;
        }
        self.index(rkey, new)?;
        self.records.insert(rkey, codec::encode(new).as_slice())?;
        Ok(())
    }

    fn delete(&mut self, rkey: &[u8], old: &Record) -> Result<(), redb::StorageError> {
        self.unindex(rkey, old)?;
        self.records.remove(rkey)?;
        Ok(())
    }

    fn index(&mut self, rkey: &[u8], rec: &Record) -> Result<(), redb::StorageError> {
        match rec.state {
            DiskState::Processing => self.leases.insert((rec.lease_until_ms, rkey), ())?,
            DiskState::Unknown => self.recovery.insert((rec.unknown_since_ms, rkey), ())?,
            _ => self.expiry.insert((rec.expires_at_ms, rkey), ())?,
        };
        Ok(())
    }

    fn unindex(&mut self, rkey: &[u8], rec: &Record) -> Result<(), redb::StorageError> {
        match rec.state {
            DiskState::Processing => self.leases.remove((rec.lease_until_ms, rkey))?,
            DiskState::Unknown => self.recovery.remove((rec.unknown_since_ms, rkey))?,
            _ => self.expiry.remove((rec.expires_at_ms, rkey))?,
        };
        Ok(())
    }
}

/// Up to `limit` index entries below `upper`, oldest first.
fn first_keys(
    table: &Table<'_, (u64, &'static [u8]), ()>,
    upper: (u64, &[u8]),
    limit: usize,
) -> Result<Vec<(u64, Vec<u8>)>, redb::StorageError> {
    let mut out = Vec::new();
    for entry in table.range(..upper)?.take(limit) {
        let (k, _) = entry?;
        let (at, rkey) = k.value();
        out.push((at, rkey.to_vec()));
    }
    Ok(out)
}

fn fenced(key: &IdempotencyKey, token: u64, rec: &Record) -> OpError {
    let state = crate::State::from(rec.state);
    let reason = if rec.token != token {
        format!("the record now belongs to token {} ({state})", rec.token)
    } else {
        format!("the record is already {state}")
    };
    OpError::Refused(Error::Fenced {
        key: key.clone(),
        token,
        reason,
    })
}

/// The provider reference of a claim: `idem_<token hex>_<20 hex digits>`,
/// a blake3 hash of the record key and token. Stable for the claim, distinct
/// across keys, scopes and tokens, and printable ASCII (safe as a payment
/// provider's idempotency key or transaction id).
pub(crate) fn reference(rkey: &[u8], token: u64) -> String {
    let mut h = blake3::Hasher::new_derive_key("idempotency 2026-11-29 provider reference v1");
    h.update(&(rkey.len() as u64).to_le_bytes());
    h.update(rkey);
    h.update(&token.to_le_bytes());
    let hash = h.finalize();
    format!("idem_{token:x}_{}", hex(&hash.as_bytes()[..10]))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}
