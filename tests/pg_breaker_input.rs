//! Hostile connection strings, end to end against the test server: guards
//! against an `@` in a URL parameter (`?user=admin@server`, as managed
//! databases name users) being taken for credentials, so the engine
//! connects to a host made of the rest of the string; and against any
//! malformed, odd or unreachable connection string (quoting, backslashes,
//! percent-encoding, unix socket directories, IPv6, a megabyte host name,
//! an sslrootcert that is a directory, empty, a private key, 10 MB of
//! noise) that panics or shows the password in the error's text, Debug
//! form or source chain.
//!
//! Needs `scripts/with-postgres` (`IDEMPOTENCY_TEST_PG`); skipped without
//! it, except under `CI=true`, where it fails.

use std::error::Error as StdError;
use std::time::Duration;

use idempotency::postgres::{Client, NoTls};
use idempotency::{Engine, OpenError};

type TestResult = Result<(), Box<dyn StdError + Send + Sync>>;

const PASSWORD: &str = "Hunter2-breaker-secret";

/// The test server's connection string and port; `None` (skip) outside CI.
fn server() -> Option<(String, u16)> {
    match std::env::var("IDEMPOTENCY_TEST_PG") {
        Ok(url) if !url.is_empty() => {
            let port = url
                .split_whitespace()
                .find_map(|kv| kv.strip_prefix("port="))
                .and_then(|p| p.parse().ok())
                .unwrap_or(5432);
            Some((url, port))
        }
        _ if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("CI=true but IDEMPOTENCY_TEST_PG is not set: run through scripts/with-postgres")
        }
        _ => {
            eprintln!("skipped: IDEMPOTENCY_TEST_PG not set (run through scripts/with-postgres)");
            None
        }
    }
}

fn open(url: &str, prefix: &str) -> Result<Engine, OpenError> {
    Engine::builder()
        .table_prefix(prefix)
        .sweep_interval(None)
        .connect_timeout(Duration::from_secs(3))
        .open_postgres(url)
}

/// The error's text, Debug form and every source, on one line.
fn all_text(e: &(dyn StdError + 'static)) -> String {
    let mut text = format!("{e} / {e:?}");
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(&format!(" / {s} / {s:?}"));
        source = s.source();
    }
    text
}

#[test]
fn an_at_sign_in_a_url_parameter_stays_in_its_value() -> TestResult {
    let Some((admin, port)) = server() else {
        return Ok(());
    };
    let app = format!("breaker{}@example", std::process::id());
    let url = format!(
        "postgres://127.0.0.1:{port}/postgres?user=postgres&application_name={app}&sslmode=disable"
    );
    let engine = open(&url, &format!("brk_at{}_", std::process::id()))
        .map_err(|e| format!("{url}: {}", all_text(&e)))?;
    let mut client = Client::connect(&admin, NoTls)?;
    let seen: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            &[&app],
        )?
        .get(0);
    assert!(seen >= 1, "no connection named {app} on the server");
    drop(engine);
    Ok(())
}

#[test]
fn odd_connection_strings_fail_clearly_without_the_password() -> TestResult {
    let Some((_, p)) = server() else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let d = dir.path().display().to_string();
    std::fs::write(dir.path().join("empty.pem"), "")?;
    std::fs::write(
        dir.path().join("key.pem"),
        "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIA==\n-----END PRIVATE KEY-----\n",
    )?;
    std::fs::write(
        dir.path().join("bad.pem"),
        "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n",
    )?;
    std::fs::write(
        dir.path().join("noise.pem"),
        "Zm9v".repeat(2_500_000).as_bytes(),
    )?;
    let big = "x".repeat(1_000_000);
    let w = PASSWORD;
    let inputs = [
        format!(
            "host=127.0.0.1 port={p} user=postgres password='{w}' dbname=absent sslmode=disable"
        ),
        format!("host= port={p} user=postgres password={w}"),
        format!("host='' port={p} user=postgres password={w}"),
        format!("host=/nonexistent/dir port={p} user=postgres password={w}"),
        format!("host=::1 port={p} user=postgres password={w} sslmode=disable"),
        format!("postgres://postgres:{w}@[::1/postgres"),
        format!("postgres://postgres:{w}@[::1]:{p}/absent?sslmode=disable"),
        format!("postgres://postgres:{w}@127.0.0.1:{p}/absent?sslmode=disable&sslmode=bogus"),
        format!("postgres://postgres:{w}%@127.0.0.1:{p}/absent?sslmode=disable"),
        format!("postgres://postgres:{w}%FF@127.0.0.1:{p}/absent?sslmode=disable"),
        format!("postgres://postgres:{w}@127.0.0.1:{p}/absent?sslmode"),
        format!("postgres://postgres:{w}@127.0.0.1:{p}/absent?sslrootcert=%FF&sslmode=verify-ca"),
        format!("postgres://127.0.0.1:{p}/absent?password={w}&user=x@y&sslmode=disable"),
        format!("host=localhost port={p} password={w} sslmode=verify-full sslrootcert={d}"),
        format!(
            "host=localhost port={p} password={w} sslmode=verify-full sslrootcert={d}/empty.pem"
        ),
        format!("host=localhost port={p} password={w} sslmode=verify-full sslrootcert={d}/key.pem"),
        format!("host=localhost port={p} password={w} sslmode=verify-full sslrootcert={d}/bad.pem"),
        format!("host=localhost port={p} password={w} sslmode=verify-ca sslrootcert={d}/noise.pem"),
        format!("host=localhost port={p} password={w} sslmode=require sslrootcert={d}/absent.pem"),
        format!("host={big} port={p} password={w}"),
        format!("host=127.0.0.1 port=99999 password={w}"),
        format!("host=127.0.0.1 port={p} password={w} sslmode=require sslrootcert=system"),
        format!("host=127.0.0.1 port={p} password={w} sslkey=/k sslcert=/c"),
        format!("host=127.0.0.1 port={p} password={w} \\"),
        format!("host=127.0.0.1 port={p} password='{w}"),
        format!("=x password={w}"),
        format!("hostaddr=127.0.0.1 port={p} password={w} sslmode=verify-full"),
        String::new(),
    ];
    for url in &inputs {
        let shown: String = url.chars().take(120).collect();
        let attempt = url.clone();
        let opened = std::panic::catch_unwind(move || open(&attempt, "brk_input_").map(drop))
            .map_err(|_| format!("open panicked on {shown}"))?;
        let Err(e) = opened else {
            return Err(format!("opened with {shown}").into());
        };
        let text = all_text(&e);
        assert!(
            !text.contains(PASSWORD),
            "{shown}: the error shows the password: {text}"
        );
        assert!(!text.trim().is_empty(), "{shown}: an empty error");
    }
    Ok(())
}
