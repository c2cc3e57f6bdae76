//! The fast path of a fresh claim: one script reads the key's record and,
//! only when there is none, stores the claim's PROCESSING record with a
//! token drawn inside the script (`INCR` of the token counter), and lists
//! it. With `appendfsync always`, every round trip that writes waits for
//! an fsync, so a request costs what the hand-written "Lua claim, then
//! completion SET" costs: this script, then one guarded completion.
//!
//! The record's bytes are made before the token is known, so they carry
//! token 0 and no reference; the value's `"<token>:"` prefix is
//! authoritative (see `keys.rs`).

use parking_lot::Mutex;
use std::collections::HashMap;
use std::hash::BuildHasher;

use crate::error::{Corrupted, Error, Result};
use crate::key::IdempotencyKey;
use crate::store::record::Record;
use crate::store::{ClaimRequest, Claimed, ReadOrClaim};

use super::conn::{lost, storage};
use super::keys::member;
use super::shared::mark_broken;
use super::shared::Shared;
use super::txn::decode_value;

/// The claim-or-read script. Answers `{token, ''}` for a claim it stored
/// (its value is `"<token>:"` and the bytes sent, which the caller has:
/// not sending them back saves the reply's bytes and their parse),
/// `{0, value}` for a record that was there, and `{-1, ''}` for a key with
/// effect steps but no record (a store written before a released resume
/// kept its record: the full claim decides).
pub(super) const CLAIM: &str = r"
local v = redis.call('GET', KEYS[1])
if v then return {0, v} end
if redis.call('EXISTS', KEYS[5]) == 1 then return {-1, ''} end
local t = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], string.format('%d', t) .. ':' .. ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
redis.call('ZADD', KEYS[4], 0, ARGV[1])
return {t, ''}
";

/// Claims this engine holds, with the bytes it wrote for each: a
/// completion of one is one guarded script against those bytes, with no
/// read first. Bounded; a claim not remembered takes the read path. Split
/// in [`SHARDS`] maps by the member's hash, so the client threads of one
/// engine do not all wait on one lock.
pub(super) struct Remembered {
    shards: Vec<Mutex<HashMap<Vec<u8>, Claim>>>,
    hasher: std::collections::hash_map::RandomState,
}

impl Default for Remembered {
    fn default() -> Remembered {
        Remembered {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: std::collections::hash_map::RandomState::new(),
        }
    }
}

/// A remembered claim: its token and the value stored for it.
type Claim = (u64, Vec<u8>);

/// Claims remembered at most (over all shards).
const REMEMBERED: usize = 4_096;

/// Maps [`Remembered`] is split in.
const SHARDS: usize = 16;

impl Remembered {
    fn shard(&self, m: &[u8]) -> &Mutex<HashMap<Vec<u8>, Claim>> {
        let at = usize::try_from(self.hasher.hash_one(m)).unwrap_or_default() % SHARDS;
        &self.shards[at]
    }

    pub(super) fn insert(&self, key: &IdempotencyKey, token: u64, value: Vec<u8>) {
        let m = member(key);
        let mut map = self.shard(&m).lock();
        if map.len() < REMEMBERED / SHARDS {
            map.insert(m, (token, value));
        }
    }

    /// The bytes written for claim `token` of `key`, forgotten here.
    pub(super) fn take(&self, key: &IdempotencyKey, token: u64) -> Option<Vec<u8>> {
        let m = member(key);
        let mut map = self.shard(&m).lock();
        match map.get(&m) {
            Some((t, _)) if *t == token => map.remove(&m).map(|(_, v)| v),
            _ => None,
        }
    }

    pub(super) fn forget(&self, key: &IdempotencyKey) {
        let m = member(key);
        self.shard(&m).lock().remove(&m);
    }
}

impl Shared {
    /// `begin`'s first step, and a claim's fast path, in one script. A
    /// connection found lost is replaced and the script sent again: if the
    /// first one did claim (its answer lost), the second finds that record
    /// and answers it as held (PROCESSING, UNKNOWN once its lease ends),
    /// never as a second claim.
    pub(super) fn claim_or_read(
        &self,
        req: &ClaimRequest,
        remembered: &Remembered,
    ) -> Result<ReadOrClaim> {
        let what = "claiming a key";
        let now = self.clock.now_ms();
        let (rec, _) = crate::store::ops::fresh_claim(req, 0, now);
        let rec = Record {
            reference: String::new(),
            ..rec
        };
        let framed = crate::store::codec::encode(req.key.record_key(), &rec);
        let m = member(&req.key);
        let rkey = self.keys.record(&m);
        let skey = self.keys.steps(&m);
        let mut cmd = redis::Cmd::with_capacity(13, framed.len() + 2 * rkey.len() + 256);
        cmd.arg("EVALSHA")
            .arg(self.claim_script.get_hash())
            .arg(5)
            .arg(&rkey)
            .arg(&self.keys.token)
            .arg(&self.keys.lease)
            .arg(&self.keys.all)
            .arg(&skey)
            .arg(&m)
            .arg(&framed)
            // A score as Redis reads it (see `script::Arg::Num`).
            .arg(rec.lease_until_ms);
        let invoke = |c: &mut redis::Connection| -> redis::RedisResult<(i64, Vec<u8>)> {
            super::script::eval(c, &self.claim_script, &cmd)
        };
        let mut left = self.pool.max_size();
        let (token, value) = loop {
            let mut conn = self.conn(what)?;
            match invoke(&mut conn.conn) {
                Ok((token, value)) => {
                    // A claim is a write: with `wait_replicas` it waits too
                    // (a failover that lost it would let another engine
                    // claim again).
                    if token > 0 {
                        self.wait_replicas(what, &mut conn.conn)?;
                    }
                    break (token, value);
                }
                Err(e) if lost(&e) && !e.is_timeout() && left > 0 => {
                    mark_broken(&mut conn);
                    left -= 1;
                }
                Err(e) if super::conn::wrong_type(&e) => {
                    return Err(super::conn::wrong_type_record(&req.key));
                }
                Err(e) if super::conn::not_integer(&e) => {
                    return Err(super::conn::token_counter_damaged(&e));
                }
                Err(e) => {
                    if lost(&e) {
                        mark_broken(&mut conn);
                    }
                    return Err(storage(what)(e));
                }
            }
        };
        match token {
            -1 => Ok(ReadOrClaim::Read(None)),
            0 => decode_value(req.key.record_key(), &value)
                .map(|rec| ReadOrClaim::Read(Some(rec)))
                .map_err(|e| Error::Corrupt {
                    what: Corrupted::Record(req.key.clone()),
                    reason: e.to_string(),
                }),
            t => {
                let token = u64::try_from(t).map_err(|_| {
                    storage(what)(redis::RedisError::from((
                        redis::ErrorKind::UnexpectedReturnType,
                        "a negative fencing token",
                    )))
                })?;
                // The value the script stored (see `CLAIM`).
                let mut value = Vec::with_capacity(framed.len() + 21);
                value.extend_from_slice(token.to_string().as_bytes());
                value.push(b':');
                value.extend_from_slice(&framed);
                remembered.insert(&req.key, token, value);
                let reference = crate::store::record::reference(req.key.record_key(), token);
                tracing::debug!(key = %req.key, token, reference = %reference, "claimed");
                Ok(ReadOrClaim::Claimed(Claimed {
                    token,
                    reference,
                    claimed_at_ms: now,
                    lease_until_ms: rec.lease_until_ms,
                    steps: Vec::new(),
                }))
            }
        }
    }
}
