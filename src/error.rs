//! The crate's one error type.
//!
//! Expected outcomes of a request (replay, in progress, mismatch, unknown,
//! expired) are variants of [`crate::Begin`], not errors. An [`Error`] means
//! the engine could not do what was asked: bad input, a fenced claim, a
//! corrupt record, or storage failure.

use std::path::PathBuf;
use std::sync::Arc;

use crate::fingerprint::FingerprintError;
use crate::key::IdempotencyKey;

/// Everything that can go wrong in this crate.
///
/// Each variant names the key, path or limit involved. Variants that carry a
/// [`IdempotencyKey`] display it as `scope/key` with control characters
/// escaped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The scope or key failed validation: it must be 1..=255 bytes and
    /// contain no control characters (U+0000..U+001F, U+007F..U+009F).
    #[error("invalid idempotency {what} {value:?}: {reason}")]
    InvalidKey {
        /// `"scope"` or `"key"`.
        what: &'static str,
        /// The rejected value, lossily decoded if it was not UTF-8.
        value: String,
        /// Why it was rejected.
        reason: &'static str,
    },

    /// The request body could not be fingerprinted (invalid JSON, a
    /// duplicate member, a bad JSON Pointer).
    #[error("cannot fingerprint request: {0}")]
    Fingerprint(#[from] FingerprintError),

    /// A response (envelope body plus headers) is larger than the engine's
    /// `max_response_bytes`. Nothing was stored. From `complete` or `fail`,
    /// the record becomes UNKNOWN (the work ran, but its result cannot be
    /// kept); from a resolver's answer, the record stays UNKNOWN.
    #[error("response for {key} is {size} bytes, over the limit of {limit} bytes")]
    ResponseTooLarge {
        /// The key whose response was refused.
        key: IdempotencyKey,
        /// Size of the response in bytes.
        size: usize,
        /// The configured limit in bytes.
        limit: usize,
    },

    /// The fencing token no longer owns the record: the claim was superseded
    /// (its lease ran out and recovery or another caller took over) or the
    /// record already has an outcome. The stored record was left untouched.
    #[error("fencing token {token} no longer owns {key}: {reason}")]
    Fenced {
        /// The key the claim was for.
        key: IdempotencyKey,
        /// The refused fencing token.
        token: u64,
        /// What the record holds now.
        reason: String,
    },

    /// An operation needs a record that does not exist (or has expired).
    #[error("no record for {key}")]
    NotFound {
        /// The key that was looked up.
        key: IdempotencyKey,
    },

    /// The operation is not allowed in the record's current state (for
    /// example purging a PROCESSING record without `force`).
    #[error("cannot {action} {key}: record is {state}")]
    InvalidState {
        /// The key involved.
        key: IdempotencyKey,
        /// What was attempted.
        action: &'static str,
        /// The record's state.
        state: crate::State,
    },

    /// A stored record could not be decoded. The record is left as is; other
    /// keys keep working.
    #[error("record for {key} is corrupt: {reason}")]
    CorruptRecord {
        /// The key whose record failed to decode.
        key: String,
        /// What the decoder found.
        reason: String,
    },

    /// An app-registered upcaster refused to convert an old envelope.
    #[error("upcasting the stored response of {key} from schema version {from}: {reason}")]
    Upcast {
        /// The key being replayed.
        key: IdempotencyKey,
        /// The stored envelope's schema version.
        from: u32,
        /// The upcaster's message.
        reason: String,
    },

    /// The file exists but is not a redb database (or is damaged). Nothing
    /// was written to it.
    #[error("{path}: not a usable redb database: {source}")]
    NotADatabase {
        /// The file that was opened.
        path: PathBuf,
        /// What redb reported.
        #[source]
        source: redb::DatabaseError,
    },

    /// `open_existing` was asked for a file that does not exist.
    #[error("{path}: no such database file")]
    MissingDatabase {
        /// The path that was looked for.
        path: PathBuf,
    },

    /// The database holds idempotency records in a format version this build
    /// does not know. Nothing was written to it.
    #[error("record format version {found} is not supported by this build (it reads version {supported}); use a newer version of the crate")]
    UnsupportedFormat {
        /// The version found in the database.
        found: u8,
        /// The version this build reads and writes.
        supported: u8,
    },

    /// redb reported an error.
    #[error("storage error while {context}: {source}")]
    Storage {
        /// What the engine was doing.
        context: &'static str,
        /// The underlying redb error.
        #[source]
        source: redb::Error,
    },

    /// An earlier commit or I/O failure poisoned the engine. Nothing is
    /// written after the disk has said no: drop the engine and reopen the file.
    #[error("engine is poisoned by an earlier failure ({cause}); drop it and reopen the database")]
    Poisoned {
        /// The failure that poisoned the engine.
        cause: Arc<str>,
    },

    /// The app's local write (see `Engine::complete_local`) failed or
    /// panicked; its transaction was rolled back and the key released.
    #[error("local write for {key} failed and was rolled back: {source}")]
    LocalWrite {
        /// The key whose completion carried the write.
        key: IdempotencyKey,
        /// The app's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },

    /// A write was called from inside an app's local write closure (see
    /// `Engine::complete_local`) on the same engine. The closure runs on the
    /// engine's writer thread, so the call would wait for itself forever.
    /// Reads (`record`, `records`, ...) are fine there.
    #[error("engine write called from inside a local write closure of the same engine (it would deadlock); do the write after the closure returns")]
    Reentrant,

    /// A claim was passed to an engine other than the one that issued it
    /// (or a claim taken before the engine was reopened). The claim was
    /// consumed: like any claim dropped without an outcome, its record in
    /// its own engine becomes UNKNOWN (settleable once its lease ends).
    #[error("claim for {key} was issued by another engine")]
    ForeignClaim {
        /// The claim's key.
        key: IdempotencyKey,
    },

    /// Another handle or process has the database open.
    #[error("{path}: database is already open (by this process or another)")]
    AlreadyOpen {
        /// The database file.
        path: PathBuf,
    },

    /// The engine was dropped while this handle (a claim, an inbox ticket)
    /// was still alive.
    #[error("engine has been closed")]
    Closed,

    /// The engine could not start a thread, or hit a state it never
    /// expects (a bug: please report it with the message).
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    pub(crate) fn storage(context: &'static str, source: impl Into<redb::Error>) -> Error {
        Error::Storage {
            context,
            source: source.into(),
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
