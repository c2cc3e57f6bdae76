//! Reads: plain commands outside any script, each seeing the last commit.
//! A read of several keys that must agree (a key's steps and its record)
//! is one `MULTI`/`EXEC`.

use crate::dead_letter::DeadLetter;
use crate::error::{Corrupted, Error, Result};
use crate::key::IdempotencyKey;
use crate::message::OutboxEntry;
use crate::store::codec;
use crate::store::record::{EntityState, Record, RecordState};
use crate::store::step::{HistoryRecord, StepRecord};
use crate::store::Scanned;

use super::keys::{key_of, member};
use super::shared::Shared;
use super::txn::decode_value;

/// A hash's fields and values.
type Pairs = Vec<(String, Vec<u8>)>;

/// Records per page of a listing.
const SCAN_PAGE: usize = 1_000;

fn corrupt(key: &IdempotencyKey) -> impl Fn(codec::DecodeError) -> Error + '_ {
    move |e| Error::Corrupt {
        what: Corrupted::Record(key.clone()),
        reason: e.to_string(),
    }
}

/// A read met a key of another Redis type (see [`typed`]).
pub(super) struct WrongType;

/// A read's answer, with `WRONGTYPE` (a key of another Redis type) kept
/// apart from the failures of the server or the connection.
pub(super) fn typed<T>(r: redis::RedisResult<T>) -> redis::RedisResult<Result<T, WrongType>> {
    match r {
        Err(e) if super::conn::wrong_type(&e) => Ok(Err(WrongType)),
        other => other.map(Ok),
    }
}

impl Shared {
    pub(super) fn record(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        let rkey = self.keys.record(&member(key));
        let bytes: Option<Vec<u8>> = self
            .read("reading a record", |c| {
                typed(redis::cmd("GET").arg(&rkey).query(c))
            })?
            .map_err(|WrongType| super::conn::wrong_type_record(key))?;
        bytes
            .map(|b| decode_value(key.record_key(), &b).map_err(corrupt(key)))
            .transpose()
    }

    /// Up to `limit` members of `index` with scores in `[min, max]`, with
    /// their scores, lowest first.
    fn range(
        &self,
        what: &'static str,
        index: &str,
        max: u64,
        limit: usize,
    ) -> Result<Vec<(Vec<u8>, f64)>> {
        self.read(what, |c| {
            redis::cmd("ZRANGE")
                .arg(index)
                .arg("-inf")
                .arg(max)
                .arg("BYSCORE")
                .arg("LIMIT")
                .arg(0)
                // Redis takes a signed 64-bit count: `usize::MAX` ("no
                // limit", as `idem unknown` asks) is refused as out of range.
                .arg(i64::try_from(limit).unwrap_or(i64::MAX))
                .arg("WITHSCORES")
                .query(c)
        })
    }

    /// The records of `members` (absent ones as `None`), in one `MGET`.
    fn records_of(&self, what: &'static str, members: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>> {
        if members.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<Vec<u8>> = members.iter().map(|m| self.keys.record(m)).collect();
        self.read(what, |c| redis::cmd("MGET").arg(&keys).query(c))
    }

    pub(super) fn in_doubt(
        &self,
        limit: usize,
        now_ms: u64,
    ) -> Result<Vec<(IdempotencyKey, Record)>> {
        let what = "reading the recovery queue";
        if limit == 0 {
            return Ok(Vec::new());
        }
        let unknown = self.range(what, &self.keys.recovery, u64::MAX, limit)?;
        let stale = self.range(what, &self.keys.lease, now_ms, limit)?;
        let members: Vec<Vec<u8>> = unknown
            .iter()
            .chain(&stale)
            .map(|(m, _)| m.clone())
            .collect();
        let values = self.records_of(what, &members)?;
        let mut found = Vec::with_capacity(members.len());
        for (kind, (m, bytes)) in members.iter().zip(values).enumerate() {
            let kind = usize::from(kind >= unknown.len());
            let (Ok(key), Some(bytes)) = (key_of(m), bytes) else {
                continue;
            };
            match decode_value(key.record_key(), &bytes) {
                // The index may lag a record another engine just changed:
                // the record's own state decides.
                Ok(rec) if rec.state == RecordState::Unknown => {
                    found.push((rec.unknown_since_ms, 0, key, rec));
                }
                Ok(rec) if rec.state == RecordState::Processing && rec.lease_until_ms <= now_ms => {
                    found.push((rec.lease_until_ms, 1, key, rec));
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::error!(key = %key, kind, error = %e, "skipping a corrupt in-doubt record");
                }
            }
        }
        // The order of the other backends: by the instant each came into
        // doubt, UNKNOWN first at the same instant, then by record key.
        found.sort_by(|a, b| (a.0, a.1, a.2.record_key()).cmp(&(b.0, b.1, b.2.record_key())));
        found.truncate(limit);
        Ok(found.into_iter().map(|(_, _, k, r)| (k, r)).collect())
    }

    /// Every record in (scope, key) byte order, a page at a time, until
    /// `visit` returns false.
    pub(super) fn scan(&self, visit: &mut (dyn FnMut(Scanned) -> bool + Send)) -> Result<()> {
        let what = "listing records";
        let mut after: Option<Vec<u8>> = None;
        loop {
            let start = match &after {
                None => b"-".to_vec(),
                Some(m) => {
                    let mut s = b"(".to_vec();
                    s.extend_from_slice(m);
                    s
                }
            };
            let members: Vec<Vec<u8>> = self.read(what, |c| {
                redis::cmd("ZRANGE")
                    .arg(&self.keys.all)
                    .arg(&start)
                    .arg("+")
                    .arg("BYLEX")
                    .arg("LIMIT")
                    .arg(0)
                    .arg(SCAN_PAGE)
                    .query(c)
            })?;
            let values = self.records_of(what, &members)?;
            for (m, bytes) in members.iter().zip(values) {
                // Deleted since the page was read.
                let Some(bytes) = bytes else { continue };
                let key = key_of(m);
                let rkey = match &key {
                    Ok(k) => k.record_key().to_vec(),
                    Err(raw) => raw.clone(),
                };
                if !visit((key, decode_value(&rkey, &bytes))) {
                    return Ok(());
                }
            }
            if members.len() < SCAN_PAGE {
                return Ok(());
            }
            after = members.last().cloned();
        }
    }

    pub(super) fn oldest_in_doubt_ms(&self, now_ms: u64) -> Result<Option<u64>> {
        let what = "reading the recovery queue";
        let unknown = self.range(what, &self.keys.recovery, u64::MAX, 1)?;
        let stale = self.range(what, &self.keys.lease, now_ms, 1)?;
        Ok(unknown
            .iter()
            .chain(&stale)
            .map(|(_, score)| score_ms(*score))
            .min())
    }

    pub(super) fn sweep_due(&self, now_ms: u64) -> Result<bool> {
        let what = "checking for sweep work";
        let count = |index: &str| -> Result<u64> {
            self.read(what, |c| {
                redis::cmd("ZCOUNT")
                    .arg(index)
                    .arg("-inf")
                    .arg(now_ms)
                    .query(c)
            })
        };
        Ok(count(&self.keys.lease)? > 0 || count(&self.keys.expiry)? > 0)
    }

    pub(super) fn outbox(&self, limit: usize) -> Result<Vec<OutboxEntry>> {
        let what = "reading the outbox";
        if limit == 0 {
            return Ok(Vec::new());
        }
        let seqs: Vec<u64> = self.read(what, |c| {
            redis::cmd("ZRANGE")
                .arg(&self.keys.outbox_order)
                .arg(0)
                .arg(limit.saturating_sub(1))
                .query(c)
        })?;
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let values: Vec<Option<Vec<u8>>> = self.read(what, |c| {
            redis::cmd("HMGET")
                .arg(&self.keys.outbox)
                .arg(&seqs)
                .query(c)
        })?;
        let mut out = Vec::with_capacity(seqs.len());
        for (seq, bytes) in seqs.into_iter().zip(values) {
            let Some(bytes) = bytes else { continue };
            let entry = codec::decode_outbox(seq, &bytes).map_err(|e| Error::Corrupt {
                what: Corrupted::OutboxMessage(seq),
                reason: e.to_string(),
            })?;
            out.push(entry);
        }
        Ok(out)
    }

    /// Up to `limit` dead letters, oldest first.
    pub(super) fn dead_letters(&self, limit: usize) -> Result<Vec<DeadLetter>> {
        let what = "reading the dead letters";
        if limit == 0 {
            return Ok(Vec::new());
        }
        let seqs: Vec<u64> = self.read(what, |c| {
            redis::cmd("ZRANGE")
                .arg(&self.keys.dead_letters_order)
                .arg(0)
                .arg(i64::try_from(limit - 1).unwrap_or(i64::MAX))
                .query(c)
        })?;
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let values: Vec<Option<Vec<u8>>> = self.read(what, |c| {
            redis::cmd("HMGET")
                .arg(&self.keys.dead_letters)
                .arg(&seqs)
                .query(c)
        })?;
        let mut out = Vec::with_capacity(seqs.len());
        for (seq, bytes) in seqs.into_iter().zip(values) {
            // Redriven since the order was read.
            let Some(bytes) = bytes else { continue };
            let letter = codec::decode_dead_letter(seq, &bytes).map_err(|e| Error::Corrupt {
                what: Corrupted::DeadLetter(seq),
                reason: e.to_string(),
            })?;
            out.push(letter);
        }
        Ok(out)
    }

    pub(super) fn outbox_len(&self) -> Result<u64> {
        self.read("counting the outbox", |c| {
            redis::cmd("ZCARD").arg(&self.keys.outbox_order).query(c)
        })
    }

    pub(super) fn entity(&self, entity: &str) -> Result<Option<EntityState>> {
        let ekey = self.keys.entity(entity);
        let bytes: Option<Vec<u8>> = self.read("reading an entity", |c| {
            redis::cmd("GET").arg(&ekey).query(c)
        })?;
        bytes
            .map(|b| {
                codec::decode_entity(entity, &b).map_err(|e| Error::Corrupt {
                    what: Corrupted::Entity(entity.to_owned()),
                    reason: e.to_string(),
                })
            })
            .transpose()
    }

    /// `key`'s effect steps in name order, as seen at `now_ms`, read in one
    /// `MULTI` with the record's claim.
    pub(super) fn steps(&self, key: &IdempotencyKey, now_ms: u64) -> Result<Vec<StepRecord>> {
        let m = member(key);
        let (skey, rkey) = (self.keys.steps(&m), self.keys.record(&m));
        let (pairs, record): (Pairs, Option<Vec<u8>>) = self.read("reading effect steps", |c| {
            redis::pipe()
                .atomic()
                .cmd("HGETALL")
                .arg(&skey)
                .cmd("GET")
                .arg(&rkey)
                .query(c)
        })?;
        let claim = record
            .map(|b| decode_value(key.record_key(), &b).map_err(corrupt(key)))
            .transpose()?
            .map(|rec| {
                let live = rec.state == RecordState::Processing && rec.lease_until_ms > now_ms;
                (rec.token, live)
            });
        let mut pairs = pairs;
        pairs.sort();
        let mut out = Vec::with_capacity(pairs.len());
        for (name, bytes) in pairs {
            let step = codec::decode_step(key.record_key(), &name, &bytes).map_err(|e| {
                Error::Corrupt {
                    what: Corrupted::Step {
                        key: key.clone(),
                        step: name.clone(),
                    },
                    reason: e.to_string(),
                }
            })?;
            out.push(step.as_seen(claim));
        }
        Ok(out)
    }

    /// `key`'s evidence log, oldest first.
    pub(super) fn history(&self, key: &IdempotencyKey) -> Result<Vec<HistoryRecord>> {
        let hkey = self.keys.history(&member(key));
        let pairs: Vec<(String, Vec<u8>)> = self.read("reading the evidence log", |c| {
            redis::cmd("HGETALL").arg(&hkey).query(c)
        })?;
        let mut entries = Vec::with_capacity(pairs.len());
        for (seq, bytes) in pairs {
            let seq = seq.parse::<u32>().unwrap_or(u32::MAX);
            let entry = codec::decode_history(key.record_key(), seq, &bytes).map_err(|e| {
                Error::Corrupt {
                    what: Corrupted::History {
                        key: key.clone(),
                        seq,
                    },
                    reason: e.to_string(),
                }
            })?;
            entries.push(entry);
        }
        entries.sort_by_key(|e| e.seq);
        Ok(entries)
    }
}

/// A ZSET score as ms (scores are whole ms; a negative or non-finite one,
/// which the engine never writes, reads as 0).
pub(super) fn score_ms(score: f64) -> u64 {
    if score.is_finite() && score > 0.0 {
        // Whole ms up to 2^53: exact.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let ms = score as u64;
        ms
    } else {
        0
    }
}
