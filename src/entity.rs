//! Business entities with conditional state transitions (compare-and-set).

use serde::{Deserialize, Serialize};

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::ops::{Op, Reply};

/// The answer to [`Engine::transition`].
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

/// An entity's stored state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct EntityState {
    pub(crate) state: String,
    pub(crate) version: u64,
    pub(crate) updated_at_ms: u64,
}

/// Longest entity id or state name, in bytes.
pub const MAX_ENTITY_BYTES: usize = 255;

impl Engine {
    /// Moves `entity` to state `to` if its current state is one of `from`.
    /// An entity that does not exist yet is created when `from` is empty.
    /// One write transaction (compare-and-set through the writer), so racing
    /// transitions never lose an update: exactly one wins and the others get
    /// `Conflict` with the winner's state (or `AlreadyInState`).
    ///
    /// Rules, in order: current state == `to` → `AlreadyInState`; current in
    /// `from` (or absent with `from` empty) → `Applied`; else `Conflict`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidKey`] for an empty or over-long (> 255 bytes) entity
    /// id or state name; storage errors.
    pub fn transition(&self, entity: &str, from: &[&str], to: &str) -> Result<Transition> {
        check("entity id", entity)?;
        check("state", to)?;
        for f in from {
            check("state", f)?;
        }
        let op = Op::Transition {
            entity: entity.to_owned(),
            from: from.iter().map(|s| (*s).to_owned()).collect(),
            to: to.to_owned(),
        };
        match self.shared.submit(op)? {
            Reply::Transition(t) => Ok(t),
            other => Err(self.shared.unexpected(other)),
        }
    }

    /// The entity's current state and version, if it exists.
    ///
    /// # Errors
    ///
    /// Storage errors; [`Error::CorruptRecord`].
    pub fn entity_state(&self, entity: &str) -> Result<Option<(String, u64)>> {
        let ctx = "reading an entity";
        let table = self.shared.read_table(crate::tables::ENTITIES, ctx)?;
        let Some(v) = table.get(entity).map_err(|e| Error::storage(ctx, e))? else {
            return Ok(None);
        };
        let s = crate::codec::decode_entity(v.value()).map_err(|e| Error::CorruptRecord {
            key: format!("entity {entity:?}"),
            reason: e.to_string(),
        })?;
        Ok(Some((s.state, s.version)))
    }
}

fn check(what: &'static str, value: &str) -> Result<()> {
    let reason = if value.is_empty() {
        "must not be empty"
    } else if value.len() > MAX_ENTITY_BYTES {
        "longer than 255 bytes"
    } else {
        return Ok(());
    };
    Err(Error::InvalidKey {
        what,
        value: value.chars().take(64).collect(),
        reason,
    })
}
