//! Scrubbing a Redis store: every key under the prefix is one the engine
//! writes (anything else is reported: another writer shares the prefix),
//! every value decodes under its key, every record's token is at most the
//! token counter, the indexes (lease, recovery, expiry, and the listing
//! of every record) agree with the records both ways, and every key with
//! effect steps or log entries has a record.

use std::collections::{BTreeSet, HashMap, HashSet};

use crate::error::Result;
use crate::store::codec;
use crate::store::record::hex;
use crate::verify::Damage;

use super::keys::key_of;
use super::read::score_ms;
use super::read::{typed, WrongType};
use super::script::Index;
use super::shared::Shared;
use super::txn::{decode_value, index_of, split_value};

/// Keys asked of `SCAN` at a time.
const PAGE: usize = 1_000;

fn index_name(index: Index) -> &'static str {
    match index {
        Index::Lease => "leases",
        Index::Recovery => "recovery",
        Index::Expiry => "expiry",
    }
}

/// The lease, recovery and expiry indexes, each as member → score (ms).
type Indexes = Vec<(Index, HashMap<Vec<u8>, u64>)>;

/// The name damage reports give the listing of every record (`i:keys`).
const LISTING: &str = "listing";

impl Shared {
    /// Every index, as member → score.
    fn indexes(&self) -> Result<Indexes> {
        let mut indexes = Vec::new();
        for (index, name) in [
            (Index::Lease, &self.keys.lease),
            (Index::Recovery, &self.keys.recovery),
            (Index::Expiry, &self.keys.expiry),
        ] {
            let entries: Vec<(Vec<u8>, f64)> = self.read("verifying the Redis indexes", |c| {
                redis::cmd("ZRANGE")
                    .arg(name)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query(c)
            })?;
            let entries = entries.into_iter().map(|(m, s)| (m, score_ms(s))).collect();
            indexes.push((index, entries));
        }
        Ok(indexes)
    }

    /// The listing of every record, as its members.
    fn listing(&self) -> Result<HashSet<Vec<u8>>> {
        let members: Vec<Vec<u8>> = self.read("verifying the Redis indexes", |c| {
            redis::cmd("ZRANGE")
                .arg(&self.keys.all)
                .arg(0)
                .arg(-1)
                .query(c)
        })?;
        Ok(members.into_iter().collect())
    }

    /// Checks every key under the prefix. Not a snapshot: a record written
    /// during the scan may show as a stray or missing index entry; run it
    /// again to tell damage from traffic. Keys under a longer prefix that
    /// another engine uses (`ten:eu:` beside `ten:`, told by its
    /// `<prefix>meta`) are that engine's, not strangers: they are skipped.
    pub(super) fn verify(&self) -> Result<(Vec<Damage>, u64)> {
        let what = "verifying the Redis store";
        let p = self.keys.prefix.as_bytes();
        let mut problems = Vec::new();
        let mut checked = 0;
        let counter = self.token_counter(&mut problems)?;
        let indexes = self.indexes()?;
        let listing = self.listing()?;
        let fixed = [
            &self.keys.lease,
            &self.keys.recovery,
            &self.keys.expiry,
            &self.keys.all,
            &self.keys.outbox,
            &self.keys.outbox_order,
            &self.keys.outbox_next,
            &self.keys.dead_letters,
            &self.keys.dead_letters_order,
            &self.keys.dead_letters_next,
            &self.keys.token,
            &self.keys.meta,
        ];
        let mut pattern = p.to_vec();
        pattern.push(b'*');
        let mut cursor: u64 = 0;
        let mut records_seen: Vec<Vec<u8>> = Vec::new();
        // Members with steps or log entries (checked against the records
        // once the scan is done).
        let mut with_steps: BTreeSet<Vec<u8>> = BTreeSet::new();
        let mut nested: HashMap<Vec<u8>, bool> = HashMap::new();
        loop {
            let (next, keys): (u64, Vec<Vec<u8>>) = self.read(what, |c| {
                redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(PAGE)
                    .query(c)
            })?;
            for key in keys {
                let tail = &key[p.len()..];
                if fixed.iter().any(|f| f.as_bytes() == key.as_slice()) {
                    continue;
                }
                if let Some(m) = tail.strip_prefix(b"r:") {
                    checked += 1;
                    records_seen.push(m.to_vec());
                    self.check_record(&key, m, counter, &indexes, &mut problems)?;
                } else if let Some(m) = tail.strip_prefix(b"s:") {
                    self.check_hash(&key, m, false, &mut problems)?;
                    with_steps.insert(m.to_vec());
                } else if let Some(m) = tail.strip_prefix(b"h:") {
                    self.check_hash(&key, m, true, &mut problems)?;
                    with_steps.insert(m.to_vec());
                } else if let Some(entity) = tail.strip_prefix(b"e:") {
                    let entity = String::from_utf8_lossy(entity).into_owned();
                    let bytes: Option<Vec<u8>> =
                        self.read(what, |c| redis::cmd("GET").arg(&key).query(c))?;
                    if let Some(Err(e)) = bytes.map(|b| codec::decode_entity(&entity, &b)) {
                        problems.push(Damage::UndecodableEntity {
                            entity,
                            reason: e.to_string(),
                        });
                    }
                } else if self.nested_engine(&key, p.len(), &mut nested)? {
                    // Another engine's, on a longer prefix (`ten:eu:`
                    // under `ten:`): its own verify checks it.
                } else {
                    problems.push(Damage::ForeignKey {
                        key: String::from_utf8_lossy(&key).into_owned(),
                    });
                }
            }
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        // Index entries whose record is gone or belongs elsewhere.
        records_seen.sort();
        for (index, entries) in &indexes {
            for (m, &at_ms) in entries {
                if records_seen.binary_search(m).is_err() {
                    problems.push(Damage::StrayIndexEntry {
                        index: index_name(*index),
                        at_ms,
                        key_hex: hex(&rkey_of(m)),
                    });
                }
            }
        }
        check_listing(&listing, &records_seen, &mut problems);
        for m in with_steps {
            if records_seen.binary_search(&m).is_err() {
                problems.extend(self.steps_without_record(&m)?);
            }
        }
        self.check_outbox(&mut problems)?;
        self.check_dead_letters(&mut problems)?;
        Ok((problems, checked))
    }

    /// The fencing-token counter (0 when absent); one that is not an
    /// integer is listed (and counts as 0).
    fn token_counter(&self, problems: &mut Vec<Damage>) -> Result<u64> {
        let counter: Option<Vec<u8>> = self
            .read("verifying the Redis store", |c| {
                typed(redis::cmd("GET").arg(&self.keys.token).query(c))
            })?
            .unwrap_or_else(|WrongType| Some(b"(another Redis type)".to_vec()));
        let Some(bytes) = counter else {
            return Ok(0);
        };
        if let Some(n) = std::str::from_utf8(&bytes)
            .ok()
            .and_then(|t| t.parse().ok())
        {
            return Ok(n);
        }
        problems.push(Damage::BadMetaValue {
            key: self.keys.token.clone(),
            reason: format!(
                "the fencing-token counter holds {:?}, not an integer: no claim can draw a token",
                String::from_utf8_lossy(&bytes)
            ),
        });
        Ok(0)
    }

    /// Whether `key` lies under a longer prefix (this prefix, then more
    /// up to a `:`) on which an engine stores its settings (`<that
    /// prefix>meta` exists). Answers are kept in `seen`, by prefix.
    fn nested_engine(
        &self,
        key: &[u8],
        own: usize,
        seen: &mut HashMap<Vec<u8>, bool>,
    ) -> Result<bool> {
        for (i, &b) in key.iter().enumerate().skip(own) {
            if b != b':' {
                continue;
            }
            let nested = &key[..=i];
            let found = if let Some(&found) = seen.get(nested) {
                found
            } else {
                let mut meta = nested.to_vec();
                meta.extend_from_slice(b"meta");
                let found: bool = self.read("verifying the Redis store", |c| {
                    redis::cmd("EXISTS").arg(&meta).query(c)
                })?;
                seen.insert(nested.to_vec(), found);
                found
            };
            if found {
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn check_record(
        &self,
        key: &[u8],
        m: &[u8],
        counter: u64,
        indexes: &Indexes,
        problems: &mut Vec<Damage>,
    ) -> Result<()> {
        let rkey = rkey_of(m);
        let key_hex = hex(&rkey);
        if key_of(m).is_err() {
            problems.push(Damage::BadKey {
                key_hex: key_hex.clone(),
            });
        }
        let bytes = self.read("verifying a record", |c| {
            typed::<Option<Vec<u8>>>(redis::cmd("GET").arg(key).query(c))
        })?;
        let Ok(bytes) = bytes else {
            problems.push(Damage::Undecodable {
                key_hex,
                reason: "its Redis key holds another type than a record (WRONGTYPE)".to_owned(),
            });
            return Ok(());
        };
        let Some(bytes) = bytes else {
            return Ok(()); // deleted since the scan saw it
        };
        let rec = match decode_value(&rkey, &bytes) {
            Ok(rec) => rec,
            Err(e) => {
                problems.push(Damage::Undecodable {
                    key_hex,
                    reason: e.to_string(),
                });
                return Ok(());
            }
        };
        if let Ok((token, _)) = split_value(&bytes) {
            if token > counter {
                problems.push(Damage::Undecodable {
                    key_hex: key_hex.clone(),
                    reason: format!(
                        "its fencing token {token} is above the token counter {counter}: \
                         a later claim could be handed the same token"
                    ),
                });
            }
        }
        let (want, at_ms) = index_of(&rec);
        for (index, entries) in indexes {
            match (entries.get(m), *index == want) {
                (Some(&at), true) if at == at_ms || at_ms > (1 << 53) => {}
                (_, true) => problems.push(Damage::MissingIndexEntry {
                    index: index_name(want),
                    at_ms,
                    key_hex: key_hex.clone(),
                }),
                (Some(&at), false) => problems.push(Damage::StrayIndexEntry {
                    index: index_name(*index),
                    at_ms: at,
                    key_hex: key_hex.clone(),
                }),
                (None, false) => {}
            }
        }
        Ok(())
    }

    /// A key's steps (`history` false) or log entries decode.
    fn check_hash(
        &self,
        key: &[u8],
        m: &[u8],
        history: bool,
        problems: &mut Vec<Damage>,
    ) -> Result<()> {
        let rkey = rkey_of(m);
        let pairs: Vec<(Vec<u8>, Vec<u8>)> = self.read("verifying effect steps", |c| {
            redis::cmd("HGETALL").arg(key).query(c)
        })?;
        for (field, bytes) in pairs {
            let field = String::from_utf8_lossy(&field).into_owned();
            if history {
                let seq = field.parse::<u32>().unwrap_or(u32::MAX);
                if let Err(e) = codec::decode_history(&rkey, seq, &bytes) {
                    problems.push(Damage::UndecodableHistory {
                        key_hex: hex(&rkey),
                        seq,
                        reason: e.to_string(),
                    });
                }
            } else if let Err(e) = codec::decode_step(&rkey, &field, &bytes) {
                problems.push(Damage::UndecodableStep {
                    key_hex: hex(&rkey),
                    step: field,
                    reason: e.to_string(),
                });
            }
        }
        Ok(())
    }

    /// Member `m`'s steps and log entries, if it has no record: read in one
    /// `MULTI` (a script writes a record and its steps together, and
    /// deletes them together), so a key claimed or deleted while the scan
    /// ran is no false report.
    fn steps_without_record(&self, m: &[u8]) -> Result<Option<Damage>> {
        let (record, mut names, log_entries): (bool, Vec<Vec<u8>>, u64) =
            self.read("verifying effect steps", |c| {
                redis::pipe()
                    .atomic()
                    .cmd("EXISTS")
                    .arg(self.keys.record(m))
                    .cmd("HKEYS")
                    .arg(self.keys.steps(m))
                    .cmd("HLEN")
                    .arg(self.keys.history(m))
                    .query(c)
            })?;
        if record || (names.is_empty() && log_entries == 0) {
            return Ok(None);
        }
        names.sort();
        Ok(Some(Damage::StepsWithoutRecord {
            key_hex: hex(&rkey_of(m)),
            partition: None,
            record_in: None,
            steps: names
                .iter()
                .map(|n| String::from_utf8_lossy(n).into_owned())
                .collect(),
            log_entries,
        }))
    }

    fn check_outbox(&self, problems: &mut Vec<Damage>) -> Result<()> {
        let pairs: Vec<(String, Vec<u8>)> = self.read("verifying the outbox", |c| {
            redis::cmd("HGETALL").arg(&self.keys.outbox).query(c)
        })?;
        for (seq, bytes) in pairs {
            let seq = seq.parse::<u64>().unwrap_or(u64::MAX);
            if let Err(e) = codec::decode_outbox(seq, &bytes) {
                problems.push(Damage::UndecodableOutboxMessage {
                    seq,
                    reason: e.to_string(),
                });
            }
        }
        Ok(())
    }

    /// Every dead letter decodes, under its own sequence number.
    fn check_dead_letters(&self, problems: &mut Vec<Damage>) -> Result<()> {
        let pairs: Vec<(String, Vec<u8>)> = self.read("verifying the dead letters", |c| {
            redis::cmd("HGETALL").arg(&self.keys.dead_letters).query(c)
        })?;
        for (seq, bytes) in pairs {
            let seq = seq.parse::<u64>().unwrap_or(u64::MAX);
            if let Err(e) = codec::decode_dead_letter(seq, &bytes) {
                problems.push(Damage::UndecodableDeadLetter {
                    seq,
                    reason: e.to_string(),
                });
            }
        }
        Ok(())
    }
}

/// The listing against the records seen (sorted), both ways.
fn check_listing(listing: &HashSet<Vec<u8>>, records_seen: &[Vec<u8>], problems: &mut Vec<Damage>) {
    for m in records_seen {
        if !listing.contains(m) {
            problems.push(Damage::MissingIndexEntry {
                index: LISTING,
                at_ms: 0,
                key_hex: hex(&rkey_of(m)),
            });
        }
    }
    for m in listing {
        if records_seen.binary_search(m).is_err() {
            problems.push(Damage::StrayIndexEntry {
                index: LISTING,
                at_ms: 0,
                key_hex: hex(&rkey_of(m)),
            });
        }
    }
}

/// The record key bytes (`[scope length][scope][key]`) a member names.
fn rkey_of(m: &[u8]) -> Vec<u8> {
    match key_of(m) {
        Ok(key) => key.record_key().to_vec(),
        Err(raw) => raw,
    }
}
