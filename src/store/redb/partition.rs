//! Format 3's building blocks: the per-partition key filter
//! ([`filter`]), the `idempotency.partitions` row ([`row`]), the slot key
//! that prefixes a record key with its partition ([`slot`]: format 3 keeps
//! every partition in one table, keyed by slot), and the catalog of
//! partitions a lookup probes and the writer seals ([`catalog`]), as
//! docs/format3-plan.md specifies them. (`row.rs`'s per-partition table
//! names are from the plan's earlier one-table-per-partition layout.)
//!
//! Nothing here is wired in yet: the engine writes format 2, and this
//! module is compiled for tests only (`#[cfg(test)]` on its `mod` line in
//! `redb/mod.rs`). The session that builds format 3 lands it whole and
//! wires these in (the plan's "Tables", "Filters" and "Expiry"); until
//! then they are tested here, so that session starts from checked codecs.
//!
//! Store layer (layer 2): imports nothing above `store`.

// Wired in by format 3's writer and readers; until then only tests use all of it.
#[allow(dead_code)]
pub(crate) mod catalog;
pub(crate) mod filter;
pub(crate) mod row;
pub(crate) mod slot;
#[cfg(test)]
mod tests;
