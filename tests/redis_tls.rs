//! Redis over TLS (`rediss://`): the engine works through a TLS-only
//! server whose certificate a CA file vouches for, and every way a TLS
//! connection can be wrong is refused at open with an error that says
//! which, never with the password: a CA that did not sign the server's
//! certificate (also the system's trust store), a certificate that names
//! another host, a `rediss://` URL on a plaintext server, a `redis://`
//! URL on a TLS port, a CA file that is missing or holds no certificate,
//! and a CA file given for a plaintext URL. With mutual TLS
//! (`tls-auth-clients yes`): a client certificate the server trusts is
//! admitted; none, one another CA signed, a key that is not the
//! certificate's, unreadable or swapped files, and a client certificate
//! for a plaintext URL are refused, naming the file and never showing
//! its contents.
//!
//! The certificates are made per run with the `openssl` command (as
//! `scripts/with-postgres` makes the PostgreSQL server's); each case
//! starts its own `redis-server` (Debian's is built with TLS). Skipped
//! without `openssl` or `redis-server`, a failure under `CI=true`.

use std::path::PathBuf;
use std::time::Duration;

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey, OpenError};

#[path = "common/openssl.rs"]
mod openssl;
#[path = "common/redis_server.rs"]
mod redis_server;

use openssl::Pki;

use redis_server::{own_server, own_tls_server, BoxError, OwnServer, TlsFiles};

type TestResult = Result<(), BoxError>;

const PASSWORD: &str = "Tls-test-pw-7c1";

/// The files of a server with certificate `name` (signed by `ca`).
fn server_files(pki: &Pki, name: &str) -> (PathBuf, PathBuf, PathBuf) {
    (
        pki.path(&format!("{name}.pem")),
        pki.path(&format!("{name}.key")),
        pki.path("ca.pem"),
    )
}

/// Makes `ca` (trusted by the tests), `other-ca` (trusted by no server),
/// two server certificates signed by `ca`: `local` for `localhost` and
/// 127.0.0.1, `elsewhere` for `elsewhere.example` only, and two client
/// certificates: `client` signed by `ca`, `stranger` by `other-ca`. `None`
/// without `openssl` (an error under `CI=true`).
fn pki() -> Result<Option<Pki>, BoxError> {
    if !openssl::available()? {
        return Ok(None);
    }
    let pki = Pki::new()?;
    let d = pki.dir.path();
    for ca in ["ca", "other-ca"] {
        openssl::ca(d, ca, &format!("idempotency test {ca}"))?;
    }
    for (name, san, usage, ca) in [
        ("local", "DNS:localhost,IP:127.0.0.1", "serverAuth", "ca"),
        ("elsewhere", "DNS:elsewhere.example", "serverAuth", "ca"),
        ("client", "DNS:app.example", "clientAuth", "ca"),
        ("stranger", "DNS:app.example", "clientAuth", "other-ca"),
    ] {
        openssl::key_and_csr(d, name)?;
        let ext = format!(
            "{}extendedKeyUsage={usage}\nsubjectAltName={san}\n",
            openssl::LEAF
        );
        openssl::sign(d, name, ca, &ext)?;
    }
    Ok(Some(pki))
}

/// A TLS-only server with certificate `name`, requiring [`PASSWORD`].
fn tls_server(pki: &Pki, name: &str) -> Result<Option<OwnServer>, BoxError> {
    let (cert, key, ca) = server_files(pki, name);
    own_tls_server(
        &TlsFiles {
            cert: &cert,
            key: &key,
            ca: &ca,
        },
        &["--requirepass", PASSWORD],
    )
}

/// As [`tls_server`] with certificate `local`, and clients must present
/// a certificate signed by `ca` (`tls-auth-clients yes`).
fn mutual_tls_server(pki: &Pki) -> Result<Option<OwnServer>, BoxError> {
    let (cert, key, ca) = server_files(pki, "local");
    own_tls_server(
        &TlsFiles {
            cert: &cert,
            key: &key,
            ca: &ca,
        },
        &["--requirepass", PASSWORD, "--tls-auth-clients", "yes"],
    )
}

fn builder() -> idempotency::EngineBuilder {
    Engine::builder()
        .sweep_interval(None)
        .redis_key_prefix("tls:")
        .redis_connect_timeout(Duration::from_secs(2))
        .redis_command_timeout(Duration::from_secs(2))
}

fn fp() -> Result<Fingerprint, BoxError> {
    Ok(Fingerprint::of_json(b"{\"amount\":1}", &[])?)
}

/// `key` claimed and completed through `e`, then replayed.
fn charge_once(e: &Engine, key: &IdempotencyKey) -> TestResult {
    let Begin::Claimed(claim) = e.begin(key, fp()?)? else {
        return Err(format!("{key}: a fresh key must be claimed").into());
    };
    e.complete(claim, Envelope::new(1, 201, "charged"))?;
    let Begin::Replay(replay) = e.begin(key, fp()?)? else {
        return Err(format!("{key}: the completed key must replay").into());
    };
    assert_eq!(replay.envelope.body, b"charged");
    Ok(())
}

/// The open's error, checked to leave the password out.
fn refusal(opened: Result<Engine, OpenError>) -> Result<String, BoxError> {
    let err = match opened {
        Ok(_) => return Err("the open was not refused".into()),
        Err(e) => e,
    };
    let text = format!("{err} / {err:?}");
    assert!(!text.contains(PASSWORD), "the password shows: {text}");
    eprintln!("refused: {err}");
    Ok(err.to_string())
}

#[test]
fn claims_complete_and_replay_over_tls() -> TestResult {
    let Some(pki) = pki()? else { return Ok(()) };
    let Some(s) = tls_server(&pki, "local")? else {
        return Ok(());
    };
    for host in ["localhost", "127.0.0.1"] {
        let url = format!("rediss://:{PASSWORD}@{host}:{}/", s.port);
        let e = builder()
            .redis_tls_ca(pki.path("ca.pem"))
            .open_redis(&url)?;
        let key = IdempotencyKey::new("tls", format!("charge-{host}"))?;
        charge_once(&e, &key)?;
        assert!(e.verify()?.is_sound());
    }
    Ok(())
}

#[test]
fn a_certificate_no_trusted_ca_signed_is_refused() -> TestResult {
    let Some(pki) = pki()? else { return Ok(()) };
    let Some(s) = tls_server(&pki, "local")? else {
        return Ok(());
    };
    let url = format!("rediss://:{PASSWORD}@localhost:{}/", s.port);
    // The system's trust store does not hold the throwaway CA.
    let system = refusal(builder().open_redis(&url))?;
    let other = refusal(
        builder()
            .redis_tls_ca(pki.path("other-ca.pem"))
            .open_redis(&url),
    )?;
    for err in [system, other] {
        assert!(
            err.contains("TLS") && err.contains("certificate") && err.contains("not trusted"),
            "{err}"
        );
    }
    Ok(())
}

#[test]
fn a_certificate_for_another_host_is_refused() -> TestResult {
    let Some(pki) = pki()? else { return Ok(()) };
    let Some(s) = tls_server(&pki, "elsewhere")? else {
        return Ok(());
    };
    let url = format!("rediss://:{PASSWORD}@localhost:{}/", s.port);
    let err = refusal(builder().redis_tls_ca(pki.path("ca.pem")).open_redis(&url))?;
    assert!(
        err.contains("TLS") && err.contains("does not name the host"),
        "{err}"
    );
    Ok(())
}

#[test]
fn tls_and_plaintext_mixed_up_are_refused() -> TestResult {
    let Some(pki) = pki()? else { return Ok(()) };
    let Some(tls) = tls_server(&pki, "local")? else {
        return Ok(());
    };
    let Some(plain) = own_server(&["--requirepass", PASSWORD])? else {
        return Ok(());
    };
    let ca = pki.path("ca.pem");
    // rediss:// on a plaintext server.
    let url = format!("rediss://:{PASSWORD}@localhost:{}/", plain.port);
    let err = refusal(builder().redis_tls_ca(&ca).open_redis(&url))?;
    assert!(err.contains("TLS") && err.contains("plaintext"), "{err}");
    // redis:// on a TLS port: the server hangs up on plaintext.
    let url = format!("redis://:{PASSWORD}@localhost:{}/", tls.port);
    let err = refusal(builder().open_redis(&url))?;
    assert!(err.contains("rediss://"), "{err}");
    // A CA file for a plaintext URL is a mistake, not a no-op.
    let url = format!("redis://:{PASSWORD}@localhost:{}/", plain.port);
    let err = refusal(builder().redis_tls_ca(&ca).open_redis(&url))?;
    assert!(
        err.contains("ca.pem") && err.contains("not rediss://"),
        "{err}"
    );
    Ok(())
}

#[test]
fn an_unusable_ca_file_is_named() -> TestResult {
    let Some(pki) = pki()? else { return Ok(()) };
    let Some(s) = tls_server(&pki, "local")? else {
        return Ok(());
    };
    let url = format!("rediss://:{PASSWORD}@localhost:{}/", s.port);
    let missing = pki.path("missing.pem");
    let err = refusal(builder().redis_tls_ca(&missing).open_redis(&url))?;
    assert!(
        err.contains("missing.pem") && err.contains("cannot read"),
        "{err}"
    );
    // A private key is PEM, but not a certificate.
    let err = refusal(builder().redis_tls_ca(pki.path("ca.key")).open_redis(&url))?;
    assert!(
        err.contains("ca.key") && err.contains("no PEM certificate"),
        "{err}"
    );
    Ok(())
}

#[test]
fn mutual_tls_admits_a_client_certificate_the_server_trusts() -> TestResult {
    let Some(pki) = pki()? else { return Ok(()) };
    let Some(s) = mutual_tls_server(&pki)? else {
        return Ok(());
    };
    let url = format!("rediss://:{PASSWORD}@localhost:{}/", s.port);
    let e = builder()
        .redis_tls_ca(pki.path("ca.pem"))
        .redis_tls_client_cert(pki.path("client.pem"), pki.path("client.key"))
        .open_redis(&url)?;
    let key = IdempotencyKey::new("tls", "mutual")?;
    charge_once(&e, &key)?;
    drop(e);
    // The operator's read-only open presents it too.
    let reader = builder()
        .redis_tls_ca(pki.path("ca.pem"))
        .redis_tls_client_cert(pki.path("client.pem"), pki.path("client.key"))
        .open_redis_read_only(&url)?;
    assert!(reader.record(&key)?.is_some());
    Ok(())
}

#[test]
fn mutual_tls_refusals_name_the_cause_and_never_the_key() -> TestResult {
    let Some(pki) = pki()? else { return Ok(()) };
    let Some(s) = mutual_tls_server(&pki)? else {
        return Ok(());
    };
    let Some(plain) = own_server(&["--requirepass", PASSWORD])? else {
        return Ok(());
    };
    let url = format!("rediss://:{PASSWORD}@localhost:{}/", s.port);
    let with = |cert: &str, key: &str| {
        builder()
            .redis_tls_ca(pki.path("ca.pem"))
            .redis_tls_client_cert(pki.path(cert), pki.path(key))
    };
    let cases: Vec<(Result<Engine, OpenError>, &[&str])> = vec![
        (
            builder().redis_tls_ca(pki.path("ca.pem")).open_redis(&url),
            &["requires a client certificate", "redis_tls_client_cert"],
        ),
        (
            with("stranger.pem", "stranger.key").open_redis(&url),
            &["refused this client's certificate", "tls-ca-cert-file"],
        ),
        (
            with("client.pem", "stranger.key").open_redis(&url),
            &[
                "stranger.key",
                "does not belong to the certificate",
                "client.pem",
            ],
        ),
        (
            with("client.pem", "missing.key").open_redis(&url),
            &["missing.key", "cannot read"],
        ),
        (
            with("client.key", "client.key").open_redis(&url),
            &["client.key", "no PEM certificate"],
        ),
        (
            with("client.pem", "client.pem").open_redis(&url),
            &["client.pem", "no usable PEM private key"],
        ),
        (
            with("client.pem", "client.key")
                .open_redis(&format!("redis://:{PASSWORD}@localhost:{}/", plain.port)),
            &["client certificate", "not rediss://"],
        ),
    ];
    // Every base64 line of the PEM files involved: none may show.
    let mut secrets = Vec::new();
    for name in ["client.key", "stranger.key", "client.pem", "stranger.pem"] {
        let text = std::fs::read_to_string(pki.path(name))?;
        secrets.extend(
            text.lines()
                .filter(|l| !l.starts_with("-----") && l.len() > 16)
                .map(str::to_owned),
        );
    }
    for (opened, words) in cases {
        let err = refusal(opened)?;
        for word in words {
            assert!(err.contains(word), "{word:?} missing from: {err}");
        }
        assert!(
            !err.contains("PRIVATE KEY") && !secrets.iter().any(|l| err.contains(l.as_str())),
            "the error shows PEM contents: {err}"
        );
    }
    Ok(())
}
