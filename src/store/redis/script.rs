//! The one script every generic write commits with: a guarded write.
//!
//! An operation (`store/ops.rs`) runs against a [`super::txn::RedisTxn`]
//! that reads with plain commands and buffers its writes. Each read leaves
//! a *guard*: the exact bytes seen (or that the key was absent). Commit is
//! one `EVALSHA` of [`GUARDED`]: the script checks every guard and, only
//! when all still hold, applies every buffered write; otherwise it writes
//! nothing and answers which guard failed (a *conflict*: another engine
//! changed what this op read, so the op runs again on fresh reads). Redis
//! runs a script alone, so a commit is atomic, and a read set proven
//! unchanged at commit makes the op serializable with every other write.
//!
//! Arguments: `KEYS[1..4]` are the lease, recovery, expiry and listing
//! indexes; the other keys follow. `ARGV` is `guard count`, the guards,
//! then the writes, each an opcode and its operands (key numbers index
//! `KEYS`).
//!
//! Index upkeep is exact, not blanket: a record write names the index the
//! record was in before (as the op's guarded read of it proves, see
//! [`Was`]), so moving a record costs one `ZREM` of that index and one
//! `ZADD`, staying in one index costs the `ZADD` alone, and only a record
//! new under its key is added to the listing. A record whose previous
//! place the op does not know (never read, or unreadable) is taken out of
//! every index and listed again, as every write did before.

use redis::Script;

/// The guarded write. Answers 0 when it wrote, or the number of the first
/// guard that no longer holds (nothing written).
pub(super) const GUARDED: &str = r"
local a = ARGV
local i = 2
local n = tonumber(a[1])
for g = 1, n do
  local op = a[i]
  local k = KEYS[tonumber(a[i + 1])]
  if op == 'G' then
    if redis.call('GET', k) ~= a[i + 2] then return g end
    i = i + 3
  elseif op == 'N' then
    if redis.call('EXISTS', k) == 1 then return g end
    i = i + 2
  elseif op == 'H' then
    local c = tonumber(a[i + 2])
    if redis.call('HLEN', k) ~= c then return g end
    for j = 0, c - 1 do
      if redis.call('HGET', k, a[i + 3 + 2 * j]) ~= a[i + 4 + 2 * j] then return g end
    end
    i = i + 3 + 2 * c
  elseif op == 'L' then
    local c = tonumber(a[i + 2])
    if redis.call('HLEN', k) ~= c then return g end
    if c > 0 and (redis.call('HEXISTS', k, a[i + 3]) == 0 or redis.call('HEXISTS', k, a[i + 4]) == 0) then
      return g
    end
    i = i + 5
  elseif op == 'A' then
    local c = tonumber(a[i + 1])
    local ks = {}
    for j = 1, c do ks[j] = KEYS[tonumber(a[i + 1 + j])] end
    if redis.call('EXISTS', unpack(ks)) ~= 0 then return g end
    i = i + 2 + c
  elseif op == 'F' then
    if redis.call('HEXISTS', k, a[i + 2]) ~= tonumber(a[i + 3]) then return g end
    i = i + 4
  else
    return redis.error_reply('idempotency: unknown guard ' .. tostring(op))
  end
end
while i <= #a do
  local op = a[i]
  local k = KEYS[tonumber(a[i + 1])]
  if op == 'R' then
    local m = a[i + 2]
    local to = tonumber(a[i + 4])
    local was = a[i + 6]
    redis.call('SET', k, a[i + 3])
    if was == 'U' then
      for x = 1, 3 do
        if x ~= to then redis.call('ZREM', KEYS[x], m) end
      end
    elseif was ~= 'N' and tonumber(was) ~= to then
      redis.call('ZREM', KEYS[tonumber(was)], m)
    end
    redis.call('ZADD', KEYS[to], a[i + 5], m)
    if was == 'N' or was == 'U' then redis.call('ZADD', KEYS[4], 0, m) end
    i = i + 7
  elseif op == 'X' then
    local m = a[i + 2]
    redis.call('DEL', k)
    redis.call('ZREM', KEYS[1], m)
    redis.call('ZREM', KEYS[2], m)
    redis.call('ZREM', KEYS[3], m)
    redis.call('ZREM', KEYS[4], m)
    i = i + 3
  elseif op == 'Q' then
    local m = a[i + 2]
    redis.call('ZREM', KEYS[1], m)
    redis.call('ZREM', KEYS[2], m)
    redis.call('ZREM', KEYS[3], m)
    i = i + 3
  elseif op == 'S' then
    redis.call('SET', k, a[i + 2])
    i = i + 3
  elseif op == 'D' then
    redis.call('DEL', k)
    i = i + 2
  elseif op == 'HS' then
    redis.call('HSET', k, a[i + 2], a[i + 3])
    i = i + 4
  elseif op == 'HD' then
    redis.call('HDEL', k, a[i + 2])
    i = i + 3
  elseif op == 'Z' then
    redis.call('ZADD', k, a[i + 2], a[i + 3])
    i = i + 4
  elseif op == 'M' then
    local c = tonumber(redis.call('GET', k))
    if not c or c < tonumber(a[i + 2]) then redis.call('SET', k, a[i + 2]) end
    i = i + 3
  elseif op == 'ZR' then
    redis.call('ZREM', k, a[i + 2])
    i = i + 3
  else
    return redis.error_reply('idempotency: unknown write ' .. tostring(op))
  end
end
return 0
";

/// The index a record is listed in (the `KEYS` number of its ZSET).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Index {
    Lease = 1,
    Recovery = 2,
    Expiry = 3,
}

/// Where a record stood before a write of it, as the op knows it: the
/// write's index upkeep follows from it (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Was {
    /// Absent (read as absent, or removed earlier in the op): in no index
    /// and not listed.
    New,
    /// Present and decodable, so in this index (and listed).
    In(Index),
    /// Not known (never read, or unreadable): every index is cleared.
    Unknown,
}

/// A read's guard: what a key held when it was read.
#[derive(Clone, Debug)]
pub(super) enum Guard {
    /// A string key held exactly these bytes (`None`: it was absent).
    Str(Vec<u8>, Option<Vec<u8>>),
    /// A hash held exactly these fields and values.
    Hash(Vec<u8>, Vec<(Vec<u8>, Vec<u8>)>),
    /// A hash (a log) held this many fields, the first and last named.
    Span(Vec<u8>, usize, Option<(Vec<u8>, Vec<u8>)>),
    /// A hash field was there (or not).
    Field(Vec<u8>, Vec<u8>, bool),
    /// None of these keys existed (one `EXISTS` for all of them).
    Absent(Vec<Vec<u8>>),
}

/// A buffered write.
#[derive(Clone, Debug)]
pub(super) enum Write {
    /// A record's value, listed in `index` at `score` ms.
    Record {
        key: Vec<u8>,
        member: Vec<u8>,
        value: Vec<u8>,
        index: Index,
        score: u64,
        /// Where the record stood before this write.
        was: Was,
    },
    /// A record deleted, and taken out of every index.
    Unrecord {
        key: Vec<u8>,
        member: Vec<u8>,
    },
    /// A record taken out of the lease, recovery and expiry indexes (its
    /// bytes kept for an operator): one a sweep cannot read.
    Quarantine {
        member: Vec<u8>,
    },
    Set(Vec<u8>, Vec<u8>),
    Del(Vec<u8>),
    HSet(Vec<u8>, Vec<u8>, Vec<u8>),
    HDel(Vec<u8>, Vec<u8>),
    ZAdd(Vec<u8>, u64, Vec<u8>),
    ZRem(Vec<u8>, Vec<u8>),
    /// A counter raised to at least this value (never lowered).
    Raise(Vec<u8>, u64),
}

/// Guards and writes, as one invocation of [`GUARDED`].
#[derive(Default, Debug)]
pub(super) struct Batch {
    pub(super) guards: Vec<Guard>,
    pub(super) writes: Vec<Write>,
}

/// A score as Redis reads it (a double: exact up to 2^53 ms, about 285,000
/// years; later instants, "forever", only need to sort last).
pub(super) fn score(ms: u64) -> String {
    ms.to_string()
}

struct Args<'k> {
    index: &'k [&'k str; 4],
    keys: Vec<Vec<u8>>,
    argv: Vec<Vec<u8>>,
}

impl Args<'_> {
    fn key(&mut self, key: &[u8]) -> Vec<u8> {
        let n = if let Some(at) = self.keys.iter().position(|k| k == key) {
            at + 1 + self.index.len()
        } else {
            self.keys.push(key.to_vec());
            self.keys.len() + self.index.len()
        };
        n.to_string().into_bytes()
    }

    fn push(&mut self, parts: impl IntoIterator<Item = Vec<u8>>) {
        self.argv.extend(parts);
    }

    /// Appends one guard's opcode and operands.
    fn guard(&mut self, guard: &Guard) {
        let a = self;
        let op = |s: &str| s.as_bytes().to_vec();
        match guard {
            Guard::Str(key, Some(value)) => {
                let k = a.key(key);
                a.push([op("G"), k, value.clone()]);
            }
            Guard::Str(key, None) => {
                let k = a.key(key);
                a.push([op("N"), k]);
            }
            Guard::Hash(key, pairs) => {
                let k = a.key(key);
                a.push([op("H"), k, pairs.len().to_string().into_bytes()]);
                for (f, v) in pairs {
                    a.push([f.clone(), v.clone()]);
                }
            }
            Guard::Span(key, count, ends) => {
                let k = a.key(key);
                let (first, last) = ends.clone().unwrap_or_default();
                a.push([op("L"), k, count.to_string().into_bytes(), first, last]);
            }
            Guard::Absent(keys) => {
                let mut parts = vec![op("A"), keys.len().to_string().into_bytes()];
                for key in keys {
                    parts.push(a.key(key));
                }
                a.push(parts);
            }
            Guard::Field(key, field, present) => {
                let k = a.key(key);
                let present = if *present { op("1") } else { op("0") };
                a.push([op("F"), k, field.clone(), present]);
            }
        }
    }
}

impl Batch {
    pub(super) fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }

    /// The script's invocation: keys and arguments.
    pub(super) fn invocation(&self, index: &[&str; 4]) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        let mut a = Args {
            index,
            keys: Vec::new(),
            argv: vec![self.guards.len().to_string().into_bytes()],
        };
        let op = |s: &str| s.as_bytes().to_vec();
        for guard in &self.guards {
            a.guard(guard);
        }
        for write in &self.writes {
            match write {
                Write::Record {
                    key,
                    member,
                    value,
                    index,
                    score: at,
                    was,
                } => {
                    let k = a.key(key);
                    let index = (*index as u8).to_string().into_bytes();
                    let was = match was {
                        Was::New => op("N"),
                        Was::In(i) => (*i as u8).to_string().into_bytes(),
                        Was::Unknown => op("U"),
                    };
                    a.push([
                        op("R"),
                        k,
                        member.clone(),
                        value.clone(),
                        index,
                        score(*at).into_bytes(),
                        was,
                    ]);
                }
                Write::Unrecord { key, member } => {
                    let k = a.key(key);
                    a.push([op("X"), k, member.clone()]);
                }
                Write::Quarantine { member } => {
                    // The key number is not used.
                    a.push([op("Q"), op("1"), member.clone()]);
                }
                Write::Set(key, value) => {
                    let k = a.key(key);
                    a.push([op("S"), k, value.clone()]);
                }
                Write::Del(key) => {
                    let k = a.key(key);
                    a.push([op("D"), k]);
                }
                Write::HSet(key, field, value) => {
                    let k = a.key(key);
                    a.push([op("HS"), k, field.clone(), value.clone()]);
                }
                Write::HDel(key, field) => {
                    let k = a.key(key);
                    a.push([op("HD"), k, field.clone()]);
                }
                Write::ZAdd(key, at, m) => {
                    let k = a.key(key);
                    a.push([op("Z"), k, score(*at).into_bytes(), m.clone()]);
                }
                Write::ZRem(key, m) => {
                    let k = a.key(key);
                    a.push([op("ZR"), k, m.clone()]);
                }
                Write::Raise(key, at_least) => {
                    let k = a.key(key);
                    a.push([op("M"), k, at_least.to_string().into_bytes()]);
                }
            }
        }
        let mut keys: Vec<Vec<u8>> = index.iter().map(|k| k.as_bytes().to_vec()).collect();
        keys.extend(a.keys);
        (keys, a.argv)
    }

    /// How to tell, after the answer to this batch's commit was lost,
    /// whether it ran: one key (or hash field) it changes, with the bytes
    /// it held before (its guard) and the bytes the commit leaves.
    pub(super) fn probe(&self) -> Option<Probe> {
        for write in &self.writes {
            let (key, field, new) = match write {
                Write::Record { key, value, .. } | Write::Set(key, value) => {
                    (key, None, Some(value.clone()))
                }
                Write::Unrecord { key, .. } | Write::Del(key) => (key, None, None),
                Write::HSet(key, field, value) => (key, Some(field), Some(value.clone())),
                Write::HDel(key, field) => (key, Some(field), None),
                _ => continue,
            };
            let old = self.guards.iter().find_map(|g| match (g, field) {
                (Guard::Str(k, old), None) if k == key => Some(old.clone()),
                (Guard::Hash(k, pairs), Some(f)) if k == key => Some(
                    pairs
                        .iter()
                        .find(|(name, _)| name == f)
                        .map(|(_, v)| v.clone()),
                ),
                (Guard::Span(k, _, _), Some(_)) if k == key => Some(None),
                (Guard::Absent(ks), _) if ks.contains(key) => Some(None),
                _ => None,
            });
            if let Some(old) = old.filter(|old| *old != new) {
                return Some(Probe {
                    key: key.clone(),
                    field: field.cloned(),
                    old,
                    new,
                });
            }
        }
        None
    }
}

/// One key (or hash field) a lost commit would have changed.
#[derive(Debug)]
pub(super) struct Probe {
    pub(super) key: Vec<u8>,
    pub(super) field: Option<Vec<u8>>,
    pub(super) old: Option<Vec<u8>>,
    pub(super) new: Option<Vec<u8>>,
}

/// The script, for `EVALSHA` (loaded again with `EVAL` after a server
/// restart forgot it).
pub(super) fn guarded() -> Script {
    Script::new(GUARDED)
}
