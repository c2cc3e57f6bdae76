//! The server-side work of a fresh-key request on Redis, counted: guards
//! against index upkeep creeping back onto the hot path. One request is
//! `begin` of a fresh key, then `complete` with a 300-byte response (the
//! bench's request); the server's `INFO commandstats` (reset before) counts
//! every command, those a script runs included. The engine must stay at
//! the per-request budget below (2 `EVALSHA`, 11 commands inside them) and
//! still leave a store `verify` finds sound.
//!
//! Starts its own `redis-server` (appendonly yes, appendfsync always) so no
//! other test's traffic is counted; skipped without the binary (a failure
//! under `CI=true`).

use std::collections::BTreeMap;

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey};

#[path = "common/redis_server.rs"]
mod redis_server;

use redis_server::{own_server, BoxError};

type TestResult = Result<(), BoxError>;

/// Requests counted.
const REQUESTS: u64 = 200;

/// Commands per fresh-key request, `EVALSHA` included: the claim script
/// (`GET`, `EXISTS` of the steps, `INCR`, `SET`, `ZADD` lease, `ZADD`
/// listing) and the completion (`GET` and one `EXISTS` as guards, `SET`,
/// `ZREM` lease, `ZADD` expiry). It was 17 before the index upkeep was cut.
const BUDGET: u64 = 13;

/// What opening a pooled connection sends (redis-rs's `CLIENT SETINFO`,
/// the engine's `CLIENT ID`, and `HELLO`, `AUTH`, `SELECT` where the URL
/// asks for them): counted apart from the requests' commands.
const CONNECTION_SETUP: [&str; 5] = ["client|setinfo", "client|id", "hello", "auth", "select"];

/// `INFO commandstats` as command name → calls.
fn commandstats(conn: &mut redis::Connection) -> Result<BTreeMap<String, u64>, BoxError> {
    let info: String = redis::cmd("INFO").arg("commandstats").query(conn)?;
    let mut calls = BTreeMap::new();
    for line in info.lines() {
        let Some(rest) = line.strip_prefix("cmdstat_") else {
            continue;
        };
        let (name, stats) = rest
            .split_once(':')
            .ok_or("a commandstats line without ':'")?;
        let n = stats
            .split(',')
            .find_map(|kv| kv.strip_prefix("calls="))
            .ok_or("a commandstats line without calls=")?
            .parse()?;
        calls.insert(name.to_owned(), n);
    }
    Ok(calls)
}

#[test]
fn a_fresh_key_request_stays_within_its_command_budget() -> TestResult {
    let Some(s) = own_server(&[])? else {
        return Ok(());
    };
    let engine = Engine::builder()
        .sweep_interval(None)
        .redis_key_prefix("cmds:")
        .open_redis(s.url().as_str())?;
    let fp = Fingerprint::from_bytes([7; 32]);
    let request = |n: u64| -> TestResult {
        let key = IdempotencyKey::new("cmds", format!("k-{n}"))?;
        let Begin::Claimed(claim) = engine.begin(&key, fp)? else {
            return Err(format!("fresh key {key} was not claimed").into());
        };
        engine.complete(claim, Envelope::new(1, 201, vec![b'x'; 300]))?;
        Ok(())
    };
    // Warm: every pooled connection made, the scripts loaded.
    request(u64::MAX)?;
    let mut admin = redis::Client::open(s.url().as_str())?.get_connection()?;
    redis::cmd("CONFIG").arg("RESETSTAT").exec(&mut admin)?;
    for n in 0..REQUESTS {
        request(n)?;
    }
    let mut calls = commandstats(&mut admin)?;
    calls.remove("info");
    calls.remove("config|resetstat");
    // A connection the pool opens while the requests run (r2d2 keeps one
    // idle connection and opens its replacement on a thread of its own,
    // so one opened for the warm request may land after the reset) says
    // who it is once: not a request's work.
    let setup: BTreeMap<String, u64> = CONNECTION_SETUP
        .iter()
        .filter_map(|name| calls.remove_entry(*name))
        .collect();
    let total: u64 = calls.values().sum();
    println!(
        "{REQUESTS} requests: {total} commands ({:.2} per request): {calls:?}; connection setup: {setup:?}",
        total as f64 / REQUESTS as f64
    );
    assert_eq!(
        calls.get("evalsha"),
        Some(&(2 * REQUESTS)),
        "two scripts per request: {calls:?}"
    );
    assert!(
        total <= BUDGET * REQUESTS,
        "{total} commands for {REQUESTS} requests, over the budget of {BUDGET} each: {calls:?}"
    );
    let report = engine.verify()?;
    assert!(report.is_sound(), "{report:?}");
    Ok(())
}
