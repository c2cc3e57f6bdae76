//! Effect steps: one durable entry per external call a claim makes, and the
//! evidence log that records every step transition and settlement.
//!
//! (The store's bounds only, so far; the public step types come with the
//! engine's half of effect steps.)

/// Longest step name accepted, in bytes.
pub const MAX_STEP_NAME_BYTES: usize = 64;

/// Most steps one key may hold (over all its claims); the 17th distinct
/// name is refused with [`crate::Error::TooManySteps`].
pub const MAX_STEPS_PER_KEY: usize = 16;

/// Largest evidence (a provider's answer, as bytes) a step stores.
pub const MAX_EVIDENCE_BYTES: usize = 4096;

/// Most history entries one key keeps. A transition that would write
/// entry 257 is refused with [`crate::Error::HistoryFull`] and writes
/// nothing (an operator can still purge the key).
pub const MAX_HISTORY_ENTRIES: usize = 256;
