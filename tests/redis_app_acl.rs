//! The app's Redis user with the least the README's ACL grants: guards
//! against a documented ACL that misses a command some path of the engine
//! sends (a `NOPERM` the first time that path runs in production). An
//! engine logged in as that user opens (durability and scripting checks),
//! claims, completes and replays, refuses a changed request, records an
//! in-doubt failure and has it resolved, runs effect steps, fills and
//! drains the outbox and the dead letters, moves an entity, sweeps expired
//! records and verifies, with no permission error anywhere. The rules are
//! read from README.md's `ACL SETUSER` block, so the two cannot drift.
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

/// The README's section that documents the app user's ACL.
const ACL_SECTION: &str = "## On Redis / Valkey";
/// The key pattern of the README's ACL: the default `redis_key_prefix`.
const README_KEYS: &str = "~idempotency:*";

/// The ACL rules (`+command`, `-@category`, ...) of the `ACL SETUSER`
/// block in the README's "On Redis / Valkey" section, read from README.md
/// so the test runs what the README documents. The user name, `on`, the
/// password and the key pattern are checked and left out (the test gives
/// its own); any other token is an error, so a rule of a kind this parser
/// does not know cannot be dropped silently.
fn documented_rules() -> Result<Vec<String>, Box<dyn std::error::Error>> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/README.md");
    let readme = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let section = readme
        .split_once(ACL_SECTION)
        .map(|(_, rest)| rest)
        .ok_or_else(|| format!("{path} has no \"{ACL_SECTION}\" section"))?;
    // The section ends at the next `## ` heading.
    let section = section.split("\n## ").next().unwrap_or(section);
    // Every other piece of the split is a fenced block: its first line is
    // the info string (`text`), the rest its body.
    let mut tokens = section
        .split("```")
        .skip(1)
        .step_by(2)
        .map(|b| b.split_once('\n').map_or("", |(_, body)| body))
        .map(str::split_whitespace)
        .find(|t| t.clone().take(2).eq(["ACL", "SETUSER"]))
        .ok_or_else(|| {
            format!(
                "{path}: no fenced block starting with `ACL SETUSER` in its \"{ACL_SECTION}\" \
                 section: the app user's ACL this test runs is documented there"
            )
        })?
        .skip(2);
    let user = tokens
        .next()
        .ok_or("the README's ACL SETUSER names no user")?;
    let mut rules = Vec::new();
    let mut keys = None;
    for token in tokens {
        match token.chars().next() {
            Some('+' | '-') => rules.push(token.to_owned()),
            Some('~') => keys = Some(token),
            Some('>') => {}
            _ if token == "on" => {}
            _ => {
                return Err(format!(
                    "the README's ACL for {user} has a token this test cannot place: {token:?}"
                )
                .into())
            }
        }
    }
    if keys != Some(README_KEYS) {
        return Err(format!(
            "the README's ACL for {user} grants keys {keys:?}, not {README_KEYS:?}"
        )
        .into());
    }
    if rules.first().map(String::as_str) != Some("-@all") {
        return Err(format!(
            "the README's ACL for {user} does not start its rules with -@all: {rules:?}"
        )
        .into());
    }
    Ok(rules)
}

fn key(k: &str) -> Result<IdempotencyKey, Box<dyn std::error::Error>> {
    Ok(IdempotencyKey::new("shop:pay", k)?)
}

fn fp(body: &str) -> Result<Fingerprint, Box<dyn std::error::Error>> {
    Ok(Fingerprint::of_json(body.as_bytes(), &[])?)
}

#[test]
fn the_documented_app_acl_runs_every_path() -> TestResult {
    // Read first: a README that lost its ACL block fails without Redis too.
    let rules = documented_rules()?;
    assert!(rules.len() > 20, "too few rules read: {rules:?}");
    let Some(server) = own_server(&[]).map_err(|e| e.to_string())? else {
        return Ok(());
    };
    let keys = format!("~{PREFIX}*");
    let pass = format!(">{PW}");
    let mut args = vec!["ACL", "SETUSER", USER, "on", pass.as_str(), keys.as_str()];
    args.extend(rules.iter().map(String::as_str));
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
