//! `open_postgres_existing` and `open_postgres_read_only`: guards against
//! an operator tool's open that creates the engine's tables under a wrong
//! database or prefix, a read-only engine that writes (a claim, a sweep, a
//! resolution, a purge), a read-only open that accepts
//! tables of a newer schema, and an existing open that needs the privilege
//! to create tables.
//!
//! Needs a server: `IDEMPOTENCY_TEST_PG` (set by `scripts/with-postgres`).
//! Without it the tests are skipped, except under `CI=true`, where they fail.

use std::error::Error as StdError;
use std::sync::atomic::{AtomicU64, Ordering};

use idempotency::postgres::{Client, NoTls};
use idempotency::{
    Begin, Clock, Engine, Envelope, Error, Fingerprint, IdempotencyKey, OpenError, PurgeMode,
    Resolution,
};

type TestResult = Result<(), Box<dyn StdError + Send + Sync>>;

/// The server's connection string, or `None` (skip) outside CI.
fn server() -> Option<String> {
    match std::env::var("IDEMPOTENCY_TEST_PG") {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("CI=true but IDEMPOTENCY_TEST_PG is not set: run the tests through scripts/with-postgres")
        }
        _ => {
            eprintln!("skipped: IDEMPOTENCY_TEST_PG not set (run through scripts/with-postgres)");
            None
        }
    }
}

/// A table prefix no other test uses.
fn prefix() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "tm_{}_{}_",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn key(k: &str) -> Result<IdempotencyKey, Error> {
    IdempotencyKey::new("pg-modes", k)
}

fn fp() -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(b"{}", &[])
}

/// How many relations (tables, sequences, indexes) exist under `prefix`.
fn relations(url: &str, prefix: &str) -> Result<i64, Box<dyn StdError + Send + Sync>> {
    let mut client = Client::connect(url, NoTls)?;
    let pattern = format!("{}%", prefix.replace('_', "\\_"));
    Ok(client
        .query_one(
            "SELECT count(*) FROM pg_class WHERE relname LIKE $1",
            &[&pattern],
        )?
        .get(0))
}

#[test]
fn missing_tables_are_refused_and_not_created() -> TestResult {
    let Some(url) = server() else { return Ok(()) };
    let p = prefix();
    let opens = [
        Engine::builder()
            .table_prefix(&p)
            .open_postgres_existing(&url),
        Engine::builder()
            .table_prefix(&p)
            .open_postgres_read_only(&url),
    ];
    for opened in opens {
        match opened {
            Err(OpenError::NoPostgresTables { prefix, missing }) => {
                assert_eq!(prefix, p);
                assert!(missing.contains(&format!("{p}records")), "{missing}");
            }
            other => panic!("expected NoPostgresTables, got {other:?}"),
        }
    }
    assert_eq!(relations(&url, &p)?, 0);
    Ok(())
}

#[test]
fn existing_tables_open_writable_and_read_only() -> TestResult {
    let Some(url) = server() else { return Ok(()) };
    let p = prefix();
    let app = Engine::builder()
        .table_prefix(&p)
        .sweep_interval(None)
        .open_postgres(&url)?;
    let Begin::Claimed(claim) = app.begin(&key("done")?, fp()?)? else {
        return Err("expected a claim".into());
    };
    app.complete(claim, Envelope::new(1, 201, "ok"))?;
    let Begin::Claimed(claim) = app.begin(&key("in-doubt")?, fp()?)? else {
        return Err("expected a claim".into());
    };
    let reason = "provider timed out".to_string();
    app.fail(claim, idempotency::Failure::InDoubt { reason })?;

    let tool = Engine::builder()
        .table_prefix(&p)
        .sweep_interval(None)
        .open_postgres_existing(&url)?;
    let Begin::Claimed(claim) = tool.begin(&key("by-tool")?, fp()?)? else {
        return Err("expected a claim".into());
    };
    tool.complete(claim, Envelope::new(1, 200, "ok"))?;
    drop(tool);

    let reader = Engine::builder()
        .table_prefix(&p)
        .open_postgres_read_only(&url)?;
    assert!(reader.record(&key("by-tool")?)?.is_some());
    assert!(matches!(
        reader.begin(&key("done")?, fp()?)?,
        Begin::Replay(_)
    ));
    let refused = [
        reader.begin(&key("new")?, fp()?).map(drop),
        reader.purge(&key("done")?, PurgeMode::Force).map(drop),
        reader.resolve(&key("in-doubt")?, Resolution::NotExecuted, "test"),
    ];
    for result in refused {
        assert!(
            matches!(result, Err(Error::ReadOnly { .. })),
            "expected Error::ReadOnly, got {result:?}"
        );
    }
    assert!(reader.record(&key("new")?)?.is_none());
    assert_eq!(reader.stats()?.completed, 2);
    // A sweep with nothing due writes nothing, so it succeeds (as on
    // redb); one with work due, a day later, is refused.
    assert_eq!(reader.sweep_now()?.deleted, 0);
    let day_later = idempotency::SystemClock.now_ms() + 2 * 24 * 3600 * 1000;
    let late_reader = Engine::builder()
        .table_prefix(&p)
        .clock(idempotency::ManualClock::new(day_later))
        .database_clock(false)
        .open_postgres_read_only(&url)?;
    let swept = late_reader.sweep_now();
    assert!(
        matches!(swept, Err(Error::ReadOnly { .. })),
        "expected Error::ReadOnly, got {swept:?}"
    );
    assert_eq!(reader.stats()?.completed, 2);
    Ok(())
}

#[test]
fn read_only_open_refuses_a_newer_schema() -> TestResult {
    let Some(url) = server() else { return Ok(()) };
    let p = prefix();
    drop(Engine::builder().table_prefix(&p).open_postgres(&url)?);
    let mut client = Client::connect(&url, NoTls)?;
    client.execute(
        &format!("UPDATE {p}meta SET value = 99 WHERE name = 'schema_version'"),
        &[],
    )?;
    match Engine::builder()
        .table_prefix(&p)
        .open_postgres_read_only(&url)
    {
        Err(OpenError::UnsupportedSchema { found: 99, .. }) => Ok(()),
        other => Err(format!("expected UnsupportedSchema, got {other:?}").into()),
    }
}

#[test]
fn an_existing_open_needs_no_create_privilege() -> TestResult {
    let Some(url) = server() else { return Ok(()) };
    let p = prefix();
    drop(Engine::builder().table_prefix(&p).open_postgres(&url)?);
    let mut admin = Client::connect(&url, NoTls)?;
    let role = format!("{p}operator");
    admin.batch_execute(&format!(
        "CREATE ROLE {role} LOGIN;
         REVOKE CREATE ON SCHEMA public FROM PUBLIC;
         GRANT SELECT, INSERT, UPDATE, DELETE ON {p}meta, {p}records, {p}outbox, {p}entities,
             {p}steps, {p}history TO {role};
         GRANT USAGE ON SEQUENCE {p}tokens, {p}outbox_seq TO {role};"
    ))?;
    let as_role = format!("{url} user={role}");
    let engine = Engine::builder()
        .table_prefix(&p)
        .sweep_interval(None)
        .open_postgres_existing(&as_role)?;
    let Begin::Claimed(claim) = engine.begin(&key("by-operator")?, fp()?)? else {
        return Err("expected a claim".into());
    };
    engine.complete(claim, Envelope::new(1, 200, "ok"))?;
    assert!(engine.record(&key("by-operator")?)?.is_some());
    Ok(())
}
