//! Errors: [`OpenError`] for opening a database, [`Error`] for everything an
//! open engine is asked to do.
//!
//! Expected outcomes of a request (replay, processing, mismatch, in doubt,
//! tombstoned) are variants of [`crate::Begin`], not errors. An [`Error`]
//! means the engine could not do what was asked: bad input, a fenced claim,
//! a corrupt record, or a storage failure. Every error about an idempotency
//! record names its [`IdempotencyKey`].

use std::path::PathBuf;
use std::sync::Arc;

use crate::fingerprint::FingerprintError;
use crate::key::IdempotencyKey;

/// The error type an app's local write returns to abort it (see
/// [`crate::Engine::complete_local`]).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A storage library's error, boxed so the engine's errors do not depend on
/// one backend.
pub type StorageError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What can go wrong opening a database (the `open*` calls of
/// [`crate::EngineBuilder`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The file exists but is not a redb database, or is damaged. Nothing
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

    /// `open_existing` found a file of 0 bytes: no database was ever
    /// written there (a crash before the first commit, or a file created by
    /// something else).
    #[error("{path}: the file is empty (0 bytes), not a database")]
    EmptyFile {
        /// The empty file.
        path: PathBuf,
    },

    /// The database holds idempotency records in a format version this build
    /// does not know (it reads versions 1 to `supported`; a writable open
    /// migrates version 1 to the newest). Nothing was written to it.
    #[error("{path}: record format version {found} is not supported by this build (it reads versions 1 to {supported}); use a newer version of the crate")]
    UnsupportedFormat {
        /// The database file (`<backend>` for a storage backend).
        path: PathBuf,
        /// The version found in the database.
        found: u8,
        /// The newest version this build reads and writes.
        supported: u8,
    },

    /// The file was written by a pre-release build of record format 2,
    /// whose checksums changed before format 2 was released (its meta
    /// values carry none, its stored values carry BLAKE3 ones). This build
    /// cannot read it and does not migrate it: re-create the database (or
    /// read it with the build that wrote it). Nothing was written to it.
    #[error("{path}: written by a pre-release build of record format 2, whose checksums this build does not read; re-create the database (nothing was written to it)")]
    PreReleaseFormat {
        /// The database file.
        path: PathBuf,
    },

    /// The database is damaged; `what` says where.
    ///
    /// [`Corrupted::File`]: redb's integrity check (run on every writable
    /// open from a path: every page's checksum) failed, or the storage
    /// library panicked while opening it, or the backend itself failed by
    /// panicking. Nothing was written to it.
    ///
    /// [`Corrupted::Meta`]: a value of the database's meta table (the
    /// format version, the next fencing token or outbox sequence number,
    /// the journal's id and position, the stored expiry settings) is
    /// damaged: its checksum does not match its bytes and key, its length
    /// is wrong for its key, or a value that must be there is missing (its
    /// key was damaged). Trusting it could hand out fencing tokens again or
    /// skip journal frames, so the open is refused; an open from a path
    /// refuses before writing anything. Restore the file from a backup. A
    /// read-only open checks the values it uses (the format and the
    /// journal's); `verify` lists every damaged one.
    #[error("{path}: {what} is corrupt: {reason}")]
    Corrupt {
        /// The database file (`<backend>` for a storage backend).
        path: PathBuf,
        /// Which value is damaged: the file as a whole or a meta value.
        what: Corrupted,
        /// What is wrong with it (for the file, the check's or the panic's
        /// message).
        reason: String,
    },

    /// A read-only open met a file that needs recovery after a crash
    /// (recovery writes to the file). Open it writable once (any engine
    /// open, or a writing `idem` command such as `sweep`) to recover it.
    #[error("{path}: the database needs recovery after an unclean shutdown, which a read-only open cannot do; open it writable once (e.g. `idem sweep`)")]
    NeedsRecovery {
        /// The database file.
        path: PathBuf,
    },

    /// The database's write-ahead journal (`<database file>.journal`,
    /// format 2) cannot be used: damaged before its end (the detail names
    /// the byte offset), not a journal, or another database's. Nothing was
    /// applied from it; the database file is as its last checkpoint left it.
    /// Keep both files for inspection; a journal is never skipped silently.
    #[error("{path}: the journal cannot be used: {detail}")]
    Journal {
        /// The journal file.
        path: PathBuf,
        /// What is wrong, with the byte offset where it applies.
        detail: String,
    },

    /// A read-only open (or a compaction) found a redb database without
    /// the engine's tables (another program's file, or one no engine has
    /// opened yet). Nothing was written to it.
    #[error("{path}: a redb database without idempotency tables (not written by this crate)")]
    NoEngineTables {
        /// The database file.
        path: PathBuf,
    },

    /// Another handle or process has the database open.
    #[error("{path}: database is already open (by this process or another)")]
    AlreadyOpen {
        /// The database file.
        path: PathBuf,
    },

    /// The storage library failed while the database was being prepared.
    #[error("storage error while {context}: {source}")]
    Storage {
        /// What the engine was doing.
        context: &'static str,
        /// The underlying error.
        #[source]
        source: StorageError,
    },

    /// The table prefix given to
    /// `EngineBuilder::table_prefix` (feature `postgres`) is not usable: it must be 1 to
    /// 40 characters of `a-z`, `0-9` and `_`, not starting with a digit.
    #[error("invalid table prefix {prefix:?}: {reason}")]
    InvalidTablePrefix {
        /// The prefix given.
        prefix: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// The key prefix given to `EngineBuilder::redis_key_prefix` (feature
    /// `redis`) is not usable: it must be 1 to 64 printable ASCII
    /// characters without spaces or the glob characters `* ? [ ] \`.
    #[error("invalid Redis key prefix {prefix:?}: {reason}")]
    InvalidKeyPrefix {
        /// The prefix given (at most 80 characters of it).
        prefix: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// The Redis server does not keep every acknowledged write across a
    /// crash (feature `redis`): the engine needs `appendonly yes` and
    /// `appendfsync always`, or a server crash can forget acknowledged
    /// outcomes and work runs twice. Nothing was written. Fix the server
    /// (`CONFIG SET appendonly yes`, `CONFIG SET appendfsync always`, and
    /// the same in `redis.conf`), or accept the risk with
    /// `EngineBuilder::allow_volatile(true)`. A setting `CONFIG GET` could
    /// not read (`found` starts with `unreadable`, as on a managed service
    /// that blocks `CONFIG`) is accepted with
    /// `EngineBuilder::redis_durability_attested(true)` once the provider
    /// confirmed it.
    #[error("the Redis server has {setting} {found}; the engine needs appendonly yes and appendfsync always, or a server crash can forget acknowledged outcomes (fix: CONFIG SET {setting} {}, and in redis.conf; or accept the risk with EngineBuilder::allow_volatile(true))", if *setting == "appendonly" { "yes" } else { "always" })]
    RedisNotDurable {
        /// `"appendonly"` or `"appendfsync"`.
        setting: &'static str,
        /// The value the server reported (or why it could not be read).
        found: String,
    },

    /// The Redis server may evict the engine's keys (feature `redis`): its
    /// `maxmemory-policy` is one of `allkeys-*`, so when memory runs out it
    /// deletes any key, a PROCESSING record or the fencing-token counter
    /// among them, and work runs twice. The engine sets no Redis expiry, so
    /// `noeviction` and the `volatile-*` policies never touch its keys.
    /// Nothing was written. Fix the server (`CONFIG SET maxmemory-policy
    /// noeviction`, and the same in `redis.conf`), or accept the risk with
    /// `EngineBuilder::allow_volatile(true)`.
    ///
    /// A policy `CONFIG GET` answered nothing for (`policy` starts with
    /// `unreadable`) is refused too, since it may be any; it is accepted
    /// with `EngineBuilder::redis_durability_attested(true)`.
    #[error("the Redis server has maxmemory-policy {policy}; the engine needs one that never evicts its keys (noeviction or volatile-*), since allkeys-* deletes any key when memory runs out, claims and the fencing-token counter included, so work may run twice (fix: CONFIG SET maxmemory-policy noeviction, and in redis.conf; or accept the risk with EngineBuilder::allow_volatile(true))")]
    RedisEvicts {
        /// The policy the server reported (`allkeys-lru`, ...), or why it
        /// could not be read.
        policy: String,
    },

    /// The server behind a Redis URL cannot hold the engine's records
    /// (feature `redis`): a cluster URL or a server in cluster mode, a
    /// server that is not Redis or Valkey, or one that refuses Lua
    /// scripts. Nothing was written.
    #[error("unsupported Redis server: {reason}")]
    RedisUnsupported {
        /// What is unsupported, and what to use instead.
        reason: String,
    },

    /// An open that never creates tables
    /// (`EngineBuilder::open_postgres_existing`, `open_postgres_read_only`;
    /// feature `postgres`) found the engine's tables missing under this
    /// prefix: a wrong database or prefix, or one no engine has opened yet.
    /// Nothing was written.
    #[error("no idempotency tables under prefix {prefix:?} in this PostgreSQL database (missing: {missing}); check the database and the table prefix")]
    NoPostgresTables {
        /// The table prefix.
        prefix: String,
        /// The missing tables and sequences, comma-separated.
        missing: String,
    },

    /// An open that never creates (`EngineBuilder::open_redis_existing`,
    /// `open_redis_read_only`; feature `redis`) found no engine's layout
    /// under this key prefix (no `<prefix>meta` hash): a wrong server,
    /// database number or prefix, or one no engine has opened yet.
    /// Nothing was written.
    #[error("no idempotency data under key prefix {prefix:?} on this Redis server (no {prefix}meta hash); check the URL's database number and the key prefix")]
    NoRedisData {
        /// The key prefix.
        prefix: String,
    },

    /// The PostgreSQL tables (or, feature `redis`, the Redis keys) under
    /// this prefix were written by a newer version of the crate (schema or
    /// layout version `found`). Nothing was changed.
    #[error("the idempotency data under prefix {prefix:?} (PostgreSQL tables or Redis keys) has schema version {found}; this build knows version {supported}; use a newer version of the crate")]
    UnsupportedSchema {
        /// The table prefix.
        prefix: String,
        /// The schema version stored in `<prefix>meta`.
        found: i64,
        /// The schema version this build creates and reads.
        supported: i64,
    },

    /// Another engine on these PostgreSQL tables (or, feature `redis`,
    /// this Redis key prefix) expires records by a different policy.
    /// Engines sharing a prefix must use one policy: one that forgets
    /// would delete the tombstones another keeps, which would then run a
    /// key's work again. Nothing was changed. To change the policy, stop
    /// every engine on the prefix, delete the row `tombstone_keep_ms` from
    /// `<prefix>meta` (on Redis, that field of the `<prefix>meta` hash),
    /// and open them again with the new policy (or open with
    /// [`crate::EngineBuilder::expiry_settings_from_database`] to follow
    /// the stored one).
    #[error("the idempotency data under prefix {prefix:?} (PostgreSQL tables or Redis keys) is used with expiry policy {stored:?}, not {requested:?}; engines sharing a prefix must use one policy (to change it, stop them all and delete 'tombstone_keep_ms' from <prefix>meta: the row, or on Redis the hash field)")]
    ExpiryPolicyConflict {
        /// The table prefix.
        prefix: String,
        /// The policy stored by the engines already using the tables.
        stored: crate::policy::ExpiryPolicy,
        /// The policy this engine was built with.
        requested: crate::policy::ExpiryPolicy,
    },

    /// The engine could not start one of its threads.
    #[error("cannot start the {thread} thread: {source}")]
    ThreadStart {
        /// Which thread (`writer`, `sweeper`, or on PostgreSQL
        /// `dropped-claims`).
        thread: &'static str,
        /// What the OS reported.
        #[source]
        source: std::io::Error,
    },

    /// [`crate::Engine::salvage`] was given a new file that already exists
    /// and is not empty (or a non-empty journal beside it), or whose
    /// temporary file `NEW.salvaging` is the damaged file or its journal:
    /// salvage only writes a fresh file, and never over another database.
    #[error("{}: already exists and is not empty; salvage writes only a new file", path.display())]
    SalvageTargetExists {
        /// The existing file.
        path: PathBuf,
    },
}

/// Everything that can go wrong asking an open engine to do something.
///
/// Each variant about one input names the key, entity, path or limit
/// involved. Variants about the storage as a whole (`Storage`, `Poisoned`,
/// `Closed`) name what the engine was doing instead: one group commit
/// carries many callers' keys, and the caller has its own key at hand.
/// Variants that carry an [`IdempotencyKey`] display it as `scope/key` with
/// control characters escaped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The scope or key failed validation: it must be 1..=255 bytes and
    /// contain no control characters (U+0000..U+001F, U+007F..U+009F).
    #[error("invalid idempotency {what} {value:?}: {reason}")]
    InvalidKey {
        /// `"scope"`, `"key"` or `"inbox consumer"`.
        what: &'static str,
        /// The rejected value (at most 64 characters of it).
        value: String,
        /// Why it was rejected.
        reason: &'static str,
    },

    /// An entity id or state name given to [`crate::Engine::transition`] is
    /// empty, longer than [`crate::MAX_ENTITY_BYTES`], or has a control
    /// character.
    #[error("invalid entity {what} {value:?}: {reason}")]
    InvalidEntity {
        /// `"entity id"` or `"state"`.
        what: &'static str,
        /// The rejected value (at most 64 characters of it).
        value: String,
        /// Why it was rejected.
        reason: &'static str,
    },

    /// The request body could not be fingerprinted (invalid JSON, a
    /// duplicate member, a bad JSON Pointer).
    #[error("cannot fingerprint request: {0}")]
    Fingerprint(#[from] FingerprintError),

    /// A response (envelope body plus headers, plus any resource reference
    /// and the topics and payloads of any outbox messages stored with it)
    /// is larger than the engine's `max_response_bytes`. Nothing was stored.
    ///
    /// From `complete` or `fail(Failure::Final)`, the size is checked before
    /// the claim is used, and the claim comes back in `claim`: the record is
    /// still PROCESSING under it, so the app can store a smaller answer with
    /// it (a known outcome is never recorded as unknown). Dropping the error
    /// drops the claim, with a dropped claim's effect. From a resolver's
    /// answer or a local write, `claim` is `None` and the record stays as it
    /// was (UNKNOWN, or released for a local write).
    #[error("response for {key} is {size} bytes, over the limit of {limit} bytes")]
    ResponseTooLarge {
        /// The key whose response was refused.
        key: IdempotencyKey,
        /// Size of the response in bytes.
        size: usize,
        /// The configured limit in bytes.
        limit: usize,
        /// The claim, handed back unused (from `complete` and `fail`).
        claim: Option<ReturnedClaim>,
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
    /// example purging a PROCESSING record without [`crate::PurgeMode::Force`]).
    #[error("{key}: record is {state}, cannot {action}")]
    InvalidState {
        /// The key involved.
        key: IdempotencyKey,
        /// What was attempted.
        action: &'static str,
        /// The record's state.
        state: crate::State,
    },

    /// A stored value could not be decoded, or its checksum does not match
    /// its bytes and key (the file was damaged); `what` names the value
    /// ([`Corrupted::Record`] with its key, [`Corrupted::RecordKey`],
    /// [`Corrupted::OutboxMessage`] with its sequence number,
    /// [`Corrupted::Entity`] with its id). A corrupt record is left as is:
    /// it is never replayed, never treated as absent, and other keys keep
    /// working.
    #[error("{what} is corrupt: {reason}")]
    Corrupt {
        /// Which stored value is damaged.
        what: Corrupted,
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

    /// The storage library reported an error.
    #[error("storage error while {context}: {source}")]
    Storage {
        /// What the engine was doing.
        context: &'static str,
        /// The underlying error.
        #[source]
        source: StorageError,
    },

    /// The database did not answer within its bound (feature `postgres`:
    /// `EngineBuilder::statement_timeout` plus a second per round trip,
    /// `EngineBuilder::connect_timeout` for a new connection). The
    /// connection was given up. For a read, nothing changed; for a write,
    /// the engine settles a lost COMMIT where the server can tell (see
    /// [`Error::NotCommitted`]) and otherwise the write's outcome is
    /// unknown, as with [`Error::Storage`]. Retrying the call (with the
    /// same key) is safe.
    #[error("{context}: the database did not answer within {after:?}")]
    Timeout {
        /// What the engine was doing.
        context: &'static str,
        /// How long it waited.
        after: std::time::Duration,
    },

    /// A write's connection broke while it was committing, and the
    /// database then said the transaction did not commit (feature
    /// `postgres`, from `pg_xact_status`), or the database refused the
    /// COMMIT: nothing was written. A `begin` (or any call that takes no
    /// claim) may be retried as it is. A claim passed to a `complete` or
    /// `fail` that returns this was consumed, as with any failed write:
    /// its record is still PROCESSING and becomes UNKNOWN when its lease
    /// ends (settle it with the resolver, or retry the request with the
    /// same key once it is).
    ///
    /// Unlike [`Error::Storage`], this is about one call's own transaction
    /// (PostgreSQL runs each call in its own), so it names the call's key
    /// and, for an effect-step write, the step.
    #[error("{context}{}: not committed (the connection broke during COMMIT and the database rolled the transaction back); nothing was written, the call may be retried", subject(.key.as_ref(), .step.as_deref()))]
    NotCommitted {
        /// What the engine was doing.
        context: &'static str,
        /// The key of the call whose write did not commit; `None` only for
        /// a write that is not about one key (a sweep, an entity's state,
        /// removing published outbox messages).
        key: Option<IdempotencyKey>,
        /// The effect step the write was for (a reservation, a
        /// confirmation or rejection, a settlement of one step), if any.
        step: Option<String>,
    },

    /// A commit or I/O failure poisoned the engine: this call's own (the
    /// calls of the group whose commit failed hear it first) or an earlier
    /// one. Nothing is written after the disk has said no. An engine
    /// opened from a file reopens it by itself once the disk takes writes
    /// again (see [`crate::Engine::poisoned`]); one opened with
    /// `open_with_backend` must be dropped and opened again.
    #[error("writes refused: the engine is poisoned by a storage failure ({cause}); it reopens the database once storage takes writes again")]
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
        source: BoxError,
    },

    /// A write was called from inside an app's local write closure (see
    /// `Engine::complete_local`) on the same engine. On redb the closure
    /// runs on the engine's writer thread, and on PostgreSQL it holds the
    /// key's row lock, so the call would wait for itself forever. Reads
    /// (`record`, `records`, ...) are fine there.
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

    /// The engine was opened read-only ([`crate::EngineBuilder::open_read_only`],
    /// `open_postgres_read_only` with feature `postgres`, or
    /// `open_redis_read_only` with feature `redis`) and was asked to write.
    #[error("engine is read-only: cannot {operation}")]
    ReadOnly {
        /// The write that was refused.
        operation: &'static str,
    },

    /// The engine was dropped while this handle (a claim, an inbox ticket)
    /// was still alive.
    #[error("engine has been closed")]
    Closed,

    /// An effect step name is empty, longer than
    /// [`crate::MAX_STEP_NAME_BYTES`] bytes, contains a character that is
    /// not printable ASCII (`u8::is_ascii_graphic`: no space, control, bidi
    /// or other non-ASCII character, so a name cannot pass for another in
    /// `idem show`) or a `/` (the step's reference is
    /// `{claim reference}/{name}`). Nothing was written.
    #[error("invalid effect step name {name:?}: {reason}")]
    InvalidStepName {
        /// The rejected name (at most 64 characters of it).
        name: String,
        /// Why it was rejected.
        reason: &'static str,
    },

    /// A step's evidence (the provider's answer) is longer than
    /// [`crate::MAX_EVIDENCE_BYTES`]. Nothing was written; the step is
    /// still reserved.
    #[error("evidence for step {step:?} of {key} is {bytes} bytes, over the limit of 4096 bytes")]
    EvidenceTooLarge {
        /// The key the step belongs to.
        key: IdempotencyKey,
        /// The step name.
        step: String,
        /// The evidence's size in bytes.
        bytes: usize,
    },

    /// The claim already reserved (or confirmed, or failed) this step: a
    /// step name is used once per claim. Nothing was written.
    #[error("effect step {step:?} of {key} was already used by this claim")]
    StepReused {
        /// The key the step belongs to.
        key: IdempotencyKey,
        /// The step name.
        step: String,
    },

    /// The key has no step of this name (a confirm of a step never
    /// reserved, or a resolver's or operator's answer for a step the key's
    /// claims never reserved). Nothing was written.
    #[error("{key} has no effect step {step:?}")]
    StepNotFound {
        /// The key.
        key: IdempotencyKey,
        /// The step name asked for.
        step: String,
    },

    /// The key already holds [`crate::MAX_STEPS_PER_KEY`] distinct steps.
    /// Nothing was written.
    #[error("{key} already holds the most effect steps a key may hold (16)")]
    TooManySteps {
        /// The key.
        key: IdempotencyKey,
    },

    /// The key's evidence log holds [`crate::MAX_HISTORY_ENTRIES`]
    /// entries: the transition that would write one more was refused and
    /// nothing was written. An operator can still purge the key.
    #[error("the evidence log of {key} is full (256 entries); the transition was refused")]
    HistoryFull {
        /// The key.
        key: IdempotencyKey,
    },

    /// An operator's settlement needs a reason (non-blank), which the
    /// evidence log records. Nothing was written.
    #[error("a reason is required to settle by hand; it is recorded in the evidence log")]
    ReasonRequired,

    /// An operator's reason is longer than [`crate::MAX_REASON_BYTES`]
    /// bytes (it is stored in the key's evidence log, whose size per key is
    /// bounded). Nothing was written.
    #[error(
        "the reason given to settle {key} by hand is {bytes} bytes, over the limit of 1024 bytes"
    )]
    ReasonTooLong {
        /// The key being settled.
        key: IdempotencyKey,
        /// The reason's size in bytes.
        bytes: usize,
    },

    /// Opening a database failed (lets `?` mix opening and requests in one
    /// function).
    #[error(transparent)]
    Open(#[from] OpenError),
}

/// Which stored value an [`Error::Corrupt`] or [`OpenError::Corrupt`] is
/// about, naming it by the key or number it is stored under.
///
/// `Display` reads as the subject of "... is corrupt" (e.g. `record for
/// scope/key`, `outbox message #7`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Corrupted {
    /// An idempotency record, by its key.
    Record(IdempotencyKey),
    /// A record's stored key bytes (as lower-case hex), which are not a
    /// valid scope and key (only listings and scrubs meet them: no request
    /// can look them up).
    RecordKey(String),
    /// An outbox message, by its sequence number.
    OutboxMessage(u64),
    /// A dead letter, by its sequence number.
    DeadLetter(u64),
    /// An entity's stored state, by the entity id.
    Entity(String),
    /// An effect step of a key, by the key and the step name.
    Step {
        /// The key the step belongs to.
        key: IdempotencyKey,
        /// The step name.
        step: String,
    },
    /// An entry of a key's evidence log, by the key and its sequence
    /// number.
    History {
        /// The key the log belongs to.
        key: IdempotencyKey,
        /// The entry's sequence number.
        seq: u32,
    },
    /// A value of the meta table, by its key (`next_token`,
    /// `journal_lsn`, ...); only in [`OpenError::Corrupt`], except the
    /// Redis store's fencing-token counter, which a claim meets.
    Meta(&'static str),
    /// The database file as a whole; only in [`OpenError::Corrupt`].
    File,
}

impl std::fmt::Display for Corrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Corrupted::Record(key) => write!(f, "record for {key}"),
            Corrupted::RecordKey(key_hex) => write!(f, "record key {key_hex}"),
            Corrupted::OutboxMessage(seq) => write!(f, "outbox message #{seq}"),
            Corrupted::DeadLetter(seq) => write!(f, "dead letter #{seq}"),
            Corrupted::Entity(entity) => write!(f, "entity {entity:?}"),
            Corrupted::Step { key, step } => write!(f, "effect step {step:?} of {key}"),
            Corrupted::History { key, seq } => write!(f, "evidence log entry #{seq} of {key}"),
            Corrupted::Meta(key) => write!(f, "the meta value {key:?}"),
            Corrupted::File => f.write_str("the database file"),
        }
    }
}

/// A claim handed back unused inside [`Error::ResponseTooLarge`]; turn it
/// back into the claim with `ReturnedClaim::into_claim` and complete it
/// with a smaller answer. Dropping it drops the claim (a dropped claim's
/// effect: in doubt, never re-executed).
///
/// (The claim is boxed as `Any` so that this bottom-layer error type does
/// not depend on the claim handle above it.)
pub struct ReturnedClaim(pub(crate) Box<dyn std::any::Any + Send + Sync>);

impl std::fmt::Debug for ReturnedClaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReturnedClaim(..)")
    }
}

/// " for {key}" / " for step {step:?} of {key}" (empty without a key): the
/// subject of an [`Error::NotCommitted`].
fn subject(key: Option<&IdempotencyKey>, step: Option<&str>) -> String {
    match (key, step) {
        (Some(key), Some(step)) => format!(" for step {step:?} of {key}"),
        (Some(key), None) => format!(" for {key}"),
        (None, _) => String::new(),
    }
}

impl Error {
    /// Names `key` (and `step`) in an [`Error::NotCommitted`] raised below
    /// the engine, where one transaction is known only by what it was
    /// doing; a name already there is kept, and any other error is
    /// returned as it is.
    pub(crate) fn naming(self, key: &IdempotencyKey, step: Option<&str>) -> Error {
        match self {
            Error::NotCommitted {
                context,
                key: None,
                step: None,
            } => Error::NotCommitted {
                context,
                key: Some(key.clone()),
                step: step.map(str::to_string),
            },
            other => other,
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_committed_names_its_key_and_step_once_named() -> Result<()> {
        let key = IdempotencyKey::new("shop:pay", "k-1")?;
        let bare = Error::NotCommitted {
            context: "reserving an effect step",
            key: None,
            step: None,
        };
        assert!(bare
            .to_string()
            .starts_with("reserving an effect step: not committed"));
        let named = bare.naming(&key, Some("charge"));
        let text = named.to_string();
        assert!(
            text.starts_with("reserving an effect step for step \"charge\" of shop:pay/k-1:"),
            "{text}"
        );
        // A name already given is kept; other errors pass through.
        let other = IdempotencyKey::new("shop:pay", "k-2")?;
        let again = named.naming(&other, None).to_string();
        assert_eq!(again, text);
        let closed = Error::Closed.naming(&key, None);
        assert_eq!(closed.to_string(), "engine has been closed");
        Ok(())
    }
}
