//! Format 3's building blocks: the per-partition key filter
//! ([`filter`]), the `idempotency.partitions` row ([`row`]), the slot key
//! that prefixes a record key with its partition ([`slot`]: format 3 keeps
//! every partition in one table, keyed by slot), and the catalog of
//! partitions a lookup probes and the writer seals ([`catalog`]), as
//! docs/format3-plan.md specifies them.
//!
//! The writer (`tables.rs`), the reads (`layout.rs`, `snapshot.rs`,
//! `read.rs`), the open (`open.rs`), the journal's replay (`recover.rs`)
//! and `verify.rs` use them for a file of format 3, which every new file
//! is (and a format-2 file after `EngineBuilder::migrate_to_format_3`).
//!
//! Store layer (layer 2): imports nothing above `store`.

pub(crate) mod catalog;
pub(crate) mod filter;
pub(crate) mod filter_group;
pub(crate) mod merge;
#[cfg(feature = "bench-fixtures")]
pub(crate) mod probe_fixture;
pub(crate) mod row;
pub(crate) mod slot;
