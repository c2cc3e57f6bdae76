//! TLS for `rediss://` URLs: the crypto provider, the CA file and the
//! client certificate (mutual TLS).
//!
//! The redis crate speaks TLS through rustls (its `tls-rustls` feature)
//! and builds its client configuration with rustls's process-wide default
//! provider. That call panics when the build holds more than one provider
//! and none was chosen, so the `ring` provider (the one the PostgreSQL
//! backend uses) is installed as the default first, unless the app chose
//! one already.

use std::path::{Path, PathBuf};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::error::OpenError;

const CONTEXT: &str = "reading the Redis TLS CA file";
const CLIENT_CONTEXT: &str = "reading the Redis TLS client certificate";

/// The files a `rediss://` connection uses, as the builder named them.
#[derive(Debug, Clone, Default)]
pub(crate) struct TlsFiles {
    /// The PEM file of the CAs trusted for the server's certificate;
    /// `None`: the system's trust store.
    pub(crate) ca: Option<PathBuf>,
    /// The client's certificate chain and private key (PEM files), for a
    /// server that asks for one (`tls-auth-clients yes`); `None`: none.
    pub(crate) client: Option<(PathBuf, PathBuf)>,
}

impl TlsFiles {
    pub(super) fn is_empty(&self) -> bool {
        self.ca.is_none() && self.client.is_none()
    }

    /// The refusal of TLS files given with a URL that does not use TLS.
    pub(super) fn without_tls(&self, scheme: &str) -> OpenError {
        let mut given = Vec::new();
        if let Some(ca) = &self.ca {
            given.push(format!("a TLS CA file ({})", ca.display()));
        }
        if let Some((cert, _)) = &self.client {
            given.push(format!("a TLS client certificate ({})", cert.display()));
        }
        let what = given.join(" and ");
        // Nothing was read yet: the mistake is the pairing, not a file.
        OpenError::Storage {
            context: "checking the URL against the TLS files given",
            source: format!(
                "{what} given, but the URL's scheme is {scheme}://, not rediss://: the \
                 connection would not use TLS (use a rediss:// URL for a TLS port, or \
                 leave the TLS files out)"
            )
            .into(),
        }
    }

    /// The client certificate and key, read and checked (see
    /// [`read_client`]); `None` without one.
    pub(super) fn read_client(&self) -> Result<Option<redis::ClientTlsConfig>, OpenError> {
        self.client
            .as_ref()
            .map(|(cert, key)| read_client(cert, key))
            .transpose()
    }
}

/// Makes `ring` rustls's process-wide default provider if none is set.
pub(super) fn install_provider() {
    // An error means a default is already set (by the app, or by an
    // earlier open): that one is used.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Most bytes a PEM file of certificates or a key may hold: a CA bundle
/// is a few hundred KiB; more is not such a file (`/dev/zero`, a disk
/// image), and reading it whole would exhaust memory.
const MAX_PEM_BYTES: u64 = 8 << 20;

/// The bytes of the file at `path`, at most [`MAX_PEM_BYTES`]; the
/// failure in words (without the file's contents).
fn read_pem(path: &Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read it: {e}"))?;
    let mut bytes = Vec::new();
    file.take(MAX_PEM_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read it: {e}"))?;
    if u64::try_from(bytes.len()).unwrap_or(u64::MAX) > MAX_PEM_BYTES {
        return Err(format!(
            "it is larger than {} MiB, so not a PEM file of certificates or a key",
            MAX_PEM_BYTES >> 20
        ));
    }
    Ok(bytes)
}

/// The bytes of the PEM file at `path`, checked to hold at least one
/// certificate and nothing that fails to parse as one.
///
/// # Errors
///
/// [`OpenError::Storage`] naming the file: unreadable, no `-----BEGIN
/// CERTIFICATE-----` block, or a block that does not parse.
pub(super) fn read_ca(path: &Path) -> Result<Vec<u8>, OpenError> {
    let fail = |what: String| OpenError::Storage {
        context: CONTEXT,
        source: format!("{}: {what}", path.display()).into(),
    };
    let pem = read_pem(path).map_err(fail)?;
    let mut count = 0_usize;
    for cert in CertificateDer::pem_slice_iter(&pem) {
        cert.map_err(|e| fail(format!("a certificate in it does not parse: {e}")))?;
        count += 1;
    }
    if count == 0 {
        return Err(fail(
            "it holds no PEM certificate (expected -----BEGIN CERTIFICATE-----)".to_owned(),
        ));
    }
    Ok(pem)
}

/// The client certificate chain at `cert` and private key at `key` (PEM
/// files), checked before any connection: the chain holds at least one
/// certificate and nothing that fails to parse, the key file holds one
/// private key (PKCS#8, PKCS#1 or SEC1) that rustls can sign with, and
/// the key belongs to the chain's first certificate.
///
/// # Errors
///
/// [`OpenError::Storage`] naming the file at fault (never its contents):
/// unreadable, no certificate or no private key in it, an encrypted key,
/// one that does not parse or that rustls cannot use, or a key that is
/// not the certificate's.
fn read_client(cert: &Path, key: &Path) -> Result<redis::ClientTlsConfig, OpenError> {
    let fail = |path: &Path, what: String| OpenError::Storage {
        context: CLIENT_CONTEXT,
        source: format!("{}: {what}", path.display()).into(),
    };
    let cert_pem = read_pem(cert).map_err(|what| fail(cert, what))?;
    let mut chain = Vec::new();
    for c in CertificateDer::pem_slice_iter(&cert_pem) {
        chain.push(c.map_err(|e| fail(cert, format!("a certificate in it does not parse: {e}")))?);
    }
    if chain.is_empty() {
        return Err(fail(
            cert,
            "it holds no PEM certificate (expected -----BEGIN CERTIFICATE-----)".to_owned(),
        ));
    }
    let key_pem = read_pem(key).map_err(|what| fail(key, what))?;
    let private = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
        if encrypted(&key_pem) {
            return fail(
                key,
                "its private key is encrypted (passphrase-protected), which the client \
                 cannot use: give an unencrypted copy (openssl pkey -in KEY -out NEW), \
                 readable only by the app's user"
                    .to_owned(),
            );
        }
        fail(
            key,
            format!("it holds no usable PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"),
        )
    })?;
    let keys_in_file = PrivateKeyDer::pem_slice_iter(&key_pem).count();
    let provider = rustls::crypto::ring::default_provider();
    rustls::sign::CertifiedKey::from_der(chain, private, &provider).map_err(|e| match e {
        rustls::Error::InconsistentKeys(_) => fail(
            key,
            format!(
                "this key does not belong to the certificate in {} (the first one in it: the \
                 client's own certificate comes first, then its intermediates){}",
                cert.display(),
                if keys_in_file > 1 {
                    format!("; the file holds {keys_in_file} private keys, the first is used")
                } else {
                    String::new()
                }
            ),
        ),
        other => fail(key, format!("rustls cannot sign with this key ({other})")),
    })?;
    Ok(redis::ClientTlsConfig {
        client_cert: cert_pem,
        client_key: key_pem,
    })
}

/// Whether the PEM bytes hold an encrypted private key: PKCS#8's
/// `ENCRYPTED PRIVATE KEY` block, or OpenSSL's traditional form (a
/// `Proc-Type: 4,ENCRYPTED` header in the key block), neither of which
/// rustls reads.
fn encrypted(pem: &[u8]) -> bool {
    let has = |needle: &[u8]| pem.windows(needle.len()).any(|w| w == needle);
    has(b"-----BEGIN ENCRYPTED PRIVATE KEY-----") || has(b"Proc-Type: 4,ENCRYPTED")
}

/// The rustls error inside a failed connection, if the TLS layer failed.
fn rustls_error(e: &redis::RedisError) -> Option<&rustls::Error> {
    // The redis crate keeps an I/O error as an `Arc` of it, and rustls's
    // error is the I/O error's inner error.
    let inner = std::error::Error::source(e)?;
    let io = inner
        .downcast_ref::<std::sync::Arc<dyn std::error::Error + Send + Sync>>()
        .and_then(|arc| arc.downcast_ref::<std::io::Error>())
        .or_else(|| inner.downcast_ref::<std::io::Error>())?;
    io.get_ref()?.downcast_ref::<rustls::Error>()
}

/// Why a connection to a `rediss://` URL failed, in words, when the TLS
/// layer is the cause (or the likely one); `None` otherwise. `files`:
/// whether a CA file named the trusted CAs, and whether a client
/// certificate was presented.
pub(super) fn describe_failure(e: &redis::RedisError, files: &TlsFiles) -> Option<String> {
    use rustls::AlertDescription as A;
    use rustls::CertificateError as C;
    let trusted = if files.ca.is_some() {
        "the CA file given (EngineBuilder::redis_tls_ca)"
    } else {
        "the system's trust store (name a CA file with EngineBuilder::redis_tls_ca)"
    };
    let Some(tls) = rustls_error(e) else {
        // A plaintext server reads the TLS handshake as the start of a
        // command and waits for the rest: the handshake times out.
        return e.is_timeout().then(|| {
            "TLS handshake: the server did not answer in time; a plaintext Redis port \
             never answers one (use redis:// for it), else the server is slow or gone"
                .to_owned()
        });
    };
    Some(match tls {
        rustls::Error::InvalidCertificate(
            C::NotValidForName | C::NotValidForNameContext { .. },
        ) => format!("TLS: the server's certificate does not name the host of the URL ({tls})"),
        rustls::Error::InvalidCertificate(C::UnknownIssuer | C::BadSignature) => format!(
            "TLS: the server's certificate is not trusted: no CA in {trusted} signed it ({tls})"
        ),
        rustls::Error::InvalidCertificate(_) => {
            format!("TLS: the server's certificate is refused ({tls})")
        }
        rustls::Error::AlertReceived(A::CertificateRequired) => format!(
            "TLS: the server requires a client certificate (tls-auth-clients); give one with \
             EngineBuilder::redis_tls_client_cert ({tls})"
        ),
        // The server says why it refused the client's certificate: only
        // an unknown CA is a matter of its tls-ca-cert-file.
        rustls::Error::AlertReceived(A::CertificateExpired) if files.client.is_some() => format!(
            "TLS: the server refused this client's certificate as expired or not yet valid: \
             renew it ({tls})"
        ),
        rustls::Error::AlertReceived(A::CertificateRevoked) if files.client.is_some() => {
            format!("TLS: the server refused this client's certificate as revoked ({tls})")
        }
        rustls::Error::AlertReceived(A::UnsupportedCertificate) if files.client.is_some() => {
            format!(
                "TLS: the server refused this client's certificate as not made for client \
                 authentication: its extendedKeyUsage must allow clientAuth ({tls})"
            )
        }
        rustls::Error::AlertReceived(
            A::BadCertificate
            | A::UnknownCA
            | A::CertificateUnknown
            | A::DecryptError
            | A::AccessDenied,
        ) if files.client.is_some() => format!(
            "TLS: the server refused this client's certificate: its tls-ca-cert-file must hold \
             the CA that signed it ({tls})"
        ),
        rustls::Error::InvalidMessage(_) => format!(
            "TLS: the server's answer is not TLS, a plaintext port? (use redis:// for it) ({tls})"
        ),
        other => format!("TLS handshake failed ({other})"),
    })
}

#[cfg(test)]
mod tests {
    use super::read_ca;

    fn error_of(path: &std::path::Path) -> String {
        match read_ca(path) {
            Ok(_) => format!("{} was accepted", path.display()),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn an_unusable_ca_file_is_named() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let missing = dir.path().join("missing.pem");
        let err = error_of(&missing);
        assert!(
            err.contains("missing.pem") && err.contains("cannot read"),
            "{err}"
        );

        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n")?;
        let err = error_of(&empty);
        assert!(
            err.contains("empty.pem") && err.contains("no PEM certificate"),
            "{err}"
        );

        let broken = dir.path().join("broken.pem");
        std::fs::write(
            &broken,
            "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n",
        )?;
        let err = error_of(&broken);
        assert!(
            err.contains("broken.pem") && err.contains("does not parse"),
            "{err}"
        );
        Ok(())
    }
}
