//! Connections: the URL's checks, the pool's manager, and the errors a
//! caller sees (none of which shows the URL, so none shows a password).

use std::time::Duration;

use super::tls;

use crate::error::{Corrupted, Error, OpenError};
use crate::key::IdempotencyKey;

/// A pooled connection and its server-side id (`CLIENT ID`), by which a
/// connection whose answer was lost is ended before its write is settled.
pub(super) struct RedisConn {
    pub(super) conn: redis::Connection,
    pub(super) id: i64,
    /// Set when an answer may still be on its way (a timeout, a lost
    /// reply): the pool then drops the connection instead of reusing it.
    pub(super) broken: bool,
}

/// Makes connections with a bound on connecting and on every later round
/// trip.
#[derive(Debug)]
pub(super) struct Manager {
    pub(super) client: redis::Client,
    pub(super) connect_timeout: Duration,
    pub(super) command_timeout: Duration,
}

impl Manager {
    pub(super) fn connect(&self) -> redis::RedisResult<RedisConn> {
        let mut conn = self
            .client
            .get_connection_with_timeout(self.connect_timeout)?;
        conn.set_read_timeout(Some(self.command_timeout))?;
        conn.set_write_timeout(Some(self.command_timeout))?;
        let id: i64 = redis::cmd("CLIENT").arg("ID").query(&mut conn)?;
        Ok(RedisConn {
            conn,
            id,
            broken: false,
        })
    }
}

impl r2d2::ManageConnection for Manager {
    type Connection = RedisConn;
    type Error = redis::RedisError;

    fn connect(&self) -> redis::RedisResult<RedisConn> {
        Manager::connect(self)
    }

    fn is_valid(&self, conn: &mut RedisConn) -> redis::RedisResult<()> {
        redis::cmd("PING").query::<()>(&mut conn.conn)
    }

    fn has_broken(&self, conn: &mut RedisConn) -> bool {
        conn.broken || !redis::ConnectionLike::is_open(&conn.conn)
    }
}

/// A password given apart from the URL (`EngineBuilder::redis_password`):
/// kept out of `Debug` output, so no log of the builder or the options
/// shows it.
#[derive(Clone)]
pub(crate) struct Password(pub(crate) String);

impl std::fmt::Debug for Password {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Password(<redacted>)")
    }
}

/// The client for `url`, after the checks a URL gets before any
/// connection: a cluster URL is refused (this build speaks to one server),
/// and a URL that does not parse says so without repeating it. A
/// `rediss://` URL trusts the CAs in `tls.ca` (a PEM file) if given, else
/// the system's trust store, and presents `tls.client` (certificate chain
/// and key PEM files) when given; either with another scheme is refused.
/// `password` is sent when the URL has none (a URL's own password wins,
/// as a libpq connection string's wins over `PGPASSWORD`).
pub(super) fn client(
    url: &str,
    tls_files: &tls::TlsFiles,
    password: Option<&Password>,
) -> Result<redis::Client, OpenError> {
    let scheme = url.split("://").next().unwrap_or_default();
    if url.contains("://") && scheme.to_ascii_lowercase().contains("cluster") {
        return Err(OpenError::RedisUnsupported {
            reason: format!(
                "a cluster URL ({scheme}://): Redis Cluster is not supported; \
                 give the URL of one primary (redis://host:port/db)"
            ),
        });
    }
    let malformed = |detail: String| OpenError::Storage {
        context: "parsing the Redis URL",
        source: format!(
            "malformed Redis URL ({detail}); expected redis://[user:password@]host[:port][/db], \
             rediss://… or unix:///path/to/socket"
        )
        .into(),
    };
    if !url.contains("://") {
        return Err(malformed("no scheme".to_owned()));
    }
    let tls = scheme.eq_ignore_ascii_case("rediss");
    if tls {
        tls::install_provider();
    }
    let mut info = redis::IntoConnectionInfo::into_connection_info(url)
        .map_err(|e| malformed(describe_kind(&e)))?;
    if let Some(Password(password)) = password {
        if info.redis_settings().password().is_none() {
            let settings = info.redis_settings().clone().set_password(password);
            info = info.set_redis_settings(settings);
        }
    }
    if tls_files.is_empty() {
        return redis::Client::open(info).map_err(|e| malformed(describe_kind(&e)));
    }
    if !tls {
        return Err(tls_files.without_tls(scheme));
    }
    let certificates = redis::TlsCertificates {
        client_tls: tls_files.read_client()?,
        root_cert: tls_files.ca.as_deref().map(tls::read_ca).transpose()?,
    };
    redis::Client::build_with_tls(info, certificates).map_err(|e| malformed(describe_kind(&e)))
}

/// What went wrong, in words that never carry the URL: the error's kind,
/// and the server's own message (which names no password).
pub(super) fn describe(e: &redis::RedisError) -> String {
    // NOPERM: the user and password are right, its ACL forbids the
    // command (a read-only user asked to write); not a failed login.
    if e.code() == Some("NOPERM") {
        return format!(
            "permission denied (NOPERM): the Redis user's ACL does not allow it ({})",
            e.detail().unwrap_or("no detail")
        );
    }
    if e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("WRONGPASS" | "NOAUTH"))
    {
        return format!(
            "authentication failed ({}): check the user name and the password (the URL's, \
             or EngineBuilder::redis_password when the URL has none)",
            e.code().unwrap_or("refused")
        );
    }
    if e.is_timeout() {
        return "the server did not answer in time".to_owned();
    }
    if e.is_connection_refusal() {
        return "the connection was refused (is redis-server running on that port?)".to_owned();
    }
    if e.kind() == redis::ErrorKind::Parse {
        return "the server's answer is not the Redis protocol (is this a Redis server?)"
            .to_owned();
    }
    e.to_string()
}

fn describe_kind(e: &redis::RedisError) -> String {
    match e.kind() {
        redis::ErrorKind::InvalidClientConfig => "the URL does not parse".to_owned(),
        other => format!("{other:?}"),
    }
}

/// A storage error of an open engine, naming what it was doing.
pub(super) fn storage(context: &'static str) -> impl Fn(redis::RedisError) -> Error {
    move |e| Error::Storage {
        context,
        source: describe(&e).into(),
    }
}

/// An error at open, naming what it was doing.
pub(super) fn open_storage(context: &'static str) -> impl Fn(redis::RedisError) -> OpenError {
    move |e| OpenError::Storage {
        context,
        source: describe(&e).into(),
    }
}

/// The open's first connection failed: what happened, with the TLS
/// layer's part in words for a `rediss://` URL, and a hint when a
/// plaintext URL's server hung up at once (a TLS port does).
pub(super) fn connect_failed(
    e: &redis::RedisError,
    url: &str,
    tls_files: &tls::TlsFiles,
) -> OpenError {
    let context = "connecting to Redis";
    let scheme = url.split("://").next().unwrap_or_default();
    let words = if scheme.eq_ignore_ascii_case("rediss") {
        tls::describe_failure(e, tls_files).unwrap_or_else(|| describe(e))
    } else if scheme.eq_ignore_ascii_case("redis") && e.is_connection_dropped() {
        format!(
            "{}: the server hung up at once, as a TLS port does on plaintext \
             (use rediss:// for a TLS port)",
            describe(e)
        )
    } else {
        describe(e)
    };
    OpenError::Storage {
        context,
        source: words.into(),
    }
}

/// Whether the connection is gone (or its answer was lost): the command
/// may or may not have run.
pub(super) fn lost(e: &redis::RedisError) -> bool {
    e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_unrecoverable_error()
}

/// A command or script met a key of another Redis type than the engine
/// stores there (`WRONGTYPE`): something else wrote under the prefix.
pub(super) fn wrong_type(e: &redis::RedisError) -> bool {
    e.code() == Some("WRONGTYPE") || e.to_string().contains("WRONGTYPE")
}

/// `INCR` met a value that is not a 64-bit integer (a damaged counter).
pub(super) fn not_integer(e: &redis::RedisError) -> bool {
    e.to_string().contains("not an integer")
}

/// A key of another Redis type where `key`'s record belongs.
pub(super) fn wrong_type_record(key: &IdempotencyKey) -> Error {
    Error::Corrupt {
        what: Corrupted::Record(key.clone()),
        reason: "its record's Redis key holds another type (WRONGTYPE): something else \
                 wrote under the prefix"
            .to_owned(),
    }
}

/// The fencing-token counter (`<prefix>token`) holds no integer.
pub(super) fn token_counter_damaged(e: &redis::RedisError) -> Error {
    Error::Corrupt {
        what: Corrupted::Meta("token (the fencing-token counter <prefix>token)"),
        reason: format!(
            "it is not an integer, so no claim can draw a fencing token ({}); \
             set it above every record's token",
            describe(e)
        ),
    }
}
