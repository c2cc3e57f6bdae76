//! Breaking `open_redis_existing` and `open_redis_read_only`: every read
//! an operator tool makes (steps, history, dead letters, the outbox, an
//! entity's state, a begin on settled, in-doubt and running keys, a sweep
//! with nothing due, a flush) through a read-only engine opened as a user
//! whose ACL allows only reading, with the dataset digest unchanged; a
//! writing open as that user named as a permission problem (not a wrong
//! password, not a server without scripting); a damaged `<prefix>meta`
//! (another Redis type, a format that is no integer or no version) on
//! each open mode, refused naming the prefix with nothing written; and a
//! prefix with no data beside a longer one that has some.
//!
//! Each test starts its own durable `redis-server`, so "nothing written"
//! is checked on the server's dataset digest (`DEBUG DIGEST`). Skipped
//! without the binary; a failure under `CI=true`.

#[path = "common/redis_server.rs"]
mod redis_server;

use std::error::Error as StdError;

use idempotency::{
    Begin, Engine, Envelope, Failure, Fingerprint, IdempotencyKey, OpenError, OutgoingMessage,
};
use redis_server::{checked, digest, own_server, read_only_user, OwnServer};

type TestResult = Result<(), Box<dyn StdError + Send + Sync>>;

const PREFIX: &str = "ro24:";
const READER_PW: &str = "reader-pw-5d2";

fn key(k: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("ro24", k)
}

fn fp() -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(b"{}", &[])
}

fn server() -> Result<Option<OwnServer>, Box<dyn StdError + Send + Sync>> {
    own_server(&["--enable-debug-command", "local"])
}

/// The read-only user of the docs; its URL.
fn reader_url(server: &OwnServer) -> Result<String, Box<dyn StdError + Send + Sync>> {
    read_only_user(&server.url(), "reader", READER_PW, Some("~*"))
}

/// An app that leaves under [`PREFIX`]: `done` (COMPLETED, with a
/// confirmed effect step and one outbox message, another given up to
/// the dead letters), `in-doubt` (UNKNOWN), `running` (PROCESSING, held),
/// and the entity `order-1` in state `open`.
fn app_writes(url: &str) -> Result<Engine, Box<dyn StdError + Send + Sync>> {
    let app = Engine::builder()
        .redis_key_prefix(PREFIX)
        .sweep_interval(None)
        .open_redis(url)?;
    let Begin::Claimed(claim) = app.begin(&key("done")?, fp()?)? else {
        return Err("expected a claim".into());
    };
    let _step = claim.effect("charge")?;
    claim.confirm("charge", b"ch_1")?;
    app.complete_with_messages(
        claim,
        Envelope::new(1, 201, "ok"),
        vec![
            OutgoingMessage::new("email", "receipt"),
            OutgoingMessage::new("ledger", "entry"),
        ],
    )?;
    let outbox = app.outbox();
    let taken = outbox.take(10)?;
    let first = taken.first().ok_or("no outbox message")?;
    outbox
        .give_up(first, 3, "broker refused it")?
        .ok_or("not given up")?;
    let Begin::Claimed(claim) = app.begin(&key("in-doubt")?, fp()?)? else {
        return Err("expected a claim".into());
    };
    let reason = "provider timed out".to_string();
    app.fail(claim, Failure::InDoubt { reason })?;
    let Begin::Claimed(claim) = app.begin(&key("running")?, fp()?)? else {
        return Err("expected a claim".into());
    };
    std::mem::forget(claim);
    app.transition("order-1", &[], "open")?;
    Ok(app)
}

#[test]
fn every_read_of_a_read_only_user_works_and_writes_nothing() -> TestResult {
    let Some(server) = server()? else {
        return Ok(());
    };
    let app = app_writes(&server.url())?;
    let url = reader_url(&server)?;
    let before = digest(server.port)?;
    let reader = Engine::builder()
        .redis_key_prefix(PREFIX)
        .open_redis_read_only(&url)?;
    let done = key("done")?;
    assert!(matches!(reader.begin(&done, fp()?)?, Begin::Replay(_)));
    assert!(matches!(
        reader.begin(&key("in-doubt")?, fp()?)?,
        Begin::InDoubt(_)
    ));
    assert!(matches!(
        reader.begin(&key("running")?, fp()?)?,
        Begin::Processing { .. }
    ));
    let steps = reader.steps(&done)?;
    assert_eq!(steps.len(), 1, "{steps:?}");
    reader.history(&done)?;
    assert_eq!(reader.dead_letters(10)?.len(), 1);
    assert_eq!(reader.outbox().len()?, 1);
    assert_eq!(reader.outbox().take(10)?.len(), 1);
    assert_eq!(
        reader.entity_state("order-1")?.map(|(s, _)| s).as_deref(),
        Some("open")
    );
    assert!(reader.entity_state("order-2")?.is_none());
    assert_eq!(reader.records(&Default::default())?.len(), 3);
    assert_eq!(reader.in_doubt(10)?.len(), 1);
    reader.stats()?;
    let report = reader.verify()?;
    assert!(report.damage.is_empty(), "{:?}", report.damage);
    reader.flush()?;
    // Nothing due now: the sweep has nothing to do, or is refused.
    match reader.sweep_now() {
        Ok(counts) => assert_eq!(counts, Default::default()),
        Err(idempotency::Error::ReadOnly { .. }) => {}
        Err(e) => return Err(format!("sweep_now: {e}").into()),
    }
    drop(reader);
    assert_eq!(digest(server.port)?, before, "a read-only engine wrote");
    drop(app);
    Ok(())
}

#[test]
fn a_writing_open_as_a_read_only_user_names_the_permission() -> TestResult {
    let Some(server) = server()? else {
        return Ok(());
    };
    drop(app_writes(&server.url())?);
    let url = reader_url(&server)?;
    let before = digest(server.port)?;
    for opened in [
        Engine::builder()
            .redis_key_prefix(PREFIX)
            .open_redis_existing(&url),
        Engine::builder().redis_key_prefix(PREFIX).open_redis(&url),
    ] {
        let err = match opened {
            Ok(_) => return Err("a read-only user opened for writing".into()),
            Err(e) => e.to_string(),
        };
        assert!(!err.contains(READER_PW), "the password shows: {err}");
        // The password is right: the ACL forbids the command.
        assert!(
            !err.contains("authentication failed") && !err.contains("check the user name"),
            "a permission refusal reads as a wrong password: {err}"
        );
        assert!(
            !err.contains("does not run Lua scripts"),
            "a permission refusal reads as a server without scripting: {err}"
        );
        assert!(
            err.contains("NOPERM") && err.contains("permission"),
            "the refusal names the permission: {err}"
        );
    }
    assert_eq!(digest(server.port)?, before);
    Ok(())
}

#[test]
fn a_damaged_meta_is_refused_on_every_open_mode_naming_the_prefix() -> TestResult {
    let Some(server) = server()? else {
        return Ok(());
    };
    let url = server.url();
    drop(app_writes(&url)?);
    let meta = format!("{PREFIX}meta");
    type Damage = &'static [&'static [&'static str]];
    let damages: [(&str, Damage); 5] = [
        ("a string", &[&["DEL", "M"], &["SET", "M", "1"]]),
        ("a list", &[&["DEL", "M"], &["RPUSH", "M", "1"]]),
        ("format not an integer", &[&["HSET", "M", "format", "one"]]),
        ("format 1.5", &[&["HSET", "M", "format", "1.5"]]),
        ("ttl_ms not an integer", &[&["HSET", "M", "ttl_ms", "x"]]),
    ];
    for (what, commands) in damages {
        // Back to the app's meta, then damaged.
        checked(server.port, &["DEL", &meta])?;
        drop(
            Engine::builder()
                .redis_key_prefix(PREFIX)
                .sweep_interval(None)
                .open_redis(&url)?,
        );
        for command in commands {
            let args: Vec<&str> = command
                .iter()
                .map(|a| if *a == "M" { meta.as_str() } else { a })
                .collect();
            checked(server.port, &args)?;
        }
        let before = digest(server.port)?;
        let opens: [(&str, Result<Engine, OpenError>); 4] = [
            (
                "read-only",
                Engine::builder()
                    .redis_key_prefix(PREFIX)
                    .open_redis_read_only(&url),
            ),
            (
                "existing",
                Engine::builder()
                    .redis_key_prefix(PREFIX)
                    .sweep_interval(None)
                    .open_redis_existing(&url),
            ),
            (
                "create",
                Engine::builder()
                    .redis_key_prefix(PREFIX)
                    .sweep_interval(None)
                    .open_redis(&url),
            ),
            (
                "stored expiry",
                Engine::builder()
                    .redis_key_prefix(PREFIX)
                    .sweep_interval(None)
                    .expiry_settings_from_database()
                    .open_redis_existing(&url),
            ),
        ];
        for (mode, opened) in opens {
            let err = match opened {
                Ok(_) => return Err(format!("{what}: the {mode} open accepted it").into()),
                Err(e) => e.to_string(),
            };
            eprintln!("{what} / {mode}: {err}");
            assert!(
                err.contains(&meta),
                "{what} / {mode}: the error names {meta}: {err}"
            );
        }
        assert_eq!(digest(server.port)?, before, "{what}: an open wrote");
    }
    Ok(())
}

#[test]
fn a_format_that_is_no_version_is_refused_not_rewritten() -> TestResult {
    let Some(server) = server()? else {
        return Ok(());
    };
    let url = server.url();
    drop(app_writes(&url)?);
    let meta = format!("{PREFIX}meta");
    for format in ["0", "-1"] {
        checked(server.port, &["HSET", &meta, "format", format])?;
        let before = digest(server.port)?;
        for opened in [
            Engine::builder()
                .redis_key_prefix(PREFIX)
                .open_redis_read_only(&url),
            Engine::builder()
                .redis_key_prefix(PREFIX)
                .sweep_interval(None)
                .open_redis_existing(&url),
            Engine::builder()
                .redis_key_prefix(PREFIX)
                .sweep_interval(None)
                .open_redis(&url),
        ] {
            let err = match opened {
                Ok(_) => return Err(format!("format {format} was accepted").into()),
                Err(e) => e.to_string(),
            };
            assert!(err.contains(&meta), "{err}");
        }
        assert_eq!(digest(server.port)?, before, "format {format}: rewritten");
    }
    Ok(())
}

#[test]
fn an_empty_prefix_beside_a_longer_one_with_data() -> TestResult {
    let Some(server) = server()? else {
        return Ok(());
    };
    let url = server.url();
    let nested = Engine::builder()
        .redis_key_prefix("ten:eu:")
        .sweep_interval(None)
        .open_redis(&url)?;
    let Begin::Claimed(claim) = nested.begin(&key("eu")?, fp()?)? else {
        return Err("expected a claim".into());
    };
    nested.complete(claim, Envelope::new(1, 200, "eu"))?;
    let before = digest(server.port)?;
    for opened in [
        Engine::builder()
            .redis_key_prefix("ten:")
            .open_redis_read_only(&url),
        Engine::builder()
            .redis_key_prefix("ten:")
            .open_redis_existing(&url),
    ] {
        assert!(
            matches!(opened, Err(OpenError::NoRedisData { .. })),
            "{opened:?}"
        );
    }
    assert_eq!(digest(server.port)?, before);
    // Once `ten:` has a layout, its engines see none of `ten:eu:`'s.
    drop(
        Engine::builder()
            .redis_key_prefix("ten:")
            .sweep_interval(None)
            .open_redis(&url)?,
    );
    let outer = Engine::builder()
        .redis_key_prefix("ten:")
        .open_redis_read_only(&url)?;
    assert!(outer.records(&Default::default())?.is_empty());
    assert!(outer.record(&key("eu")?)?.is_none());
    let report = outer.verify()?;
    assert!(report.damage.is_empty(), "{:?}", report.damage);
    assert_eq!(outer.stats()?.completed, 0);
    Ok(())
}

#[test]
fn a_read_only_user_a_day_later_reads_expired_leases_without_writing() -> TestResult {
    let Some(server) = server()? else {
        return Ok(());
    };
    let app = app_writes(&server.url())?;
    let url = reader_url(&server)?;
    let before = digest(server.port)?;
    // A day later: the app's lease on `running` has run out, and every
    // TTL: reads must decide on read-time truth, not write it back.
    let day_later = idempotency::Clock::now_ms(&idempotency::SystemClock) + 2 * 24 * 3600 * 1000;
    let reader = Engine::builder()
        .redis_key_prefix(PREFIX)
        .clock(idempotency::ManualClock::new(day_later))
        .open_redis_read_only(&url)?;
    let in_doubt = reader.in_doubt(10)?;
    assert_eq!(in_doubt.len(), 2, "{in_doubt:?}");
    reader.records(&Default::default())?;
    reader.stats()?;
    reader.verify()?;
    for name in ["running", "done", "in-doubt"] {
        match reader.begin(&key(name)?, fp()?) {
            Ok(_) | Err(idempotency::Error::ReadOnly { .. }) => {}
            Err(e) => return Err(format!("begin {name}: {e}").into()),
        }
    }
    drop(reader);
    assert_eq!(digest(server.port)?, before, "a read-only engine wrote");
    drop(app);
    Ok(())
}
