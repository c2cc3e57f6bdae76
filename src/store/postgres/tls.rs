//! TLS for PostgreSQL connections, as libpq's `sslmode` and `sslrootcert`
//! describe it, through rustls with the `ring` provider (no OpenSSL).
//!
//! | sslmode       | encrypted             | certificate checked                  |
//! |---------------|-----------------------|--------------------------------------|
//! | `disable`     | no                    | -                                    |
//! | `allow`, `prefer` (default) | if the server offers TLS | no                  |
//! | `require`     | yes, or refused       | no (chain, if a root file exists)    |
//! | `verify-ca`   | yes, or refused       | chain to a trusted CA                |
//! | `verify-full` | yes, or refused       | chain, and the name in `host`        |
//!
//! "Not checked" still checks the handshake's signature against the
//! certificate's key, so only a certificate's authenticity is skipped.
//! Trusted CAs: `sslrootcert` (a PEM file), else libpq's default
//! `~/.postgresql/root.crt` when it exists, or `sslrootcert=system`.
//! As in libpq, `require` with a root file behaves as `verify-ca`.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};

use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::Socket;

use crate::error::OpenError;

use super::connstr::{self, ConnStr, RootCert, SslMode};

/// The connector handed to the client (and to every pooled connection):
/// tokio-postgres-rustls's, with our verifier in its configuration.
#[derive(Clone)]
pub(super) struct Tls(tokio_postgres_rustls::MakeRustlsConnect);

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Tls(rustls)")
    }
}

type Inner = tokio_postgres_rustls::MakeRustlsConnect;

impl MakeTlsConnect<Socket> for Tls {
    type Stream = <Inner as MakeTlsConnect<Socket>>::Stream;
    type TlsConnect = <Inner as MakeTlsConnect<Socket>>::TlsConnect;
    type Error = <Inner as MakeTlsConnect<Socket>>::Error;

    fn make_tls_connect(&mut self, host: &str) -> Result<Self::TlsConnect, Self::Error> {
        <Inner as MakeTlsConnect<Socket>>::make_tls_connect(&mut self.0, host)
    }
}

/// What a connection string asked for, kept to explain a refused
/// connection.
#[derive(Clone)]
pub(super) struct Plan {
    mode: SslMode,
    /// The host names (`host`), comma-separated, as the certificate is
    /// checked against them.
    hosts: String,
    /// Where the trusted CAs came from, for messages; `None`: none used.
    roots: Option<String>,
    password: Option<String>,
}

impl fmt::Debug for Plan {
    /// Everything but the password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plan")
            .field("mode", &self.mode)
            .field("hosts", &self.hosts)
            .field("roots", &self.roots)
            .finish_non_exhaustive()
    }
}

/// Parses `url` and prepares its TLS: the client configuration (TLS keys
/// taken out), the connector, and the plan that explains failures.
///
/// # Errors
///
/// [`OpenError::Storage`] for a malformed string, an unknown `sslmode`,
/// or an unreadable or empty `sslrootcert`; never with the password.
pub(super) fn configure(url: &str) -> Result<(tokio_postgres::Config, Tls, Plan), OpenError> {
    let parsed = connstr::parse(url).map_err(|e| OpenError::Storage {
        context: "parsing the PostgreSQL connection string",
        source: Box::new(e),
    })?;
    let (tls, plan) = connector(&parsed).map_err(|e| OpenError::Storage {
        context: "setting up TLS for PostgreSQL",
        source: Box::new(e),
    })?;
    Ok((parsed.config, tls, plan))
}

/// Why the TLS setup failed (before any connection).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(super) enum TlsSetupError {
    #[error("cannot read sslrootcert \"{}\": {source}", path.display())]
    Unreadable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("sslrootcert \"{}\" holds no PEM certificate (expected -----BEGIN CERTIFICATE-----)", path.display())]
    NoCertificate { path: PathBuf },
    #[error("sslrootcert \"{}\": a certificate is not usable as a CA: {source}", path.display())]
    BadCertificate {
        path: PathBuf,
        source: rustls::Error,
    },
    #[error("sslmode={mode} needs trusted CA certificates, and libpq's default sslrootcert \"{}\" does not exist: give sslrootcert=<PEM file> (or sslrootcert=system), or choose another sslmode", path.display())]
    NoRootCert { mode: SslMode, path: PathBuf },
    #[error("sslrootcert=system: no certificate in the system's trust store ({0})")]
    NoSystemRoots(String),
    #[error("setting up rustls: {0}")]
    Rustls(String),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The connector and plan for a parsed connection string.
pub(super) fn connector(parsed: &ConnStr) -> Result<(Tls, Plan), TlsSetupError> {
    let provider = provider();
    let needs_roots = matches!(parsed.sslmode, SslMode::VerifyCa | SslMode::VerifyFull);
    let wants_roots = needs_roots || parsed.sslmode == SslMode::Require;
    let roots = if wants_roots {
        load_roots(&parsed.rootcert, parsed.sslmode)?
    } else {
        None
    };
    let verifier: Arc<dyn ServerCertVerifier> = match (&roots, parsed.sslmode) {
        (Some((store, _)), mode) => {
            let webpki = WebPkiServerVerifier::builder_with_provider(
                Arc::new(store.clone()),
                provider.clone(),
            )
            .build()
            .map_err(|e| TlsSetupError::Rustls(e.to_string()))?;
            if mode == SslMode::VerifyFull {
                webpki
            } else {
                Arc::new(ChainOnly(webpki))
            }
        }
        (None, _) => Arc::new(AnyCertificate(provider.clone())),
    };
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsSetupError::Rustls(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    let hosts = parsed
        .config
        .get_hosts()
        .iter()
        .map(|h| match h {
            tokio_postgres::config::Host::Tcp(name) => name.clone(),
            #[cfg(unix)]
            tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
        })
        .collect::<Vec<_>>()
        .join(",");
    let plan = Plan {
        mode: parsed.sslmode,
        hosts,
        roots: roots.map(|(_, from)| from),
        password: parsed
            .config
            .get_password()
            .map(|p| String::from_utf8_lossy(p).into_owned()),
    };
    Ok((Tls(Inner::new(config)), plan))
}

/// The trusted CAs and a description of where they came from; `None` if
/// none are configured and `mode` can do without.
fn load_roots(
    rootcert: &RootCert,
    mode: SslMode,
) -> Result<Option<(RootCertStore, String)>, TlsSetupError> {
    let needs = matches!(mode, SslMode::VerifyCa | SslMode::VerifyFull);
    match rootcert {
        RootCert::File(path) => Ok(Some((
            read_pem(path)?,
            format!("sslrootcert \"{}\"", path.display()),
        ))),
        RootCert::System => {
            let found = rustls_native_certs::load_native_certs();
            let mut store = RootCertStore::empty();
            store.add_parsable_certificates(found.certs);
            if store.is_empty() {
                let errors: Vec<String> = found.errors.iter().map(ToString::to_string).collect();
                return Err(TlsSetupError::NoSystemRoots(errors.join("; ")));
            }
            Ok(Some((store, "the system's trust store".to_owned())))
        }
        RootCert::Default => {
            let path = std::env::var_os("HOME").map_or_else(
                || PathBuf::from("~/.postgresql/root.crt"),
                |home| Path::new(&home).join(".postgresql").join("root.crt"),
            );
            if path.exists() {
                Ok(Some((
                    read_pem(&path)?,
                    format!("sslrootcert \"{}\"", path.display()),
                )))
            } else if needs {
                Err(TlsSetupError::NoRootCert { mode, path })
            } else {
                Ok(None)
            }
        }
    }
}

fn read_pem(path: &Path) -> Result<RootCertStore, TlsSetupError> {
    let bytes = std::fs::read(path).map_err(|source| TlsSetupError::Unreadable {
        path: path.to_owned(),
        source,
    })?;
    let mut store = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&bytes) {
        let cert = cert.map_err(|_| TlsSetupError::NoCertificate {
            path: path.to_owned(),
        })?;
        store
            .add(cert)
            .map_err(|source| TlsSetupError::BadCertificate {
                path: path.to_owned(),
                source,
            })?;
    }
    if store.is_empty() {
        return Err(TlsSetupError::NoCertificate {
            path: path.to_owned(),
        });
    }
    Ok(store)
}

/// tokio-postgres's text for its TLS error kind (it has no accessor for
/// the kind; `tests/pg_tls.rs` fails if this text changes).
const TLS_KIND: &str = "error performing TLS handshake";

impl Plan {
    /// `e`, from connecting with this plan, explained: the mode and host
    /// when TLS failed, what the server or socket said otherwise; never
    /// the password.
    pub(super) fn explain_text(&self, e: &tokio_postgres::Error) -> String {
        let text = if e.to_string() == TLS_KIND {
            self.explain_tls(e)
        } else {
            super::described::describe(e)
        };
        connstr::scrub(&text, self.password.as_deref())
    }

    fn explain_tls(&self, e: &tokio_postgres::Error) -> String {
        let mode = self.mode;
        let host = &self.hosts;
        let cause = std::error::Error::source(e);
        let rustls_error = cause
            .and_then(|c| c.downcast_ref::<std::io::Error>())
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>());
        let roots = self.roots.as_deref().unwrap_or("the trusted CAs");
        match rustls_error {
            Some(rustls::Error::InvalidCertificate(CertificateError::NotValidForNameContext {
                presented,
                ..
            })) if !presented.is_empty() => format!(
                "sslmode={mode}: the server certificate is not valid for host \"{host}\" (it names {})",
                presented.iter().map(|name| plain_name(name)).collect::<Vec<_>>().join(", ")
            ),
            Some(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => format!("sslmode={mode}: the server certificate is not valid for host \"{host}\""),
            Some(rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer)) => format!(
                "sslmode={mode}: the certificate of the server at host \"{host}\" is not signed by a CA in {roots}"
            ),
            Some(other) => format!(
                "sslmode={mode}: the TLS handshake with the server at host \"{host}\" failed: {other}"
            ),
            None => match cause {
                Some(c) if c.to_string() == "server does not support TLS" => format!(
                    "sslmode={mode}: the server at host \"{host}\" does not support TLS (it refused the SSLRequest)"
                ),
                Some(c) => format!(
                    "sslmode={mode}: the TLS handshake with the server at host \"{host}\" failed: {c}"
                ),
                None => format!(
                    "sslmode={mode}: the TLS handshake with the server at host \"{host}\" failed"
                ),
            },
        }
    }
}

/// `DnsName("db")` or `IpAddress(10.0.0.1)`, as rustls shows a name, as
/// `db` or `10.0.0.1`.
fn plain_name(name: &str) -> &str {
    name.strip_prefix("DnsName(\"")
        .and_then(|n| n.strip_suffix("\")"))
        .or_else(|| {
            name.strip_prefix("IpAddress(")
                .and_then(|n| n.strip_suffix(')'))
        })
        .unwrap_or(name)
}

/// Accepts any certificate (`prefer`, `require` without a root file) but
/// still checks that the server holds the certificate's key: encryption
/// against eavesdroppers, no defence against an active man in the middle.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain must lead to a trusted CA (and be in date); the
/// name in it is not compared with `host`. webpki checks the chain before
/// the name, so a name mismatch means the chain passed.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type R = Result<(), Box<dyn std::error::Error>>;

    #[test]
    fn root_files_that_cannot_serve_are_named() -> R {
        let dir = tempfile::tempdir()?;
        let missing = dir.path().join("missing.pem");
        let e = read_pem(&missing).err().ok_or("read a missing file")?;
        let text = e.to_string();
        assert!(text.contains(&missing.display().to_string()), "{text}");
        assert!(text.contains("os error"), "{text}");
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "not a certificate")?;
        let e = read_pem(&junk).err().ok_or("read a file without PEM")?;
        assert!(matches!(e, TlsSetupError::NoCertificate { .. }), "{e}");
        Ok(())
    }

    #[test]
    fn an_explicit_root_file_is_required_to_read_whatever_the_mode() -> R {
        for mode in ["require", "verify-ca", "verify-full"] {
            let parsed = connstr::parse(&format!(
                "host=h sslmode={mode} sslrootcert=/nonexistent.pem"
            ))?;
            let e = connector(&parsed)
                .err()
                .ok_or("accepted a missing sslrootcert")?;
            assert!(matches!(e, TlsSetupError::Unreadable { .. }), "{mode}: {e}");
        }
        // Modes that check nothing do not read it (libpq neither).
        let parsed = connstr::parse("host=h sslmode=prefer sslrootcert=/nonexistent.pem")?;
        assert!(connector(&parsed).is_ok());
        Ok(())
    }

    #[test]
    fn rustls_names_are_shown_plainly() {
        assert_eq!(plain_name("DnsName(\"db.example.com\")"), "db.example.com");
        assert_eq!(plain_name("IpAddress(10.0.0.1)"), "10.0.0.1");
        assert_eq!(plain_name("other"), "other");
    }
}
