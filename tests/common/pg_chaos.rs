//! Helpers for the PostgreSQL fault tests (`pg_multiprocess.rs`,
//! `pg_connection_loss.rs`): the test server from the environment
//! `scripts/with-postgres` sets, unique table prefixes, a plain client for
//! side tables, and dropping a test's tables afterwards.
//!
//! Used through `#[path = "common/pg_chaos.rs"] mod pg_chaos;` (not part of
//! `common/mod.rs`, so other tests do not compile it).

#![allow(dead_code)] // each test file uses some of these

use std::error::Error;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idempotency::postgres::{Client, Config, NoTls};

/// The connection string of the test server.
pub const PG_VAR: &str = "IDEMPOTENCY_TEST_PG";
/// Its data directory.
pub const PG_DATA_VAR: &str = "IDEMPOTENCY_TEST_PG_DATA";
/// The OS user that runs it.
pub const PG_USER_VAR: &str = "IDEMPOTENCY_TEST_PG_USER";

/// The test server's connection string, or `None` (after saying so) when
/// the tests run without one. Under `CI=true` a missing server fails the
/// test instead: CI must never skip these silently.
pub fn pg_url() -> Option<String> {
    match std::env::var(PG_VAR) {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "{PG_VAR} is not set but CI=true: PostgreSQL tests must run in CI (run them through scripts/with-postgres)"
            );
            eprintln!("skipped: {PG_VAR} not set (run through scripts/with-postgres)");
            None
        }
    }
}

/// A table prefix no other test (in this or another process) uses:
/// `t_<pid>_<tag>_<counter>_<millis>_`, within the 40 characters the engine
/// allows.
pub fn unique_prefix(tag: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() % 1_000_000);
    format!("t_{}_{tag}_{n}_{ms}_", std::process::id())
}

/// Parses a connection string (key=value or URL form).
pub fn config(url: &str) -> Result<Config, Box<dyn Error + Send + Sync>> {
    Config::from_str(url).map_err(|e| format!("cannot parse {PG_VAR} {url:?}: {e}").into())
}

/// A plain client (no pool, no TLS) that gives up connecting after 5 s.
pub fn connect(url: &str) -> Result<Client, Box<dyn Error + Send + Sync>> {
    let mut cfg = config(url)?;
    cfg.connect_timeout(Duration::from_secs(5));
    cfg.connect(NoTls)
        .map_err(|e| format!("cannot connect to the test server: {e}").into())
}

/// Drops every table and sequence whose name starts with `prefix`.
pub fn drop_prefix(client: &mut Client, prefix: &str) -> Result<(), Box<dyn Error + Send + Sync>> {
    let pattern = format!("{}%", prefix.replace('_', "\\_"));
    let rows = client.query(
        "SELECT c.relname, c.relkind::text FROM pg_class c \
         JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'S') AND c.relname LIKE $1",
        &[&pattern],
    )?;
    for row in rows {
        let (name, kind): (String, String) = (row.get(0), row.get(1));
        let what = if kind == "S" { "SEQUENCE" } else { "TABLE" };
        client.batch_execute(&format!("DROP {what} IF EXISTS \"{name}\" CASCADE"))?;
    }
    Ok(())
}
