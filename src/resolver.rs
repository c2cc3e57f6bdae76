//! Settling in-doubt (UNKNOWN) records by asking the outside world what
//! happened.

use crate::envelope::Envelope;
use crate::outcome::InDoubt;

/// What a resolver learned about one in-doubt record.
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
    StillInDoubt,
}

/// Answers for in-doubt records by *querying*, never by re-executing.
///
/// Typical implementation: look up [`InDoubt::reference`] at the payment
/// provider (the app passed the claim's reference to the provider as its
/// idempotency key or transaction id). A query that fails (network error,
/// provider outage) should answer [`Resolution::StillInDoubt`].
///
/// Resolvers run on the calling thread (of `begin` or
/// [`crate::Engine::recover_in_doubt`]), never on the engine's writer
/// thread, so a slow provider does not hold up other keys.
pub trait Resolver: Send + Sync {
    /// Settles one in-doubt record. `in_doubt.attempts` counts earlier
    /// `StillInDoubt` answers; `in_doubt.age` is how long it has been
    /// UNKNOWN.
    fn resolve(&self, in_doubt: &InDoubt) -> Resolution;
}

impl<F> Resolver for F
where
    F: Fn(&InDoubt) -> Resolution + Send + Sync,
{
    fn resolve(&self, in_doubt: &InDoubt) -> Resolution {
        self(in_doubt)
    }
}
