//! Where the engine keeps its records: a redb file, or a PostgreSQL
//! database (cargo feature `postgres`) or a Redis / Valkey server (cargo
//! feature `redis`) that several servers can share.

use std::error::Error;
use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};

use idempotency::{Engine, EngineBuilder};

/// The table prefix of the demo's engine on PostgreSQL: its tables are
/// `payments_demo_records`, `payments_demo_outbox`, `payments_demo_entities`
/// and `payments_demo_meta`, created on first use.
pub const TABLE_PREFIX: &str = "payments_demo_";

/// The key prefix of the demo's engine on Redis: every key it writes starts
/// with `payments_demo:`.
pub const REDIS_PREFIX: &str = "payments_demo:";

/// The error for a PostgreSQL store in a build without PostgreSQL.
#[cfg(not(feature = "postgres"))]
const NEEDS_FEATURE: &str = "this build has no PostgreSQL support: build the demo with \
    `--features postgres` (cargo run --release -p payments-demo --features postgres -- ...)";

/// The error for a Redis store in a build without Redis.
#[cfg(not(feature = "redis"))]
const NEEDS_REDIS: &str = "this build has no Redis support: build the demo with \
    `--features redis` (cargo run --release -p payments-demo --features redis -- ...)";

/// The error for `--nats` in a build without NATS.
#[cfg(not(feature = "nats"))]
pub const NEEDS_NATS: &str = "this build has no NATS support: build the demo with \
    `--features nats` (scripts/demo-nats does)";

/// The engine's store, as `--store` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Store {
    /// A redb file (created if missing).
    Redb(PathBuf),
    /// A libpq connection string or `postgres://` URL.
    Postgres(String),
    /// A `redis://` or `rediss://` URL.
    Redis(String),
}

impl Store {
    /// `postgres://…`, `postgresql://…` or a `keyword=value …` connection
    /// string (`host=127.0.0.1 port=5432 user=app`) is PostgreSQL;
    /// `redis://…` or `rediss://…` is Redis; anything else is the path of
    /// a redb file (`./a=b.redb` is a path).
    pub fn parse(s: &str) -> Store {
        let keyword = s
            .trim_start()
            .split_once('=')
            .is_some_and(|(k, _)| !k.is_empty() && k.trim_end().bytes().all(is_keyword_byte));
        if s.starts_with("redis://") || s.starts_with("rediss://") {
            Store::Redis(s.to_owned())
        } else if s.starts_with("postgres://") || s.starts_with("postgresql://") || keyword {
            Store::Postgres(s.to_owned())
        } else {
            Store::Redb(PathBuf::from(s))
        }
    }

    /// Fails at once for a PostgreSQL or Redis store when this build cannot
    /// open one, so the demo stops before it starts any server.
    ///
    /// # Errors
    ///
    /// Without the `postgres` feature, for [`Store::Postgres`]; without
    /// the `redis` feature, for [`Store::Redis`].
    pub fn check_supported(&self) -> Result<(), Box<dyn Error>> {
        match self {
            Store::Redb(_) => Ok(()),
            #[cfg(feature = "postgres")]
            Store::Postgres(_) => Ok(()),
            #[cfg(not(feature = "postgres"))]
            Store::Postgres(_) => Err(format!("--store {self}: {NEEDS_FEATURE}").into()),
            #[cfg(feature = "redis")]
            Store::Redis(_) => Ok(()),
            #[cfg(not(feature = "redis"))]
            Store::Redis(_) => Err(format!("--store {self}: {NEEDS_REDIS}").into()),
        }
    }

    /// The value to pass as `--store` to a child server.
    pub fn to_arg(&self) -> OsString {
        match self {
            Store::Redb(path) => path.clone().into_os_string(),
            Store::Postgres(conn) | Store::Redis(conn) => conn.into(),
        }
    }

    /// The redb file, if the store is one.
    pub fn redb_path(&self) -> Option<&Path> {
        match self {
            Store::Redb(path) => Some(path),
            Store::Postgres(_) | Store::Redis(_) => None,
        }
    }

    /// Opens the engine `builder` describes on this store.
    ///
    /// # Errors
    ///
    /// The engine's open error, naming the store (never its password); for
    /// PostgreSQL without the `postgres` feature or Redis without the
    /// `redis` feature, an error saying to build with it.
    pub fn open(&self, builder: EngineBuilder) -> Result<Engine, Box<dyn Error + Send + Sync>> {
        match self {
            Store::Redb(path) => builder
                .open(path)
                .map_err(|e| format!("cannot open {}: {e}", path.display()).into()),
            Store::Postgres(conn) => open_postgres(builder, conn)
                .map_err(|e| format!("cannot open the PostgreSQL store {self}: {e}").into()),
            Store::Redis(url) => open_redis(builder, url)
                .map_err(|e| format!("cannot open the Redis store {self}: {e}").into()),
        }
    }
}

#[cfg(feature = "postgres")]
fn open_postgres(
    builder: EngineBuilder,
    conn: &str,
) -> Result<Engine, Box<dyn Error + Send + Sync>> {
    Ok(builder.table_prefix(TABLE_PREFIX).open_postgres(conn)?)
}

#[cfg(not(feature = "postgres"))]
fn open_postgres(_: EngineBuilder, _: &str) -> Result<Engine, Box<dyn Error + Send + Sync>> {
    Err(NEEDS_FEATURE.into())
}

#[cfg(feature = "redis")]
fn open_redis(builder: EngineBuilder, url: &str) -> Result<Engine, Box<dyn Error + Send + Sync>> {
    Ok(builder.redis_key_prefix(REDIS_PREFIX).open_redis(url)?)
}

#[cfg(not(feature = "redis"))]
fn open_redis(_: EngineBuilder, _: &str) -> Result<Engine, Box<dyn Error + Send + Sync>> {
    Err(NEEDS_REDIS.into())
}

fn is_keyword_byte(b: u8) -> bool {
    b.is_ascii_lowercase() || b == b'_'
}

/// The store for people to read: a PostgreSQL or Redis password is shown
/// as `***`.
impl fmt::Display for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Store::Redb(path) => write!(f, "{}", path.display()),
            Store::Postgres(conn) | Store::Redis(conn) => write!(f, "{}", redact(conn)),
        }
    }
}

/// `conn` with its password, if any, replaced by `***`: the password of a
/// URL's `user:password@` and the value of a `password=` keyword (quoted or
/// not).
fn redact(conn: &str) -> String {
    if let Some(rest) = ["postgres://", "postgresql://", "redis://", "rediss://"]
        .iter()
        .find_map(|scheme| conn.strip_prefix(scheme))
    {
        let scheme = &conn[..conn.len() - rest.len()];
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        if let Some(at) = rest[..authority_end].rfind('@') {
            if let Some(colon) = rest[..at].find(':') {
                return format!("{scheme}{}:***{}", &rest[..colon], &rest[at..]);
            }
        }
        return conn.to_owned();
    }
    let mut out = String::with_capacity(conn.len());
    let mut rest = conn;
    while let Some(at) = rest.find("password") {
        let (before, from) = rest.split_at(at);
        out.push_str(before);
        let after = from["password".len()..].trim_start();
        // Only the keyword itself: `password` at a word start, then `=`.
        let word_start = before.is_empty() || before.ends_with(char::is_whitespace);
        let Some(value) = after.strip_prefix('=').filter(|_| word_start) else {
            out.push_str("password");
            rest = &from["password".len()..];
            continue;
        };
        let value = value.trim_start();
        let len = if let Some(quoted) = value.strip_prefix('\'') {
            // A quoted value ends at the first unescaped quote.
            let mut escaped = false;
            let end = quoted
                .char_indices()
                .find(|&(_, c)| {
                    let end = c == '\'' && !escaped;
                    escaped = c == '\\' && !escaped;
                    end
                })
                .map_or(quoted.len(), |(i, _)| i + 1);
            1 + end
        } else {
            value.find(char::is_whitespace).unwrap_or(value.len())
        };
        out.push_str("password=***");
        rest = &value[len..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_strings_are_postgres_and_anything_else_a_path() {
        for conn in [
            "postgres://app@db/app",
            "postgresql://db",
            "host=127.0.0.1 port=5433 user=postgres",
            "dbname = app",
        ] {
            assert_eq!(Store::parse(conn), Store::Postgres(conn.into()), "{conn}");
        }
        for url in ["redis://127.0.0.1:6379/", "rediss://u:p@cache:6380/2"] {
            assert_eq!(Store::parse(url), Store::Redis(url.into()), "{url}");
        }
        for path in [
            "payments.redb",
            "/tmp/x.redb",
            "./a=b.redb",
            "A=b.redb",
            "redis.redb",
        ] {
            assert_eq!(Store::parse(path), Store::Redb(path.into()), "{path}");
        }
    }

    #[test]
    fn passwords_are_not_shown() {
        assert_eq!(
            redact("postgres://app:s3cret@db:5432/app?sslmode=disable"),
            "postgres://app:***@db:5432/app?sslmode=disable"
        );
        assert_eq!(redact("postgres://app@db/app"), "postgres://app@db/app");
        assert_eq!(
            Store::Redis("redis://:s3cret@cache:6379/0".into()).to_string(),
            "redis://:***@cache:6379/0"
        );
        assert_eq!(
            redact("rediss://app:s3cret@cache/"),
            "rediss://app:***@cache/"
        );
        assert_eq!(
            redact("host=db password=s3cret user=app"),
            "host=db password=*** user=app"
        );
        assert_eq!(
            redact("host=db password = 'a \\' b' user=app"),
            "host=db password=*** user=app"
        );
        assert_eq!(redact("host=db user=password"), "host=db user=password");
        assert_eq!(
            Store::Postgres("user=app password=x".into()).to_string(),
            "user=app password=***"
        );
    }
}
