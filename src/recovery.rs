//! Settling UNKNOWN records by asking the outside world what happened.

use crate::envelope::Envelope;
use crate::outcome::Pending;

/// What a resolver learned about one UNKNOWN record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resolution {
    /// The work did happen; this is its response. The record becomes
    /// COMPLETED and later requests replay it.
    Completed(Envelope),
    /// The work never happened (the provider has no such reference). The
    /// record is released and the next request executes afresh, under a new
    /// fencing token.
    NotExecuted,
    /// The provider cannot tell yet. The record stays UNKNOWN and its
    /// attempt count grows.
    StillUnknown,
}

/// Answers for UNKNOWN records by *querying*, never by re-executing.
///
/// Typical implementation: look up [`Pending::reference`] at the payment
/// provider (the app passed the claim's reference to the provider as its
/// idempotency key or transaction id). A query that fails (network error,
/// provider outage) should answer [`Resolution::StillUnknown`].
///
/// Resolvers run on the calling thread (of `begin` or
/// [`crate::Engine::recover_pending`]), never on the engine's writer thread,
/// so a slow provider does not hold up other keys.
pub trait Resolver: Send + Sync {
    /// Settles one UNKNOWN record. `pending.attempts` counts earlier
    /// `StillUnknown` answers; `pending.age_ms` is how long it has been
    /// UNKNOWN.
    fn resolve(&self, pending: &Pending) -> Resolution;
}

impl<F> Resolver for F
where
    F: Fn(&Pending) -> Resolution + Send + Sync,
{
    fn resolve(&self, pending: &Pending) -> Resolution {
        self(pending)
    }
}

/// What one [`crate::Engine::recover_pending`] run did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Records the resolver settled as completed.
    pub completed: u64,
    /// Records the resolver settled as not executed (released).
    pub not_executed: u64,
    /// Records still unknown after this run.
    pub still_unknown: u64,
    /// Records settled by someone else meanwhile (skipped).
    pub skipped: u64,
}
