//! What background passes report: sweeps and recovery runs.

/// What one sweep step or pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepCounts {
    /// Stale PROCESSING records moved to UNKNOWN.
    pub moved_to_unknown: u64,
    /// Expired records deleted.
    pub deleted: u64,
    /// Expired records turned into tombstones.
    pub tombstoned: u64,
    /// Whether the step stopped at its limit with more work left.
    pub more: bool,
}

/// What one [`crate::Engine::recover_in_doubt`] run did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Records the resolver settled as completed.
    pub completed: u64,
    /// Records the resolver settled as not executed (released).
    pub not_executed: u64,
    /// Keys with effect steps whose steps are all settled: RESUMABLE. The
    /// record stays UNKNOWN (its fingerprint still checked) until the
    /// client's retry resumes it: the next `begin` with the same
    /// fingerprint replaces it by a fresh claim in one write, steps and
    /// log kept, and skips the confirmed steps. Counted on runs that have
    /// room for them after the other in-doubt records (they never take the
    /// place of one); a key never retried stays listed until retried or
    /// purged.
    pub resumed: u64,
    /// Records still in doubt after this run (the resolver could not tell,
    /// its answer was refused, or the record is not resolvable yet).
    pub still_in_doubt: u64,
    /// Records settled by someone else meanwhile (skipped).
    pub skipped: u64,
}
