//! Format 3's building blocks: the per-partition key filter
//! ([`filter`]), the `idempotency.partitions` row and the per-partition
//! table names ([`row`]), as docs/format3-plan.md specifies them.
//!
//! Nothing here is wired in yet: the engine writes format 2, and this
//! module is compiled for tests only (`#[cfg(test)]` on its `mod` line in
//! `redb/mod.rs`). The session that builds format 3 lands it whole and
//! wires these in (the plan's "Tables", "Filters" and "Expiry"); until
//! then they are tested here, so that session starts from checked codecs.
//!
//! Store layer (layer 2): imports nothing above `store`.

pub(crate) mod filter;
pub(crate) mod row;
#[cfg(test)]
mod tests;
