//! What `begin` answers.

use std::time::Duration;

use crate::engine::claim::Claim;
use crate::outcome::{InDoubt, Replay};

/// The answer to [`crate::Engine::begin`]: exactly one of these.
///
/// Suggested HTTP mapping (status codes from the IETF `Idempotency-Key`
/// draft, draft-ietf-httpapi-idempotency-key-header; the draft suggests 422
/// for a reused key with a different request, Stripe answers 400, and this
/// crate's HTTP layer answers 409 by default with a problem type that tells
/// mismatch and processing apart):
///
/// | outcome | HTTP |
/// |---|---|
/// | `Claimed` | run the handler |
/// | `Replay` | the stored status, headers and body |
/// | `Processing` | 409 Conflict with `Retry-After` |
/// | `Mismatch` | 409 (or 422) problem+json: key reused with a different request |
/// | `InDoubt` | 503 with `Retry-After` until recovery settles it |
/// | `Tombstoned` | 409 Conflict, problem+json: key expired and may not be reused yet |
#[derive(Debug)]
#[must_use = "a Claimed outcome must be completed or failed"]
pub enum Begin {
    /// This caller won the atomic insert of a PROCESSING record, durably.
    /// Run the work, then complete or fail the claim.
    Claimed(Claim),
    /// The key completed earlier with the same fingerprint.
    Replay(Replay),
    /// Another caller holds the claim and its work is running (or may
    /// still run: a dropped claim before its lease ends). Retry after
    /// `retry_after` (the remaining lease; never zero). For a dropped claim
    /// on an engine with a resolver it can be shorter: the time until the
    /// resolver may be asked again (see
    /// [`EngineBuilder::resolver_interval`](crate::EngineBuilder::resolver_interval)).
    Processing {
        /// Remaining lease of the current holder, or the time to the next
        /// resolver question about a dropped claim.
        retry_after: Duration,
    },
    /// The key was used before with a different fingerprint. The work must
    /// not run, and no stored response is revealed.
    Mismatch,
    /// The key's work may have had side effects whose result was never
    /// recorded: the record is in doubt. It is never executed again by
    /// `begin`; resolve it with a [`crate::Resolver`] (query the provider by
    /// `reference`). A key with effect steps is settled step by step
    /// instead ([`InDoubt::steps`] says which are still unknown) and is
    /// answered `InDoubt` until every step is settled; then `begin`
    /// resumes it (`Claimed`, with the steps in [`Claim::steps`]) or
    /// replays the response a resolver built from them.
    InDoubt(InDoubt),
    /// The key's record expired and is kept as a tombstone: the key may not
    /// be reused until `reusable_at_ms`. The work does not run.
    Tombstoned {
        /// When the original record expired (ms since the Unix epoch).
        expired_at_ms: u64,
        /// When the tombstone runs out and the key may be reused (ms since
        /// the Unix epoch).
        reusable_at_ms: u64,
    },
}
