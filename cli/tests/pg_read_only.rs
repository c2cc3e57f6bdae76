//! The read-only commands on PostgreSQL write nothing: guards against a
//! `stats`, `inspect`, `show`, `unknown` or `verify` that stores settings,
//! sweeps, marks a record or draws a fencing token while it looks. They run
//! as a role that may only `SELECT` the engine's tables (no privilege on
//! its sequences) and must succeed; and as the superuser, after which a
//! digest of every table's rows and each sequence's `last_value` must be
//! unchanged. A writing command as that role must fail (so the role really
//! cannot write).

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::pg::{checksums, client, pg_url, select_only_role, unique_prefix};
use common::*;
use idempotency::{Begin, EffectStep, Engine, Envelope, Failure, ManualClock, OutgoingMessage};

const HOUR: Duration = Duration::from_secs(3600);

/// Records a writable open or a sweep would change: a COMPLETED one past
/// its TTL, a PROCESSING one whose lease ran out, an UNKNOWN one, and an
/// outbox message.
fn populate(url: &str, prefix: &str) -> TestResult {
    let now = SystemTime::now().duration_since(UNIX_EPOCH)?;
    let clock = ManualClock::new(u64::try_from((now - 3 * HOUR).as_millis())?);
    let engine = Engine::builder()
        .clock(clock.clone())
        .ttl(HOUR)
        .sweep_interval(None)
        .table_prefix(prefix)
        .database_clock(false)
        .open_postgres(url)?;
    let c = claim(&engine, &key("shop", "expired")?, fp("{}")?)?;
    let message = OutgoingMessage::new("payments", "p_1");
    engine.complete_with_messages(c, Envelope::new(1, 201, "ok"), vec![message])?;
    let c = claim(&engine, &key("shop", "unknown")?, fp("{}")?)?;
    let reason = "provider timed out".to_string();
    engine.fail(c, Failure::InDoubt { reason })?;
    // A key with an effect step in doubt: show and unknown read the step
    // and history tables too.
    let c = claim(&engine, &key("shop", "steps")?, fp("{}")?)?;
    assert!(matches!(c.effect("charge")?, EffectStep::Run { .. }));
    let reason = "provider timed out".to_string();
    engine.fail(c, Failure::InDoubt { reason })?;
    let k = key("shop", "stale")?;
    let Begin::Claimed(stale) = engine.begin_with_lease(&k, fp("{}")?, Duration::from_secs(30))?
    else {
        return Err("expected a claim".into());
    };
    drop(engine);
    drop(stale);
    Ok(())
}

/// Every read-only command, with the DB argument and prefix after the
/// subcommand.
fn read_only_commands(db: &str, prefix: &str) -> Vec<Vec<String>> {
    let with = |args: &[&str]| {
        let mut v = vec![args[0].to_string(), db.to_string()];
        v.extend(args[1..].iter().map(|a| (*a).to_string()));
        v.extend(["--table-prefix".to_string(), prefix.to_string()]);
        v
    };
    vec![
        with(&["stats"]),
        with(&["stats", "--json"]),
        with(&["inspect"]),
        with(&["inspect", "--json", "--state", "UNKNOWN"]),
        with(&["show", "shop", "expired"]),
        with(&["show", "shop", "stale", "--json"]),
        with(&["show", "shop", "steps"]),
        with(&["show", "shop", "steps", "--json"]),
        with(&["unknown"]),
        with(&["unknown", "--json"]),
        with(&["verify"]),
        with(&["verify", "--json"]),
    ]
}

#[test]
fn read_only_commands_write_nothing() -> TestResult {
    let Some(url) = pg_url() else { return Ok(()) };
    let prefix = unique_prefix("ro");
    populate(&url, &prefix)?;
    let mut admin = client(&url)?;
    let before = checksums(&mut admin, &prefix)?;
    let reader = select_only_role(&mut admin, &url, &prefix)?;

    for db in [&reader, &url] {
        for args in read_only_commands(db, &prefix) {
            let out = idem_ok(&args)?;
            assert!(!out.is_empty(), "idem {args:?} printed nothing");
        }
    }
    // What they saw: the stale claim counts as UNKNOWN, nothing was swept.
    let stats = idem_ok(["stats", reader.as_str(), "--table-prefix", &prefix])?;
    assert!(stats.contains("UNKNOWN        3"), "{stats}");
    assert!(stats.contains("expired        1"), "{stats}");

    assert_eq!(checksums(&mut admin, &prefix)?, before);

    // The role cannot write: a writing command fails, and writes nothing.
    let err = idem_err(["sweep", reader.as_str(), "--table-prefix", &prefix])?;
    assert!(err.contains("permission denied"), "{err}");
    assert_eq!(checksums(&mut admin, &prefix)?, before);

    // As the superuser the same command does write (the digests see it).
    let swept = idem_ok(["sweep", url.as_str(), "--table-prefix", &prefix])?;
    assert!(swept.contains("moved to UNKNOWN: 1, deleted: 1"), "{swept}");
    assert_ne!(checksums(&mut admin, &prefix)?, before);
    Ok(())
}
