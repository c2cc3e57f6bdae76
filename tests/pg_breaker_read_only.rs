//! A read-only open (`open_postgres_read_only`, what `idem stats`,
//! `inspect`, `show`, `unknown` and `verify` use) with libpq's
//! `target_session_attrs` in the connection string: guards against the
//! read-only session setting making every server look read-only before the
//! client checks the attribute, so that the app's own HA string
//! (`host=db1,db2 target_session_attrs=read-write`) refuses a healthy
//! primary ("database does not allow writes") and `read-only` accepts it.
//!
//! Needs `scripts/with-postgres` (`IDEMPOTENCY_TEST_PG`); skipped without
//! it, except under `CI=true`, where it fails.

use std::error::Error as StdError;
use std::time::Duration;

use idempotency::postgres::{Client, NoTls};
use idempotency::{Engine, IdempotencyKey};

type TestResult = Result<(), Box<dyn StdError + Send + Sync>>;

fn server() -> Option<String> {
    match std::env::var("IDEMPOTENCY_TEST_PG") {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("CI=true but IDEMPOTENCY_TEST_PG is not set: run through scripts/with-postgres")
        }
        _ => {
            eprintln!("skipped: IDEMPOTENCY_TEST_PG not set (run through scripts/with-postgres)");
            None
        }
    }
}

fn read_only(url: &str, prefix: &str) -> Result<Engine, idempotency::OpenError> {
    Engine::builder()
        .table_prefix(prefix)
        .connect_timeout(Duration::from_secs(5))
        .open_postgres_read_only(url)
}

#[test]
fn target_session_attrs_tells_the_primary_apart() -> TestResult {
    let Some(admin) = server() else {
        return Ok(());
    };
    let prefix = format!("brk_ro{}_", std::process::id());
    // The app creates the tables (the test server is a primary).
    drop(
        Engine::builder()
            .table_prefix(&prefix)
            .sweep_interval(None)
            .open_postgres(&admin)?,
    );
    let app = format!("brk_ro{}", std::process::id());
    let rw = format!("{admin} target_session_attrs=read-write application_name={app}");
    let engine = read_only(&rw, &prefix).map_err(|e| format!("read-write on a primary: {e}"))?;
    let key = IdempotencyKey::new("s", "k")?;
    assert!(engine.record(&key)?.is_none());
    // Its sessions are on the server, under the name the string gave.
    let mut admin_client = Client::connect(&admin, NoTls)?;
    let sessions: i64 = admin_client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            &[&app],
        )?
        .get(0);
    assert!(sessions >= 1, "no session named {app}");
    drop(engine);
    // A primary is not what `read-only` asks for (libpq refuses it too).
    let ro = format!("{admin} target_session_attrs=read-only");
    match read_only(&ro, &prefix) {
        Ok(_) => Err("target_session_attrs=read-only accepted a primary".into()),
        Err(e) => {
            let text = e.to_string();
            assert!(text.contains("read only"), "{text}");
            Ok(())
        }
    }
}
