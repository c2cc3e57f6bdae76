//! PostgreSQL helpers for the CLI's tests: the test server, a table prefix
//! per test, a SELECT-only role, and checksums of every table and sequence.
//!
//! The server comes from `IDEMPOTENCY_TEST_PG` (set by
//! `scripts/with-postgres`). Without it the PostgreSQL tests are skipped
//! with a message, or fail under `CI=true`, as the library's are.

use std::sync::atomic::{AtomicU64, Ordering};

use postgres::{Client, NoTls};

use super::TestResult;

/// The test server's connection string, or `None` (skip) outside CI.
pub fn pg_url() -> Option<String> {
    match std::env::var("IDEMPOTENCY_TEST_PG") {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var("CI").is_ok_and(|v| v == "true") => panic!(
            "CI=true but IDEMPOTENCY_TEST_PG is not set: run the tests through scripts/with-postgres"
        ),
        _ => {
            eprintln!("skipped: IDEMPOTENCY_TEST_PG not set (run through scripts/with-postgres)");
            None
        }
    }
}

/// A table prefix no other test (or test run) uses.
pub fn unique_prefix(tag: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "cli_{tag}_{}_{nanos}_{}_",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

pub fn client(url: &str) -> TestResult<Client> {
    Ok(Client::connect(url, NoTls)?)
}

/// The engine's tables under `prefix` (a writable open creates them all,
/// the effect steps', their history's and the dead letters' included).
pub fn tables(prefix: &str) -> Vec<String> {
    [
        "meta",
        "records",
        "outbox",
        "entities",
        "steps",
        "history",
        "dead_letters",
    ]
    .iter()
    .map(|t| format!("{prefix}{t}"))
    .collect()
}

/// The engine's sequences under `prefix`.
pub fn sequences(prefix: &str) -> Vec<String> {
    ["tokens", "outbox_seq", "dead_letters_seq"]
        .iter()
        .map(|t| format!("{prefix}{t}"))
        .collect()
}

/// A digest of every row of every table under `prefix`, and each
/// sequence's `last_value` and `is_called`.
pub fn checksums(client: &mut Client, prefix: &str) -> TestResult<Vec<(String, String)>> {
    let mut sums = Vec::new();
    for table in tables(prefix) {
        let row = client.query_one(
            &format!(
                "SELECT count(*)::text || ':' || coalesce(md5(string_agg(t::text, '|' ORDER BY t::text)), '-')
                 FROM {table} t"
            ),
            &[],
        )?;
        sums.push((table, row.get::<_, String>(0)));
    }
    for seq in sequences(prefix) {
        let row = client.query_one(
            &format!("SELECT last_value::text || ':' || is_called::text FROM {seq}"),
            &[],
        )?;
        sums.push((seq, row.get::<_, String>(0)));
    }
    Ok(sums)
}

/// A login role with only `SELECT` on the tables under `prefix` (no
/// privilege on the sequences); returns its connection string (the server
/// trusts local logins, so it needs no password).
pub fn select_only_role(client: &mut Client, url: &str, prefix: &str) -> TestResult<String> {
    let role = format!("{prefix}reader");
    client.batch_execute(&format!("CREATE ROLE {role} LOGIN"))?;
    for table in tables(prefix) {
        client.batch_execute(&format!("GRANT SELECT ON {table} TO {role}"))?;
    }
    Ok(format!("{url} user={role}"))
}
