//! Opening: connect, make sure the server is a single Redis (or Valkey)
//! with scripting, check that it keeps acknowledged writes (`appendonly
//! yes`, `appendfsync always`) and never evicts them (`maxmemory-policy`
//! not `allkeys-*`) unless the builder accepted the risk, and
//! agree with the other engines on the prefix about the expiry settings.
//! An open in [`Mode::Existing`] or [`Mode::ReadOnly`] refuses a prefix
//! no engine has opened; a read-only one writes nothing.

use std::time::Duration;

use redis::Commands;

use crate::error::OpenError;
use crate::policy::ExpiryPolicy;
use crate::store::config::StoreConfig;

use super::conn::{open_storage, RedisConn};
use super::keys::Keys;

/// How an open treats the key prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Write the layout if the prefix has none (`open_redis`).
    Create,
    /// Use the layout; refuse a prefix without one (`open_redis_existing`).
    Existing,
    /// As `Existing`, and write nothing (`open_redis_read_only`): no
    /// scripting or durability check (it runs no script and writes
    /// nothing), no settings stored; the engine wraps the store in
    /// `store/read_only.rs`'s `ReadOnly`, which refuses every write. Its
    /// reads are plain commands (`GET`, `MGET`, `HGETALL`, `HMGET`,
    /// `ZRANGE`, `ZCOUNT`, `ZCARD`, `EXISTS`, `SCAN`, and `MULTI`/`EXEC`
    /// around a record and its effect steps), so a user whose ACL allows
    /// only those (and `INFO`, `CLIENT ID`) can run it, and so can a
    /// replica.
    ReadOnly,
}

/// The layout version this build writes under a prefix (`<prefix>meta`'s
/// `format`).
pub(super) const LAYOUT_VERSION: i64 = 1;

/// How the builder asked to reach the server.
#[derive(Debug, Clone)]
pub(crate) struct RedisOptions {
    pub(crate) url: String,
    pub(crate) prefix: String,
    pub(crate) pool_size: u32,
    pub(crate) connect_timeout: Duration,
    pub(crate) command_timeout: Duration,
    pub(crate) allow_volatile: bool,
    /// The app vouches for the server's durability where `CONFIG GET`
    /// cannot read it (`EngineBuilder::redis_durability_attested`).
    pub(crate) durability_attested: bool,
    pub(crate) wait_replicas: Option<(u32, Duration)>,
    /// The files of a `rediss://` connection: trusted CAs, client
    /// certificate.
    pub(crate) tls: super::tls::TlsFiles,
    /// The password sent when the URL has none.
    pub(crate) password: Option<super::conn::Password>,
    /// Whether the open may create the layout, and whether it writes.
    pub(crate) mode: Mode,
}

/// The value of `name` in an `INFO` answer.
fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines().find_map(|line| {
        let (k, v) = line.split_once(':')?;
        (k == name).then(|| v.trim())
    })
}

/// The server checks, on the first connection.
pub(super) fn check_server(conn: &mut RedisConn, opts: &RedisOptions) -> Result<(), OpenError> {
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query(&mut conn.conn)
        .map_err(open_storage(
            "asking the Redis server what it is (INFO server)",
        ))?;
    if info_field(&info, "redis_version").is_none() {
        return Err(OpenError::RedisUnsupported {
            reason: "the server answered INFO without a redis_version: not a Redis or Valkey \
                     server"
                .to_owned(),
        });
    }
    let cluster: String = redis::cmd("INFO")
        .arg("cluster")
        .query(&mut conn.conn)
        .map_err(open_storage("asking the Redis server about cluster mode"))?;
    if info_field(&cluster, "cluster_enabled") == Some("1") {
        return Err(OpenError::RedisUnsupported {
            reason: "the server runs in cluster mode (cluster_enabled:1): Redis Cluster is not \
                     supported; use a server without cluster mode"
                .to_owned(),
        });
    }
    if opts.mode == Mode::ReadOnly {
        // Reads are plain commands: a read-only engine runs no script and
        // writes nothing, so neither scripting nor durability matters (a
        // user whose ACL allows only reads, or a replica, will do).
        return Ok(());
    }
    // Scripting: every transition is a Lua script.
    let one: redis::RedisResult<i64> = redis::cmd("EVAL")
        .arg("return 1")
        .arg(0)
        .query(&mut conn.conn);
    if let Err(e) = one {
        if e.code() == Some("NOPERM") {
            // The server runs scripts; this user may not (a read-only ACL
            // user): say so, not that the server lacks scripting.
            return Err(OpenError::RedisUnsupported {
                reason: format!(
                    "this user may not run Lua scripts (EVAL: {}); every transition of the \
                     engine is one atomic script, so an engine that writes needs a user \
                     allowed +@scripting and +@write (a read-only open needs neither)",
                    super::conn::describe(&e)
                ),
            });
        }
        return Err(OpenError::RedisUnsupported {
            reason: format!(
                "the server does not run Lua scripts (EVAL: {}); every transition of the \
                 engine is one atomic script",
                super::conn::describe(&e)
            ),
        });
    }
    check_durability(conn, opts.allow_volatile, opts.durability_attested)
}

/// `appendonly yes`, `appendfsync always` and no `allkeys-*` eviction,
/// unless volatile is allowed. With `attested`, a setting `CONFIG GET`
/// cannot read (a managed server that blocks or renames `CONFIG`) counts
/// as the app vouched for it; one it reads is checked all the same.
fn check_durability(
    conn: &mut RedisConn,
    allow_volatile: bool,
    attested: bool,
) -> Result<(), OpenError> {
    let mut setting = |name: &'static str| -> Setting {
        let pair: redis::RedisResult<Vec<String>> = redis::cmd("CONFIG")
            .arg("GET")
            .arg(name)
            .query(&mut conn.conn);
        match pair {
            // A server without the setting answers an empty array.
            Ok(pair) => match pair.get(1) {
                Some(value) => Setting::Read(value.clone()),
                None => Setting::Unreadable("CONFIG GET answered nothing".to_owned()),
            },
            Err(e) => Setting::Unreadable(format!("CONFIG GET: {}", super::conn::describe(&e))),
        }
    };
    let settings = Settings {
        appendonly: setting("appendonly"),
        appendfsync: setting("appendfsync"),
        maxmemory_policy: setting("maxmemory-policy"),
    };
    judge(settings, allow_volatile, attested)
}

/// One persistence setting as `CONFIG GET` answered it.
#[derive(Debug, Clone)]
enum Setting {
    /// Its value.
    Read(String),
    /// Why it could not be read (an error, or an empty answer).
    Unreadable(String),
}

/// The three settings [`judge`] weighs.
#[derive(Debug, Clone)]
struct Settings {
    appendonly: Setting,
    appendfsync: Setting,
    maxmemory_policy: Setting,
}

/// Whether a server with `settings` may hold the engine's records: each
/// of `appendonly yes`, `appendfsync always` and a `maxmemory-policy`
/// that never evicts the engine's keys (anything but `allkeys-*`: the
/// engine sets no Redis expiry, so `noeviction` and `volatile-*` leave
/// them alone), else [`OpenError::RedisNotDurable`] or
/// [`OpenError::RedisEvicts`] naming the first one that fails. A setting
/// that could not be read is refused too (its value may be any), unless
/// the app `attested` it; `allow_volatile` accepts every one, with a
/// warning.
fn judge(settings: Settings, allow_volatile: bool, attested: bool) -> Result<(), OpenError> {
    let unreadable = |why: &str| format!("unreadable ({why}){UNREADABLE_HINT}");
    for (name, found, want) in [
        ("appendonly", settings.appendonly, "yes"),
        ("appendfsync", settings.appendfsync, "always"),
    ] {
        match found {
            Setting::Read(found) if found == want => {}
            Setting::Read(found) if !allow_volatile => {
                return Err(OpenError::RedisNotDurable {
                    setting: name,
                    found,
                })
            }
            Setting::Unreadable(why) if !allow_volatile && !attested => {
                return Err(OpenError::RedisNotDurable {
                    setting: name,
                    found: unreadable(&why),
                })
            }
            Setting::Unreadable(_) if attested => tracing::info!(
                setting = name,
                "Redis opened with redis_durability_attested: the setting is not readable (CONFIG GET refused), so the app's word that every write persists before its reply is taken"
            ),
            found => tracing::warn!(
                setting = name,
                found = ?found,
                "Redis opened with allow_volatile: a server crash can forget acknowledged outcomes, so work may run twice"
            ),
        }
    }
    match settings.maxmemory_policy {
        Setting::Read(policy) if policy.starts_with("allkeys-") => {
            if !allow_volatile {
                return Err(OpenError::RedisEvicts { policy });
            }
            tracing::warn!(
                setting = "maxmemory-policy",
                found = %policy,
                "Redis opened with allow_volatile: the server may evict claims and the token counter, so work may run twice"
            );
        }
        Setting::Unreadable(why) if !allow_volatile && !attested => {
            return Err(OpenError::RedisEvicts {
                policy: unreadable(&why),
            })
        }
        Setting::Read(_) | Setting::Unreadable(_) => {}
    }
    Ok(())
}

/// What a refusal for an unreadable setting adds: the way out for a
/// managed server.
const UNREADABLE_HINT: &str = "; a managed server that blocks CONFIG: check its persistence \
     with the provider, then open with EngineBuilder::redis_durability_attested(true)";

const META_CONTEXT: &str = "reading the stored settings";

/// Reading or storing `<prefix>meta` failed: the error names the key and
/// what the server said, and what to do for the two refusals an operator
/// meets there: an ACL without the prefix's key pattern (`NOPERM` on a
/// key), and a writable open of a replica (`READONLY`).
fn meta_storage<'k>(
    keys: &'k Keys,
    context: &'static str,
) -> impl Fn(redis::RedisError) -> OpenError + 'k {
    move |e| {
        let hint = match e.code() {
            Some("NOPERM") if e.detail().is_some_and(|d| d.contains("key")) => format!(
                "; the user's ACL must allow the keys under the prefix (~{}*)",
                keys.prefix
            ),
            Some("READONLY") => {
                "; this server is a replica: a writable open needs the primary".to_owned()
            }
            _ => String::new(),
        };
        OpenError::Storage {
            context,
            source: format!(
                "{}: {}{hint}",
                keys.meta,
                super::conn::describe(&e).trim_end_matches('.')
            )
            .into(),
        }
    }
}

/// `<prefix>meta` (named) is not what an engine writes there.
fn meta_damaged(keys: &Keys, what: &str) -> OpenError {
    OpenError::Storage {
        context: META_CONTEXT,
        source: format!(
            "{}: {what}; an engine writes a hash of the integers format, ttl_ms and \
             tombstone_keep_ms there: something else wrote it, or it was damaged",
            keys.meta
        )
        .into(),
    }
}

/// The integer fields of `<prefix>meta` (`format`, `ttl_ms`,
/// `tombstone_keep_ms`) that it holds. A key of another Redis type, or one
/// of these fields not a 64-bit integer, is refused naming the key
/// ([`OpenError::Storage`]), as every storage failure of the read.
fn read_meta(
    conn: &mut RedisConn,
    keys: &Keys,
) -> Result<std::collections::HashMap<&'static str, i64>, OpenError> {
    let raw: redis::RedisResult<std::collections::HashMap<String, Vec<u8>>> =
        conn.conn.hgetall(&keys.meta);
    let raw = match raw {
        Err(e) if super::conn::wrong_type(&e) => {
            return Err(meta_damaged(
                keys,
                "it holds another Redis type than a hash (WRONGTYPE)",
            ))
        }
        other => other.map_err(meta_storage(keys, META_CONTEXT))?,
    };
    let mut meta = std::collections::HashMap::new();
    for field in ["format", "ttl_ms", "tombstone_keep_ms"] {
        let Some(bytes) = raw.get(field) else {
            continue;
        };
        let value = std::str::from_utf8(bytes)
            .ok()
            .and_then(|text| text.parse::<i64>().ok())
            .ok_or_else(|| {
                let shown = String::from_utf8_lossy(&bytes[..bytes.len().min(32)]).into_owned();
                meta_damaged(keys, &format!("its {field} is not an integer ({shown:?})"))
            })?;
        meta.insert(field, value);
    }
    Ok(meta)
}

/// Stores this engine's expiry settings under the prefix, or (with
/// `stored_expiry`) takes the stored ones; refuses a policy that differs
/// from the one the other engines on the prefix use, and a layout newer
/// than this build's, and a damaged `<prefix>meta` (see [`read_meta`]; a
/// format below 1). Outside [`Mode::Create`], refuses a prefix with no
/// layout ([`OpenError::NoRedisData`]); in [`Mode::ReadOnly`] it only
/// reads (the stored settings are taken with `stored_expiry`, and a
/// policy that differs is not this engine's to refuse: it sweeps nothing).
pub(super) fn prepare(
    conn: &mut RedisConn,
    keys: &Keys,
    mut cfg: StoreConfig,
    stored_expiry: bool,
    mode: Mode,
) -> Result<StoreConfig, OpenError> {
    let meta = read_meta(conn, keys)?;
    match meta.get("format") {
        Some(&found) if found > LAYOUT_VERSION => {
            return Err(OpenError::UnsupportedSchema {
                prefix: keys.prefix.clone(),
                found,
                supported: LAYOUT_VERSION,
            });
        }
        Some(&found) if found < 1 => {
            return Err(meta_damaged(
                keys,
                &format!("its format is {found}, which is no layout version"),
            ));
        }
        None if mode != Mode::Create => {
            return Err(OpenError::NoRedisData {
                prefix: keys.prefix.clone(),
            });
        }
        _ => {}
    }
    let keep_of = |cfg: &StoreConfig| {
        cfg.expiry
            .keep_ms()
            .map_or(-1, |ms| i64::try_from(ms).unwrap_or(i64::MAX))
    };
    if stored_expiry {
        if let (Some(&ttl), Some(&keep)) = (meta.get("ttl_ms"), meta.get("tombstone_keep_ms")) {
            cfg.ttl_ms = u64::try_from(ttl).unwrap_or(0);
            cfg.expiry = match u64::try_from(keep) {
                Ok(ms) => ExpiryPolicy::Tombstone {
                    keep: Duration::from_millis(ms),
                },
                Err(_) => ExpiryPolicy::Forget,
            };
        }
    } else if mode == Mode::ReadOnly {
        return Ok(cfg);
    } else if let Some(&stored) = meta.get("tombstone_keep_ms") {
        if stored != keep_of(&cfg) {
            return Err(OpenError::ExpiryPolicyConflict {
                prefix: keys.prefix.clone(),
                stored: match u64::try_from(stored) {
                    Ok(ms) => ExpiryPolicy::Tombstone {
                        keep: Duration::from_millis(ms),
                    },
                    Err(_) => ExpiryPolicy::Forget,
                },
                requested: cfg.expiry,
            });
        }
    }
    if mode == Mode::ReadOnly {
        return Ok(cfg);
    }
    let ttl = i64::try_from(cfg.ttl_ms).unwrap_or(i64::MAX);
    let _: () = redis::cmd("HSET")
        .arg(&keys.meta)
        .arg("format")
        .arg(LAYOUT_VERSION)
        .arg("ttl_ms")
        .arg(ttl)
        .arg("tombstone_keep_ms")
        .arg(keep_of(&cfg))
        .query(&mut conn.conn)
        .map_err(meta_storage(keys, "storing the settings"))?;
    Ok(cfg)
}

#[cfg(test)]
#[path = "open_tests.rs"]
mod tests;
