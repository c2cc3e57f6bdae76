//! The redb tables the engine owns.
//!
//! Every engine table name starts with `idempotency.`; an app that keeps its
//! own tables in the same database file must use names without that prefix.
//!
//! Index tables let background passes cost O(work) instead of a scan:
//! each record is in exactly one index, chosen by its state:
//!
//! | state | index | entry |
//! |---|---|---|
//! | PROCESSING | `idempotency.leases` | `(lease_until_ms, record key)` |
//! | UNKNOWN | `idempotency.recovery` | `(unknown_since_ms, record key)` |
//! | COMPLETED, FAILED_FINAL, TOMBSTONE | `idempotency.expiry` | `(expires_at_ms, record key)` |

use redb::TableDefinition;

/// Format version and the fencing-token counter.
pub(crate) const META: TableDefinition<&str, &[u8]> = TableDefinition::new("idempotency.meta");
/// Record key → encoded record (see `codec.rs`).
pub(crate) const RECORDS: TableDefinition<&[u8], &[u8]> =
    TableDefinition::new("idempotency.records");
/// PROCESSING records by lease end.
pub(crate) const LEASES: TableDefinition<(u64, &[u8]), ()> =
    TableDefinition::new("idempotency.leases");
/// UNKNOWN records by the instant they became unknown: the recovery queue.
pub(crate) const RECOVERY: TableDefinition<(u64, &[u8]), ()> =
    TableDefinition::new("idempotency.recovery");
/// Records that expire, by expiry instant.
pub(crate) const EXPIRY: TableDefinition<(u64, &[u8]), ()> =
    TableDefinition::new("idempotency.expiry");

/// Unpublished outbox messages by sequence number (commit order).
pub(crate) const OUTBOX: TableDefinition<u64, &[u8]> = TableDefinition::new("idempotency.outbox");
/// Business entity id → encoded state and version.
pub(crate) const ENTITIES: TableDefinition<&str, &[u8]> =
    TableDefinition::new("idempotency.entities");

/// `META` key holding the one-byte record format version.
pub(crate) const META_FORMAT_VERSION: &str = "format_version";
/// `META` key holding the next fencing token (u64 little-endian).
pub(crate) const META_NEXT_TOKEN: &str = "next_token";
/// `META` key holding the TTL (u64 little-endian ms) of the last app
/// that opened the database, for operator tools.
pub(crate) const META_TTL_MS: &str = "ttl_ms";
/// `META` key holding that app's expiry policy: `[0]` forget, or `[1]`
/// followed by the tombstone duration (u64 little-endian ms).
pub(crate) const META_EXPIRY_POLICY: &str = "expiry_policy";
/// `META` key holding the next outbox sequence number (u64 little-endian).
pub(crate) const META_NEXT_OUTBOX: &str = "next_outbox_seq";
