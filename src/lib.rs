//! Exactly-once execution of retried operations.
//!
//! Clients retry: timeouts, gateways, at-least-once queues, impatient users.
//! This crate remembers what an idempotency key *meant* (a fingerprint of the
//! request's business fields) and how far its work got: in one embedded
//! [redb](https://docs.rs/redb) file, or (feature `postgres`) in PostgreSQL
//! tables that several app servers share, with the same API and the same
//! rules:
//!
//! - **Atomic claim.** [`Engine::begin`] inserts a PROCESSING record in one
//!   durable write transaction *before* the work runs; a concurrent twin can
//!   never also win. Claims are group-committed: many callers share one fsync.
//! - **Fingerprint.** [`Fingerprint`] hashes the canonical form of the
//!   business fields (not raw bytes). Same key with a different fingerprint
//!   is [`Begin::Mismatch`], never a replay.
//! - **Visible processing** (another caller holds the key) with a
//!   retry-after hint, **replay** of a stored [`Envelope`] (versioned for
//!   upgrades), and **recovery**: work that may
//!   have happened but was never recorded becomes UNKNOWN and is settled by a
//!   [`Resolver`] that queries the provider, never by executing again.
//! - **Effect steps** for operations with several external calls: each call
//!   is reserved durably before it is made ([`Claim::effect`]) and
//!   confirmed with the provider's answer; after a crash the steps are
//!   settled one by one by asking each provider
//!   ([`Resolver::resolve_step`], [`EngineBuilder::step_resolver`]) and the
//!   retry resumes, skipping the calls already made. Every transition is in
//!   the key's evidence log ([`Engine::history`]).
//! - **Expiry** by TTL, decided at read time and cleaned up by a background
//!   sweeper, with an optional tombstone policy ([`ExpiryPolicy`]).
//!
//! Names: a record's *state* is UNKNOWN ([`State::Unknown`], printed
//! `UNKNOWN`); a *value* that describes such a record, or an outcome that
//! leaves one, is *in doubt* ([`InDoubt`], [`Begin::InDoubt`],
//! [`Failure::InDoubt`], [`Resolution::StillInDoubt`],
//! [`Engine::recover_in_doubt`]). To *settle* is only ever to resolve an
//! in-doubt record.
//!
//! Features: `http` adds a tower layer for the IETF `Idempotency-Key`
//! header draft (`idempotency::http`); `postgres` adds
//! `EngineBuilder::open_postgres` (see `docs/postgres.md`). The guides
//! (replay, recovery, expiry, HTTP, messaging, operations, the on-disk
//! format) are the `docs/` pages, listed in the README; `docs/design.md`
//! maps the code.
//!
//! What it is not: a distributed lock service or a general cache. On redb,
//! one process owns the database file (redb locks it); apps that outgrow one
//! machine share a PostgreSQL database instead. Keys and scopes are at most
//! 255 bytes; responses are limited by
//! [`EngineBuilder::max_response_bytes`] (1 MiB by default).
//!
//! # Example
//!
//! ```
//! use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey};
//!
//! let dir = tempfile::tempdir()?;
//! let engine = Engine::builder().open(dir.path().join("idem.redb"))?;
//! let key = IdempotencyKey::new("tenant-1:create_payment", "9f1c-retry-safe")?;
//! let fp = Fingerprint::of_json(br#"{"amount": 10, "currency": "EUR"}"#, &[])?;
//!
//! match engine.begin(&key, fp)? {
//!     Begin::Claimed(claim) => {
//!         // Do the work once, passing claim.reference() to the provider.
//!         let body = format!(r#"{{"payment":"{}"}}"#, claim.reference());
//!         engine.complete(claim, Envelope::new(1, 201, body))?;
//!     }
//!     other => panic!("a new key is claimed, got {other:?}"),
//! }
//!
//! // The retry, with members reordered: same fingerprint, so it replays.
//! let retry = Fingerprint::of_json(br#"{"currency":"EUR","amount":10.0}"#, &[])?;
//! match engine.begin(&key, retry)? {
//!     Begin::Replay(replay) => assert_eq!(replay.envelope.status, 201),
//!     other => panic!("expected a replay, got {other:?}"),
//! }
//!
//! // The same key with a different amount is a conflict, never a replay.
//! let tampered = Fingerprint::of_json(br#"{"amount": 100, "currency": "EUR"}"#, &[])?;
//! assert!(matches!(engine.begin(&key, tampered)?, Begin::Mismatch));
//! # Ok::<_, Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]
#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]
// Items are `pub` only where users reach them; everything else says
// `pub(crate)` (or less), so the public surface is visible in the code.
#![warn(unreachable_pub)]
// Pedantic lints on the library itself; tests may cast and count freely.
#![cfg_attr(not(test), warn(clippy::pedantic))]
#![allow(
    // Getters and builder setters throughout: `#[must_use]` on each adds
    // noise without catching bugs; the outcomes that matter (`Begin`,
    // `Receive`) are `#[must_use]` types themselves.
    clippy::must_use_candidate,
    // Debug impls leave out engine links and closures on purpose.
    clippy::missing_fields_in_debug,
    // `key`/`rkey`, `claim`/`claimed` read clearly where they meet.
    clippy::similar_names,
    // Counting lines for an error position runs once per error, not per
    // byte of hot input; a byte-counting crate is not worth a dependency.
    clippy::naive_bytecount,
    // `Claimed::claimed_at_ms` and the like name what the field holds.
    clippy::struct_field_names
)]

// Layer 1, the public value types: they import nothing above them.
pub mod canonical;
mod clock;
mod compaction;
mod dead_letter;
mod envelope;
mod error;
mod fingerprint;
mod key;
mod message;
mod outcome;
mod policy;
mod report;
mod resolver;
mod salvage;
mod state;
mod step;
pub mod timestamp;
mod transition;
mod verify;

// Layer 2, the private store layer, behind its typed seam (`store::Backend`),
// one folder per backend.
mod store;

// Layer 3, the engine: its handle, builder, core, claim and features.
mod engine;

// Layer 4, the HTTP adapter, above everything.
#[cfg(feature = "http")]
pub mod http;

// Layer 5, the JetStream adapter, beside HTTP at the top.
#[cfg(feature = "nats")]
pub mod nats;

// Beside the adapters: the benches' bulk preload (not part of the API).
#[cfg(feature = "bench-fixtures")]
#[doc(hidden)]
pub mod bench_fixtures;

pub use clock::{Clock, ManualClock, SystemClock};
pub use compaction::Compaction;
pub use dead_letter::{DeadLetter, Delivery};
pub use engine::begin::Begin;
pub use engine::builder::EngineBuilder;
pub use engine::claim::Claim;
pub use engine::effects::Effects;
pub use engine::handle::Engine;
pub use engine::inbox::{AfterFailure, Inbox, Processed, Receive, Ticket};
pub use engine::inspect::{RecordFilter, RecordInfo, Stats};
pub use engine::local::LocalRun;
pub use engine::outbox::{Outbox, OUTBOX_DEAD_LETTER_CONSUMER};
pub use engine::wait::DurableWrite;
pub use envelope::Envelope;
pub use error::{BoxError, Corrupted, Error, OpenError, Result, ReturnedClaim, StorageError};
pub use fingerprint::{
    Fingerprint, FingerprintBuilder, FingerprintError, FINGERPRINT_ALGORITHM_VERSION,
};
pub use key::{IdempotencyKey, MAX_KEY_BYTES};
pub use message::{OutboxEntry, OutgoingMessage};
pub use outcome::{Failure, InDoubt, Replay, ReplayKind};
pub use policy::{ExpiryPolicy, PurgeMode};
pub use report::{RecoveryReport, SweepCounts};
pub use resolver::{Resolution, Resolver};
pub use salvage::{Lost, SalvageReport};
pub use state::State;
pub use step::{
    Actor, EffectStep, HistoryEntry, InDoubtStep, StepInfo, StepResolution, StepState,
    MAX_EVIDENCE_BYTES, MAX_HISTORY_ENTRIES, MAX_REASON_BYTES, MAX_STEPS_PER_KEY,
    MAX_STEP_NAME_BYTES,
};
pub use store::LocalTx;
pub use transition::{Transition, MAX_ENTITY_BYTES};
pub use verify::{Damage, VerifyReport};

/// The `tracing` target of the events that record an operator's action on
/// a record: today a purge (`Engine::purge`), at WARN, with the key, its
/// state and whether it was forced. An app can route them to an audit
/// log with a target filter; the `idem` CLI leaves them out of its
/// stderr, since it prints what it did itself. Every other event's target
/// is its module path (`idempotency::...`).
pub const AUDIT_TARGET: &str = "idempotency::audit";

/// The synchronous PostgreSQL client crate, for tools that share the
/// engine's connection settings. Its types (`types::ToSql`,
/// `types::Type`, `Row`, `Statement`) are the ones [`PgTransaction`] takes
/// and returns (both crates re-export `tokio_postgres`'s).
#[cfg(feature = "postgres")]
pub use postgres;
#[cfg(feature = "postgres")]
pub use store::postgres::{PgError, Transaction as PgTransaction};
#[cfg(feature = "redis")]
pub use store::redis::RedisLocal;

/// Decodes a fuzz input as a stored record, for the `record_decode` fuzz
/// target (built only under `cfg(fuzzing)`). Byte 0 picks the mode: even,
/// the rest is a stored value as is; odd, the rest is a payload the hook
/// frames with a correct checksum first, so mutations reach the field
/// decoders. Returns whether it decoded as a record; the same bytes also
/// go through the outbox, entity and meta decoders, which must not panic
/// either.
#[cfg(fuzzing)]
#[doc(hidden)]
pub fn __fuzz_decode_record(input: &[u8]) -> bool {
    store::codec::fuzz_decode(input)
}

/// Decodes a fuzz input as one of the redb backend's stored structures
/// (a journal's frames, a format-3 partition row or key filter), for the
/// `stored_structures` fuzz target (built only under `cfg(fuzzing)`); byte 0
/// picks the structure and mode, byte 1 a partition number or checkpoint
/// LSN. Returns whether it decoded.
#[cfg(fuzzing)]
#[doc(hidden)]
pub fn __fuzz_decode_stored(input: &[u8]) -> bool {
    store::redb::fuzz_stored(input)
}

/// The README's Rust snippets, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// Declares one doctest-only item per `docs/` page, so the Rust snippets
/// in every page compile and run as doctests (a page without snippets
/// costs nothing).
#[cfg(doctest)]
macro_rules! doc_pages {
    ($($name:ident = $path:literal,)*) => {$(
        #[doc = include_str!($path)]
        struct $name;
    )*};
}

#[cfg(doctest)]
doc_pages! {
    DesignDoctests = "../docs/design.md",
    DevelopmentDoctests = "../docs/development.md",
    ExpiryDoctests = "../docs/expiry.md",
    FingerprintsDoctests = "../docs/fingerprints.md",
    FormatDoctests = "../docs/format.md",
    HttpDoctests = "../docs/http.md",
    MessagingDoctests = "../docs/messaging.md",
    MetricsDoctests = "../docs/metrics.md",
    OperationsDoctests = "../docs/operations.md",
    PostgresDoctests = "../docs/postgres.md",
    RecoveryDoctests = "../docs/recovery.md",
    RedbDoctests = "../docs/redb.md",
    ReplayDoctests = "../docs/replay.md",
}
