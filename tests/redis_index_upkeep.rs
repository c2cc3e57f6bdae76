//! The Redis indexes stay exact now that a record write only touches the
//! index the record was in and the one it moves to: guards against a
//! record left behind in its old index, missing from its new one, or
//! missing from the listing, through claim, completion, lease end (sweep to
//! UNKNOWN), resolution and expiry; and against `verify` missing damage to
//! the listing (`i:keys`) either way.
//!
//! Starts its own `redis-server` (appendonly yes, appendfsync always);
//! skipped without the binary (a failure under `CI=true`).

use std::time::Duration;

use idempotency::{
    Begin, Damage, Engine, Envelope, Fingerprint, IdempotencyKey, ManualClock, Resolution,
};

#[path = "common/redis_server.rs"]
mod redis_server;

use redis_server::{own_server, BoxError};

type TestResult = Result<(), BoxError>;

const PREFIX: &str = "up:";

/// Where a record is listed: the lease, recovery, expiry indexes (each its
/// score, if there) and whether the listing has it.
type Place = [Option<f64>; 4];

fn place(conn: &mut redis::Connection, key: &IdempotencyKey) -> Result<Place, BoxError> {
    let mut member = key.scope().as_bytes().to_vec();
    member.push(0);
    member.extend_from_slice(key.key().as_bytes());
    let mut out = [None; 4];
    for (i, index) in ["i:lease", "i:recovery", "i:expiry", "i:keys"]
        .iter()
        .enumerate()
    {
        out[i] = redis::cmd("ZSCORE")
            .arg(format!("{PREFIX}{index}"))
            .arg(&member)
            .query(conn)?;
    }
    Ok(out)
}

/// Which of lease, recovery, expiry hold the record, and whether it is listed.
fn where_is(p: Place) -> (bool, bool, bool, bool) {
    (
        p[0].is_some(),
        p[1].is_some(),
        p[2].is_some(),
        p[3].is_some(),
    )
}

fn sound(engine: &Engine) -> TestResult {
    let report = engine.verify()?;
    assert!(report.is_sound(), "{report:?}");
    Ok(())
}

#[test]
fn every_transition_leaves_each_record_in_exactly_its_index() -> TestResult {
    let Some(s) = own_server(&[])? else {
        return Ok(());
    };
    let clock = ManualClock::new(1_000_000);
    let engine = Engine::builder()
        .clock(clock.clone())
        .lease(Duration::from_secs(1))
        .ttl(Duration::from_secs(10))
        .sweep_interval(None)
        .redis_key_prefix(PREFIX)
        .open_redis(s.url().as_str())?;
    let mut conn = redis::Client::open(s.url().as_str())?.get_connection()?;
    let fp = Fingerprint::from_bytes([1; 32]);
    let (done, lost) = (
        IdempotencyKey::new("up", "done")?,
        IdempotencyKey::new("up", "lost")?,
    );

    let Begin::Claimed(claim) = engine.begin(&done, fp)? else {
        return Err("fresh key not claimed".into());
    };
    assert_eq!(
        where_is(place(&mut conn, &done)?),
        (true, false, false, true)
    );
    engine.complete(claim, Envelope::new(1, 200, "ok"))?;
    let p = place(&mut conn, &done)?;
    assert_eq!(where_is(p), (false, false, true, true), "completed: {p:?}");
    sound(&engine)?;

    let Begin::Claimed(_dropped) = engine.begin(&lost, fp)? else {
        return Err("fresh key not claimed".into());
    };
    clock.advance(Duration::from_secs(2));
    let counts = engine.sweep_now()?;
    assert_eq!(counts.moved_to_unknown, 1, "{counts:?}");
    let p = place(&mut conn, &lost)?;
    assert_eq!(where_is(p), (false, true, false, true), "unknown: {p:?}");
    assert_eq!(engine.in_doubt(10)?.len(), 1);
    sound(&engine)?;

    engine.resolve(
        &lost,
        Resolution::Completed(Envelope::new(1, 200, "late")),
        "test",
    )?;
    let p = place(&mut conn, &lost)?;
    assert_eq!(where_is(p), (false, false, true, true), "resolved: {p:?}");
    assert!(engine.in_doubt(10)?.is_empty());
    sound(&engine)?;

    // Past every TTL: the sweeper deletes (or tombstones) both; a deleted
    // record is in no index, a tombstone only in the expiry index.
    clock.advance(Duration::from_secs(3_600));
    while engine.sweep_now()?.more {}
    for key in [&done, &lost] {
        let p = place(&mut conn, key)?;
        match engine.record(key)? {
            None => assert_eq!(where_is(p), (false, false, false, false), "{key}: {p:?}"),
            Some(_) => assert_eq!(where_is(p), (false, false, true, true), "{key}: {p:?}"),
        }
    }
    sound(&engine)?;
    Ok(())
}

#[test]
fn verify_reports_listing_damage_both_ways() -> TestResult {
    let Some(s) = own_server(&[])? else {
        return Ok(());
    };
    let engine = Engine::builder()
        .sweep_interval(None)
        .redis_key_prefix(PREFIX)
        .open_redis(s.url().as_str())?;
    let mut conn = redis::Client::open(s.url().as_str())?.get_connection()?;
    let key = IdempotencyKey::new("up", "listed")?;
    let Begin::Claimed(claim) = engine.begin(&key, Fingerprint::from_bytes([2; 32]))? else {
        return Err("fresh key not claimed".into());
    };
    engine.complete(claim, Envelope::new(1, 200, "ok"))?;
    sound(&engine)?;
    redis::cmd("ZREM")
        .arg(format!("{PREFIX}i:keys"))
        .arg(b"up\0listed")
        .exec(&mut conn)?;
    redis::cmd("ZADD")
        .arg(format!("{PREFIX}i:keys"))
        .arg(0)
        .arg(b"up\0ghost")
        .exec(&mut conn)?;
    let report = engine.verify()?;
    let missing = report.damage.iter().any(|d| {
        matches!(
            d,
            Damage::MissingIndexEntry {
                index: "listing",
                ..
            }
        )
    });
    let stray = report.damage.iter().any(|d| {
        matches!(
            d,
            Damage::StrayIndexEntry {
                index: "listing",
                ..
            }
        )
    });
    assert!(missing && stray, "{report:?}");
    assert_eq!(report.damage.len(), 2, "{report:?}");
    Ok(())
}
