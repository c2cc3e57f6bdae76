//! The PostgreSQL schema: table names from the app's prefix, creation on
//! first open, and the schema version every open checks.
//!
//! | table | holds |
//! |---|---|
//! | `<prefix>meta` | `schema_version`, and the TTL and expiry policy of the last app that opened it |
//! | `<prefix>records` | one row per idempotency key: `scope`, `key`, the encoded record (`store/codec.rs`), and copies of `state`, `token` and the instants that the partial indexes order by |
//! | `<prefix>outbox` | unpublished outbox messages by sequence number |
//! | `<prefix>entities` | business entity id → state and version |
//! | `<prefix>tokens`, `<prefix>outbox_seq` | sequences: fencing tokens, outbox sequence numbers |
//! | `<prefix>steps` | effect steps: `scope`, `key`, `name`, the encoded step (`store/codec.rs`) |
//! | `<prefix>history` | the evidence log: `scope`, `key`, `seq`, the encoded entry |
//! | `<prefix>dead_letters`, `<prefix>dead_letters_seq` | messages given up: `seq`, `consumer`, the encoded dead letter (`store/codec.rs`, as on redb) |
//!
//! The steps and history tables came with effect steps, without a schema
//! version change: every writable open creates them if they are missing
//! (`CREATE TABLE IF NOT EXISTS`); an open of existing tables without
//! DDL that writes requires them (`OpenError::NoPostgresTables` names
//! them: run one writable open with `create` after upgrading), and a
//! read-only open does not (its reads find no steps where they are
//! missing). The dead-letter table and its sequence came later the same
//! way (created by every writable open; a read-only open lists none
//! where they are missing).

use super::client::{Client, PgError, Transaction};

use crate::error::OpenError;
use crate::policy::ExpiryPolicy;
use crate::store::config::StoreConfig;

/// The schema this build creates and reads.
pub(super) const SCHEMA_VERSION: i64 = 1;

/// The default table prefix.
pub(crate) const DEFAULT_PREFIX: &str = "idempotency_";

/// Table and sequence names under one prefix.
#[derive(Debug, Clone)]
pub(super) struct Names {
    pub(super) prefix: String,
    pub(super) meta: String,
    pub(super) records: String,
    pub(super) outbox: String,
    pub(super) entities: String,
    pub(super) tokens: String,
    pub(super) outbox_seq: String,
    pub(super) steps: String,
    pub(super) history: String,
    pub(super) dead_letters: String,
    pub(super) dead_letters_seq: String,
}

impl Names {
    /// Checks `prefix`: 1 to 40 characters of `[a-z0-9_]`, not starting
    /// with a digit, so every name is a plain SQL identifier that needs no
    /// quoting and fits PostgreSQL's 63-byte limit.
    pub(super) fn new(prefix: &str) -> Result<Names, OpenError> {
        let reason = if prefix.is_empty() || prefix.len() > 40 {
            Some("it must be 1 to 40 characters long")
        } else if !prefix
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            Some("only a-z, 0-9 and _ are allowed")
        } else if prefix.starts_with(|c: char| c.is_ascii_digit()) {
            Some("it must not start with a digit")
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(OpenError::InvalidTablePrefix {
                prefix: prefix.to_owned(),
                reason,
            });
        }
        let name = |what: &str| format!("{prefix}{what}");
        Ok(Names {
            prefix: prefix.to_owned(),
            meta: name("meta"),
            records: name("records"),
            outbox: name("outbox"),
            entities: name("entities"),
            tokens: name("tokens"),
            outbox_seq: name("outbox_seq"),
            steps: name("steps"),
            history: name("history"),
            dead_letters: name("dead_letters"),
            dead_letters_seq: name("dead_letters_seq"),
        })
    }

    fn ddl(&self) -> String {
        let Names {
            prefix: p,
            meta,
            records,
            outbox,
            entities,
            tokens,
            outbox_seq,
            steps,
            history,
            dead_letters,
            dead_letters_seq,
        } = self;
        format!(
            "CREATE TABLE IF NOT EXISTS {meta} (
                 name text PRIMARY KEY,
                 value bigint NOT NULL);
             CREATE TABLE IF NOT EXISTS {records} (
                 scope text COLLATE \"C\" NOT NULL,
                 key text COLLATE \"C\" NOT NULL,
                 state smallint NOT NULL,
                 token bigint NOT NULL,
                 lease_until_ms bigint NOT NULL,
                 unknown_since_ms bigint NOT NULL,
                 expires_at_ms bigint NOT NULL,
                 record bytea NOT NULL,
                 PRIMARY KEY (scope, key));
             CREATE INDEX IF NOT EXISTS {p}records_leases
                 ON {records} (lease_until_ms) WHERE state = 0;
             CREATE INDEX IF NOT EXISTS {p}records_recovery
                 ON {records} (unknown_since_ms) WHERE state = 3;
             CREATE INDEX IF NOT EXISTS {p}records_expiry
                 ON {records} (expires_at_ms) WHERE state IN (1, 2, 4);
             CREATE SEQUENCE IF NOT EXISTS {tokens} AS bigint START 1;
             CREATE SEQUENCE IF NOT EXISTS {outbox_seq} AS bigint START 1;
             CREATE TABLE IF NOT EXISTS {outbox} (
                 seq bigint PRIMARY KEY,
                 id text NOT NULL,
                 topic text NOT NULL,
                 payload bytea NOT NULL,
                 created_at_ms bigint NOT NULL);
             CREATE TABLE IF NOT EXISTS {entities} (
                 entity text COLLATE \"C\" PRIMARY KEY,
                 state text NOT NULL,
                 version bigint NOT NULL,
                 updated_at_ms bigint NOT NULL);
             CREATE TABLE IF NOT EXISTS {steps} (
                 scope text COLLATE \"C\" NOT NULL,
                 key text COLLATE \"C\" NOT NULL,
                 name text COLLATE \"C\" NOT NULL,
                 step bytea NOT NULL,
                 PRIMARY KEY (scope, key, name));
             CREATE TABLE IF NOT EXISTS {history} (
                 scope text COLLATE \"C\" NOT NULL,
                 key text COLLATE \"C\" NOT NULL,
                 seq bigint NOT NULL,
                 entry bytea NOT NULL,
                 PRIMARY KEY (scope, key, seq));
             CREATE SEQUENCE IF NOT EXISTS {dead_letters_seq} AS bigint START 1;
             CREATE TABLE IF NOT EXISTS {dead_letters} (
                 seq bigint PRIMARY KEY,
                 consumer text NOT NULL,
                 letter bytea NOT NULL);"
        )
    }
}

fn storage(context: &'static str) -> impl FnOnce(PgError) -> OpenError {
    move |e| OpenError::Storage {
        context,
        source: Box::new(e),
    }
}

/// Creates the schema if it is missing (with `create`; without, a missing
/// table is `OpenError::NoPostgresTables` and no DDL runs, so the role
/// needs no `CREATE` privilege) and checks its version; stores this
/// app's TTL and expiry policy for operator tools (or, with
/// `stored_expiry`, takes them from the database). Several processes may
/// open the same database at once: one advisory lock per prefix orders
/// them.
pub(super) fn prepare(
    client: &mut Client,
    names: &Names,
    mut cfg: StoreConfig,
    stored_expiry: bool,
    create: bool,
) -> Result<StoreConfig, OpenError> {
    let mut tx = client
        .transaction()
        .map_err(storage("starting the schema transaction"))?;
    tx.execute(
        "SELECT pg_advisory_xact_lock(hashtext($1))",
        &[&format!("idempotency schema {}", names.prefix)],
    )
    .map_err(storage("locking the schema"))?;
    let exists: bool = tx
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&names.meta])
        .map_err(storage("looking for the schema"))?
        .get(0);
    if exists {
        let found: Option<i64> = tx
            .query_opt(
                &format!(
                    "SELECT value FROM {} WHERE name = 'schema_version'",
                    names.meta
                ),
                &[],
            )
            .map_err(storage("reading the schema version"))?
            .map(|row| row.get(0));
        if let Some(found) = found {
            if found != SCHEMA_VERSION {
                return Err(OpenError::UnsupportedSchema {
                    prefix: names.prefix.clone(),
                    found,
                    supported: SCHEMA_VERSION,
                });
            }
        }
    }
    if create {
        tx.batch_execute(&names.ddl())
            .map_err(storage("creating the schema"))?;
    } else {
        require_writable_tables(&mut tx, names)?;
    }
    let set = format!(
        "INSERT INTO {} (name, value) VALUES ($1, $2)
         ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value",
        names.meta
    );
    tx.execute(&set, &[&"schema_version", &SCHEMA_VERSION])
        .map_err(storage("writing the schema version"))?;
    if stored_expiry {
        let rows = tx
            .query(
                &format!(
                    "SELECT name, value FROM {} WHERE name IN ('ttl_ms', 'tombstone_keep_ms')",
                    names.meta
                ),
                &[],
            )
            .map_err(storage("reading the stored expiry settings"))?;
        let mut ttl = None;
        let mut keep = None;
        for row in rows {
            let name: String = row.get(0);
            let value: i64 = row.get(1);
            match name.as_str() {
                "ttl_ms" => ttl = u64::try_from(value).ok(),
                _ => keep = Some(value),
            }
        }
        if let (Some(ttl_ms), Some(keep)) = (ttl, keep) {
            cfg.ttl_ms = ttl_ms;
            cfg.expiry = policy_of(keep);
        }
    } else {
        let keep = cfg
            .expiry
            .keep_ms()
            .map_or(-1, |ms| i64::try_from(ms).unwrap_or(i64::MAX));
        // Every engine on one prefix must expire by the same policy: one
        // that forgets would delete the tombstones another one promised to
        // keep, and that one would then run a key's work again.
        let stored: Option<i64> = tx
            .query_opt(
                &format!(
                    "SELECT value FROM {} WHERE name = 'tombstone_keep_ms'",
                    names.meta
                ),
                &[],
            )
            .map_err(storage("reading the stored expiry policy"))?
            .map(|row| row.get(0));
        if let Some(stored) = stored.filter(|&stored| stored != keep) {
            return Err(OpenError::ExpiryPolicyConflict {
                prefix: names.prefix.clone(),
                stored: policy_of(stored),
                requested: cfg.expiry,
            });
        }
        let ttl = i64::try_from(cfg.ttl_ms).unwrap_or(i64::MAX);
        tx.execute(&set, &[&"ttl_ms", &ttl])
            .map_err(storage("storing the TTL"))?;
        tx.execute(&set, &[&"tombstone_keep_ms", &keep])
            .map_err(storage("storing the expiry policy"))?;
    }
    tx.commit().map_err(storage("committing the schema"))?;
    Ok(cfg)
}

/// `OpenError::NoPostgresTables` unless every table and sequence of
/// `names` exists. Only reads.
pub(super) fn require_tables(client: &mut Transaction<'_>, names: &Names) -> Result<(), OpenError> {
    let all = [
        &names.meta,
        &names.records,
        &names.outbox,
        &names.entities,
        &names.tokens,
        &names.outbox_seq,
    ];
    require(client, names, &all)
}

/// [`require_tables`], and the effect-step tables, which every write
/// touches (a read-only open does not need them).
fn require_writable_tables(client: &mut Transaction<'_>, names: &Names) -> Result<(), OpenError> {
    require_tables(client, names)?;
    require(
        client,
        names,
        &[
            &names.steps,
            &names.history,
            &names.dead_letters,
            &names.dead_letters_seq,
        ],
    )
}

/// `OpenError::NoPostgresTables` unless every one of `all` exists.
fn require(client: &mut Transaction<'_>, names: &Names, all: &[&String]) -> Result<(), OpenError> {
    let mut missing = Vec::new();
    for name in all {
        let found: bool = client
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[name])
            .map_err(storage("looking for the schema"))?
            .get(0);
        if !found {
            missing.push(name.as_str());
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(OpenError::NoPostgresTables {
            prefix: names.prefix.clone(),
            missing: missing.join(", "),
        })
    }
}

/// The expiry policy stored as `tombstone_keep_ms` (-1: forget).
pub(super) fn policy_of(keep_ms: i64) -> ExpiryPolicy {
    match u64::try_from(keep_ms) {
        Ok(keep_ms) => ExpiryPolicy::Tombstone {
            keep: std::time::Duration::from_millis(keep_ms),
        },
        Err(_) => ExpiryPolicy::Forget,
    }
}

#[cfg(test)]
mod tests {
    use super::Names;

    #[test]
    fn prefixes_are_plain_identifiers() {
        assert!(Names::new("idempotency_").is_ok());
        assert!(Names::new("app2_idem_").is_ok());
        for bad in [
            "",
            "Upper_",
            "1abc",
            "semi;colon",
            "quote\"",
            &"a".repeat(41),
        ] {
            assert!(Names::new(bad).is_err(), "{bad:?} was accepted");
        }
    }
}
