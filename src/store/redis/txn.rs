//! One optimistic Redis transaction as the shared operations see it
//! (`store/ops.rs`). Reads are plain commands, each leaving a guard (the
//! bytes seen); writes are buffered, and a view of them answers later
//! reads of the same op (its own writes first). Nothing reaches the server
//! until the commit, one guarded script (`script.rs`).

use std::collections::{BTreeMap, HashMap};

use redis::Commands;

use crate::dead_letter::DeadLetter;
use crate::key::IdempotencyKey;
use crate::message::{OutboxEntry, OutgoingMessage};
use crate::store::codec::{self, DecodeError};
use crate::store::config::StoreConfig;
use crate::store::ops::{Loaded, LoadedStep, Txn};
use crate::store::record::{EntityState, Record, RecordState};
use crate::store::step::{HistoryRecord, StepRecord};

use super::conn::RedisConn;
use super::keys::{member, Keys};
use super::script::{Batch, Guard, Index, Was, Write};

/// A storage failure inside a Redis transaction: a read or a counter
/// increment failed (nothing of the op was written).
#[derive(Debug)]
pub(crate) struct Fault(pub(crate) redis::RedisError);

impl From<redis::RedisError> for Fault {
    fn from(e: redis::RedisError) -> Fault {
        Fault(e)
    }
}

/// A record's stored value: `"<token>:"` and the framed record.
pub(crate) fn encode_value(key: &IdempotencyKey, rec: &Record) -> Vec<u8> {
    let framed = codec::encode(key.record_key(), rec);
    let mut out = format!("{}:", rec.token).into_bytes();
    out.extend_from_slice(&framed);
    out
}

/// The token prefix and the framed bytes of a stored value.
pub(crate) fn split_value(bytes: &[u8]) -> Result<(u64, &[u8]), DecodeError> {
    let colon = bytes
        .iter()
        .take(21)
        .position(|&b| b == b':')
        .ok_or_else(|| DecodeError::Malformed("no token prefix".to_owned()))?;
    let token = std::str::from_utf8(&bytes[..colon])
        .ok()
        .and_then(|t| t.parse::<u64>().ok())
        .ok_or_else(|| DecodeError::Malformed("the token prefix is not a number".to_owned()))?;
    Ok((token, &bytes[colon + 1..]))
}

/// A record from its stored value. The checksum is checked on the framed
/// bytes as stored; a record stored with token 0 (a fast-path claim) takes
/// the prefix's token and the reference derived from it.
pub(crate) fn decode_value(rkey: &[u8], bytes: &[u8]) -> Result<Record, DecodeError> {
    let (token, framed) = split_value(bytes)?;
    let mut rec = codec::decode(rkey, framed)?;
    if rec.token == 0 {
        rec.token = token;
        rec.reference = crate::store::record::reference(rkey, token);
    }
    Ok(rec)
}

/// The index a record is listed in and its instant there.
pub(crate) fn index_of(rec: &Record) -> (Index, u64) {
    match rec.state {
        RecordState::Processing => (Index::Lease, rec.lease_until_ms),
        RecordState::Unknown => (Index::Recovery, rec.unknown_since_ms),
        _ => (Index::Expiry, rec.expires_at_ms),
    }
}

pub(crate) struct RedisTxn<'t> {
    pub(super) conn: &'t mut RedisConn,
    pub(super) keys: &'t Keys,
    pub(super) now: u64,
    pub(super) cfg: StoreConfig,
    pub(super) batch: Batch,
    /// String keys as this op sees them (read, then its own writes).
    strings: HashMap<Vec<u8>, Option<Vec<u8>>>,
    /// Step hashes, by key.
    steps: HashMap<Vec<u8>, BTreeMap<String, Vec<u8>>>,
    /// Log spans, by key.
    spans: HashMap<Vec<u8>, Option<(u32, u32)>>,
    /// Outbox messages known present (or not), by sequence.
    outbox: HashMap<u64, bool>,
    /// Dead letters as this op sees them (read, then its own writes).
    dead_letters: HashMap<u64, Option<Vec<u8>>>,
    /// Where each record this op read or wrote stands (by record key),
    /// as its guards prove: what a write of it must change in the indexes.
    placed: HashMap<Vec<u8>, Was>,
    /// Reads sent to the server.
    pub(super) reads: usize,
    /// The highest fencing token of a record this op loaded: a token it
    /// draws exceeds it even if the counter was reset.
    max_token: u64,
    /// The token counter was found holding no integer.
    pub(super) token_damaged: bool,
}

impl<'t> RedisTxn<'t> {
    pub(super) fn new(
        conn: &'t mut RedisConn,
        keys: &'t Keys,
        now: u64,
        cfg: StoreConfig,
    ) -> RedisTxn<'t> {
        RedisTxn {
            conn,
            keys,
            now,
            cfg,
            batch: Batch::default(),
            strings: HashMap::new(),
            steps: HashMap::new(),
            spans: HashMap::new(),
            outbox: HashMap::new(),
            dead_letters: HashMap::new(),
            placed: HashMap::new(),
            reads: 0,
            max_token: 0,
            token_damaged: false,
        }
    }

    /// Takes `value` as what `key`'s record holds without reading it (the
    /// bytes this engine wrote for a claim it holds, with no steps and no
    /// log; the claim script listed it in the lease index): the guards
    /// prove it at commit (the record's bytes, and one `EXISTS` that the
    /// step and log hashes are absent), and a wrong guess is a conflict,
    /// after which the op runs again on real reads.
    pub(super) fn assume_record(&mut self, key: &IdempotencyKey, value: Vec<u8>) {
        let m = member(key);
        let rkey = self.keys.record(&m);
        self.batch
            .guards
            .push(Guard::Str(rkey.clone(), Some(value.clone())));
        self.strings.insert(rkey.clone(), Some(value));
        self.placed.insert(rkey, Was::In(Index::Lease));
        let skey = self.keys.steps(&m);
        let hkey = self.keys.history(&m);
        self.batch
            .guards
            .push(Guard::Absent(vec![skey.clone(), hkey.clone()]));
        self.steps.insert(skey, BTreeMap::new());
        self.spans.insert(hkey, None);
    }

    /// A string key's bytes as this op sees them (read once, guarded).
    pub(super) fn load_str(&mut self, key: Vec<u8>) -> Result<Option<Vec<u8>>, Fault> {
        if let Some(seen) = self.strings.get(&key) {
            return Ok(seen.clone());
        }
        self.reads += 1;
        let value: Option<Vec<u8>> = self.conn.conn.get(&key)?;
        self.batch
            .guards
            .push(Guard::Str(key.clone(), value.clone()));
        self.strings.insert(key, value.clone());
        Ok(value)
    }

    fn set_str(&mut self, key: Vec<u8>, value: Option<Vec<u8>>) {
        self.strings.insert(key, value);
    }

    /// An app key's bytes as this op will leave them (a local write).
    pub(super) fn set_app(&mut self, key: Vec<u8>, value: Option<Vec<u8>>) {
        self.set_str(key, value);
    }

    fn steps_of(&mut self, key: &IdempotencyKey) -> Result<Vec<u8>, Fault> {
        let skey = self.keys.steps(&member(key));
        if !self.steps.contains_key(&skey) {
            self.reads += 1;
            let pairs: Vec<(Vec<u8>, Vec<u8>)> = self.conn.conn.hgetall(&skey)?;
            let mut pairs = pairs;
            pairs.sort();
            let view = pairs
                .iter()
                .map(|(f, v)| (String::from_utf8_lossy(f).into_owned(), v.clone()))
                .collect();
            self.batch.guards.push(Guard::Hash(skey.clone(), pairs));
            self.steps.insert(skey.clone(), view);
        }
        Ok(skey)
    }

    fn span_of(&mut self, key: &IdempotencyKey) -> Result<Vec<u8>, Fault> {
        let hkey = self.keys.history(&member(key));
        if !self.spans.contains_key(&hkey) {
            self.reads += 1;
            let fields: Vec<Vec<u8>> = self.conn.conn.hkeys(&hkey)?;
            let seqs: Vec<u32> = fields
                .iter()
                .filter_map(|f| std::str::from_utf8(f).ok()?.parse().ok())
                .collect();
            let span = seqs.iter().min().copied().zip(seqs.iter().max().copied());
            let ends = span.map(|(f, l)| (f.to_string().into_bytes(), l.to_string().into_bytes()));
            self.batch
                .guards
                .push(Guard::Span(hkey.clone(), fields.len(), ends));
            self.spans.insert(hkey.clone(), span);
        }
        Ok(hkey)
    }
}

impl Txn for RedisTxn<'_> {
    type Fatal = Fault;

    fn now(&self) -> u64 {
        self.now
    }

    fn cfg(&self) -> StoreConfig {
        self.cfg
    }

    fn load(&mut self, key: &IdempotencyKey) -> Result<Loaded<Record>, Fault> {
        let rkey = self.keys.record(&member(key));
        let bytes = match self.load_str(rkey.clone()) {
            Err(Fault(e)) if super::conn::wrong_type(&e) => {
                return Ok(Some(Err(DecodeError::Malformed(
                    "its record's Redis key holds another type (WRONGTYPE): something else \
                     wrote under the prefix"
                        .to_owned(),
                ))))
            }
            other => other?,
        };
        let loaded = bytes.map(|b| decode_value(key.record_key(), &b));
        let was = match &loaded {
            None => Was::New,
            Some(Ok(rec)) => {
                self.max_token = self.max_token.max(rec.token);
                Was::In(index_of(rec).0)
            }
            Some(Err(_)) => Was::Unknown,
        };
        self.placed.insert(rkey, was);
        Ok(loaded)
    }

    fn store(
        &mut self,
        key: &IdempotencyKey,
        _old: Option<&Record>,
        new: &Record,
    ) -> Result<(), Fault> {
        let m = member(key);
        let rkey = self.keys.record(&m);
        let value = encode_value(key, new);
        let (index, score) = index_of(new);
        self.set_str(rkey.clone(), Some(value.clone()));
        let was = self
            .placed
            .insert(rkey.clone(), Was::In(index))
            .unwrap_or(Was::Unknown);
        self.batch.writes.push(Write::Record {
            key: rkey,
            member: m,
            value,
            index,
            score,
            was,
        });
        Ok(())
    }

    fn remove(&mut self, key: &IdempotencyKey, _old: Option<&Record>) -> Result<(), Fault> {
        let m = member(key);
        let rkey = self.keys.record(&m);
        self.set_str(rkey.clone(), None);
        self.placed.insert(rkey.clone(), Was::New);
        self.batch.writes.push(Write::Unrecord {
            key: rkey,
            member: m,
        });
        Ok(())
    }

    fn next_token(&mut self) -> Result<u64, Fault> {
        // Drawn now, after the op's reads: the token exceeds that of any
        // record the commit's guards then prove unchanged. A token of an
        // op that conflicts is never used (gaps are harmless). A counter
        // found below a loaded record's token (reset, restored) is not
        // trusted: the token is one above that record's, and the commit
        // raises the counter to it so later draws exceed it too.
        let drawn: u64 = self
            .conn
            .conn
            .incr(&self.keys.token, 1u64)
            .inspect_err(|e| self.token_damaged = super::conn::not_integer(e))?;
        if drawn > self.max_token {
            return Ok(drawn);
        }
        let token = self.max_token.saturating_add(1);
        self.max_token = token;
        self.batch
            .writes
            .push(Write::Raise(self.keys.token.as_bytes().to_vec(), token));
        Ok(token)
    }

    fn push_outbox(&mut self, id: String, message: OutgoingMessage) -> Result<(), Fault> {
        let seq: u64 = self.conn.conn.incr(&self.keys.outbox_next, 1u64)?;
        let entry = OutboxEntry {
            seq,
            id,
            topic: message.topic,
            payload: message.payload,
            created_at_ms: self.now,
        };
        let bytes = codec::encode_outbox(seq, &entry);
        let field = seq.to_string().into_bytes();
        self.outbox.insert(seq, true);
        self.batch.writes.push(Write::HSet(
            self.keys.outbox.as_bytes().to_vec(),
            field.clone(),
            bytes,
        ));
        self.batch.writes.push(Write::ZAdd(
            self.keys.outbox_order.as_bytes().to_vec(),
            seq,
            field,
        ));
        Ok(())
    }

    fn remove_outbox(&mut self, seq: u64) -> Result<bool, Fault> {
        let field = seq.to_string().into_bytes();
        let present = if let Some(&present) = self.outbox.get(&seq) {
            present
        } else {
            self.reads += 1;
            let present: bool = self.conn.conn.hexists(&self.keys.outbox, &field)?;
            self.batch.guards.push(Guard::Field(
                self.keys.outbox.as_bytes().to_vec(),
                field.clone(),
                present,
            ));
            present
        };
        if present {
            self.outbox.insert(seq, false);
            self.batch.writes.push(Write::HDel(
                self.keys.outbox.as_bytes().to_vec(),
                field.clone(),
            ));
            self.batch.writes.push(Write::ZRem(
                self.keys.outbox_order.as_bytes().to_vec(),
                field,
            ));
        }
        Ok(present)
    }

    fn push_dead_letter(&mut self, mut letter: DeadLetter) -> Result<u64, Fault> {
        let seq: u64 = self.conn.conn.incr(&self.keys.dead_letters_next, 1u64)?;
        letter.seq = seq;
        letter.dead_at_ms = self.now;
        let bytes = codec::encode_dead_letter(seq, &letter);
        let field = seq.to_string().into_bytes();
        self.dead_letters.insert(seq, Some(bytes.clone()));
        self.batch.writes.push(Write::HSet(
            self.keys.dead_letters.as_bytes().to_vec(),
            field.clone(),
            bytes,
        ));
        self.batch.writes.push(Write::ZAdd(
            self.keys.dead_letters_order.as_bytes().to_vec(),
            seq,
            field,
        ));
        Ok(seq)
    }

    fn load_dead_letter(&mut self, seq: u64) -> Result<Loaded<DeadLetter>, Fault> {
        let bytes = if let Some(seen) = self.dead_letters.get(&seq) {
            seen.clone()
        } else {
            self.reads += 1;
            let field = seq.to_string().into_bytes();
            let bytes: Option<Vec<u8>> = self.conn.conn.hget(&self.keys.dead_letters, &field)?;
            // A letter is written once and never changed, so its presence
            // is all the commit must prove: two redrives of one letter
            // cannot both commit.
            self.batch.guards.push(Guard::Field(
                self.keys.dead_letters.as_bytes().to_vec(),
                field,
                bytes.is_some(),
            ));
            self.dead_letters.insert(seq, bytes.clone());
            bytes
        };
        Ok(bytes.map(|b| codec::decode_dead_letter(seq, &b)))
    }

    fn remove_dead_letter(&mut self, seq: u64) -> Result<(), Fault> {
        let field = seq.to_string().into_bytes();
        self.dead_letters.insert(seq, None);
        self.batch.writes.push(Write::HDel(
            self.keys.dead_letters.as_bytes().to_vec(),
            field.clone(),
        ));
        self.batch.writes.push(Write::ZRem(
            self.keys.dead_letters_order.as_bytes().to_vec(),
            field,
        ));
        Ok(())
    }

    fn load_entity(&mut self, entity: &str) -> Result<Loaded<EntityState>, Fault> {
        let bytes = self.load_str(self.keys.entity(entity))?;
        Ok(bytes.map(|b| codec::decode_entity(entity, &b)))
    }

    fn store_entity(&mut self, entity: &str, state: &EntityState) -> Result<(), Fault> {
        let ekey = self.keys.entity(entity);
        let bytes = codec::encode_entity(entity, state);
        self.set_str(ekey.clone(), Some(bytes.clone()));
        self.batch.writes.push(Write::Set(ekey, bytes));
        Ok(())
    }

    fn load_steps(&mut self, key: &IdempotencyKey) -> Result<Vec<LoadedStep>, Fault> {
        let skey = self.steps_of(key)?;
        let view = self.steps.get(&skey).cloned().unwrap_or_default();
        Ok(view
            .into_iter()
            .map(|(name, bytes)| {
                let step = codec::decode_step(key.record_key(), &name, &bytes);
                (name, step)
            })
            .collect())
    }

    fn store_step(&mut self, key: &IdempotencyKey, step: &StepRecord) -> Result<(), Fault> {
        let skey = self.steps_of(key)?;
        let bytes = codec::encode_step(key.record_key(), step);
        if let Some(view) = self.steps.get_mut(&skey) {
            view.insert(step.name.clone(), bytes.clone());
        }
        self.batch
            .writes
            .push(Write::HSet(skey, step.name.as_bytes().to_vec(), bytes));
        Ok(())
    }

    fn remove_steps(&mut self, key: &IdempotencyKey) -> Result<(), Fault> {
        let skey = self.keys.steps(&member(key));
        self.steps.insert(skey.clone(), BTreeMap::new());
        self.batch.writes.push(Write::Del(skey));
        Ok(())
    }

    fn history_span(&mut self, key: &IdempotencyKey) -> Result<Option<(u32, u32)>, Fault> {
        let hkey = self.span_of(key)?;
        Ok(self.spans.get(&hkey).copied().flatten())
    }

    fn append_history(&mut self, key: &IdempotencyKey, entry: &HistoryRecord) -> Result<(), Fault> {
        let hkey = self.span_of(key)?;
        let bytes = codec::encode_history(key.record_key(), entry);
        let span = self.spans.get(&hkey).copied().flatten();
        let seq = entry.seq;
        let span = span.map_or((seq, seq), |(f, l)| (f.min(seq), l.max(seq)));
        self.spans.insert(hkey.clone(), Some(span));
        self.batch
            .writes
            .push(Write::HSet(hkey, seq.to_string().into_bytes(), bytes));
        Ok(())
    }

    fn remove_history(&mut self, key: &IdempotencyKey) -> Result<(), Fault> {
        let hkey = self.keys.history(&member(key));
        self.spans.insert(hkey.clone(), None);
        self.batch.writes.push(Write::Del(hkey));
        Ok(())
    }
}
