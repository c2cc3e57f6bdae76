//! Opening PostgreSQL tables that must already exist, and read-only, for
//! operator tools (`idem`): an open that never creates the schema, and one
//! whose every session is read-only and whose every write is refused.
//!
//! A read-only engine is read-only twice over: its sessions start with
//! `SET default_transaction_read_only = on` (the server refuses any write, even
//! one this crate's code would send by mistake), and `store/read_only.rs`'s
//! `ReadOnly` wrapper refuses every write before it reaches the server, with
//! `Error::ReadOnly`, as the redb reader does. The schema check and the database clock's measurement
//! only read.

use crate::error::{OpenError, Result};
use crate::store::config::StoreConfig;

use super::client::{Client, PgError};
use super::schema::{policy_of, require_tables, Names, SCHEMA_VERSION};

/// How an open treats the schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Create the tables if they are missing (`open_postgres`).
    Create,
    /// Use the tables; refuse if they are missing (`open_postgres_existing`).
    Existing,
    /// As `Existing`, and write nothing: read-only sessions, writes refused.
    ReadOnly,
}

fn storage(context: &'static str) -> impl FnOnce(PgError) -> OpenError {
    move |e| OpenError::Storage {
        context,
        source: Box::new(e),
    }
}

/// The SQL that starts every session of an open in `mode`: for a read-only
/// open, `SET default_transaction_read_only = on`. It runs once the
/// connection is made, not as a startup option (`options=-c ...`): the
/// server would then report every session read-only from the start, and
/// the connection string's `target_session_attrs` check (which asks
/// `SHOW transaction_read_only`) would refuse a primary for `read-write`
/// and accept it for `read-only`. Set after the startup, it also
/// overrides any `default_transaction_read_only` in the string's `options`.
pub(super) fn session_setup(mode: Mode) -> &'static str {
    match mode {
        Mode::ReadOnly => "SET default_transaction_read_only = on;",
        Mode::Create | Mode::Existing => "",
    }
}

/// The read-only open's schema check, in one read-only transaction: every
/// table exists, the schema version is this build's, and (with
/// `stored_expiry`) the TTL and expiry policy the last app stored replace
/// the builder's.
pub(super) fn check(
    client: &mut Client,
    names: &Names,
    mut cfg: StoreConfig,
    stored_expiry: bool,
) -> Result<StoreConfig, OpenError> {
    let mut tx = client
        .transaction_with("BEGIN READ ONLY")
        .map_err(storage("starting a read-only transaction"))?;
    require_tables(&mut tx, names)?;
    let rows = tx
        .query(
            &format!(
                "SELECT name, value FROM {} \
                 WHERE name IN ('schema_version', 'ttl_ms', 'tombstone_keep_ms')",
                names.meta
            ),
            &[],
        )
        .map_err(storage("reading the schema version"))?;
    let (mut version, mut ttl, mut keep) = (None, None, None);
    for row in rows {
        let name: String = row.get(0);
        let value: i64 = row.get(1);
        match name.as_str() {
            "schema_version" => version = Some(value),
            "ttl_ms" => ttl = u64::try_from(value).ok(),
            _ => keep = Some(value),
        }
    }
    match version {
        Some(SCHEMA_VERSION) => {}
        Some(found) => {
            return Err(OpenError::UnsupportedSchema {
                prefix: names.prefix.clone(),
                found,
                supported: SCHEMA_VERSION,
            })
        }
        None => {
            return Err(OpenError::NoPostgresTables {
                prefix: names.prefix.clone(),
                missing: format!("the schema_version row of {}", names.meta),
            })
        }
    }
    if let (true, Some(ttl_ms), Some(keep)) = (stored_expiry, ttl, keep) {
        cfg.ttl_ms = ttl_ms;
        cfg.expiry = policy_of(keep);
    }
    tx.commit().map_err(storage("ending the schema check"))?;
    Ok(cfg)
}
