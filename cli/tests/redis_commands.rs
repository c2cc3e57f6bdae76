//! The operator commands on Redis: guards against a CLI that cannot open a
//! `redis://` URL (in any case of its scheme), that shows other records
//! there than the engine wrote, that applies `--table-prefix` to a Redis
//! URL, `--key-prefix` to anything else, or `--redis-ca` or
//! `--redis-client-cert` to anything but a `rediss://` URL, that writes
//! under a mistyped key prefix, that cannot take the password from
//! `REDISCLI_AUTH` (kept out of `ps`), or that prints a Redis password in
//! an error.
//!
//! Needs `IDEMPOTENCY_TEST_REDIS` (set by `scripts/with-redis`, which
//! `scripts/with-services` runs). Without it the server tests are skipped
//! with a message, or fail under `CI=true`; the usage checks need no
//! server.

mod common;

#[path = "../../tests/common/redis_server.rs"]
mod redis_server;

use std::time::{SystemTime, UNIX_EPOCH};

use common::*;
use idempotency::{Engine, Envelope, Failure};

/// The test server's URL, or `None` (skip) outside CI.
fn redis_url() -> Option<String> {
    match std::env::var(redis_server::URL_VAR) {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var("CI").is_ok_and(|v| v == "true") => panic!(
            "CI=true but IDEMPOTENCY_TEST_REDIS is not set: run the tests through scripts/with-redis"
        ),
        _ => {
            eprintln!("skipped: IDEMPOTENCY_TEST_REDIS not set (run through scripts/with-redis)");
            None
        }
    }
}

fn unique_prefix(tag: &str) -> TestResult<String> {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos();
    Ok(format!("cli_{tag}_{}_{nanos}:", std::process::id()))
}

/// `idem` that must exit 2 with one `idem: ...` line; returns it.
fn usage_err(args: &[&str]) -> TestResult<String> {
    let out = idem(args)?;
    let stderr = String::from_utf8(out.stderr)?;
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "stderr: {stderr:?}");
    assert!(stderr.starts_with("idem: "), "stderr: {stderr:?}");
    Ok(stderr.trim_end().to_string())
}

#[test]
fn prefixes_go_with_their_backend() -> TestResult {
    // Checked before connecting: no server needed.
    let redis = "redis://127.0.0.1:1/";
    let err = usage_err(&["stats", redis, "--table-prefix", "app_"])?;
    assert!(
        err.contains(
            "--table-prefix applies to a PostgreSQL connection string, not to a Redis URL"
        ),
        "{err}"
    );
    let err = usage_err(&["stats", "host=127.0.0.1 port=1", "--key-prefix", "app:"])?;
    assert!(
        err.contains("--key-prefix applies to a Redis URL, not to a PostgreSQL connection string"),
        "{err}"
    );
    let dir = tempfile::tempdir()?;
    let file = db_path(dir.path());
    let file = file.to_str().ok_or("a UTF-8 temp path")?;
    let err = usage_err(&["stats", file, "--key-prefix", "app:"])?;
    assert!(
        err.contains("--key-prefix applies to a Redis URL, not to the file"),
        "{err}"
    );
    let err = usage_err(&["stats", file, "--redis-ca", "ca.pem"])?;
    assert!(
        err.contains("--redis-ca applies to a rediss:// URL, not to the file"),
        "{err}"
    );
    let err = usage_err(&[
        "stats",
        file,
        "--redis-client-cert",
        "client.pem",
        "--redis-client-key",
        "client.key",
    ])?;
    assert!(
        err.contains("--redis-client-cert applies to a rediss:// URL, not to the file"),
        "{err}"
    );
    // TLS files with a plaintext URL: a command-line mistake too.
    let err = usage_err(&["stats", redis, "--redis-ca", "ca.pem"])?;
    assert!(
        err.contains("--redis-ca applies to a rediss:// URL, not to a redis:// URL (no TLS"),
        "{err}"
    );
    // A scheme in capitals is still a URL (RFC 3986: schemes are
    // case-insensitive), not a file name.
    let err = usage_err(&["stats", "REDIS://127.0.0.1:1/", "--table-prefix", "app_"])?;
    assert!(err.contains("not to a Redis URL"), "{err}");
    // One without the other is a usage error (clap's).
    let out = idem(["stats", redis, "--redis-client-cert", "client.pem"])?;
    assert_eq!(out.status.code(), Some(2));
    let err = usage_err(&["salvage", redis, file])?;
    assert!(err.contains("salvage works on redb files"), "{err}");
    let err = usage_err(&["sweep", file, "--redis-durability-attested"])?;
    assert!(
        err.contains("--redis-durability-attested applies to a Redis URL, not to the file"),
        "{err}"
    );
    Ok(())
}

/// A managed service blocks CONFIG (here: a user allowed everything but
/// it): the commands that write refuse the server until the operator says
/// its durability was checked (`--redis-durability-attested`); reading
/// commands never needed it.
#[test]
fn writing_commands_on_a_server_that_blocks_config_need_the_attestation() -> TestResult {
    let Some(server) = redis_server::own_server(&[]).map_err(|e| e.to_string())? else {
        return Ok(());
    };
    let managed = redis_server::no_config_user(&server.url(), "managed", "managed-pw")
        .map_err(|e| e.to_string())?;
    let engine = Engine::builder()
        .redis_key_prefix("managed:")
        .sweep_interval(None)
        .redis_durability_attested(true)
        .open_redis(&managed)?;
    let c = claim(&engine, &key("t:pay", "k1")?, fp("{}")?)?;
    engine.complete(c, Envelope::new(1, 201, "ok"))?;
    drop(engine);

    let base = ["--key-prefix", "managed:"];
    let refused = idem(["sweep", managed.as_str()].iter().chain(&base))?;
    let stderr = String::from_utf8(refused.stderr)?;
    assert_eq!(refused.status.code(), Some(1), "stderr: {stderr}");
    assert!(stderr.contains("unreadable (CONFIG GET"), "{stderr}");
    assert!(!stderr.contains("managed-pw"), "{stderr}");
    // The way out is named as the operator gives it: the flag, not the
    // library's builder call.
    assert!(
        stderr.contains("then open with --redis-durability-attested"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("EngineBuilder::redis_durability"),
        "{stderr}"
    );
    let swept = idem_ok(
        ["sweep", managed.as_str(), "--redis-durability-attested"]
            .iter()
            .chain(&base),
    )?;
    assert!(swept.contains("deleted"), "{swept}");
    let stats = idem_ok(["stats", managed.as_str()].iter().chain(&base))?;
    assert!(stats.contains("COMPLETED"), "{stats}");
    Ok(())
}

#[test]
fn commands_read_and_settle_records_on_redis() -> TestResult {
    let Some(url) = redis_url() else {
        return Ok(());
    };
    let prefix = unique_prefix("cmds")?;
    let engine = Engine::builder()
        .sweep_interval(None)
        .redis_key_prefix(&prefix)
        .open_redis(&url)?;
    let done = claim(&engine, &key("shop:pay", "a-done")?, fp(r#"{"n":1}"#)?)?;
    engine.complete(done, Envelope::new(1, 201, r#"{"payment":"p_1"}"#))?;
    let lost = claim(&engine, &key("shop:pay", "b-unknown")?, fp(r#"{"n":2}"#)?)?;
    let reason = "provider timed out".to_string();
    engine.fail(lost, Failure::InDoubt { reason })?;
    drop(engine);

    let with = |args: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = args.iter().map(|a| (*a).to_string()).collect();
        v.extend(["--key-prefix".to_string(), prefix.clone()]);
        v
    };
    let stats: serde_json::Value =
        serde_json::from_str(&idem_ok(with(&["stats", &url, "--json"]))?)?;
    assert_eq!(stats["completed"], 1, "{stats}");
    assert_eq!(stats["unknown"], 1, "{stats}");
    let listed = idem_ok(with(&["inspect", &url]))?;
    assert!(
        listed.contains("a-done") && listed.contains("b-unknown"),
        "{listed}"
    );
    // No `--limit`: "all of them" must reach Redis as a count it takes
    // (it refuses `LIMIT 0 18446744073709551615`).
    let unknown = idem_ok(with(&["unknown", &url]))?;
    assert!(
        unknown.contains("b-unknown") && !unknown.contains("a-done"),
        "{unknown}"
    );
    let shown = idem_ok(with(&["show", &url, "shop:pay", "a-done"]))?;
    assert!(shown.contains("COMPLETED"), "{shown}");
    idem_ok(with(&[
        "resolve",
        &url,
        "shop:pay",
        "b-unknown",
        "--not-executed",
        "--reason",
        "provider has no such charge",
    ]))?;
    let unknown = idem_ok(with(&["unknown", &url, "--limit", "100"]))?;
    assert!(!unknown.contains("b-unknown"), "{unknown}");
    let verify = idem_ok(with(&["verify", &url]))?;
    assert!(!verify.is_empty());

    // A prefix no engine has opened (a typo) is an error naming it, for
    // the commands that read and those that write, and nothing is written
    // under it.
    let other = unique_prefix("empty")?;
    for args in [
        vec!["stats", url.as_str(), "--json"],
        vec!["sweep", url.as_str()],
    ] {
        let mut args = args;
        args.extend(["--key-prefix", other.as_str()]);
        let err = idem_err(&args)?;
        assert!(
            err.contains("no idempotency data under key prefix") && err.contains(&other),
            "{args:?}: {err}"
        );
    }
    let port = redis_server::port_of(&url).ok_or("a port in the test server's URL")?;
    assert_eq!(
        redis_server::delete_prefix(port, &other).map_err(|e| e.to_string())?,
        0,
        "a command wrote under a prefix that held nothing"
    );
    redis_server::delete_prefix(port, &prefix).map_err(|e| e.to_string())?;
    Ok(())
}

#[test]
fn a_wrong_password_is_one_line_without_the_password() -> TestResult {
    let Some(url) = redis_url() else {
        return Ok(());
    };
    // The test server has no password: AUTH with one fails.
    let with_password = url.replacen("redis://", "redis://:s3cret-pw@", 1);
    let err = idem_err(["stats", with_password.as_str()])?;
    assert!(!err.contains("s3cret-pw"), "{err}");
    Ok(())
}

/// `idem` with `REDISCLI_AUTH` set (or removed, for `None`).
fn idem_with_auth(args: &[&str], auth: Option<&str>) -> TestResult<std::process::Output> {
    let mut cmd = idem_command();
    cmd.args(args);
    match auth {
        Some(pw) => cmd.env("REDISCLI_AUTH", pw),
        None => cmd.env_remove("REDISCLI_AUTH"),
    };
    Ok(cmd.output()?)
}

#[test]
fn a_password_comes_from_rediscli_auth_when_the_url_has_none() -> TestResult {
    const PW: &str = "cli-auth-pw-5d0e";
    let Some(server) =
        redis_server::own_server(&["--requirepass", PW]).map_err(|e| e.to_string())?
    else {
        return Ok(());
    };
    let prefix = "cliauth:";
    let engine = Engine::builder()
        .sweep_interval(None)
        .redis_key_prefix(prefix)
        .open_redis(&format!("redis://:{PW}@127.0.0.1:{}/", server.port))?;
    let done = claim(&engine, &key("shop:pay", "k-1")?, fp("{}")?)?;
    engine.complete(done, Envelope::new(1, 201, "ok"))?;
    drop(engine);

    // No password in the URL (so none in `ps`): REDISCLI_AUTH gives it.
    let url = server.url();
    let args = ["stats", url.as_str(), "--key-prefix", prefix, "--json"];
    let out = idem_with_auth(&args, Some(PW))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(stats["completed"], 1, "{stats}");

    // Without it, or with a wrong one: exit 1, one line naming the
    // variable, never the password tried.
    for auth in [None, Some("not-the-password-9a1")] {
        let out = idem_with_auth(&args, auth)?;
        let stderr = String::from_utf8(out.stderr)?;
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr:?}");
        assert!(stderr.contains("authentication"), "{stderr}");
        assert!(stderr.contains("REDISCLI_AUTH"), "{stderr}");
        assert!(!stderr.contains("not-the-password"), "{stderr}");
    }

    // A password in the URL wins over the variable.
    let with_pw = format!("redis://:{PW}@127.0.0.1:{}/", server.port);
    let out = idem_with_auth(
        &["stats", &with_pw, "--key-prefix", prefix],
        Some("not-the-password-9a1"),
    )?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
