//! Business entities with conditional state transitions (compare-and-set).

use crate::engine::core::Core;
use crate::error::{Error, Result};
use crate::store::TransitionRequest;
use crate::transition::{Transition, MAX_ENTITY_BYTES};

/// Moves `entity` to `to` if its state is one of `from` (see
/// `Engine::transition`).
pub(crate) fn transition(core: &Core, entity: &str, from: &[&str], to: &str) -> Result<Transition> {
    check("entity id", entity)?;
    check("state", to)?;
    for f in from {
        check("state", f)?;
    }
    core.store.transition(TransitionRequest {
        entity: entity.to_owned(),
        from: from.iter().map(|s| (*s).to_owned()).collect(),
        to: to.to_owned(),
    })
}

/// The entity's current state and version, if it exists.
pub(crate) fn state(core: &Core, entity: &str) -> Result<Option<(String, u64)>> {
    check("entity id", entity)?;
    Ok(core.store.entity(entity)?.map(|s| (s.state, s.version)))
}

fn check(what: &'static str, value: &str) -> Result<()> {
    let reason = if value.is_empty() {
        "must not be empty"
    } else if value.len() > MAX_ENTITY_BYTES {
        "longer than 255 bytes"
    } else if value.chars().any(char::is_control) {
        "contains a control character"
    } else {
        return Ok(());
    };
    Err(Error::InvalidEntity {
        what,
        value: value.chars().take(64).collect(),
        reason,
    })
}
