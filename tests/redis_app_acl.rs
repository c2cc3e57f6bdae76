//! The app's Redis user with the least the README's ACL grants: guards
//! against a documented ACL that misses a command some path of the engine
//! sends (a `NOPERM` the first time that path runs in production). An
//! engine logged in as that user opens (durability and scripting checks),
//! claims, completes and replays, refuses a changed request, records an
//! in-doubt failure and has it resolved, runs effect steps, fills and
//! drains the outbox and the dead letters, moves an entity, sweeps expired
//! records and verifies, with no permission error anywhere.
//!
//! Starts its own durable `redis-server`; skipped without the binary (a
//! failure under `CI=true`).

#[path = "common/redis_server.rs"]
mod redis_server;

use std::time::Duration;

use idempotency::{
    Begin, EffectStep, Engine, Envelope, Failure, Fingerprint, IdempotencyKey, ManualClock,
    OutgoingMessage, Resolution, Transition,
};
use redis_server::{checked, own_server};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const PREFIX: &str = "aclapp:";
const USER: &str = "idem-app";
const PW: &str = "acl-app-pw-3c7";

/// The ACL rules of the README's "On Redis / Valkey" section, after the
/// user name and password, for keys under [`PREFIX`].
const RULES: &[&str] = &[
    "-@all",
    "+get",
    "+set",
    "+mget",
    "+del",
    "+exists",
    "+incr",
    "+incrby",
    "+scan",
    "+zadd",
    "+zrem",
    "+zrange",
    "+zcount",
    "+zcard",
    "+hset",
    "+hget",
    "+hmget",
    "+hgetall",
    "+hdel",
    "+hlen",
    "+hexists",
    "+eval",
    "+evalsha",
    "+script|load",
    "+multi",
    "+exec",
    "+ping",
    "+info",
    "+config|get",
    "+client|id",
    "+client|kill",
    "+wait",
    "+hkeys",
];

fn key(k: &str) -> Result<IdempotencyKey, Box<dyn std::error::Error>> {
    Ok(IdempotencyKey::new("shop:pay", k)?)
}

fn fp(body: &str) -> Result<Fingerprint, Box<dyn std::error::Error>> {
    Ok(Fingerprint::of_json(body.as_bytes(), &[])?)
}

#[test]
fn the_documented_app_acl_runs_every_path() -> TestResult {
    let Some(server) = own_server(&[]).map_err(|e| e.to_string())? else {
        return Ok(());
    };
    let keys = format!("~{PREFIX}*");
    let pass = format!(">{PW}");
    let mut args = vec!["ACL", "SETUSER", USER, "on", pass.as_str(), keys.as_str()];
    args.extend_from_slice(RULES);
    checked(server.port, &args).map_err(|e| e.to_string())?;

    let clock = ManualClock::new(1_900_000_000_000);
    let engine = Engine::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .ttl(Duration::from_secs(60))
        .redis_key_prefix(PREFIX)
        .redis_password(PW)
        .open_redis(&format!("redis://{USER}@127.0.0.1:{}/", server.port))?;

    // Claim, complete, replay; a changed request is a conflict.
    let Begin::Claimed(c) = engine.begin(&key("k-1")?, fp("{\"n\":1}")?)? else {
        return Err("a fresh key must be claimed".into());
    };
    engine.complete_with_messages(
        c,
        Envelope::new(1, 201, "ok"),
        vec![
            OutgoingMessage::new("email", "receipt"),
            OutgoingMessage::new("ledger", "entry"),
        ],
    )?;
    assert!(matches!(
        engine.begin(&key("k-1")?, fp("{\"n\":1}")?)?,
        Begin::Replay(_)
    ));
    assert!(matches!(
        engine.begin(&key("k-1")?, fp("{\"n\":2}")?)?,
        Begin::Mismatch
    ));

    // Effect steps, then an in-doubt failure an operator resolves.
    let Begin::Claimed(c) = engine.begin(&key("k-2")?, fp("{}")?)? else {
        return Err("a fresh key must be claimed".into());
    };
    assert!(matches!(c.effect("charge")?, EffectStep::Run { .. }));
    c.confirm("charge", b"ch_1")?;
    engine.fail(
        c,
        Failure::InDoubt {
            reason: "mailer timed out".into(),
        },
    )?;
    assert_eq!(engine.in_doubt(10)?.len(), 1);
    assert_eq!(engine.steps(&key("k-2")?)?.len(), 1);
    engine.resolve(
        &key("k-2")?,
        Resolution::Completed(Envelope::new(1, 201, "ok")),
        "provider says charged",
    )?;
    assert!(!engine.history(&key("k-2")?)?.is_empty());

    // Outbox: publish one, give up the other (a dead letter), redrive it.
    let outbox = engine.outbox();
    let taken = outbox.take(10)?;
    assert_eq!(taken.len(), 2);
    outbox.mark_published(&[taken[0].seq])?;
    let dead = outbox
        .give_up(&taken[1], 3, "no such stream")?
        .ok_or("the message must become a dead letter")?;
    assert_eq!(engine.dead_letters(10)?.len(), 1);
    engine.redrive(dead)?;

    // An entity moves once.
    assert!(matches!(
        engine.transition("order-1", &[], "paid")?,
        Transition::Applied { version: 1 }
    ));

    // Expiry: past the TTL, a sweep deletes; verify finds nothing wrong.
    clock.advance(Duration::from_secs(3600));
    let swept = engine.sweep_now()?;
    assert_eq!(swept.deleted + swept.tombstoned, 2, "{swept:?}");
    let report = engine.verify()?;
    assert!(report.is_sound(), "{report:?}");
    assert_eq!(engine.stats()?.completed, 0);
    Ok(())
}
