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
//!
//! One batch shape, the completion of a claim this engine holds (the
//! second script of every request), commits with [`SETTLE_HELD`] instead:
//! the same guards, write and answer, without the general interpreter
//! (see [`Batch::command`]).

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

/// One operand of the script's invocation, borrowed from the batch (the
/// command is built in one buffer, with no copy per argument).
enum Arg<'b> {
    Bytes(&'b [u8]),
    /// A count, a key number, or a score in ms: decimal, as Redis reads a
    /// score (a double: exact up to 2^53 ms, about 285,000 years; later
    /// instants, "forever", only need to sort last).
    Num(u64),
}

struct Args<'b> {
    /// The index keys, then the others, each once.
    keys: Vec<&'b [u8]>,
    argv: Vec<Arg<'b>>,
}

impl<'b> Args<'b> {
    /// The `KEYS` number of `key` (added when new).
    fn key(&mut self, key: &'b [u8]) -> Arg<'b> {
        let n = if let Some(at) = self.keys.iter().position(|k| *k == key) {
            at + 1
        } else {
            self.keys.push(key);
            self.keys.len()
        };
        Arg::Num(n as u64)
    }

    fn push<const N: usize>(&mut self, parts: [Arg<'b>; N]) {
        self.argv.extend(parts);
    }

    /// Appends one guard's opcode and operands.
    fn guard(&mut self, guard: &'b Guard) {
        let a = self;
        let op = |s: &'static str| Arg::Bytes(s.as_bytes());
        match guard {
            Guard::Str(key, Some(value)) => {
                let k = a.key(key);
                a.push([op("G"), k, Arg::Bytes(value)]);
            }
            Guard::Str(key, None) => {
                let k = a.key(key);
                a.push([op("N"), k]);
            }
            Guard::Hash(key, pairs) => {
                let k = a.key(key);
                a.push([op("H"), k, Arg::Num(pairs.len() as u64)]);
                for (f, v) in pairs {
                    a.push([Arg::Bytes(f), Arg::Bytes(v)]);
                }
            }
            Guard::Span(key, count, ends) => {
                let k = a.key(key);
                let (first, last) = ends
                    .as_ref()
                    .map_or((&[][..], &[][..]), |(f, l)| (f.as_slice(), l.as_slice()));
                a.push([
                    op("L"),
                    k,
                    Arg::Num(*count as u64),
                    Arg::Bytes(first),
                    Arg::Bytes(last),
                ]);
            }
            Guard::Absent(keys) => {
                a.push([op("A"), Arg::Num(keys.len() as u64)]);
                for key in keys {
                    let k = a.key(key);
                    a.argv.push(k);
                }
            }
            Guard::Field(key, field, present) => {
                let k = a.key(key);
                let present = if *present { op("1") } else { op("0") };
                a.push([op("F"), k, Arg::Bytes(field), present]);
            }
        }
    }
}

/// `EVALSHA sha numkeys keys… args…`, built in one buffer.
fn evalsha(sha: &str, keys: &[&[u8]], argv: &[Arg<'_>]) -> redis::Cmd {
    let bytes = keys.iter().map(|k| k.len() + 8).sum::<usize>()
        + argv
            .iter()
            .map(|a| match a {
                Arg::Bytes(b) => b.len() + 8,
                Arg::Num(_) => 28,
            })
            .sum::<usize>()
        + 64;
    let mut cmd = redis::Cmd::with_capacity(3 + keys.len() + argv.len(), bytes);
    cmd.arg("EVALSHA").arg(sha).arg(keys.len());
    for k in keys {
        cmd.arg(*k);
    }
    for a in argv {
        match a {
            Arg::Bytes(b) => cmd.arg(*b),
            Arg::Num(n) => cmd.arg(*n),
        };
    }
    cmd
}

/// The completion of a held claim, the hot path of every request: the
/// same guards and write as [`GUARDED`] runs for such a batch (see
/// [`Batch::command`]), without its general interpreter. `KEYS`: the
/// record, its step and log hashes, the index it was in, the index it goes
/// to. `ARGV`: the bytes it must hold, its new bytes, its member, its new
/// score. Answers as [`GUARDED`] does: 0 written, or the failed guard's
/// number (nothing written).
pub(super) const SETTLE_HELD: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 1 end
if redis.call('EXISTS', KEYS[2], KEYS[3]) ~= 0 then return 2 end
redis.call('SET', KEYS[1], ARGV[2])
if KEYS[4] ~= KEYS[5] then redis.call('ZREM', KEYS[4], ARGV[3]) end
redis.call('ZADD', KEYS[5], ARGV[4], ARGV[3])
return 0
";

/// The scripts a batch commits with.
pub(super) struct Scripts<'s> {
    pub(super) guarded: &'s Script,
    pub(super) settle_held: &'s Script,
}

impl Batch {
    pub(super) fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }

    /// The script's invocation, and the script it runs: [`SETTLE_HELD`]
    /// for a batch of its one shape (a record proven to hold known bytes
    /// and to have no step and no log, rewritten where its index is
    /// known), [`GUARDED`] for every other.
    pub(super) fn command<'s>(
        &self,
        scripts: &Scripts<'s>,
        index: &[&str; 4],
    ) -> (redis::Cmd, &'s Script) {
        if let Some(cmd) = self.settle_held(scripts.settle_held, index) {
            return (cmd, scripts.settle_held);
        }
        (self.guarded(scripts.guarded, index), scripts.guarded)
    }

    fn settle_held(&self, script: &Script, index: &[&str; 4]) -> Option<redis::Cmd> {
        let [Guard::Str(rkey, Some(old)), Guard::Absent(absent)] = self.guards.as_slice() else {
            return None;
        };
        let [skey, hkey] = absent.as_slice() else {
            return None;
        };
        let [Write::Record {
            key,
            member,
            value,
            index: to,
            score: at,
            was: Was::In(from),
        }] = self.writes.as_slice()
        else {
            return None;
        };
        if key != rkey {
            return None;
        }
        let from = index[*from as usize - 1].as_bytes();
        let to = index[*to as usize - 1].as_bytes();
        let keys = [rkey.as_slice(), skey, hkey, from, to];
        let argv = [
            Arg::Bytes(old),
            Arg::Bytes(value),
            Arg::Bytes(member),
            Arg::Num(*at),
        ];
        Some(evalsha(script.get_hash(), &keys, &argv))
    }

    /// The [`GUARDED`] invocation: keys and arguments.
    fn guarded(&self, script: &Script, index: &[&str; 4]) -> redis::Cmd {
        let mut a = Args {
            keys: index.iter().map(|k| k.as_bytes()).collect(),
            argv: vec![Arg::Num(self.guards.len() as u64)],
        };
        let op = |s: &'static str| Arg::Bytes(s.as_bytes());
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
                    let was = match was {
                        Was::New => op("N"),
                        Was::In(i) => Arg::Num(*i as u64),
                        Was::Unknown => op("U"),
                    };
                    a.push([
                        op("R"),
                        k,
                        Arg::Bytes(member),
                        Arg::Bytes(value),
                        Arg::Num(*index as u64),
                        Arg::Num(*at),
                        was,
                    ]);
                }
                Write::Unrecord { key, member } => {
                    let k = a.key(key);
                    a.push([op("X"), k, Arg::Bytes(member)]);
                }
                Write::Quarantine { member } => {
                    // The key number is not used.
                    a.push([op("Q"), op("1"), Arg::Bytes(member)]);
                }
                Write::Set(key, value) => {
                    let k = a.key(key);
                    a.push([op("S"), k, Arg::Bytes(value)]);
                }
                Write::Del(key) => {
                    let k = a.key(key);
                    a.push([op("D"), k]);
                }
                Write::HSet(key, field, value) => {
                    let k = a.key(key);
                    a.push([op("HS"), k, Arg::Bytes(field), Arg::Bytes(value)]);
                }
                Write::HDel(key, field) => {
                    let k = a.key(key);
                    a.push([op("HD"), k, Arg::Bytes(field)]);
                }
                Write::ZAdd(key, at, m) => {
                    let k = a.key(key);
                    a.push([op("Z"), k, Arg::Num(*at), Arg::Bytes(m)]);
                }
                Write::ZRem(key, m) => {
                    let k = a.key(key);
                    a.push([op("ZR"), k, Arg::Bytes(m)]);
                }
                Write::Raise(key, at_least) => {
                    let k = a.key(key);
                    a.push([op("M"), k, Arg::Num(*at_least)]);
                }
            }
        }
        evalsha(script.get_hash(), &a.keys, &a.argv)
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

/// The script, for `EVALSHA` (loaded again after a server restart forgot
/// it, see [`eval`]).
pub(super) fn guarded() -> Script {
    Script::new(GUARDED)
}

/// Runs `cmd` (an `EVALSHA` of `script`); a server that does not know the
/// script (`NOSCRIPT`: restarted, or `SCRIPT FLUSH`) loads it, and the
/// command is sent again (it did not run).
pub(super) fn eval<T: redis::FromRedisValue>(
    conn: &mut redis::Connection,
    script: &Script,
    cmd: &redis::Cmd,
) -> redis::RedisResult<T> {
    match cmd.query(conn) {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script.load(conn)?;
            cmd.query(conn)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INDEX: [&str; 4] = ["i:lease", "i:recovery", "i:expiry", "i:keys"];

    fn held() -> Batch {
        Batch {
            guards: vec![
                Guard::Str(b"r:m".to_vec(), Some(b"7:old".to_vec())),
                Guard::Absent(vec![b"s:m".to_vec(), b"h:m".to_vec()]),
            ],
            writes: vec![Write::Record {
                key: b"r:m".to_vec(),
                member: b"m".to_vec(),
                value: b"7:new".to_vec(),
                index: Index::Expiry,
                score: 99,
                was: Was::In(Index::Lease),
            }],
        }
    }

    /// The held-claim completion takes the short script, with the record,
    /// its hashes and both indexes as keys; any other shape the general one.
    #[test]
    fn only_a_held_completion_takes_the_short_script() {
        let (guarded, settle_held) = (guarded(), Script::new(SETTLE_HELD));
        let scripts = Scripts {
            guarded: &guarded,
            settle_held: &settle_held,
        };
        let (cmd, script) = held().command(&scripts, &INDEX);
        assert_eq!(script.get_hash(), settle_held.get_hash());
        let args: Vec<&[u8]> = cmd
            .args_iter()
            .filter_map(|a| match a {
                redis::Arg::Simple(b) => Some(b),
                _ => None,
            })
            .collect();
        let want: [&[u8]; 12] = [
            b"EVALSHA",
            settle_held.get_hash().as_bytes(),
            b"5",
            b"r:m",
            b"s:m",
            b"h:m",
            b"i:lease",
            b"i:expiry",
            b"7:old",
            b"7:new",
            b"m",
            b"99",
        ];
        assert_eq!(args, want);

        let mut unknown = held();
        if let Some(Write::Record { was, .. }) = unknown.writes.first_mut() {
            *was = Was::Unknown;
        }
        let mut more = held();
        more.writes.push(Write::Del(b"x".to_vec()));
        let mut other_key = held();
        other_key.guards[0] = Guard::Str(b"r:n".to_vec(), Some(b"7:old".to_vec()));
        for batch in [unknown, more, other_key] {
            let (_, script) = batch.command(&scripts, &INDEX);
            assert_eq!(script.get_hash(), guarded.get_hash(), "{batch:?}");
        }
    }
}
