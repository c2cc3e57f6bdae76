//! Throwaway certificates for the TLS tests, made with the `openssl`
//! command in a directory: a self-signed CA, a certificate request for a
//! key, a request signed by a CA under given extensions.
//!
//! Include it with `#[path = "common/openssl.rs"] mod openssl;`.

#![allow(dead_code)] // each test file uses some of these

use std::error::Error;
use std::path::{Path, PathBuf};
use std::process::Command;

type BoxError = Box<dyn Error + Send + Sync>;

/// Extensions of an end-entity certificate (append `extendedKeyUsage` and
/// `subjectAltName` lines).
pub const LEAF: &str =
    "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n";

/// A temp dir of keys and certificates, named `<name>.key`, `<name>.pem`.
pub struct Pki {
    pub dir: tempfile::TempDir,
}

impl Pki {
    pub fn new() -> Result<Pki, BoxError> {
        Ok(Pki {
            dir: tempfile::tempdir()?,
        })
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn read(&self, name: &str) -> Result<String, BoxError> {
        Ok(std::fs::read_to_string(self.path(name))?)
    }

    /// A file `name` holding the files `parts`, one after the other.
    pub fn write(&self, name: &str, parts: &[&str]) -> Result<PathBuf, BoxError> {
        let mut text = String::new();
        for part in parts {
            text.push_str(&self.read(part)?);
        }
        let path = self.path(name);
        std::fs::write(&path, text)?;
        Ok(path)
    }
}

/// Whether the `openssl` command runs: `Ok(false)` (after saying so) when
/// it does not; under `CI=true` that is an error, not a skip.
pub fn available() -> Result<bool, BoxError> {
    if Command::new("openssl").arg("version").output().is_ok() {
        return Ok(true);
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        return Err("openssl is not installed and CI=true".into());
    }
    eprintln!("skipped: openssl is not installed");
    Ok(false)
}

/// Runs `openssl args…` in `dir`; its stderr is the error when it fails.
pub fn openssl(dir: &Path, args: &[&str]) -> Result<(), BoxError> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()?;
    if !out.status.success() {
        return Err(format!("openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr)).into());
    }
    Ok(())
}

/// A self-signed CA valid for 2 days: `name.key` and `name.pem` in `dir`,
/// common name `cn`.
pub fn ca(dir: &Path, name: &str, cn: &str) -> Result<(), BoxError> {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={cn}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.pem"),
        ],
    )
}

/// `name.csr` for the existing key `name.key`, common name `name`.
pub fn csr(dir: &Path, name: &str) -> Result<(), BoxError> {
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-key",
            &format!("{name}.key"),
            "-subj",
            &format!("/CN={name}"),
            "-out",
            &format!("{name}.csr"),
        ],
    )
}

/// A new 2048-bit RSA key `name.key` (PKCS#8) and its `name.csr`.
pub fn key_and_csr(dir: &Path, name: &str) -> Result<(), BoxError> {
    openssl(
        dir,
        &[
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
            &format!("{name}.key"),
        ],
    )?;
    csr(dir, name)
}

/// `name.pem`: `name.csr` signed by the CA `ca` (its `.pem` and `.key`)
/// for 2 days under the extensions `ext` (written to `name.ext`).
pub fn sign(dir: &Path, name: &str, ca: &str, ext: &str) -> Result<(), BoxError> {
    std::fs::write(dir.join(format!("{name}.ext")), ext)?;
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &format!("{name}.ext"),
            "-out",
            &format!("{name}.pem"),
        ],
    )
}
