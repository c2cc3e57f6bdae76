//! What a DB argument names: a redb file, a PostgreSQL database, or a
//! Redis server (a `redis://` or `rediss://` URL).
//!
//! A PostgreSQL connection string is a URL (`postgres://...`,
//! `postgresql://...`) or libpq's `keyword=value` form, recognised by a
//! libpq connection keyword directly before an `=` (`host=db1 dbname=app`,
//! `dbname = app`). Anything else is a file path, as before, so a file whose
//! name holds `host=` is reached as `./host=...` (the keyword must start
//! the argument or follow a space).

use std::path::Path;

/// Where the records are.
#[derive(Debug, PartialEq, Eq)]
pub enum Target<'a> {
    /// A redb database file.
    File(&'a Path),
    /// A PostgreSQL connection string, as given.
    Postgres(&'a str),
    /// A Redis URL, as given.
    Redis(&'a str),
}

/// libpq's connection keywords (PostgreSQL 17, "Parameter Key Words").
const LIBPQ_KEYWORDS: &[&str] = &[
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "passfile",
    "require_auth",
    "channel_binding",
    "connect_timeout",
    "client_encoding",
    "options",
    "application_name",
    "fallback_application_name",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
    "replication",
    "gssencmode",
    "sslmode",
    "sslnegotiation",
    "sslcompression",
    "sslcert",
    "sslkey",
    "sslpassword",
    "sslcertmode",
    "sslrootcert",
    "sslcrl",
    "sslcrldir",
    "sslsni",
    "requirepeer",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "krbsrvname",
    "gsslib",
    "gssdelegation",
    "service",
    "target_session_attrs",
    "load_balance_hosts",
];

/// Classifies a DB argument (see the module doc).
pub fn classify(db: &Path) -> Target<'_> {
    match db.to_str() {
        Some(s) if has_scheme(s, "redis") || has_scheme(s, "rediss") => Target::Redis(s),
        Some(s) if is_postgres(s) => Target::Postgres(s),
        _ => Target::File(db),
    }
}

/// Whether `s` starts with `scheme://`, the scheme in any case (RFC 3986,
/// section 3.1: schemes are case-insensitive, so `REDIS://` is a URL, not
/// a file name).
pub fn has_scheme(s: &str, scheme: &str) -> bool {
    s.get(..scheme.len())
        .is_some_and(|head| head.eq_ignore_ascii_case(scheme))
        && s[scheme.len()..].starts_with("://")
}

fn is_postgres(s: &str) -> bool {
    if s.starts_with("postgres://") || s.starts_with("postgresql://") {
        return true;
    }
    // Each `=`: the word before it (spaces allowed in between) must be a
    // keyword that starts the string or follows whitespace.
    s.match_indices('=').any(|(at, _)| {
        let before = s[..at].trim_end();
        let start = before
            .rfind(|c: char| !(c.is_ascii_lowercase() || c == '_'))
            .map_or(0, |i| i + 1);
        let word = &before[start..];
        let at_boundary = before[..start]
            .chars()
            .next_back()
            .is_none_or(char::is_whitespace);
        at_boundary && LIBPQ_KEYWORDS.contains(&word)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_strings_and_paths() {
        for pg in [
            "postgres://app@db1/app",
            "postgresql://db1:5433/app?sslmode=require",
            "host=127.0.0.1 port=5432 user=postgres dbname=postgres",
            "dbname=app",
            "  dbname = app",
            "sslmode=verify-full host=db1",
        ] {
            assert_eq!(classify(Path::new(pg)), Target::Postgres(pg), "{pg}");
        }
        for redis in [
            "redis://127.0.0.1:6379/",
            "rediss://:pw@cache:6380/2",
            "REDIS://127.0.0.1:6379/",
            "Rediss://cache:6380/",
        ] {
            assert_eq!(classify(Path::new(redis)), Target::Redis(redis), "{redis}");
        }
        for file in [
            "redis.redb",
            "redis:/not-a-url",
            "redis",
            "rediss:",
            "réd://x",
            "app.redb",
            "/var/lib/app/idem.redb",
            "./host=x.redb",
            "dir/dbname=app",
            "weird=name.redb",
            "postgres:/not-a-url",
        ] {
            assert_eq!(classify(Path::new(file)), Target::File(Path::new(file)));
        }
    }
}
