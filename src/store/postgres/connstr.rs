//! The connection string, in libpq's `key=value` form or as a
//! `postgres://` URL. We take out the TLS keys, `sslmode` and
//! `sslrootcert` (tokio-postgres knows only three modes and no root
//! certificate), and hand the rest to `tokio_postgres::Config` unchanged.
//!
//! Errors never carry the password: our own syntax errors give a byte
//! offset, never a value, and any text from tokio-postgres has the
//! password removed before it is shown.

use std::fmt;
use std::path::PathBuf;

/// libpq's `sslmode` values (PostgreSQL docs, "SSL Support", table 34.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SslMode {
    Disable,
    /// libpq tries plaintext first, then TLS; tokio-postgres cannot, so
    /// this encrypts when the server offers TLS, like `prefer`.
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

const MODES: &str = "disable, allow, prefer, require, verify-ca, verify-full";

impl SslMode {
    fn parse(value: &str) -> Option<SslMode> {
        Some(match value {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where the trusted CA certificates come from (`sslrootcert`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RootCert {
    /// Not given: libpq's default, `~/.postgresql/root.crt`, if it exists.
    Default,
    /// A PEM file of one or more CA certificates.
    File(PathBuf),
    /// `sslrootcert=system` (libpq 16): the operating system's trust store.
    System,
}

/// A parsed connection string: the client's configuration and the TLS
/// choice taken out of it.
pub(crate) struct ConnStr {
    pub(crate) config: tokio_postgres::Config,
    pub(crate) sslmode: SslMode,
    pub(crate) rootcert: RootCert,
}

/// Why a connection string was refused. No variant holds the password.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum ConnStrError {
    /// The text does not follow libpq's syntax.
    #[error("malformed connection string: {what} at byte {at}")]
    Malformed { what: &'static str, at: usize },
    /// `sslmode` has a value libpq does not know.
    #[error("unknown sslmode \"{value}\" in the connection string: expected one of {MODES}")]
    UnknownSslMode { value: String },
    /// `sslrootcert=system` with a mode that does not check host names
    /// (libpq refuses it too: the system's CAs sign certificates for anyone).
    #[error("sslmode={mode} may not be used with sslrootcert=system: use sslmode=verify-full")]
    WeakSystemRoots { mode: SslMode },
    /// `verify-full` with `hostaddr` and no `host`: no name to check.
    #[error("sslmode=verify-full needs `host`, the name the server certificate is checked against (`hostaddr` alone is only an address)")]
    NoHostToVerify,
    /// tokio-postgres refused the rest (an unknown key, a bad port, ...);
    /// its message, with the password taken out.
    #[error("{0}")]
    Rejected(String),
}

/// Parses `text`, libpq's `key=value` form or a `postgres://` /
/// `postgresql://` URL.
///
/// Defaults follow libpq: `sslmode=prefer`; with `sslrootcert=system` and
/// no `sslmode`, `verify-full`; without a password, the environment's
/// `PGPASSWORD` if set.
pub(crate) fn parse(text: &str) -> Result<ConnStr, ConnStrError> {
    let split = if let Some(body) = strip_scheme(text) {
        split_url(text, body)?
    } else {
        split_key_values(text)?
    };
    let Split {
        rest,
        sslmode,
        rootcert,
        password,
    } = split;
    let sslmode = match sslmode {
        Some(value) => SslMode::parse(&value).ok_or(ConnStrError::UnknownSslMode { value })?,
        None if rootcert.as_deref() == Some("system") => SslMode::VerifyFull,
        None => SslMode::Prefer,
    };
    let rootcert = match rootcert.as_deref() {
        None | Some("") => RootCert::Default,
        Some("system") => RootCert::System,
        Some(path) => RootCert::File(PathBuf::from(path)),
    };
    if rootcert == RootCert::System && sslmode != SslMode::VerifyFull {
        return Err(ConnStrError::WeakSystemRoots { mode: sslmode });
    }
    let mut config: tokio_postgres::Config = rest.parse().map_err(|e: tokio_postgres::Error| {
        let text = match std::error::Error::source(&e) {
            Some(cause) => format!("{e}: {cause}"),
            None => e.to_string(),
        };
        ConnStrError::Rejected(scrub(&text, password.as_deref()))
    })?;
    config.ssl_mode(match sslmode {
        SslMode::Disable => tokio_postgres::config::SslMode::Disable,
        SslMode::Allow | SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
            tokio_postgres::config::SslMode::Require
        }
    });
    // libpq checks the certificate against `host` and connects to
    // `hostaddr` (tokio-postgres does the same). With `hostaddr` alone
    // tokio-postgres has no name for the TLS handshake at all; the
    // address serves when no name is checked.
    if sslmode != SslMode::Disable && config.get_hosts().is_empty() {
        if sslmode == SslMode::VerifyFull && !config.get_hostaddrs().is_empty() {
            return Err(ConnStrError::NoHostToVerify);
        }
        let addrs: Vec<String> = config
            .get_hostaddrs()
            .iter()
            .map(ToString::to_string)
            .collect();
        for addr in addrs {
            config.host(addr);
        }
    }
    // libpq's PGPASSWORD: the password when the string gives none, so an
    // operator need not put it on a command line, where `ps` shows it.
    if config.get_password().is_none() {
        if let Some(password) = std::env::var_os("PGPASSWORD").filter(|p| !p.is_empty()) {
            config.password(password.into_encoded_bytes());
        }
    }
    Ok(ConnStr {
        config,
        sslmode,
        rootcert,
    })
}

/// `text` with every occurrence of `password` replaced.
pub(crate) fn scrub(text: &str, password: Option<&str>) -> String {
    match password {
        Some(p) if !p.is_empty() => text.replace(p, "********"),
        _ => text.to_owned(),
    }
}

struct Split {
    /// The connection string without the TLS keys.
    rest: String,
    sslmode: Option<String>,
    rootcert: Option<String>,
    password: Option<String>,
}

fn strip_scheme(text: &str) -> Option<&str> {
    text.strip_prefix("postgresql://")
        .or_else(|| text.strip_prefix("postgres://"))
}

fn malformed(what: &'static str, at: usize) -> ConnStrError {
    ConnStrError::Malformed { what, at }
}

/// `postgres://user:password@host:port/db?key=value&...`: the TLS keys
/// are taken out of the query; the rest is kept byte for byte.
fn split_url(text: &str, body: &str) -> Result<Split, ConnStrError> {
    let offset = text.len() - body.len();
    // The credentials end at the last `@` before the path (a password may
    // hold `?` or `/` unencoded, as libpq allows for `?`).
    let authority_end = body.find('/').unwrap_or(body.len());
    let at = body[..authority_end].rfind('@');
    let mut password = at.and_then(|at| {
        body[..at]
            .split_once(':')
            .map(|(_, p)| percent_decode(p).unwrap_or_else(|| p.to_owned()))
    });
    let query_from = at.map_or(0, |at| at + 1);
    let Some(q) = body[query_from..].find('?').map(|q| q + query_from) else {
        return Ok(Split {
            rest: text.to_owned(),
            sslmode: None,
            rootcert: None,
            password,
        });
    };
    // tokio-postgres takes everything up to the first `@` of the whole
    // string as the credentials, so an `@` in a parameter of a URL without
    // credentials (`?user=admin@server`) would become user, host and port.
    // libpq reads the credentials only before the path; the kept pairs
    // carry their `@` percent-encoded, which both decode alike.
    let mut kept: Vec<String> = Vec::new();
    let (mut sslmode, mut rootcert) = (None, None);
    let mut pos = offset + q + 1;
    for pair in body[q + 1..].split('&') {
        let here = pos;
        pos += pair.len() + 1;
        if pair.is_empty() {
            continue;
        }
        let (key, value) = pair
            .split_once('=')
            .ok_or(malformed("a URL parameter without `=`", here))?;
        let key_decoded = percent_decode(key).ok_or(malformed("bad percent-encoding", here))?;
        let decoded = || percent_decode(value).ok_or(malformed("bad percent-encoding", here));
        match key_decoded.as_str() {
            "sslmode" => sslmode = Some(decoded()?),
            "sslrootcert" => rootcert = Some(decoded()?),
            "password" => {
                password = Some(decoded()?);
                kept.push(pair.replace('@', "%40"));
            }
            _ => kept.push(pair.replace('@', "%40")),
        }
    }
    let mut rest = text[..offset + q].to_owned();
    if !kept.is_empty() {
        rest.push('?');
        rest.push_str(&kept.join("&"));
    }
    Ok(Split {
        rest,
        sslmode,
        rootcert,
        password,
    })
}

/// `%XX` sequences decoded; `None` if one is cut short or not hex, or the
/// result is not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// libpq's `key = value ...` form (values bare, or single-quoted with
/// backslash escapes): the TLS keys are taken out, the other pairs are
/// written back quoted.
fn split_key_values(text: &str) -> Result<Split, ConnStrError> {
    let mut it = text.char_indices().peekable();
    // A key given twice takes its last value, as in libpq (tokio-postgres
    // would add a second `host` instead of replacing the first).
    let mut pairs: Vec<(String, String)> = Vec::new();
    let (mut sslmode, mut rootcert, mut password) = (None, None, None);
    loop {
        while it.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let Some(&(start, _)) = it.peek() else { break };
        let mut key = String::new();
        while let Some((_, c)) = it.next_if(|(_, c)| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while it.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        if it.next_if(|(_, c)| *c == '=').is_none() {
            return Err(malformed("a key without `=` (expected key=value)", start));
        }
        if key.is_empty() {
            return Err(malformed("`=` without a key", start));
        }
        while it.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if let Some((quote_at, _)) = it.next_if(|(_, c)| *c == '\'') {
            loop {
                match it.next() {
                    None => return Err(malformed("an unterminated quoted value", quote_at)),
                    Some((_, '\'')) => break,
                    Some((at, '\\')) => match it.next() {
                        Some((_, c)) => value.push(c),
                        None => return Err(malformed("a backslash at the end", at)),
                    },
                    Some((_, c)) => value.push(c),
                }
            }
        } else {
            while let Some((at, c)) = it.next_if(|(_, c)| !c.is_whitespace()) {
                if c == '\\' {
                    match it.next() {
                        Some((_, c)) => value.push(c),
                        None => return Err(malformed("a backslash at the end", at)),
                    }
                } else {
                    value.push(c);
                }
            }
        }
        match key.as_str() {
            "sslmode" => sslmode = Some(value),
            "sslrootcert" => rootcert = Some(value),
            _ => {
                if key == "password" {
                    password = Some(value.clone());
                }
                pairs.retain(|(k, _)| *k != key);
                pairs.push((key, value));
            }
        }
    }
    let mut kept = String::new();
    for (key, value) in pairs {
        kept.push_str(&key);
        kept.push_str("='");
        for c in value.chars() {
            if c == '\'' || c == '\\' {
                kept.push('\\');
            }
            kept.push(c);
        }
        kept.push_str("' ");
    }
    Ok(Split {
        rest: kept,
        sslmode,
        rootcert,
        password,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    type R = Result<(), Box<dyn std::error::Error>>;

    /// A key given twice takes its last value, as in libpq: appending
    /// `host=other` to a string replaces its host instead of adding one.
    #[test]
    fn a_repeated_key_takes_its_last_value() -> R {
        let parsed = parse("host=127.0.0.1 port=5432 user=a host=db.example.org user=b")?;
        let hosts: Vec<String> = parsed
            .config
            .get_hosts()
            .iter()
            .map(|h| format!("{h:?}"))
            .collect();
        assert_eq!(hosts.len(), 1, "{hosts:?}");
        assert!(hosts[0].contains("db.example.org"), "{hosts:?}");
        assert_eq!(parsed.config.get_user(), Some("b"));
        Ok(())
    }

    #[test]
    fn key_value_form_takes_out_the_tls_keys() -> R {
        let c = parse(
            r"host=db.example.com user=app password='it\'s' sslmode=verify-full sslrootcert=/ca.pem dbname=x",
        )?;
        assert_eq!(c.sslmode, SslMode::VerifyFull);
        assert_eq!(c.rootcert, RootCert::File("/ca.pem".into()));
        assert_eq!(c.config.get_password(), Some(&b"it's"[..]));
        assert_eq!(c.config.get_dbname(), Some("x"));
        assert_eq!(
            c.config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Require
        );
        Ok(())
    }

    #[test]
    fn url_form_takes_out_the_tls_keys() -> R {
        let c = parse("postgres://app:p%40ss@db.example.com:5432/app?sslmode=verify-ca&application_name=a&sslrootcert=%2Fetc%2Fca.pem")?;
        assert_eq!(c.sslmode, SslMode::VerifyCa);
        assert_eq!(c.rootcert, RootCert::File("/etc/ca.pem".into()));
        assert_eq!(c.config.get_password(), Some(&b"p@ss"[..]));
        assert_eq!(c.config.get_application_name(), Some("a"));
        let c = parse("postgresql://app@localhost/app")?;
        assert_eq!(c.sslmode, SslMode::Prefer);
        assert_eq!(c.rootcert, RootCert::Default);
        Ok(())
    }

    #[test]
    fn an_at_sign_in_a_url_parameter_is_not_taken_for_credentials() -> R {
        // Azure-style user names hold an `@`; libpq reads credentials only
        // before the path, so these name the host db.example.com.
        let c = parse("postgres://db.example.com:5433/app?user=admin@srv&password=p@ss&application_name=a@b&sslmode=disable")?;
        assert!(
            matches!(
                c.config.get_hosts(),
                [tokio_postgres::config::Host::Tcp(h)] if h == "db.example.com"
            ),
            "{:?}",
            c.config.get_hosts()
        );
        assert_eq!(c.config.get_ports(), [5433]);
        assert_eq!(c.config.get_user(), Some("admin@srv"));
        assert_eq!(c.config.get_password(), Some(&b"p@ss"[..]));
        assert_eq!(c.config.get_application_name(), Some("a@b"));
        assert_eq!(c.config.get_dbname(), Some("app"));
        // With credentials before the host, as before.
        let c = parse("postgres://u:pw@db.example.com/app?application_name=a@b")?;
        assert_eq!(c.config.get_user(), Some("u"));
        assert_eq!(c.config.get_application_name(), Some("a@b"));
        Ok(())
    }

    #[test]
    fn default_is_prefer_and_system_roots_mean_verify_full() -> R {
        assert_eq!(parse("host=h")?.sslmode, SslMode::Prefer);
        assert_eq!(
            parse("host=h sslrootcert=system")?.sslmode,
            SslMode::VerifyFull
        );
        let e = parse("host=h sslmode=require sslrootcert=system").err();
        assert!(
            matches!(
                e,
                Some(ConnStrError::WeakSystemRoots {
                    mode: SslMode::Require
                })
            ),
            "{e:?}"
        );
        Ok(())
    }

    #[test]
    fn unknown_sslmode_names_the_value_and_the_choices() {
        let e = parse("host=h sslmode=verify_full password=hunter2").err();
        let text = e.map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("\"verify_full\""), "{text}");
        assert!(text.contains("verify-ca, verify-full"), "{text}");
        assert!(!text.contains("hunter2"), "{text}");
    }

    #[test]
    fn errors_never_show_the_password() {
        for bad in [
            "host=h password=hunter2 port=notaport",
            "host=h password='hunter2",
            "host=h password=hunter2 bogus",
            "postgres://app:hunter2@h:notaport/db",
            "postgres://app:hunter2@h/db?sslmode=%zz",
            "postgres://app@h/db?password=hunter2&port=x",
        ] {
            let text = parse(bad).err().map(|e| e.to_string());
            let text = text.unwrap_or_else(|| panic!("accepted {bad}"));
            assert!(!text.contains("hunter2"), "{bad}: {text}");
        }
    }

    #[test]
    fn hostaddr_alone_serves_as_the_tls_name_except_for_verify_full() -> R {
        let c = parse("hostaddr=127.0.0.1 sslmode=require")?;
        assert_eq!(c.config.get_hosts().len(), 1);
        let e = parse("hostaddr=127.0.0.1 sslmode=verify-full").err();
        assert!(matches!(e, Some(ConnStrError::NoHostToVerify)), "{e:?}");
        let c = parse("host=wrong.example hostaddr=127.0.0.1 sslmode=verify-full")?;
        assert!(matches!(
            c.config.get_hosts(),
            [tokio_postgres::config::Host::Tcp(h)] if h == "wrong.example"
        ));
        Ok(())
    }
}
