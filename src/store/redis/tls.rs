//! TLS for `rediss://` URLs: the crypto provider and the CA file.
//!
//! The redis crate speaks TLS through rustls (its `tls-rustls` feature)
//! and builds its client configuration with rustls's process-wide default
//! provider. That call panics when the build holds more than one provider
//! and none was chosen, so the `ring` provider (the one the PostgreSQL
//! backend uses) is installed as the default first, unless the app chose
//! one already.

use std::path::Path;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

use crate::error::OpenError;

const CONTEXT: &str = "reading the Redis TLS CA file";

/// Makes `ring` rustls's process-wide default provider if none is set.
pub(super) fn install_provider() {
    // An error means a default is already set (by the app, or by an
    // earlier open): that one is used.
    let _ = rustls::crypto::ring::default_provider().install_default();
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
    let pem = std::fs::read(path).map_err(|e| fail(format!("cannot read it: {e}")))?;
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
/// layer is the cause (or the likely one); `None` otherwise. `own_ca`:
/// whether [`read_ca`]'s file named the trusted CAs.
pub(super) fn describe_failure(e: &redis::RedisError, own_ca: bool) -> Option<String> {
    use rustls::CertificateError as C;
    let trusted = if own_ca {
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
