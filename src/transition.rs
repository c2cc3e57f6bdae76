//! The answer to a business entity's compare-and-set transition.

/// Longest entity id or state name, in bytes.
pub const MAX_ENTITY_BYTES: usize = 255;

/// The answer to [`crate::Engine::transition`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transition {
    /// The entity moved to the new state; `version` counts its transitions
    /// (1 for the first state).
    Applied {
        /// The entity's version after the move.
        version: u64,
    },
    /// The entity already is in the target state: a repeat of the same
    /// transition. Success, with no side effect.
    AlreadyInState {
        /// The entity's current version.
        version: u64,
    },
    /// An illegal move (e.g. pay after cancel): the entity's state is not one
    /// of the allowed `from` states. Nothing changed.
    Conflict {
        /// The entity's current state (`None`: it does not exist yet).
        current: Option<String>,
        /// Its current version (0 if it does not exist).
        version: u64,
    },
}
