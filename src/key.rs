//! Scoped idempotency keys and their byte form in the records table.

use std::fmt;

use crate::error::{Error, Result};

/// Longest scope or key accepted, in bytes.
pub const MAX_KEY_BYTES: usize = 255;

/// Scopes starting with this are the engine's own.
const RESERVED_SCOPE_PREFIX: &str = "@";
/// Scope prefix of inbox records.
const INBOX_SCOPE_PREFIX: &str = "@inbox:";

/// An idempotency key inside its scope.
///
/// The scope names the caller and the operation (for example
/// `"tenant-42:create_payment"`), so one client's key can never collide with
/// another client's, or with the same key sent to a different endpoint. Both
/// parts are validated on construction: 1..=255 bytes of UTF-8 with no control
/// characters (Unicode general category Cc, which includes tab, CR and LF).
/// The IETF `Idempotency-Key` draft leaves the key's content to the client;
/// these limits keep records and log lines well formed.
///
/// `Display` prints `scope/key` with any unusual characters escaped.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey {
    /// The record-table key `[scope length: u8][scope][key]`, both parts
    /// validated UTF-8: one allocation, and point reads use it as it is.
    rkey: Box<[u8]>,
}

// By scope, then key (the record key sorts by scope length first).
impl Ord for IdempotencyKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.scope(), self.key()).cmp(&(other.scope(), other.key()))
    }
}

impl PartialOrd for IdempotencyKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl IdempotencyKey {
    /// Validates and builds a scoped key.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`] if either part is empty, longer than 255 bytes
    /// or contains a control character; the error says which part and why.
    pub fn new(scope: impl Into<String>, key: impl Into<String>) -> Result<IdempotencyKey> {
        let scope = scope.into();
        if scope.starts_with(RESERVED_SCOPE_PREFIX) {
            return Err(Error::InvalidKey {
                what: "scope",
                value: scope,
                reason: "scopes starting with '@' are reserved for the engine (inbox)",
            });
        }
        IdempotencyKey::any(&scope, &key.into())
    }

    /// The key of message `message_id` in `consumer`'s inbox: scope
    /// `@inbox:<consumer>`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`] as for `new`.
    pub fn inbox(consumer: &str, message_id: impl Into<String>) -> Result<IdempotencyKey> {
        IdempotencyKey::any(
            &format!("{INBOX_SCOPE_PREFIX}{consumer}"),
            &message_id.into(),
        )
    }

    /// Parses a key as shown by operators, reserved scopes included (what
    /// the `idem` CLI uses to address inbox records).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`] as for `new`, without the reserved-scope rule.
    pub fn parse_any(scope: &str, key: &str) -> Result<IdempotencyKey> {
        IdempotencyKey::any(scope, key)
    }

    fn any(scope: &str, key: &str) -> Result<IdempotencyKey> {
        validate("scope", scope)?;
        validate("key", key)?;
        Ok(IdempotencyKey {
            rkey: record_key(scope, key).into_boxed_slice(),
        })
    }

    /// Like [`IdempotencyKey::new`] for raw bytes (an HTTP header value, a
    /// message id), which must be UTF-8.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`] as for `new`, or if either part is not UTF-8.
    pub fn from_bytes(scope: &[u8], key: &[u8]) -> Result<IdempotencyKey> {
        let utf8 = |what, bytes: &[u8]| {
            std::str::from_utf8(bytes)
                .map(str::to_owned)
                .map_err(|_| Error::InvalidKey {
                    what,
                    value: shown(&String::from_utf8_lossy(bytes)),
                    reason: "not valid UTF-8",
                })
        };
        IdempotencyKey::new(utf8("scope", scope)?, utf8("key", key)?)
    }

    /// Whether this key is in an engine-reserved scope (an inbox).
    pub fn is_reserved(&self) -> bool {
        self.scope().starts_with(RESERVED_SCOPE_PREFIX)
    }

    /// The scope (caller and operation).
    pub fn scope(&self) -> &str {
        self.parts().0
    }

    /// The client's key within the scope.
    pub fn key(&self) -> &str {
        self.parts().1
    }

    /// Scope and key, cut from the record key (validated on construction,
    /// so the fallbacks never apply).
    fn parts(&self) -> (&str, &str) {
        let Some((&len, rest)) = self.rkey.split_first() else {
            return ("", "");
        };
        let (scope, key) = rest.split_at(usize::from(len).min(rest.len()));
        (
            std::str::from_utf8(scope).unwrap_or_default(),
            std::str::from_utf8(key).unwrap_or_default(),
        )
    }

    /// The record-table key: `[scope length: u8][scope][key]`. Sorting by it
    /// groups records by scope.
    pub(crate) fn record_key(&self) -> &[u8] {
        &self.rkey
    }

    /// Inverse of [`IdempotencyKey::record_key`]; `None` for bytes no
    /// valid key produces.
    pub(crate) fn from_record_key(bytes: &[u8]) -> Option<IdempotencyKey> {
        let (&len, rest) = bytes.split_first()?;
        let len = usize::from(len);
        if rest.len() < len {
            return None;
        }
        let (scope, key) = rest.split_at(len);
        let scope = std::str::from_utf8(scope).ok()?;
        let key = std::str::from_utf8(key).ok()?;
        IdempotencyKey::parse_any(scope, key).ok()
    }
}

fn validate(what: &'static str, value: &str) -> Result<()> {
    let reason = if value.is_empty() {
        "must not be empty"
    } else if value.len() > MAX_KEY_BYTES {
        "longer than 255 bytes"
    } else if value.chars().any(char::is_control) {
        "contains a control character"
    } else {
        return Ok(());
    };
    Err(Error::InvalidKey {
        what,
        value: shown(value),
        reason,
    })
}

/// A refused value as its error shows it: the first 64 characters, then
/// `…` if there were more.
fn shown(value: &str) -> String {
    let mut shown: String = value.chars().take(64).collect();
    if shown.len() < value.len() {
        shown.push('…');
    }
    shown
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}",
            self.scope().escape_debug(),
            self.key().escape_debug()
        )
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({self})")
    }
}

/// The record-table key of a scope and a key: `[scope length: u8][scope]
/// [key]`. Also for stored parts that no longer form a valid key (listings
/// and `verify` show them by these bytes); a scope over 255 bytes, which
/// validation never lets through, has its length byte saturate at 255.
pub(crate) fn record_key(scope: &str, key: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + scope.len() + key.len());
    out.push(u8::try_from(scope.len()).unwrap_or(u8::MAX));
    out.extend_from_slice(scope.as_bytes());
    out.extend_from_slice(key.as_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_keys_with_reason() {
        let cases: [(&str, String, &str); 4] = [
            ("", "k".into(), "must not be empty"),
            ("s", String::new(), "must not be empty"),
            ("s", "x".repeat(256), "longer than 255 bytes"),
            ("s", "a\nb".into(), "contains a control character"),
        ];
        for (scope, key, want) in cases {
            match IdempotencyKey::new(scope, key.clone()) {
                Err(Error::InvalidKey { reason, .. }) => assert_eq!(reason, want),
                other => panic!("{scope:?}/{key:?}: {other:?}"),
            }
        }
        assert!(IdempotencyKey::new("s", "x".repeat(255)).is_ok());
        assert!(IdempotencyKey::from_bytes(b"s", &[0xff]).is_err());
    }

    #[test]
    fn record_key_round_trips_and_separates_scopes() {
        let a = IdempotencyKey::new("ab", "c").unwrap();
        let b = IdempotencyKey::new("a", "bc").unwrap();
        assert_ne!(a.record_key(), b.record_key());
        assert_eq!(
            IdempotencyKey::from_record_key(a.record_key()),
            Some(a.clone())
        );
        assert_eq!(IdempotencyKey::from_record_key(&[5, b'a']), None);
        let long = IdempotencyKey::new("s".repeat(255), "k".repeat(255)).unwrap();
        for k in [a, b, long] {
            let (scope, key) = (k.scope().to_owned(), k.key().to_owned());
            assert_eq!(k.record_key(), record_key(&scope, &key));
            assert_eq!(IdempotencyKey::parse_any(&scope, &key).unwrap(), k);
        }
    }
}
