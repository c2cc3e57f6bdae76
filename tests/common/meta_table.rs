//! The engine's meta table read with redb directly, without the engine:
//! for tests that check or damage its values.

#![allow(dead_code)] // each test file uses what it needs

use std::error::Error;
use std::path::Path;

use redb::{ReadableDatabase, ReadableTable, TableDefinition};

/// The engine's meta table (`src/store/redb/meta.rs`).
pub const META: TableDefinition<&str, &[u8]> = TableDefinition::new("idempotency.meta");

/// Every meta key a cleanly closed format-2 file holds, in the table's
/// (sorted) order.
pub const KEYS: [&str; 8] = [
    "expiry_policy",
    "format_version",
    "journal_clean",
    "journal_id",
    "journal_lsn",
    "next_outbox_seq",
    "next_token",
    "ttl_ms",
];

/// Every meta key a cleanly closed format-3 file (what this build creates)
/// holds, in the table's (sorted) order: format 2's and the filters' seed.
pub fn keys_format_3() -> Vec<&'static str> {
    let mut keys = KEYS.to_vec();
    keys.push("filter_seed");
    keys.sort_unstable();
    keys
}

/// Format 3's records table, which a half-migrated format-2 file holds
/// beside format 2's.
pub const PARTITIONED_RECORDS: TableDefinition<&[u8], &[u8]> =
    TableDefinition::new("idempotency.partitioned.records");

/// Where a migration to format 3 stands in the file `txn` reads: the first
/// byte of `format_version`, and the records format 3's records table
/// holds (`None`: no such table).
pub fn migration_state(
    txn: &redb::ReadTransaction,
) -> Result<(u8, Option<u64>), Box<dyn Error + Send + Sync>> {
    use redb::ReadableTableMetadata;
    let format = txn
        .open_table(META)?
        .get("format_version")?
        .and_then(|v| v.value().first().copied())
        .ok_or("no format_version")?;
    let copied = match txn.open_table(PARTITIONED_RECORDS) {
        Ok(t) => Some(t.len()?),
        Err(redb::TableError::TableDoesNotExist(_)) => None,
        Err(e) => return Err(e.into()),
    };
    Ok((format, copied))
}

/// The meta table's values, by key.
pub type Meta = Vec<(String, Vec<u8>)>;

/// Every value of the meta table of the file at `path`, by key.
pub fn meta_values(path: &Path) -> Result<Meta, Box<dyn Error>> {
    let db = redb::Builder::new().open_read_only(path)?;
    let txn = db.begin_read()?;
    let mut out = Vec::new();
    for entry in txn.open_table(META)?.iter()? {
        let (k, v) = entry?;
        out.push((k.value().to_string(), v.value().to_vec()));
    }
    Ok(out)
}
