//! Opening PostgreSQL from the CLI: guards against a CLI that creates the
//! engine's tables where there are none (a wrong database or prefix), that
//! panics or accepts a table prefix that is not an identifier, that applies
//! `--table-prefix` to a file, or that prints the password of a connection
//! string in an error. Each is one `idem: ...` line on stderr: exit code 2
//! for a mistake in the command line, 1 for a database that cannot be used.

mod common;

use common::pg::{client, pg_url, unique_prefix};
use common::*;

/// `idem` that must exit 2 with one `idem: ...` line; returns it.
fn usage_err(args: &[&str]) -> TestResult<String> {
    let out = idem(args)?;
    let stderr = String::from_utf8(out.stderr)?;
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "stderr: {stderr:?}");
    assert!(stderr.starts_with("idem: "), "stderr: {stderr:?}");
    assert!(out.stdout.is_empty());
    Ok(stderr.trim_end().to_string())
}

#[test]
fn a_prefix_that_is_not_an_identifier_is_a_usage_error() -> TestResult {
    // Checked before connecting: no server needed.
    let db = "host=127.0.0.1 port=1 dbname=nothing";
    for (prefix, reason) in [
        ("Bad;", "only a-z, 0-9 and _"),
        ("x\"; DROP TABLE t; --", "only a-z, 0-9 and _"),
        ("9lives_", "must not start with a digit"),
        ("", "1 to 40 characters"),
    ] {
        for cmd in ["stats", "sweep"] {
            let err = usage_err(&[cmd, db, "--table-prefix", prefix])?;
            assert!(
                err.contains("invalid table prefix") && err.contains(reason),
                "{err}"
            );
        }
    }
    Ok(())
}

#[test]
fn a_prefix_with_a_file_is_a_usage_error() -> TestResult {
    let dir = tempfile::tempdir()?;
    let db = db_path(dir.path());
    drop(engine(&db)?);
    let db = db.to_str().ok_or("temp path is not UTF-8")?;
    let err = usage_err(&["stats", db, "--table-prefix", "app_"])?;
    assert!(
        err.contains("--table-prefix") && err.contains("idem.redb"),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_wrong_database_is_named_without_the_password() -> TestResult {
    let Some(url) = pg_url() else { return Ok(()) };
    let password = "hunter2-not-printed";
    for wrong in [
        format!("{url} dbname=no_such_db_for_idem password={password}"),
        format!("{url} port=1 password={password}"),
    ] {
        for cmd in ["stats", "sweep"] {
            let err = idem_err([cmd, wrong.as_str()])?;
            assert!(!err.contains(password), "{err}");
            assert!(err.contains("connecting to PostgreSQL"), "{err}");
        }
    }
    let err = idem_err([
        "inspect",
        &format!("{url} dbname=no_such_db_for_idem password={password}"),
    ])?;
    assert!(
        err.contains("database \"no_such_db_for_idem\" does not exist"),
        "{err}"
    );
    // Said once: the server's text is not repeated by the error's source.
    assert_eq!(err.matches("does not exist").count(), 1, "{err}");
    Ok(())
}

#[test]
fn no_tables_under_the_prefix_is_an_error_and_creates_none() -> TestResult {
    let Some(url) = pg_url() else { return Ok(()) };
    let prefix = unique_prefix("none");
    for args in [
        vec!["stats"],
        vec!["inspect"],
        vec!["show", "shop", "k"],
        vec!["unknown"],
        vec!["verify"],
        vec!["sweep"],
        vec!["resolve", "shop", "k", "--not-executed", "--reason", "r"],
        vec!["purge", "shop", "k"],
    ] {
        let mut v = vec![args[0], url.as_str()];
        v.extend(&args[1..]);
        v.extend(["--table-prefix", prefix.as_str()]);
        let err = idem_err(&v)?;
        assert!(
            err.contains("no idempotency tables") && err.contains(&prefix),
            "{err}"
        );
    }
    let found: i64 = client(&url)?
        .query_one(
            "SELECT count(*) FROM pg_class WHERE relname LIKE $1",
            &[&format!("{prefix}%")],
        )?
        .get(0);
    assert_eq!(found, 0, "the CLI created tables under {prefix}");
    Ok(())
}

/// The password can come from `PGPASSWORD`, as with libpq, so an operator
/// need not put it on the command line (where `ps` shows it): without it
/// the password-only role is refused, with it the command gets past
/// authentication (to the missing tables).
#[test]
fn the_password_can_come_from_pgpassword() -> TestResult {
    let Some(url) = pg_url() else { return Ok(()) };
    let role = std::env::var("IDEMPOTENCY_TEST_PG_SCRAM_ROLE").unwrap_or_default();
    if role.is_empty() {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            return Err("CI=true but IDEMPOTENCY_TEST_PG_SCRAM_ROLE is not set".into());
        }
        eprintln!(
            "skipped: IDEMPOTENCY_TEST_PG_SCRAM_ROLE not set (run through scripts/with-postgres)"
        );
        return Ok(());
    }
    // The same password tests/pg_tls.rs gives the role, so the two may run
    // in either order.
    let password = "right-horse-battery-staple";
    client(&url)?.batch_execute(&format!(
        "DO $$ BEGIN \
           IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN \
             CREATE ROLE {role} LOGIN; \
           END IF; \
         END $$; \
         ALTER ROLE {role} PASSWORD '{password}'"
    ))?;
    let as_role = format!("{url} user={role}");
    let prefix = unique_prefix("envpw");
    let args = ["stats", as_role.as_str(), "--table-prefix", prefix.as_str()];

    let without = idem_command()
        .args(args)
        .env_remove("PGPASSWORD")
        .output()?;
    let err = String::from_utf8(without.stderr)?;
    assert_eq!(without.status.code(), Some(1), "{err}");
    assert!(
        err.contains("password"),
        "expected an authentication error: {err}"
    );

    let with = idem_command()
        .args(args)
        .env("PGPASSWORD", password)
        .output()?;
    let err = String::from_utf8(with.stderr)?;
    assert_eq!(with.status.code(), Some(1), "{err}");
    assert!(
        err.contains("no idempotency tables") && !err.contains("password"),
        "expected to get past authentication: {err}"
    );
    Ok(())
}
