//! Baseline on Redis: the idempotency store a team writes by hand, done
//! with the usual care, one connection per client thread.
//!
//! The claim is one Lua script (EVALSHA): if the key is absent it takes a
//! fencing token from a counter (`INCR`) and `SET`s a small PROCESSING
//! value (`P`, the token, the 32-byte fingerprint, the lease end) with no
//! expiry; if the key is present it compares the stored fingerprint with
//! the request's and answers "taken" or "mismatch". The completion is one
//! plain `SET key <C, token, fingerprint, response> PX <TTL>`, unfenced
//! (the naive store's completion). Durability is the server's: with
//! `appendfsync always` each command is written and fsynced before its
//! reply, the same as for the engine on the same server.

use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// Claims `KEYS[1]` if absent. ARGV: fingerprint, lease end (ms).
/// Returns the fencing token (> 0), 0 when the key is held with the same
/// fingerprint, -1 when it is held with another one.
const CLAIM: &str = r"
local v = redis.call('GET', KEYS[1])
if v then
  local fp = string.sub(v, 10, 41)
  if fp == ARGV[1] then return 0 end
  return -1
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], 'P' .. struct.pack('>I8', token) .. ARGV[1] .. struct.pack('>I8', tonumber(ARGV[2])))
return token
";

pub struct Baseline {
    /// One per client thread; a thread only ever locks its own.
    conns: Vec<Mutex<redis::Connection>>,
    claim: redis::Script,
    prefix: String,
}

fn now_ms() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970");
    u64::try_from(since.as_millis()).expect("ms fit u64")
}

impl Baseline {
    /// Opens `threads` connections; every key the baseline writes starts
    /// with `prefix`.
    pub fn open(url: &str, prefix: &str, threads: usize) -> Baseline {
        let client = redis::Client::open(url).expect("a Redis URL");
        let conns = (0..threads)
            .map(|_| Mutex::new(client.get_connection().expect("connect to Redis")))
            .collect();
        Baseline {
            conns,
            claim: redis::Script::new(CLAIM),
            prefix: prefix.to_string(),
        }
    }

    /// One request on thread `t`'s connection: claim `key` (it must be
    /// fresh), then store the response.
    pub fn request(&self, t: usize, scope: &str, key: &str, fp: &[u8; 32], body: &[u8]) {
        let mut conn = self.conns[t].lock().expect("connection lock");
        let record = format!("{}r:{scope}:{key}", self.prefix);
        let counter = format!("{}tokens", self.prefix);
        let lease_end = now_ms() + 30_000;
        let token: i64 = self
            .claim
            .key(&record)
            .key(&counter)
            .arg(&fp[..])
            .arg(lease_end)
            .invoke(&mut *conn)
            .expect("claim");
        assert!(token > 0, "a fresh key must be claimed, got {token}");
        let mut value = Vec::with_capacity(1 + 8 + 32 + body.len());
        value.push(b'C');
        value.extend_from_slice(&token.to_be_bytes());
        value.extend_from_slice(fp);
        value.extend_from_slice(body);
        redis::cmd("SET")
            .arg(&record)
            .arg(value)
            .arg("PX")
            .arg(86_400_000u64)
            .exec(&mut *conn)
            .expect("complete");
    }

    /// Deletes every key under the prefix (the server may outlive the
    /// bench).
    pub fn clear(&self) {
        let mut conn = self.conns[0].lock().expect("connection lock");
        delete_prefix(&mut conn, &self.prefix);
    }
}

/// Deletes every key that starts with `prefix`, by SCAN.
pub fn delete_prefix(conn: &mut redis::Connection, prefix: &str) {
    let pattern = format!("{prefix}*");
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query(conn)
            .expect("SCAN");
        if !keys.is_empty() {
            redis::cmd("UNLINK").arg(keys).exec(conn).expect("UNLINK");
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
}
