//! TLS to PostgreSQL, as libpq's `sslmode` and `sslrootcert` describe it:
//! guards against a `verify-full` that connects to a server whose
//! certificate names another host, a `require` that silently talks
//! plaintext to a server without TLS, a `prefer` that gives up instead of
//! falling back, a session we believe encrypted that is not (each check
//! reads `pg_stat_ssl` for the engine's own connections), and errors for
//! bad input (unknown sslmode, unreadable sslrootcert, malformed string,
//! wrong password, bad table prefix) that are unclear or show the password.
//!
//! Needs `scripts/with-postgres` (`IDEMPOTENCY_TEST_PG`, and
//! `IDEMPOTENCY_TEST_PG_CA` for its throwaway CA). Without them the tests
//! are skipped with a message, except under `CI=true`, where they fail.

use std::error::Error as StdError;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idempotency::postgres::{Client, NoTls};
use idempotency::{Engine, OpenError};

type TestResult = Result<(), Box<dyn StdError + Send + Sync>>;

const PASSWORD: &str = "hunter2-not-for-logs";

fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// The test server: its connection string (plaintext, superuser), port and
/// CA file; `None` (skip) outside CI when it or its TLS is missing.
struct Server {
    admin: String,
    port: u16,
    ca: String,
}

fn server() -> Option<Server> {
    let admin = match std::env::var("IDEMPOTENCY_TEST_PG") {
        Ok(url) if !url.is_empty() => url,
        _ if ci() => panic!(
            "CI=true but IDEMPOTENCY_TEST_PG is not set: run the tests through scripts/with-postgres"
        ),
        _ => {
            eprintln!("skipped: IDEMPOTENCY_TEST_PG not set (run through scripts/with-postgres)");
            return None;
        }
    };
    let ca = match std::env::var("IDEMPOTENCY_TEST_PG_CA") {
        Ok(ca) if !ca.is_empty() => ca,
        _ if ci() => panic!(
            "CI=true but IDEMPOTENCY_TEST_PG_CA is not set: scripts/with-postgres starts the server with TLS only when the openssl command exists"
        ),
        _ => {
            eprintln!("skipped: IDEMPOTENCY_TEST_PG_CA not set (the server has no TLS: install openssl and run through scripts/with-postgres)");
            return None;
        }
    };
    let port = admin
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("port="))
        .and_then(|p| p.parse().ok())
        .unwrap_or(5432);
    Some(Server { admin, port, ca })
}

/// A name for this test's connections (and its table prefix).
fn unique(what: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "tls_{what}_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn open(url: &str, prefix: &str) -> Result<Engine, OpenError> {
    Engine::builder()
        .table_prefix(format!("{prefix}_"))
        .sweep_interval(None)
        .connect_timeout(Duration::from_secs(5))
        .open_postgres(url)
}

/// Whether each of the connections named `app` is encrypted, as the
/// server sees them (at least one must exist).
fn encrypted(s: &Server, app: &str) -> Result<bool, Box<dyn StdError + Send + Sync>> {
    let mut admin = Client::connect(&s.admin, NoTls)?;
    let rows = admin.query(
        "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
         WHERE a.application_name = $1",
        &[&app],
    )?;
    let ssl: Vec<bool> = rows.iter().map(|r| r.get(0)).collect();
    if ssl.is_empty() {
        return Err(format!("no connection named {app} on the server").into());
    }
    if ssl.iter().any(|&on| on != ssl[0]) {
        return Err(format!("connections named {app} disagree on TLS: {ssl:?}").into());
    }
    Ok(ssl[0])
}

/// The open's error text, checked not to hold the password.
fn refused(opened: Result<Engine, OpenError>) -> Result<String, Box<dyn StdError + Send + Sync>> {
    let e = match opened {
        Ok(_) => return Err("the open succeeded".into()),
        Err(e) => e,
    };
    let text = format!("{e} / {e:?}");
    assert!(
        !text.contains(PASSWORD),
        "the error shows the password: {text}"
    );
    Ok(text)
}

#[test]
fn verify_full_connects_encrypted() -> TestResult {
    let Some(s) = server() else { return Ok(()) };
    let app = unique("vfull");
    // `localhost` is in the certificate as a DNS name, 127.0.0.1 as an IP.
    for host in ["localhost", "127.0.0.1"] {
        let url = format!(
            "host={host} port={} user=postgres dbname=postgres application_name={app} sslmode=verify-full sslrootcert={}",
            s.port, s.ca
        );
        let engine = open(&url, &app)?;
        assert!(
            encrypted(&s, &app)?,
            "verify-full to {host} is not encrypted"
        );
        drop(engine);
    }
    // The URL form, with the CA path percent-encoded.
    let url = format!(
        "postgres://postgres@localhost:{}/postgres?sslmode=verify-full&application_name={app}u&sslrootcert={}",
        s.port,
        s.ca.replace('/', "%2F")
    );
    let _engine = open(&url, &app)?;
    assert!(encrypted(&s, &format!("{app}u"))?);
    Ok(())
}

#[test]
fn verify_full_refuses_a_certificate_for_another_host() -> TestResult {
    let Some(s) = server() else { return Ok(()) };
    let app = unique("wrong");
    let url = format!(
        "host=wrong.example hostaddr=127.0.0.1 port={} user=postgres dbname=postgres password={PASSWORD} sslmode=verify-full sslrootcert={}",
        s.port, s.ca
    );
    let text = refused(open(&url, &app))?;
    assert!(
        text.contains(
            "sslmode=verify-full: the server certificate is not valid for host \"wrong.example\" (it names localhost, 127.0.0.1)"
        ),
        "{text}"
    );
    Ok(())
}

#[test]
fn verify_ca_checks_the_chain_not_the_name() -> TestResult {
    let Some(s) = server() else { return Ok(()) };
    let app = unique("vca");
    let url = format!(
        "host=wrong.example hostaddr=127.0.0.1 port={} user=postgres dbname=postgres application_name={app} sslmode=verify-ca sslrootcert={}",
        s.port, s.ca
    );
    let _engine = open(&url, &app)?;
    assert!(encrypted(&s, &app)?, "verify-ca is not encrypted");
    // A CA that did not sign the server's certificate: refused, naming it.
    let dir = tempfile::tempdir()?;
    let other = dir.path().join("other-ca.pem");
    std::fs::write(&other, OTHER_CA)?;
    let url = format!(
        "host=localhost port={} user=postgres dbname=postgres sslmode=verify-ca sslrootcert={}",
        s.port,
        other.display()
    );
    let text = refused(open(&url, &app))?;
    assert!(
        text.contains("sslmode=verify-ca: the certificate of the server at host \"localhost\" is not signed by a CA in sslrootcert"),
        "{text}"
    );
    Ok(())
}

#[test]
fn require_prefer_and_the_default_encrypt_disable_does_not() -> TestResult {
    let Some(s) = server() else { return Ok(()) };
    for (mode, expect) in [
        ("sslmode=require", true),
        ("sslmode=prefer", true),
        ("sslmode=allow", true),
        ("", true),
        ("sslmode=disable", false),
    ] {
        let app = unique("mode");
        let url = format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres application_name={app} {mode}",
            s.port
        );
        let _engine = open(&url, &app)?;
        assert_eq!(encrypted(&s, &app)?, expect, "{mode:?}");
    }
    Ok(())
}

/// A server without TLS: it answers the SSLRequest with 'N' and then
/// refuses the startup message with its own error. Serves `n` connections.
fn fake_plaintext_server(n: usize) -> std::io::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    std::thread::spawn(move || {
        for _ in 0..n {
            let Ok((mut conn, _)) = listener.accept() else {
                return;
            };
            let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
            let mut first = [0u8; 8];
            if conn.read_exact(&mut first).is_err() {
                continue;
            }
            // 80877103: the SSLRequest code.
            if first[4..8] == 80877103u32.to_be_bytes() {
                if conn.write_all(b"N").is_err() {
                    continue;
                }
                let mut len = [0u8; 4];
                if conn.read_exact(&mut len).is_err() {
                    continue;
                }
                let mut rest = vec![0u8; (u32::from_be_bytes(len) as usize).saturating_sub(4)];
                if conn.read_exact(&mut rest).is_err() {
                    continue;
                }
            }
            let mut fields = Vec::new();
            for (tag, value) in [
                (b'S', "FATAL"),
                (b'V', "FATAL"),
                (b'C', "28000"),
                (b'M', "fake plaintext server refuses the startup"),
            ] {
                fields.push(tag);
                fields.extend_from_slice(value.as_bytes());
                fields.push(0);
            }
            fields.push(0);
            let mut msg = vec![b'E'];
            msg.extend_from_slice(&(fields.len() as u32 + 4).to_be_bytes());
            msg.extend_from_slice(&fields);
            let _ = conn.write_all(&msg);
        }
    });
    Ok(port)
}

#[test]
fn require_refuses_a_server_without_tls_and_prefer_falls_back() -> TestResult {
    if server().is_none() {
        return Ok(());
    }
    let port = fake_plaintext_server(2)?;
    let url = format!("host=127.0.0.1 port={port} user=app password={PASSWORD} sslmode=require");
    let text = refused(open(&url, "require"))?;
    assert!(
        text.contains("sslmode=require: the server at host \"127.0.0.1\" does not support TLS"),
        "{text}"
    );
    // prefer goes on in plaintext: the fake's own startup error arrives.
    let url = format!("host=127.0.0.1 port={port} user=app password={PASSWORD} sslmode=prefer");
    let text = refused(open(&url, "prefer"))?;
    assert!(
        text.contains("fake plaintext server refuses the startup"),
        "{text}"
    );
    assert!(!text.contains("sslmode="), "prefer failed on TLS: {text}");
    Ok(())
}

#[test]
fn bad_input_is_a_clear_error_without_the_password() -> TestResult {
    let Some(s) = server() else { return Ok(()) };
    let base = format!(
        "host=localhost port={} user=postgres dbname=postgres password={PASSWORD}",
        s.port
    );
    let text = refused(open(&format!("{base} sslmode=verify_full"), "bad"))?;
    assert!(
        text.contains("unknown sslmode \"verify_full\"")
            && text.contains("disable, allow, prefer, require, verify-ca, verify-full"),
        "{text}"
    );
    let text = refused(open(
        &format!("{base} sslmode=verify-full sslrootcert=/nonexistent/ca.pem"),
        "bad",
    ))?;
    assert!(
        text.contains("cannot read sslrootcert \"/nonexistent/ca.pem\"")
            && text.contains("No such file"),
        "{text}"
    );
    let dir = tempfile::tempdir()?;
    let not_pem = dir.path().join("not-a-cert.pem");
    std::fs::write(&not_pem, "hello")?;
    let text = refused(open(
        &format!("{base} sslmode=verify-ca sslrootcert={}", not_pem.display()),
        "bad",
    ))?;
    assert!(text.contains("holds no PEM certificate"), "{text}");
    for malformed in [
        format!("{base} sslmode"),
        format!("{base} 'unterminated"),
        format!("host=localhost password='{PASSWORD}"),
        format!("postgres://app:{PASSWORD}@localhost:notaport/db"),
        format!("postgres://app:{PASSWORD}@localhost/db?sslmode=%zz"),
        format!("{base} nosuchoption=1"),
    ] {
        let text = refused(open(&malformed, "bad"))?;
        assert!(text.contains("connection string"), "{malformed}: {text}");
    }
    let text = refused(
        Engine::builder()
            .table_prefix("Not An Identifier")
            .open_postgres(&base),
    )?;
    assert!(text.contains("Not An Identifier"), "{text}");
    Ok(())
}

#[test]
fn a_wrong_password_shows_the_server_message_not_the_password() -> TestResult {
    let Some(s) = server() else { return Ok(()) };
    let role = std::env::var("IDEMPOTENCY_TEST_PG_SCRAM_ROLE").unwrap_or_default();
    if role.is_empty() {
        if ci() {
            return Err("CI=true but IDEMPOTENCY_TEST_PG_SCRAM_ROLE is not set".into());
        }
        eprintln!(
            "skipped: IDEMPOTENCY_TEST_PG_SCRAM_ROLE not set (run through scripts/with-postgres)"
        );
        return Ok(());
    }
    let right = "right-horse-battery-staple";
    let mut admin = Client::connect(&s.admin, NoTls)?;
    admin.batch_execute(&format!(
        "DO $$ BEGIN \
           IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN \
             CREATE ROLE {role} LOGIN; \
           END IF; \
         END $$; \
         ALTER ROLE {role} PASSWORD '{right}'"
    ))?;
    // The role and pg_hba.conf line work: the right password logs in.
    let url = |password: &str| {
        format!(
            "host=localhost port={} user={role} dbname=postgres password={password} sslmode=verify-full sslrootcert={}",
            s.port, s.ca
        )
    };
    if let Err(e) = Client::connect(
        &format!(
            "host=127.0.0.1 port={} user={role} dbname=postgres password={right} sslmode=disable",
            s.port
        ),
        NoTls,
    ) {
        return Err(format!("the right password was refused: {e:?}").into());
    }
    let text = refused(open(&url(PASSWORD), "pw"))?;
    assert!(
        text.contains(&format!(
            "password authentication failed for user \"{role}\""
        )),
        "{text}"
    );
    Ok(())
}

/// A CA certificate (P-256, self-signed) that signed nothing of ours.
const OTHER_CA: &str = "-----BEGIN CERTIFICATE-----
MIIBpjCCAUugAwIBAgIUEEIhZ6HDQyCa0WbYAbfP1ExF23UwCgYIKoZIzj0EAwIw
KDEmMCQGA1UEAwwdaWRlbXBvdGVuY3kgdW5yZWxhdGVkIHRlc3QgQ0EwHhcNMjYx
MjAxMTc1NzE1WhcNNDYxMTI2MTc1NzE1WjAoMSYwJAYDVQQDDB1pZGVtcG90ZW5j
eSB1bnJlbGF0ZWQgdGVzdCBDQTBZMBMGByqGSM49AgEGCCqGSM49AwEHA0IABES4
4R8rsHV9B2XzAAK9h6qbxM9Q9KEOp6qswOZsmEgFACCrCEmt1KbzuRIccvYdGnm0
alsF4mM92F1mVXYPxXOjUzBRMB0GA1UdDgQWBBTant2aAF0PSEeSZoSd3wAxpdpE
+TAfBgNVHSMEGDAWgBTant2aAF0PSEeSZoSd3wAxpdpE+TAPBgNVHRMBAf8EBTAD
AQH/MAoGCCqGSM49BAMCA0kAMEYCIQD3h4/aCcIUEL5s5qjOpo49DmnlFCyMCZK6
r4DzhKq30QIhAJajR79Zdkz/xdVEzQwWsl/XMU6a+RAQ7iftWY4kmyBW
-----END CERTIFICATE-----
";
