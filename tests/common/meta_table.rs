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
pub const KEYS_FORMAT_3: [&str; 9] = [
    "expiry_policy",
    "filter_seed",
    "format_version",
    "journal_clean",
    "journal_id",
    "journal_lsn",
    "next_outbox_seq",
    "next_token",
    "ttl_ms",
];

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
