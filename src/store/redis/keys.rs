//! The Redis key layout: every key the engine writes, under its prefix.
//!
//! A record is addressed by its *member*, `scope ‖ 0x00 ‖ key`: scopes and
//! keys hold no control character, so byte order of members is the
//! (scope, key) order listings show, and the same member names the record
//! in every index.
//!
//! ```text
//! <prefix>r:<member>     STRING  "<token>:" ‖ framed record (codec.rs)
//! <prefix>s:<member>     HASH    step name → framed step
//! <prefix>h:<member>     HASH    log sequence (decimal) → framed entry
//! <prefix>e:<entity>     STRING  framed entity state
//! <prefix>i:lease        ZSET    member, score lease end (PROCESSING)
//! <prefix>i:recovery     ZSET    member, score unknown since (UNKNOWN)
//! <prefix>i:expiry       ZSET    member, score expiry (COMPLETED, FINAL_FAILURE, TOMBSTONE)
//! <prefix>i:keys         ZSET    member, score 0: every record, for listings
//! <prefix>o              HASH    outbox sequence (decimal) → framed message
//! <prefix>o:order        ZSET    outbox sequence, score the same
//! <prefix>o:next         STRING  the last outbox sequence handed out
//! <prefix>d              HASH    dead-letter sequence (decimal) → framed letter
//! <prefix>d:order        ZSET    dead-letter sequence, score the same
//! <prefix>d:next         STRING  the last dead-letter sequence handed out
//! <prefix>token          STRING  the last fencing token handed out
//! <prefix>meta           HASH    format, ttl_ms, tombstone_keep_ms
//! ```
//!
//! The token prefix of a record's value is authoritative: a claim made by
//! the one-script fast path (`claim.rs`) draws its token inside the script,
//! after the record's bytes (and their checksum) were made, so those bytes
//! carry token 0 and every read patches the prefix's token in (as
//! PostgreSQL's token column is).

use crate::error::OpenError;
use crate::key::IdempotencyKey;

/// The default key prefix.
pub(crate) const DEFAULT_PREFIX: &str = "idempotency:";

/// Longest key prefix accepted, in bytes.
const MAX_PREFIX_BYTES: usize = 64;

/// The names of the engine's keys under one prefix.
#[derive(Clone, Debug)]
pub(crate) struct Keys {
    pub(crate) prefix: String,
    pub(crate) lease: String,
    pub(crate) recovery: String,
    pub(crate) expiry: String,
    pub(crate) all: String,
    pub(crate) outbox: String,
    pub(crate) outbox_order: String,
    pub(crate) outbox_next: String,
    pub(crate) dead_letters: String,
    pub(crate) dead_letters_order: String,
    pub(crate) dead_letters_next: String,
    pub(crate) token: String,
    pub(crate) meta: String,
}

impl Keys {
    /// The names under `prefix`: 1 to 64 printable ASCII characters, no
    /// space and none of the glob characters `*?[]\` (so a `SCAN` pattern
    /// of the prefix matches it literally).
    pub(crate) fn new(prefix: &str) -> Result<Keys, OpenError> {
        let reason = if prefix.is_empty() {
            Some("must not be empty")
        } else if prefix.len() > MAX_PREFIX_BYTES {
            Some("longer than 64 bytes")
        } else if !prefix.bytes().all(|b| b.is_ascii_graphic()) {
            Some("only printable ASCII without spaces is allowed")
        } else if prefix.bytes().any(|b| b"*?[]\\".contains(&b)) {
            Some("must not contain the glob characters * ? [ ] \\")
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(OpenError::InvalidKeyPrefix {
                prefix: prefix.chars().take(80).collect(),
                reason,
            });
        }
        let p = prefix;
        Ok(Keys {
            prefix: p.to_owned(),
            lease: format!("{p}i:lease"),
            recovery: format!("{p}i:recovery"),
            expiry: format!("{p}i:expiry"),
            all: format!("{p}i:keys"),
            outbox: format!("{p}o"),
            outbox_order: format!("{p}o:order"),
            outbox_next: format!("{p}o:next"),
            dead_letters: format!("{p}d"),
            dead_letters_order: format!("{p}d:order"),
            dead_letters_next: format!("{p}d:next"),
            token: format!("{p}token"),
            meta: format!("{p}meta"),
        })
    }

    pub(crate) fn record(&self, member: &[u8]) -> Vec<u8> {
        self.under("r:", member)
    }

    pub(crate) fn steps(&self, member: &[u8]) -> Vec<u8> {
        self.under("s:", member)
    }

    pub(crate) fn history(&self, member: &[u8]) -> Vec<u8> {
        self.under("h:", member)
    }

    pub(crate) fn entity(&self, entity: &str) -> Vec<u8> {
        self.under("e:", entity.as_bytes())
    }

    fn under(&self, kind: &str, tail: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.prefix.len() + kind.len() + tail.len());
        out.extend_from_slice(self.prefix.as_bytes());
        out.extend_from_slice(kind.as_bytes());
        out.extend_from_slice(tail);
        out
    }
}

/// A record's member: `scope ‖ 0x00 ‖ key`.
pub(crate) fn member(key: &IdempotencyKey) -> Vec<u8> {
    member_of(key.scope(), key.key())
}

pub(crate) fn member_of(scope: &str, key: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(scope.len() + 1 + key.len());
    out.extend_from_slice(scope.as_bytes());
    out.push(0);
    out.extend_from_slice(key.as_bytes());
    out
}

/// The key a member names (`Err`: the record key bytes of parts that do
/// not form a valid key, as listings show them).
pub(crate) fn key_of(member: &[u8]) -> Result<IdempotencyKey, Vec<u8>> {
    let split = member.iter().position(|&b| b == 0);
    let (scope, key) = match split {
        Some(at) => (&member[..at], &member[at + 1..]),
        None => (member, &[][..]),
    };
    let parsed = std::str::from_utf8(scope)
        .ok()
        .zip(std::str::from_utf8(key).ok())
        .and_then(|(s, k)| IdempotencyKey::parse_any(s, k).ok());
    parsed.ok_or_else(|| {
        let mut rkey = vec![u8::try_from(scope.len()).unwrap_or(u8::MAX)];
        rkey.extend_from_slice(scope);
        rkey.extend_from_slice(key);
        rkey
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_sort_as_scope_then_key() -> Result<(), Box<dyn std::error::Error>> {
        let a = member(&IdempotencyKey::new("a", "z")?);
        let ab = member(&IdempotencyKey::new("ab", "a")?);
        assert!(a < ab, "scope \"a\" sorts before scope \"ab\"");
        let k = IdempotencyKey::new("pay", "k-1")?;
        assert_eq!(key_of(&member(&k)), Ok(k));
        Ok(())
    }

    #[test]
    fn prefixes_with_glob_characters_are_refused() {
        assert!(Keys::new("app:*").is_err());
        assert!(Keys::new("").is_err());
        assert!(Keys::new("has space").is_err());
        assert!(Keys::new("idempotency:").is_ok());
    }
}
