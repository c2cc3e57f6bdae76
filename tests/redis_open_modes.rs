//! `open_redis_existing` and `open_redis_read_only`: guards against an
//! operator tool's open that writes the engine's layout under a mistyped
//! key prefix or database number, a read-only engine that writes anything
//! (a claim, a sweep, a resolution, a purge, the settings), a read-only
//! open that needs write permissions, scripting or a durable server (so
//! not a replica), and one that accepts a newer layout.
//!
//! Each test starts its own durable `redis-server` (Debian's package) on a
//! free loopback port, so the whole keyspace is the test's: "nothing
//! written" is checked on the server's dataset digest (`DEBUG DIGEST`).
//! Skipped without the binary; a failure under `CI=true`.

#[path = "common/redis_server.rs"]
mod redis_server;

use std::error::Error as StdError;

use idempotency::{
    Begin, Clock, Engine, Envelope, Error, Failure, Fingerprint, IdempotencyKey, ManualClock,
    OpenError, PurgeMode, Resolution,
};
use redis_server::{checked, digest, no_config_user, own_server, read_only_user, OwnServer};

type TestResult = Result<(), Box<dyn StdError + Send + Sync>>;

const PREFIX: &str = "modes:";

fn key(k: &str) -> Result<IdempotencyKey, Error> {
    IdempotencyKey::new("redis-modes", k)
}

fn fp() -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(b"{}", &[])
}

/// A server of this test's own; `None` (skip) without `redis-server`.
fn server() -> Result<Option<OwnServer>, Box<dyn StdError + Send + Sync>> {
    own_server(&["--enable-debug-command", "local"])
}

/// An app engine that leaves one COMPLETED, one UNKNOWN and one
/// PROCESSING record under [`PREFIX`].
fn app_writes(url: &str) -> Result<Engine, Box<dyn StdError + Send + Sync>> {
    let app = Engine::builder()
        .redis_key_prefix(PREFIX)
        .sweep_interval(None)
        .open_redis(url)?;
    // Keys on a server have no redb format.
    assert_eq!(app.redb_format(), None);
    let Begin::Claimed(claim) = app.begin(&key("done")?, fp()?)? else {
        return Err("expected a claim".into());
    };
    app.complete(claim, Envelope::new(1, 201, "ok"))?;
    let Begin::Claimed(claim) = app.begin(&key("in-doubt")?, fp()?)? else {
        return Err("expected a claim".into());
    };
    let reason = "provider timed out".to_string();
    app.fail(claim, Failure::InDoubt { reason })?;
    let Begin::Claimed(claim) = app.begin(&key("running")?, fp()?)? else {
        return Err("expected a claim".into());
    };
    // Held open by the app (forgotten, not dropped: a drop marks it).
    std::mem::forget(claim);
    Ok(app)
}

#[test]
fn a_prefix_without_data_is_refused_and_nothing_is_written() -> TestResult {
    let Some(server) = server()? else {
        return Ok(());
    };
    let url = server.url();
    let before = digest(server.port)?;
    let opens = [
        Engine::builder()
            .redis_key_prefix("typo:")
            .open_redis_existing(&url),
        Engine::builder()
            .redis_key_prefix("typo:")
            .open_redis_read_only(&url),
        // Another database number of the same server.
        Engine::builder()
            .redis_key_prefix(PREFIX)
            .open_redis_read_only(&format!("{url}/3")),
    ];
    for opened in opens {
        match opened {
            Err(e @ OpenError::NoRedisData { .. }) => {
                let text = e.to_string();
                assert!(
                    text.contains("typo:") || text.contains(PREFIX),
                    "the error names the prefix: {text}"
                );
            }
            other => panic!("expected NoRedisData, got {other:?}"),
        }
    }
    assert_eq!(digest(server.port)?, before, "an open wrote to the server");
    Ok(())
}

#[test]
fn read_only_reads_everything_and_writes_nothing() -> TestResult {
    let Some(server) = server()? else {
        return Ok(());
    };
    let url = server.url();
    let app = app_writes(&url)?;

    let tool = Engine::builder()
        .redis_key_prefix(PREFIX)
        .sweep_interval(None)
        .open_redis_existing(&url)?;
    let Begin::Claimed(claim) = tool.begin(&key("by-tool")?, fp()?)? else {
        return Err("expected a claim".into());
    };
    tool.complete(claim, Envelope::new(1, 200, "ok"))?;
    drop(tool);

    let before = digest(server.port)?;
    let reader = Engine::builder()
        .redis_key_prefix(PREFIX)
        .open_redis_read_only(&url)?;
    assert!(reader.record(&key("by-tool")?)?.is_some());
    assert!(matches!(
        reader.begin(&key("done")?, fp()?)?,
        Begin::Replay(_)
    ));
    let listed = reader.records(&Default::default())?;
    assert_eq!(listed.len(), 4, "{listed:?}");
    let in_doubt = reader.in_doubt(10)?;
    assert_eq!(in_doubt.len(), 1, "{in_doubt:?}");
    let report = reader.verify()?;
    assert!(report.damage.is_empty(), "{:?}", report.damage);
    let stats = reader.stats()?;
    assert_eq!((stats.completed, stats.unknown), (2, 1), "{stats:?}");
    let refused = [
        reader.begin(&key("new")?, fp()?).map(drop),
        reader.purge(&key("done")?, PurgeMode::Force).map(drop),
        reader.resolve(&key("in-doubt")?, Resolution::NotExecuted, "test"),
    ];
    for result in refused {
        assert!(
            matches!(result, Err(Error::ReadOnly { .. })),
            "expected Error::ReadOnly, got {result:?}"
        );
    }
    assert!(reader.record(&key("new")?)?.is_none());
    // A sweep with work due (a day later: the app's lease and every TTL
    // have run out) is refused; nothing changed.
    let day_later = idempotency::SystemClock.now_ms() + 2 * 24 * 3600 * 1000;
    let late = Engine::builder()
        .redis_key_prefix(PREFIX)
        .clock(ManualClock::new(day_later))
        .open_redis_read_only(&url)?;
    let swept = late.sweep_now();
    assert!(
        matches!(swept, Err(Error::ReadOnly { .. })),
        "expected Error::ReadOnly, got {swept:?}"
    );
    drop((reader, late));
    assert_eq!(digest(server.port)?, before, "a read-only engine wrote");
    drop(app);
    Ok(())
}

#[test]
fn read_only_needs_only_reading_commands_and_no_durable_server() -> TestResult {
    let Some(server) = server()? else {
        return Ok(());
    };
    let url = server.url();
    drop(app_writes(&url)?);
    // A user allowed to read only (and to ask INFO and CLIENT ID, and to
    // read several keys at one instant in a MULTI): the docs' ACL.
    let reader_url = read_only_user(&url, "reader", "reader-pw", Some("~*"))?;
    // The writing opens are refused by the server's ACL.
    let writable = Engine::builder()
        .redis_key_prefix(PREFIX)
        .open_redis_existing(&reader_url);
    assert!(writable.is_err(), "a read-only user opened for writing");
    // A server that would lose acknowledged writes: a writing open
    // refuses it, a read-only one has nothing to lose.
    checked(server.port, &["CONFIG", "SET", "appendfsync", "everysec"])?;
    let durable = Engine::builder()
        .redis_key_prefix(PREFIX)
        .open_redis_existing(&url);
    assert!(
        matches!(durable, Err(OpenError::RedisNotDurable { .. })),
        "{durable:?}"
    );

    let before = digest(server.port)?;
    let reader = Engine::builder()
        .redis_key_prefix(PREFIX)
        .open_redis_read_only(&reader_url)?;
    assert_eq!(reader.records(&Default::default())?.len(), 3);
    assert_eq!(reader.in_doubt(10)?.len(), 1);
    assert!(reader.record(&key("running")?)?.is_some());
    let report = reader.verify()?;
    assert!(report.damage.is_empty(), "{:?}", report.damage);
    assert!(reader.stats().is_ok());
    drop(reader);
    assert_eq!(digest(server.port)?, before);
    Ok(())
}

/// A read-only user whose ACL allows the reading commands but not the
/// prefix's keys is refused with the key and the missing key pattern named.
#[test]
fn read_only_user_without_the_key_pattern_is_told_to_allow_the_prefix() -> TestResult {
    let Some(server) = server()? else {
        return Ok(());
    };
    drop(app_writes(&server.url())?);
    let url = read_only_user(&server.url(), "nokeys", "nokeys-pw", None)?;
    let Err(refusal) = Engine::builder()
        .redis_key_prefix(PREFIX)
        .open_redis_read_only(&url)
    else {
        return Err("a user without the prefix's keys opened".into());
    };
    let words = refusal.to_string();
    assert!(words.contains("modes:meta"), "{words}");
    assert!(words.contains("(~modes:*)"), "{words}");
    Ok(())
}

#[test]
fn read_only_opens_on_a_replica() -> TestResult {
    let Some(primary) = server()? else {
        return Ok(());
    };
    drop(app_writes(&primary.url())?);
    let port = primary.port.to_string();
    let Some(replica) = own_server(&[
        "--enable-debug-command",
        "local",
        "--replicaof",
        "127.0.0.1",
        &port,
    ])?
    else {
        return Ok(());
    };
    // Wait (at most 20 s) for the replica to hold the primary's data.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while digest(replica.port)? != digest(primary.port)? {
        if std::time::Instant::now() > deadline {
            return Err("the replica did not sync within 20 s".into());
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let before = digest(replica.port)?;
    let writable = Engine::builder()
        .redis_key_prefix(PREFIX)
        .open_redis_existing(&replica.url());
    let Err(refusal) = writable else {
        return Err("a replica opened for writing".into());
    };
    // The refusal names the key and says the primary is needed.
    let words = refusal.to_string();
    assert!(words.contains("modes:meta"), "{words}");
    assert!(
        words.contains("a writable open needs the primary"),
        "{words}"
    );
    let reader = Engine::builder()
        .redis_key_prefix(PREFIX)
        .open_redis_read_only(&replica.url())?;
    assert_eq!(reader.records(&Default::default())?.len(), 3);
    assert!(matches!(
        reader.begin(&key("done")?, fp()?)?,
        Begin::Replay(_)
    ));
    assert!(reader.verify()?.damage.is_empty());
    drop(reader);
    assert_eq!(digest(replica.port)?, before);
    Ok(())
}

#[test]
fn read_only_refuses_a_newer_layout() -> TestResult {
    let Some(server) = server()? else {
        return Ok(());
    };
    let url = server.url();
    drop(app_writes(&url)?);
    checked(
        server.port,
        &["HSET", &format!("{PREFIX}meta"), "format", "99"],
    )?;
    for opened in [
        Engine::builder()
            .redis_key_prefix(PREFIX)
            .open_redis_read_only(&url),
        Engine::builder()
            .redis_key_prefix(PREFIX)
            .open_redis_existing(&url),
    ] {
        assert!(
            matches!(opened, Err(OpenError::UnsupportedSchema { found: 99, .. })),
            "{opened:?}"
        );
    }
    Ok(())
}

/// A managed service blocks `CONFIG` (here: a user allowed everything but
/// it). The writing open refuses the server, saying the settings are
/// unreadable and naming the way out; with `redis_durability_attested` it
/// opens and serves; a setting `CONFIG GET` can read is still checked.
#[test]
fn a_server_that_blocks_config_opens_only_when_the_app_attests_its_durability() -> TestResult {
    let Some(server) = server()? else {
        return Ok(());
    };
    let url = server.url();
    let managed = no_config_user(&url, "managed", "managed-pw")?;

    let refused = Engine::builder()
        .redis_key_prefix("attested:")
        .open_redis(&managed);
    let Err(OpenError::RedisNotDurable { setting, found }) = &refused else {
        return Err(format!("expected RedisNotDurable, got {refused:?}").into());
    };
    assert_eq!(*setting, "appendonly");
    assert!(found.starts_with("unreadable (CONFIG GET: "), "{found}");
    assert!(found.contains("redis_durability_attested(true)"), "{found}");
    assert!(!found.contains("managed-pw"), "{found}");

    let engine = Engine::builder()
        .redis_key_prefix("attested:")
        .sweep_interval(None)
        .redis_durability_attested(true)
        .open_redis(&managed)?;
    let Begin::Claimed(claim) = engine.begin(&key("paid")?, fp()?)? else {
        return Err("expected a claim".into());
    };
    engine.complete(claim, Envelope::new(1, 201, "receipt"))?;
    match engine.begin(&key("paid")?, fp()?)? {
        Begin::Replay(r) => assert_eq!(r.envelope.body, b"receipt"),
        other => return Err(format!("expected a replay, got {other:?}").into()),
    }
    drop(engine);

    // The attestation covers only what cannot be read: where CONFIG GET
    // answers `appendfsync everysec`, the open refuses as without it.
    checked(server.port, &["CONFIG", "SET", "appendfsync", "everysec"])?;
    let readable = Engine::builder()
        .redis_key_prefix("attested:")
        .redis_durability_attested(true)
        .open_redis(&url);
    assert!(
        matches!(
            &readable,
            Err(OpenError::RedisNotDurable { setting: "appendfsync", found }) if found == "everysec"
        ),
        "{readable:?}"
    );
    checked(server.port, &["CONFIG", "SET", "appendfsync", "always"])?;
    Ok(())
}
