//! Breaker 24, bad input at the Redis backend's edges: guards against a
//! prefix with glob characters (which `SCAN MATCH` would misread) being
//! accepted, against `verify` of one prefix reporting a healthy store as
//! damaged because another engine uses a longer prefix that starts with
//! it (`ten:` and `ten:eu:`), and against the URL's password showing in an
//! error raised after the open (the password changed under a running
//! engine).
//!
//! Each case starts its own durable `redis-server` on a free loopback
//! port; skipped without the binary (a failure under `CI=true`).

use std::time::Duration;

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey, OpenError};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;
use redis_server::BoxError;

const PASSWORD: &str = "Sekrit-b24-password";

#[path = "common/redis_server.rs"]
mod redis_server;

use redis_server::own_server;

fn open(url: &str, prefix: &str) -> Result<Engine, OpenError> {
    Engine::builder()
        .sweep_interval(None)
        .redis_key_prefix(prefix)
        .redis_connect_timeout(Duration::from_secs(1))
        .redis_command_timeout(Duration::from_secs(1))
        .open_redis(url)
}

fn fp() -> Result<Fingerprint, BoxError> {
    Ok(Fingerprint::of_json(b"{}", &[])?)
}

fn complete(e: &Engine, key: &IdempotencyKey) -> TestResult {
    let Begin::Claimed(c) = e.begin(key, fp()?)? else {
        return Err(format!("{key} must be claimed").into());
    };
    e.complete(c, Envelope::new(1, 200, "ok"))?;
    Ok(())
}

#[test]
fn glob_prefixes_are_refused_at_open() -> TestResult {
    let Some(s) = own_server(&[])? else {
        return Ok(());
    };
    let url = s.url();
    for prefix in ["app*", "a?:", "[ab]:", "x\\:", "", "sp ace:"] {
        let err = open(&url, prefix).err();
        assert!(
            matches!(err, Some(OpenError::InvalidKeyPrefix { .. })),
            "{prefix:?}: {err:?}"
        );
    }
    Ok(())
}

#[test]
fn a_longer_prefix_of_another_engine_is_not_damage() -> TestResult {
    // Two tenants on one server: `ten:` and `ten:eu:`. Each store is
    // healthy; verify of `ten:` must not call the other's keys foreign (or
    // the open must refuse prefixes that nest).
    let Some(s) = own_server(&[])? else {
        return Ok(());
    };
    let url = s.url();
    let outer = open(&url, "ten:")?;
    let inner = match open(&url, "ten:eu:") {
        Ok(e) => e,
        Err(err) => {
            eprintln!("nested prefix refused at open: {err}");
            return Ok(());
        }
    };
    complete(&outer, &IdempotencyKey::new("pay", "a")?)?;
    complete(&inner, &IdempotencyKey::new("pay", "b")?)?;
    let report = outer.verify()?;
    assert!(
        report.is_sound(),
        "verify of ten: on a healthy server: {} damage, e.g. {:?}",
        report.damage.len(),
        report.damage.first()
    );
    Ok(())
}

#[test]
fn a_password_changed_under_a_running_engine_stays_hidden() -> TestResult {
    let Some(s) = own_server(&["--requirepass", PASSWORD])? else {
        return Ok(());
    };
    let url = format!("redis://:{PASSWORD}@127.0.0.1:{}/", s.port);
    let e = open(&url, "pw:")?;
    complete(&e, &IdempotencyKey::new("pw", "a")?)?;
    let mut admin = redis::Client::open(url.as_str())?.get_connection()?;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("another-one")
        .query(&mut admin)?;
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .query(&mut admin)
        .unwrap_or(0);
    for i in 0..3 {
        let key = IdempotencyKey::new("pw", format!("k{i}"))?;
        let err = e
            .begin(&key, fp()?)
            .err()
            .ok_or("a begin with a stale password")?;
        let mut all = format!("{err} {err:?}");
        let mut source = std::error::Error::source(&err);
        while let Some(s) = source {
            all.push_str(&format!(" {s} {s:?}"));
            source = s.source();
        }
        assert!(!all.contains(PASSWORD), "the password shows: {all}");
    }
    Ok(())
}
