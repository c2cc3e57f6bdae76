//! Breaking mutual TLS on Redis (`EngineBuilder::redis_tls_client_cert`)
//! with the key and certificate files operators really have: an EC
//! (P-256, SEC1) key, a PKCS#1 RSA key, a chain through an intermediate
//! CA, a combined file with the key first, a key file with two keys, a
//! passphrase-protected key (PKCS#8 and the traditional OpenSSL form),
//! empty files, a directory, and a client certificate on a server that
//! does not ask for one. Each usable form opens; each unusable one is
//! refused at open naming the file and the cause, never its contents.
//!
//! Certificates are made per run with `openssl`; each server is a
//! throwaway `redis-server` of the test's own. Skipped without `openssl`
//! or `redis-server`, a failure under `CI=true`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey, OpenError};

#[path = "common/openssl.rs"]
mod openssl;
#[path = "common/redis_server.rs"]
mod redis_server;

use openssl::{openssl, sign, Pki, LEAF};

use redis_server::{own_tls_server, BoxError, OwnServer, TlsFiles};

type TestResult = Result<(), BoxError>;

const PASSWORD: &str = "Tls-breaker-pw-94e";
const PASSPHRASE: &str = "key-passphrase-3b7";

/// `ca` (root), `inter` (an intermediate `ca` signed), the server's
/// `local`, and client certificates: `ec` (P-256 SEC1 key), `rsa1`
/// (PKCS#1 RSA key), `leaf` (signed by `inter`), `other` (PKCS#8 RSA).
fn pki() -> Result<Option<Pki>, BoxError> {
    if !openssl::available()? {
        return Ok(None);
    }
    let pki = Pki::new()?;
    let d = pki.dir.path();
    openssl::ca(d, "ca", "breaker root")?;
    // Keys: RSA PKCS#8 (openssl's default), RSA PKCS#1, EC SEC1.
    for name in ["local", "inter", "leaf", "other"] {
        openssl::key_and_csr(d, name)?;
    }
    openssl(d, &["genrsa", "-traditional", "-out", "rsa1.key", "2048"])?;
    openssl(
        d,
        &[
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-out",
            "ec.key",
        ],
    )?;
    for name in ["rsa1", "ec"] {
        openssl::csr(d, name)?;
    }
    sign(
        d,
        "local",
        "ca",
        &format!("{LEAF}extendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n"),
    )?;
    sign(
        d,
        "inter",
        "ca",
        "basicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\n",
    )?;
    let client = format!("{LEAF}extendedKeyUsage=clientAuth\nsubjectAltName=DNS:app.example\n");
    for name in ["other", "rsa1", "ec"] {
        sign(d, name, "ca", &client)?;
    }
    sign(d, "leaf", "inter", &client)?;
    Ok(Some(pki))
}

/// A TLS-only server with certificate `local`; with `mutual`, clients
/// must present a certificate `ca` signed (`tls-auth-clients yes`).
fn server(pki: &Pki, mutual: bool) -> Result<Option<OwnServer>, BoxError> {
    own_tls_server(
        &TlsFiles {
            cert: &pki.path("local.pem"),
            key: &pki.path("local.key"),
            ca: &pki.path("ca.pem"),
        },
        &[
            "--requirepass",
            PASSWORD,
            "--tls-auth-clients",
            if mutual { "yes" } else { "no" },
        ],
    )
}

fn url(s: &OwnServer) -> String {
    format!("rediss://:{PASSWORD}@localhost:{}/", s.port)
}

fn builder(pki: &Pki, cert: &Path, key: &Path) -> idempotency::EngineBuilder {
    Engine::builder()
        .sweep_interval(None)
        .redis_key_prefix("mtls:")
        .redis_connect_timeout(Duration::from_secs(2))
        .redis_command_timeout(Duration::from_secs(2))
        .redis_tls_ca(pki.path("ca.pem"))
        .redis_tls_client_cert(cert, key)
}

/// A claim, completion and replay through `engine`.
fn round_trip(engine: &Engine, name: &str) -> TestResult {
    let key = IdempotencyKey::new("mtls", name)?;
    let fp = Fingerprint::of_json(b"{}", &[])?;
    let Begin::Claimed(claim) = engine.begin(&key, fp)? else {
        return Err(format!("{key}: a fresh key must be claimed").into());
    };
    engine.complete(claim, Envelope::new(1, 201, "ok"))?;
    assert!(matches!(engine.begin(&key, fp)?, Begin::Replay(_)));
    Ok(())
}

/// Every base64 line of the PEM files in the PKI dir: no error may show
/// one.
fn secrets(pki: &Pki) -> Result<Vec<String>, BoxError> {
    let mut lines = Vec::new();
    for entry in std::fs::read_dir(pki.dir.path())? {
        let path = entry?.path();
        if path.is_file() {
            let text = String::from_utf8_lossy(&std::fs::read(&path)?).into_owned();
            lines.extend(
                text.lines()
                    .filter(|l| !l.starts_with("-----") && l.len() > 16)
                    .map(str::to_owned),
            );
        }
    }
    Ok(lines)
}

fn refusal(pki: &Pki, opened: Result<Engine, OpenError>) -> Result<String, BoxError> {
    let err = match opened {
        Ok(_) => return Err("the open was not refused".into()),
        Err(e) => e,
    };
    let text = format!("{err} / {err:?}");
    eprintln!("refused: {err}");
    assert!(!text.contains(PASSWORD), "the password shows: {text}");
    assert!(!text.contains(PASSPHRASE), "the passphrase shows: {text}");
    assert!(
        !text.contains("PRIVATE KEY") && !secrets(pki)?.iter().any(|l| text.contains(l.as_str())),
        "the error shows PEM contents: {text}"
    );
    Ok(err.to_string())
}

#[test]
fn every_usable_key_and_chain_form_is_admitted() -> TestResult {
    let Some(pki) = pki()? else { return Ok(()) };
    let Some(s) = server(&pki, true)? else {
        return Ok(());
    };
    // The chain file: the leaf, then the intermediate (the server trusts
    // the root only). A combined file: the key first, then the chain.
    let chain = pki.write("leaf-chain.pem", &["leaf.pem", "inter.pem"])?;
    let combined = pki.write("combined.pem", &["leaf.key", "leaf.pem", "inter.pem"])?;
    let cases: [(&str, PathBuf, PathBuf); 5] = [
        ("ec-p256", pki.path("ec.pem"), pki.path("ec.key")),
        ("rsa-pkcs1", pki.path("rsa1.pem"), pki.path("rsa1.key")),
        ("rsa-pkcs8", pki.path("other.pem"), pki.path("other.key")),
        ("intermediate", chain, pki.path("leaf.key")),
        ("combined", combined.clone(), combined),
    ];
    for (name, cert, key) in cases {
        let engine = builder(&pki, &cert, &key)
            .open_redis(&url(&s))
            .map_err(|e| format!("{name}: {e}"))?;
        round_trip(&engine, name)?;
    }
    Ok(())
}

#[test]
fn a_client_certificate_for_a_server_that_asks_none_just_works() -> TestResult {
    let Some(pki) = pki()? else { return Ok(()) };
    let Some(s) = server(&pki, false)? else {
        return Ok(());
    };
    let engine = builder(&pki, &pki.path("ec.pem"), &pki.path("ec.key")).open_redis(&url(&s))?;
    round_trip(&engine, "not-asked")?;
    drop(engine);
    let reader =
        builder(&pki, &pki.path("ec.pem"), &pki.path("ec.key")).open_redis_read_only(&url(&s))?;
    assert_eq!(reader.records(&Default::default())?.len(), 1);
    Ok(())
}

#[test]
fn an_encrypted_key_is_named_as_encrypted() -> TestResult {
    let Some(pki) = pki()? else { return Ok(()) };
    let d = pki.dir.path();
    let pass = format!("pass:{PASSPHRASE}");
    // PKCS#8 encrypted (-----BEGIN ENCRYPTED PRIVATE KEY-----).
    openssl(
        d,
        &[
            "pkcs8",
            "-topk8",
            "-in",
            "ec.key",
            "-out",
            "ec-enc8.key",
            "-passout",
            &pass,
        ],
    )?;
    // The traditional OpenSSL form (Proc-Type: 4,ENCRYPTED in the block).
    openssl(
        d,
        &[
            "rsa",
            "-in",
            "rsa1.key",
            "-traditional",
            "-aes256",
            "-out",
            "rsa1-enc.key",
            "-passout",
            &pass,
        ],
    )?;
    let Some(s) = server(&pki, true)? else {
        return Ok(());
    };
    for (cert, key) in [("ec.pem", "ec-enc8.key"), ("rsa1.pem", "rsa1-enc.key")] {
        let err = refusal(
            &pki,
            builder(&pki, &pki.path(cert), &pki.path(key)).open_redis(&url(&s)),
        )?;
        assert!(
            err.contains(key) && err.contains("encrypted"),
            "{key}: the error must say the key is encrypted: {err}"
        );
    }
    Ok(())
}

#[test]
fn unusable_files_are_named_and_never_shown() -> TestResult {
    let Some(pki) = pki()? else { return Ok(()) };
    let Some(s) = server(&pki, true)? else {
        return Ok(());
    };
    let empty = pki.path("empty.pem");
    std::fs::write(&empty, "")?;
    let dir = pki.path("a-directory");
    std::fs::create_dir(&dir)?;
    // Two keys, the certificate's second: the first is taken.
    let two = pki.write("two-keys.key", &["other.key", "ec.key"])?;
    // The intermediate before the leaf: the first certificate is not the
    // key's.
    let backwards = pki.write("backwards.pem", &["inter.pem", "leaf.pem"])?;
    // Larger than any PEM file (9 MiB of certificate-looking lines): not
    // read whole (a device such as /dev/zero would never end).
    let huge = pki.path("huge.pem");
    let line = "A".repeat(63) + "\n";
    std::fs::write(
        &huge,
        format!(
            "-----BEGIN CERTIFICATE-----\n{}-----END CERTIFICATE-----\n",
            line.repeat(9 * 16384)
        ),
    )?;
    let cases: [(PathBuf, PathBuf, &[&str]); 8] = [
        (
            huge.clone(),
            pki.path("ec.key"),
            &["huge.pem", "larger than 8 MiB"],
        ),
        (pki.path("ec.pem"), huge, &["huge.pem", "larger than 8 MiB"]),
        (
            empty.clone(),
            pki.path("ec.key"),
            &["empty.pem", "no PEM certificate"],
        ),
        (pki.path("ec.pem"), empty, &["empty.pem", "private key"]),
        (
            dir.clone(),
            pki.path("ec.key"),
            &["a-directory", "cannot read"],
        ),
        (pki.path("ec.pem"), dir, &["a-directory", "cannot read"]),
        (
            pki.path("ec.pem"),
            two,
            &[
                "two-keys.key",
                "ec.pem",
                "2 private keys",
                "the first is used",
            ],
        ),
        (
            backwards,
            pki.path("leaf.key"),
            &["leaf.key", "backwards.pem", "own certificate comes first"],
        ),
    ];
    for (cert, key, words) in cases {
        let err = refusal(&pki, builder(&pki, &cert, &key).open_redis(&url(&s)))?;
        for word in words {
            assert!(err.contains(word), "{word:?} missing from: {err}");
        }
    }
    Ok(())
}

/// Signs the `ec` key's request again as `name`: with `days` of validity
/// and the extended key usage `usage`. `false` when openssl refuses (a
/// negative `days` is refused by some versions).
fn ec_variant(pki: &Pki, name: &str, days: &str, usage: &str) -> Result<bool, BoxError> {
    let d = pki.dir.path();
    std::fs::write(
        d.join(format!("{name}.ext")),
        format!("{LEAF}extendedKeyUsage={usage}\n"),
    )?;
    let out = Command::new("openssl")
        .args([
            "x509", "-req", "-in", "ec.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        ])
        .args(["-CAcreateserial", "-days", days, "-extfile"])
        .arg(format!("{name}.ext"))
        .arg("-out")
        .arg(format!("{name}.pem"))
        .current_dir(d)
        .output()?;
    Ok(out.status.success())
}

#[test]
fn a_refused_client_certificate_is_refused_for_its_own_reason() -> TestResult {
    let Some(pki) = pki()? else { return Ok(()) };
    let Some(s) = server(&pki, true)? else {
        return Ok(());
    };
    let mut cases = Vec::new();
    // Issued for servers only: no clientAuth.
    if ec_variant(&pki, "server-only", "2", "serverAuth")? {
        cases.push(("server-only.pem", "clientAuth"));
    } else {
        return Err("openssl could not sign server-only.pem".into());
    }
    // Expired a day before it was issued (OpenSSL 3.0 takes -days -1).
    if ec_variant(&pki, "expired", "-1", "clientAuth")? {
        cases.push(("expired.pem", "expired"));
    } else {
        eprintln!("openssl refuses -days -1: the expired case is not run");
    }
    for (cert, word) in cases {
        let err = refusal(
            &pki,
            builder(&pki, &pki.path(cert), &pki.path("ec.key")).open_redis(&url(&s)),
        )?;
        assert!(err.contains(word), "{cert}: {word:?} missing from: {err}");
        assert!(
            !err.contains("tls-ca-cert-file"),
            "{cert}: blamed on the server's CA file: {err}"
        );
    }
    Ok(())
}
