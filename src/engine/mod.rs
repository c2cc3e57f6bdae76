//! The engine: the handle users hold, its builder, the core every feature
//! shares, the claim the core issues, and the features built on the core
//! (inbox, outbox, local exactly-once, entity state machine, recovery of
//! UNKNOWN records, inspection and the background sweeper).
//!
//! This is the third layer: it imports the public value types and the
//! store layer (`crate::store`), never the HTTP adapter above it. Inside,
//! the core (`core.rs`, `claim.rs`, `begin.rs`) never imports a feature;
//! the features import the core; the handle (`handle.rs`) and its builder
//! wire them all. `lib.rs` re-exports the public items from here.

pub(crate) mod begin;
pub(crate) mod builder;
pub(crate) mod claim;
mod compact;
pub(crate) mod config;
pub(crate) mod core;
pub(crate) mod early;
pub(crate) mod effects;
pub(crate) mod entity;
pub(crate) mod handle;
pub(crate) mod inbox;
pub(crate) mod inspect;
pub(crate) mod local;
pub(crate) mod outbox;
pub(crate) mod recovery;
pub(crate) mod salvage;
pub(crate) mod steps;
pub(crate) mod sweeper;
pub(crate) mod wait;
