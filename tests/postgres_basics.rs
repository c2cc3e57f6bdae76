//! The PostgreSQL backend's own rules, beyond the behaviour it shares with
//! redb (tests/backends.rs): the schema is versioned and a newer one is
//! refused untouched, table prefixes are checked, two engines on one
//! database race for a key and exactly one wins, leases follow the
//! database's clock whatever the app servers' clocks say, and a changed
//! byte in a stored record is caught by its checksum.
//!
//! Needs a server: `IDEMPOTENCY_TEST_PG` (set by `scripts/with-postgres`).
//! Without it the tests are skipped, except under `CI=true`, where they fail.

use std::error::Error as StdError;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Barrier;
use std::time::Duration;

use idempotency::{
    Begin, Clock, Corrupted, Engine, Envelope, Fingerprint, IdempotencyKey, OpenError, SystemClock,
};

type TestResult = Result<(), Box<dyn StdError + Send + Sync>>;

/// The server's connection string, or `None` (skip) outside CI.
fn server() -> Option<String> {
    match std::env::var("IDEMPOTENCY_TEST_PG") {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("CI=true but IDEMPOTENCY_TEST_PG is not set: run the tests through scripts/with-postgres")
        }
        _ => {
            eprintln!("skipped: IDEMPOTENCY_TEST_PG not set (run through scripts/with-postgres)");
            None
        }
    }
}

/// A table prefix no other test uses.
fn prefix() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "tb_{}_{}_",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn key(k: &str) -> IdempotencyKey {
    IdempotencyKey::new("pg-basics", k).expect("valid key")
}

fn fp(body: &str) -> Fingerprint {
    Fingerprint::of_json(body.as_bytes(), &[]).expect("valid JSON")
}

#[test]
fn claim_complete_replay_and_mismatch() -> TestResult {
    let Some(url) = server() else { return Ok(()) };
    let engine = Engine::builder()
        .table_prefix(prefix())
        .sweep_interval(None)
        .open_postgres(&url)?;
    // Tables on a server have no redb format.
    assert_eq!(engine.redb_format(), None);
    let k = key("a");
    let Begin::Claimed(claim) = engine.begin(&k, fp(r#"{"amount":1}"#))? else {
        panic!("a fresh key must be claimed");
    };
    engine.complete(claim, Envelope::new(1, 201, b"charged 1".to_vec()))?;
    match engine.begin(&k, fp(r#"{"amount":1}"#))? {
        Begin::Replay(replay) => assert_eq!(replay.envelope.body, b"charged 1"),
        other => panic!("expected a replay, got {other:?}"),
    }
    assert!(matches!(
        engine.begin(&k, fp(r#"{"amount":2}"#))?,
        Begin::Mismatch
    ));
    Ok(())
}

#[test]
fn two_engines_race_and_one_wins() -> TestResult {
    let Some(url) = server() else { return Ok(()) };
    let p = prefix();
    let open = || {
        Engine::builder()
            .table_prefix(p.clone())
            .sweep_interval(None)
            .open_postgres(&url)
    };
    let (a, b) = (open()?, open()?);
    let wins = AtomicUsize::new(0);
    let rounds = 50;
    let barrier = Barrier::new(8);
    std::thread::scope(|s| {
        for t in 0..8 {
            let (engine, wins, barrier) = (if t % 2 == 0 { &a } else { &b }, &wins, &barrier);
            s.spawn(move || {
                for i in 0..rounds {
                    barrier.wait();
                    let begun = engine.begin(&key(&format!("race-{i}")), fp("{}"));
                    if let Ok(Begin::Claimed(claim)) = begun {
                        wins.fetch_add(1, Ordering::SeqCst);
                        engine
                            .complete(claim, Envelope::new(1, 200, b"ok".to_vec()))
                            .expect("complete");
                    }
                }
            });
        }
    });
    assert_eq!(wins.load(Ordering::SeqCst), rounds);
    Ok(())
}

#[test]
fn a_newer_schema_is_refused_and_left_alone() -> TestResult {
    let Some(url) = server() else { return Ok(()) };
    let p = prefix();
    drop(
        Engine::builder()
            .table_prefix(p.clone())
            .open_postgres(&url)?,
    );
    let mut client = idempotency::postgres::Client::connect(&url, idempotency::postgres::NoTls)?;
    let meta = format!("{p}meta");
    client.execute(
        &format!("UPDATE {meta} SET value = 99 WHERE name = 'schema_version'"),
        &[],
    )?;
    match Engine::builder()
        .table_prefix(p.clone())
        .open_postgres(&url)
    {
        Err(OpenError::UnsupportedSchema { found: 99, .. }) => {}
        other => panic!("expected UnsupportedSchema, got {other:?}"),
    }
    let version: i64 = client
        .query_one(
            &format!("SELECT value FROM {meta} WHERE name = 'schema_version'"),
            &[],
        )?
        .get(0);
    assert_eq!(version, 99, "the refused open changed the schema version");
    Ok(())
}

#[test]
fn bad_prefixes_and_unreachable_servers_are_clear_errors() {
    for bad in ["", "Caps_", "9lives_", "drop table x;", &"a".repeat(41)] {
        match Engine::builder()
            .table_prefix(bad)
            .open_postgres("host=127.0.0.1")
        {
            Err(OpenError::InvalidTablePrefix { prefix, .. }) => assert_eq!(prefix, bad),
            other => panic!("prefix {bad:?}: expected InvalidTablePrefix, got {other:?}"),
        }
    }
    match Engine::builder().open_postgres("this is not a connection string") {
        Err(OpenError::Storage { .. }) => {}
        other => panic!("expected a storage error, got {other:?}"),
    }
}

/// A clock that runs `offset` ahead of (or behind) the system clock, as an
/// app server with a badly set clock would.
#[derive(Debug)]
struct Skewed(i64);

impl Clock for Skewed {
    fn now_ms(&self) -> u64 {
        SystemClock.now_ms().saturating_add_signed(self.0)
    }
}

#[test]
fn leases_follow_the_database_clock_not_the_app_servers() -> TestResult {
    let Some(url) = server() else { return Ok(()) };
    let p = prefix();
    let hour: i64 = 3_600_000;
    let behind = Engine::builder()
        .table_prefix(p.clone())
        .clock(Skewed(-hour))
        .lease(Duration::from_secs(60))
        .sweep_interval(None)
        .open_postgres(&url)?;
    let ahead = Engine::builder()
        .table_prefix(p.clone())
        .clock(Skewed(hour))
        .sweep_interval(None)
        .open_postgres(&url)?;
    // Both engines read (about) the database's time.
    let gap = behind.clock().now_ms().abs_diff(ahead.clock().now_ms());
    assert!(gap < 5_000, "engines disagree by {gap} ms");
    // A 60 s lease taken by the server whose clock is an hour behind is
    // not stale for the server an hour ahead: it answers Processing.
    let k = key("skew");
    let Begin::Claimed(claim) = behind.begin(&k, fp("{}"))? else {
        panic!("a fresh key must be claimed");
    };
    match ahead.begin(&k, fp("{}"))? {
        Begin::Processing { .. } => {}
        other => panic!("the lease must still run for the other server, got {other:?}"),
    }
    assert_eq!(ahead.sweep_now()?.moved_to_unknown, 0);
    behind.complete(claim, Envelope::new(1, 200, b"done".to_vec()))?;
    // Without the database clock, the same skew breaks the lease: the
    // server an hour ahead sees it as run out. (This is what the default
    // prevents.)
    let skewed = Engine::builder()
        .table_prefix(p)
        .clock(Skewed(hour))
        .database_clock(false)
        .sweep_interval(None)
        .open_postgres(&url)?;
    let k2 = key("skew-2");
    let Begin::Claimed(_claim) = behind.begin(&k2, fp("{}"))? else {
        panic!("a fresh key must be claimed");
    };
    assert!(
        matches!(skewed.begin(&k2, fp("{}"))?, Begin::InDoubt(_)),
        "with local clocks an hour apart the lease looks run out"
    );
    Ok(())
}

/// The synchronous client may not block on an async runtime's thread
/// (tokio panics, and the client's destructor then aborts the process):
/// the engine runs such calls on a thread of its own, so opening, calling
/// and dropping inside an async task work as they do on redb.
#[test]
fn calls_on_an_async_runtime_thread_work() -> TestResult {
    let Some(url) = server() else { return Ok(()) };
    let runtime = tokio::runtime::Builder::new_current_thread().build()?;
    runtime.block_on(async {
        let engine = Engine::builder()
            .table_prefix(prefix())
            .sweep_interval(None)
            .open_postgres(&url)?;
        let k = key("async");
        let Begin::Claimed(claim) = engine.begin(&k, fp("{}"))? else {
            panic!("a fresh key must be claimed");
        };
        engine.complete(claim, Envelope::new(1, 200, b"from a task".to_vec()))?;
        assert!(matches!(engine.begin(&k, fp("{}"))?, Begin::Replay(_)));
        drop(engine);
        Ok(())
    })
}

/// Two engines on one prefix with different expiry policies (a rolling
/// deploy that switches `Tombstone` to `Forget`, or two services sharing
/// the tables): the Forget engine's sweeper would delete the tombstone the
/// other promised to keep, and that one would then claim the key again.
/// The second open is refused; one that follows the stored settings works
/// and keeps the tombstone.
#[test]
fn engines_with_different_expiry_policies_on_one_prefix_never_execute_twice() -> TestResult {
    use idempotency::{ExpiryPolicy, ManualClock};
    let Some(url) = server() else { return Ok(()) };
    let p = prefix();
    let clock = ManualClock::new(1_700_000_000_000);
    let builder = || {
        Engine::builder()
            .table_prefix(p.clone())
            .database_clock(false)
            .clock(clock.clone())
            .sweep_interval(None)
            .ttl(Duration::from_secs(10))
    };
    let tomb = builder()
        .expiry_policy(ExpiryPolicy::Tombstone {
            keep: Duration::from_secs(3600),
        })
        .open_postgres(&url)?;
    let Begin::Claimed(claim) = tomb.begin(&key("pay"), fp("{}"))? else {
        panic!("a fresh key must be claimed");
    };
    tomb.complete(claim, Envelope::new(1, 201, b"charged".to_vec()))?;
    match builder().open_postgres(&url) {
        Err(OpenError::ExpiryPolicyConflict { .. }) => {}
        other => panic!("a second expiry policy on one prefix: {other:?}"),
    }
    let forget = builder()
        .expiry_settings_from_database()
        .open_postgres(&url)?;
    clock.advance(Duration::from_secs(20));
    assert!(matches!(
        tomb.begin(&key("pay"), fp("{}"))?,
        Begin::Tombstoned { .. }
    ));
    forget.sweep_now()?;
    match tomb.begin(&key("pay"), fp("{}"))? {
        Begin::Tombstoned { .. } => Ok(()),
        other => panic!("the Tombstone engine would charge again: {other:?}"),
    }
}

/// A local write whose closure calls the engine on its own key: the inner
/// claim would wait for the row lock of the outer transaction, which waits
/// for the closure. As on redb, the inner write is refused with
/// `Error::Reentrant` instead, and the outer write completes.
#[test]
fn a_local_write_calling_the_engine_on_its_own_key_does_not_hang() -> TestResult {
    use std::sync::Arc;
    let Some(url) = server() else { return Ok(()) };
    let engine = Arc::new(
        Engine::builder()
            .table_prefix(prefix())
            .sweep_interval(None)
            .open_postgres(&url)?,
    );
    let (tx, rx) = std::sync::mpsc::channel();
    let outer = engine.clone();
    std::thread::spawn(move || {
        let inner = outer.clone();
        let run = outer.execute_local(&key("self"), fp("{}"), move |_tx| {
            match inner.begin(&key("self"), fp("{}")) {
                Err(idempotency::Error::Reentrant) => Ok(Envelope::new(1, 200, b"ok".to_vec())),
                other => Err(format!("inner begin: {other:?}").into()),
            }
        });
        let _ = tx.send(run.map(|_| ()).map_err(|e| e.to_string()));
    });
    match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => {
            Err("execute_local still blocked after 20 s (self-deadlock on the key's row)".into())
        }
    }
}

/// A wrong database name fails the open with what the server said (the
/// first connection is made outside the pool, which would retry until its
/// timeout and then report only "timed out waiting for connection: db
/// error").
#[test]
fn a_wrong_database_is_a_clear_error_at_once() -> TestResult {
    let Some(url) = server() else { return Ok(()) };
    let wrong = format!("{url} dbname=no_such_database_here");
    match Engine::builder().open_postgres(&wrong) {
        Err(e @ OpenError::Storage { .. }) => {
            let text = e.to_string();
            assert!(
                text.contains("no_such_database_here") || text.contains("3D000"),
                "{text}"
            );
        }
        other => panic!("expected a storage error, got {other:?}"),
    }
    Ok(())
}

/// Stored record bytes are checked against their checksum (record format
/// 2): a byte changed in a row's `record` is an error naming the key for
/// `begin` (never a replay of the changed bytes, never a fresh claim) and a
/// problem for `verify`, while other keys still answer; a row as a format-1
/// build wrote it (no checksum) still replays.
#[test]
fn a_changed_record_byte_is_an_error_and_a_format1_row_still_reads() -> TestResult {
    let Some(url) = server() else { return Ok(()) };
    let p = prefix();
    let engine = Engine::builder()
        .table_prefix(p.clone())
        .sweep_interval(None)
        .open_postgres(&url)?;
    for k in ["damaged", "legacy", "good"] {
        let Begin::Claimed(claim) = engine.begin(&key(k), fp("{}"))? else {
            panic!("a fresh key must be claimed");
        };
        engine.complete(claim, Envelope::new(1, 201, b"amount=122".to_vec()))?;
    }
    let mut client = idempotency::postgres::Client::connect(&url, idempotency::postgres::NoTls)?;
    let records = format!("{p}records");
    // 122 → 102 inside the stored body.
    client.execute(
        &format!(
            "UPDATE {records} SET record = overlay(record placing '\\x30'::bytea
                 from position('\\x616d6f756e743d313232'::bytea in record) + 8 for 1)
             WHERE key = 'damaged'"
        ),
        &[],
    )?;
    // Format 1: version byte 1, the same fields, no checksum.
    client.execute(
        &format!(
            "UPDATE {records} SET record = '\\x01'::bytea || substring(record from 2 for length(record) - 9)
             WHERE key = 'legacy'"
        ),
        &[],
    )?;
    match engine.begin(&key("damaged"), fp("{}")) {
        Err(idempotency::Error::Corrupt {
            what: Corrupted::Record(k),
            reason,
        }) => {
            assert_eq!(k, key("damaged"));
            assert!(reason.contains("checksum does not match"), "{reason}");
        }
        other => panic!("expected a corrupt record, got {other:?}"),
    }
    for k in ["legacy", "good"] {
        match engine.begin(&key(k), fp("{}"))? {
            Begin::Replay(replay) => assert_eq!(replay.envelope.body, b"amount=122"),
            other => panic!("{k}: expected a replay, got {other:?}"),
        }
    }
    let report = engine.verify()?;
    assert_eq!(report.damage.len(), 1, "{:?}", report.damage);
    let text = report.damage[0].to_string();
    assert!(
        text.contains("pg-basics/damaged") && text.contains("checksum does not match"),
        "{text}"
    );
    Ok(())
}

/// `verify` streams the table a page at a time in one snapshot: every row
/// of a table several pages long is checked. Copies of a record under new
/// keys fail their checksum (it covers the key), so each must be reported.
#[test]
fn verify_checks_every_row_of_a_table_longer_than_a_page() -> TestResult {
    let Some(url) = server() else { return Ok(()) };
    let p = prefix();
    let engine = Engine::builder()
        .table_prefix(p.clone())
        .sweep_interval(None)
        .open_postgres(&url)?;
    let Begin::Claimed(claim) = engine.begin(&key("original"), fp("{}"))? else {
        panic!("a fresh key must be claimed");
    };
    engine.complete(claim, Envelope::new(1, 201, b"ok".to_vec()))?;
    let mut client = idempotency::postgres::Client::connect(&url, idempotency::postgres::NoTls)?;
    let copies = 2_345;
    client.execute(
        &format!(
            "INSERT INTO {p}records
             SELECT scope, 'copy-' || g, state, token, lease_until_ms, unknown_since_ms,
                    expires_at_ms, record
             FROM {p}records, generate_series(1, {copies}) AS g
             WHERE key = 'original'"
        ),
        &[],
    )?;
    let report = engine.verify()?;
    assert_eq!(report.records, copies + 1);
    assert_eq!(report.damage.len(), copies as usize);
    assert!(report
        .damage
        .iter()
        .all(|p| p.to_string().contains("checksum does not match")));
    Ok(())
}
