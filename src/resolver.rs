//! Settling in-doubt (UNKNOWN) records by asking the outside world what
//! happened.

use crate::envelope::Envelope;
use crate::outcome::InDoubt;
use crate::step::{InDoubtStep, StepInfo, StepResolution};

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

    /// Settles one effect step in doubt (a key with steps is settled step
    /// by step, never as a whole): look `step.reference` up at the step's
    /// provider. Asked only for steps with no per-step resolver (see
    /// [`crate::EngineBuilder::step_resolver`]). The default answers
    /// [`StepResolution::StillUnknown`], so the step waits for an operator
    /// ([`crate::Engine::resolve_step`]).
    fn resolve_step(&self, step: &InDoubtStep) -> StepResolution {
        let _ = step;
        StepResolution::StillUnknown
    }

    /// Once every step of an in-doubt key is settled: the operation's
    /// response, if the steps' evidence alone determines it. `Some`
    /// completes the key with it (later requests replay it; the handler
    /// never runs again). The default, `None`, resumes instead: the key is
    /// released with its steps kept, and the next `begin` hands out a claim
    /// whose [`crate::Claim::effect`] skips the confirmed calls. The HTTP
    /// layer relies on resuming (it re-runs the handler).
    fn complete_from_steps(&self, in_doubt: &InDoubt, steps: &[StepInfo]) -> Option<Envelope> {
        let _ = (in_doubt, steps);
        None
    }
}

impl<F> Resolver for F
where
    F: Fn(&InDoubt) -> Resolution + Send + Sync,
{
    fn resolve(&self, in_doubt: &InDoubt) -> Resolution {
        self(in_doubt)
    }
}
