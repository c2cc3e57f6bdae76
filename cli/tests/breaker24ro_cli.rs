//! Every `idem` command on Redis as a user whose ACL allows only reading
//! (`-@all +@read +info +client|id +multi +exec`, the docs' example):
//! the read commands (inspect, show, unknown, dead-letters, stats,
//! verify) work and write nothing; the writing ones (resolve, sweep,
//! purge, redrive) fail with exit code 1 and one line that names the
//! missing permission, never the password, and write nothing either.
//!
//! Starts its own durable `redis-server` (dataset digest compared with
//! `DEBUG DIGEST`); skipped without it, a failure under `CI=true`.

mod common;

#[path = "../../tests/common/redis_server.rs"]
mod redis_server;

use common::*;
use idempotency::{Engine, Envelope, Failure, OutgoingMessage};
use redis_server::{digest, own_server, read_only_user};

const PREFIX: &str = "cli24ro:";
const PW: &str = "cli-reader-pw-81f";

#[test]
fn a_read_only_user_reads_and_is_refused_writes_in_one_line() -> TestResult {
    let Some(server) =
        own_server(&["--enable-debug-command", "local"]).map_err(|e| e.to_string())?
    else {
        return Ok(());
    };
    let engine = Engine::builder()
        .sweep_interval(None)
        .redis_key_prefix(PREFIX)
        .open_redis(&server.url())?;
    let done = claim(&engine, &key("shop:pay", "done")?, fp("{}")?)?;
    engine.complete_with_messages(
        done,
        Envelope::new(1, 201, "ok"),
        vec![OutgoingMessage::new("email", "receipt")],
    )?;
    let outbox = engine.outbox();
    let taken = outbox.take(1)?;
    outbox.give_up(taken.first().ok_or("no message")?, 2, "refused")?;
    let lost = claim(&engine, &key("shop:pay", "lost")?, fp("{}")?)?;
    let reason = "provider timed out".to_string();
    engine.fail(lost, Failure::InDoubt { reason })?;
    drop(engine);
    let url = read_only_user(&server.url(), "reader", PW, Some("~*")).map_err(|e| e.to_string())?;
    let with = |args: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = args.iter().map(|a| (*a).to_string()).collect();
        v.extend(["--key-prefix".to_string(), PREFIX.to_string()]);
        v
    };
    let before = digest(server.port).map_err(|e| e.to_string())?;
    for args in [
        vec!["inspect", &url],
        vec!["show", &url, "shop:pay", "done"],
        vec!["unknown", &url],
        vec!["dead-letters", &url],
        vec!["stats", &url],
        vec!["verify", &url],
    ] {
        let out = idem_ok(with(&args))?;
        assert!(!out.is_empty(), "{args:?} printed nothing");
    }
    for args in [
        vec![
            "resolve",
            &url,
            "shop:pay",
            "lost",
            "--not-executed",
            "--reason",
            "checked",
        ],
        vec!["sweep", &url],
        vec!["purge", &url, "shop:pay", "done"],
        vec!["redrive", &url, "1"],
    ] {
        let err = idem_err(with(&args))?;
        eprintln!("{args:?}: {err}");
        assert!(!err.contains(PW), "the password shows: {err}");
        assert!(
            err.contains("NOPERM") && err.contains("permission"),
            "{args:?}: the line names the missing permission: {err}"
        );
        assert!(
            !err.contains("authentication failed") && !err.contains("does not run Lua"),
            "{args:?}: a permission refusal misread: {err}"
        );
    }
    assert_eq!(
        digest(server.port).map_err(|e| e.to_string())?,
        before,
        "a command wrote"
    );
    Ok(())
}
