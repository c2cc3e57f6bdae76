//! Breaker 24, damage and hostile servers: guards against a Redis store
//! whose values under the prefix were damaged or written by something else
//! (junk at a record key, a LIST where a record belongs, a record whose
//! token prefix is not a number, a junk effect step, a damaged or reset
//! fencing-token counter) turning into a panic, an untyped error, an error
//! that does not name the key, other keys failing, `verify` missing it, or
//! a fencing token that goes backwards; and against an engine that opens
//! on a server that silently evicts keys (`maxmemory-policy allkeys-*`),
//! which loses claims and so executes twice.
//!
//! Each case starts its own `redis-server` (appendonly yes, appendfsync
//! always) on a free loopback port in a temp dir; skipped without the
//! binary (a failure under `CI=true`).

use std::time::Duration;

use idempotency::{
    Begin, Engine, Envelope, Error, Fingerprint, IdempotencyKey, ManualClock, OpenError,
};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;
use redis_server::BoxError;

const PREFIX: &str = "b24:";

/// A throwaway `redis-server`, killed (our own child) on drop.
#[path = "common/redis_server.rs"]
mod redis_server;

use redis_server::{own_server, OwnServer as Server};

/// A client connection of the test's own to `s`.
fn conn(s: &Server) -> Result<redis::Connection, BoxError> {
    Ok(redis::Client::open(s.url().as_str())?.get_connection()?)
}

fn engine(s: &Server, clock: &ManualClock) -> Result<Engine, OpenError> {
    Engine::builder()
        .sweep_interval(None)
        .clock(clock.clone())
        .lease(Duration::from_secs(30))
        .redis_key_prefix(PREFIX)
        .redis_connect_timeout(Duration::from_secs(2))
        .redis_command_timeout(Duration::from_secs(2))
        .open_redis(&s.url())
}

/// The record key of `scope`/`key` under [`PREFIX`] (see keys.rs).
fn record_key(scope: &str, key: &str) -> Vec<u8> {
    let mut k = format!("{PREFIX}r:{scope}").into_bytes();
    k.push(0);
    k.extend_from_slice(key.as_bytes());
    k
}

fn steps_key(scope: &str, key: &str) -> Vec<u8> {
    let mut k = format!("{PREFIX}s:{scope}").into_bytes();
    k.push(0);
    k.extend_from_slice(key.as_bytes());
    k
}

fn fp() -> Result<Fingerprint, BoxError> {
    Ok(Fingerprint::of_json(b"{\"amount\":1}", &[])?)
}

/// Claims and completes `key`; returns the claim's fencing token.
fn complete(e: &Engine, key: &IdempotencyKey) -> Result<u64, BoxError> {
    let Begin::Claimed(claim) = e.begin(key, fp()?)? else {
        return Err(format!("{key} must be claimed").into());
    };
    let token = claim.fencing_token();
    e.complete(claim, Envelope::new(1, 200, "ok"))?;
    Ok(token)
}

/// The engine keeps serving a healthy key beside a damaged one.
fn healthy_key_still_replays(e: &Engine, healthy: &IdempotencyKey) -> TestResult {
    let b = e.begin(healthy, fp()?)?;
    assert!(matches!(b, Begin::Replay(_)), "{healthy}: {b:?}");
    Ok(())
}

/// A value damaged in place: every read of the key is a typed error
/// naming the key, never a replay, a claim or a panic; the other keys
/// keep serving; `verify` lists it.
fn damaged_key_is_named(e: &Engine, key: &IdempotencyKey, healthy: &IdempotencyKey) -> TestResult {
    let begin = e.begin(key, fp()?);
    match &begin {
        Err(err @ Error::Corrupt { .. }) => {
            assert!(
                err.to_string().contains(key.key()),
                "the error must name the key: {err}"
            );
        }
        other => panic!("begin of damaged {key}: want Error::Corrupt naming it, got {other:?}"),
    }
    let rec = e.record(key);
    assert!(
        matches!(&rec, Err(Error::Corrupt { .. })),
        "record({key}): {rec:?}"
    );
    healthy_key_still_replays(e, healthy)?;
    let report = e.verify()?;
    let hex: String = key.key().bytes().map(|b| format!("{b:02x}")).collect();
    let listed = format!("{report:?}");
    assert!(
        !report.is_sound() && (listed.contains(key.key()) || listed.contains(&hex)),
        "verify must report {key}: {report:?}"
    );
    // Listings and stats still work.
    e.stats()?;
    Ok(())
}

#[test]
fn junk_bytes_at_a_record_key() -> TestResult {
    let Some(s) = own_server(&[])? else {
        return Ok(());
    };
    let clock = ManualClock::new(1_000_000);
    let e = engine(&s, &clock)?;
    let (bad, good) = (
        IdempotencyKey::new("d", "junk")?,
        IdempotencyKey::new("d", "ok")?,
    );
    complete(&e, &bad)?;
    complete(&e, &good)?;
    let _: () = redis::cmd("SET")
        .arg(record_key("d", "junk"))
        .arg("this is not a record")
        .query(&mut conn(&s)?)?;
    damaged_key_is_named(&e, &bad, &good)
}

#[test]
fn a_token_prefix_that_is_not_a_number() -> TestResult {
    let Some(s) = own_server(&[])? else {
        return Ok(());
    };
    let clock = ManualClock::new(1_000_000);
    let e = engine(&s, &clock)?;
    let (bad, good) = (
        IdempotencyKey::new("d", "tok")?,
        IdempotencyKey::new("d", "ok")?,
    );
    complete(&e, &bad)?;
    complete(&e, &good)?;
    let mut c = conn(&s)?;
    let rk = record_key("d", "tok");
    let value: Vec<u8> = redis::cmd("GET").arg(&rk).query(&mut c)?;
    let colon = value
        .iter()
        .position(|&b| b == b':')
        .ok_or("no token prefix")?;
    let mut damaged = b"12x".to_vec();
    damaged.extend_from_slice(&value[colon..]);
    let _: () = redis::cmd("SET").arg(&rk).arg(damaged).query(&mut c)?;
    damaged_key_is_named(&e, &bad, &good)
}

#[test]
fn a_list_where_a_record_belongs() -> TestResult {
    let Some(s) = own_server(&[])? else {
        return Ok(());
    };
    let clock = ManualClock::new(1_000_000);
    let e = engine(&s, &clock)?;
    let (bad, good) = (
        IdempotencyKey::new("d", "list")?,
        IdempotencyKey::new("d", "ok")?,
    );
    complete(&e, &bad)?;
    complete(&e, &good)?;
    let mut c = conn(&s)?;
    let rk = record_key("d", "list");
    let _: () = redis::cmd("DEL").arg(&rk).query(&mut c)?;
    let _: () = redis::cmd("RPUSH").arg(&rk).arg("x").query(&mut c)?;
    damaged_key_is_named(&e, &bad, &good)
}

#[test]
fn a_list_at_a_fresh_record_key() -> TestResult {
    // Nothing the engine wrote: a LIST appears at a key's record address
    // before its first request (a foreign writer). The first begin must
    // be a typed error naming the key, not a generic storage failure.
    let Some(s) = own_server(&[])? else {
        return Ok(());
    };
    let clock = ManualClock::new(1_000_000);
    let e = engine(&s, &clock)?;
    let (bad, good) = (
        IdempotencyKey::new("d", "fresh")?,
        IdempotencyKey::new("d", "ok")?,
    );
    complete(&e, &good)?;
    let _: () = redis::cmd("RPUSH")
        .arg(record_key("d", "fresh"))
        .arg("x")
        .query(&mut conn(&s)?)?;
    damaged_key_is_named(&e, &bad, &good)
}

#[test]
fn a_junk_effect_step() -> TestResult {
    let Some(s) = own_server(&[])? else {
        return Ok(());
    };
    let clock = ManualClock::new(1_000_000);
    let e = engine(&s, &clock)?;
    let (bad, good) = (
        IdempotencyKey::new("d", "step")?,
        IdempotencyKey::new("d", "ok")?,
    );
    complete(&e, &bad)?;
    complete(&e, &good)?;
    let _: () = redis::cmd("HSET")
        .arg(steps_key("d", "step"))
        .arg("charge")
        .arg("not a framed step")
        .query(&mut conn(&s)?)?;
    let steps = e.steps(&bad);
    assert!(
        matches!(&steps, Err(Error::Corrupt { .. })) && format!("{steps:?}").contains("step"),
        "steps of {bad}: {steps:?}"
    );
    healthy_key_still_replays(&e, &good)?;
    let report = e.verify()?;
    assert!(
        !report.is_sound(),
        "verify must report the junk step: {report:?}"
    );
    Ok(())
}

#[test]
fn a_token_counter_that_is_not_a_number_is_reported() -> TestResult {
    // Something overwrote `<prefix>token`. Claims cannot draw tokens; the
    // error must say which value is damaged, and verify must list it.
    let Some(s) = own_server(&[])? else {
        return Ok(());
    };
    let clock = ManualClock::new(1_000_000);
    let e = engine(&s, &clock)?;
    let good = IdempotencyKey::new("d", "ok")?;
    complete(&e, &good)?;
    let _: () = redis::cmd("SET")
        .arg(format!("{PREFIX}token"))
        .arg("garbage")
        .query(&mut conn(&s)?)?;
    let fresh = IdempotencyKey::new("d", "new")?;
    let begin = e.begin(&fresh, fp()?);
    let text = format!("{begin:?}");
    assert!(
        matches!(&begin, Err(Error::Corrupt { .. })) && text.contains("token"),
        "a claim against a damaged token counter: want Error::Corrupt naming the \
         token counter, got {begin:?}"
    );
    healthy_key_still_replays(&e, &good)?;
    let report = e.verify()?;
    assert!(
        !report.is_sound(),
        "verify must report the damaged token counter: {report:?}"
    );
    Ok(())
}

#[test]
fn a_reset_token_counter_never_lets_a_token_go_backwards() -> TestResult {
    // The counter vanished (an operator's DEL, an eviction, a restore of
    // an older AOF for that one key) while records with tokens stay. A
    // new claim over a key's record (here its outcome expired past the
    // TTL) must still draw a token above the one the record carries:
    // fencing tokens grow per key. And verify must notice a counter below
    // a stored record's token. (A key whose record is gone, e.g. a
    // released claim, carries no token to compare with: the store's
    // module doc says so.)
    let Some(s) = own_server(&[])? else {
        return Ok(());
    };
    let clock = ManualClock::new(1_000_000);
    let a = engine(&s, &clock)?;
    let b = engine(&s, &clock)?;
    let key = IdempotencyKey::new("t", "k")?;
    for i in 0..5 {
        complete(&a, &IdempotencyKey::new("t", format!("warm-{i}"))?)?;
    }
    let old = complete(&a, &key)?;
    clock.advance(Duration::from_secs(25 * 3600));
    let _: () = redis::cmd("DEL")
        .arg(format!("{PREFIX}token"))
        .query(&mut conn(&s)?)?;
    let report = a.verify()?;
    let Begin::Claimed(second) = b.begin(&key, fp()?)? else {
        return Err("the expired key must be claimable".into());
    };
    let new = second.fencing_token();
    assert!(
        new > old,
        "fencing token went backwards for {key}: {old} then {new} \
         (verify before the takeover said: {report:?})"
    );
    assert!(!report.is_sound(), "verify must report the reset counter");
    // The claim raised the counter: a fresh key draws above it too.
    let Begin::Claimed(third) = b.begin(&IdempotencyKey::new("t", "fresh")?, fp()?)? else {
        return Err("fresh claim".into());
    };
    assert!(
        third.fencing_token() > new,
        "a fresh claim after the takeover drew {} (takeover had {new})",
        third.fencing_token()
    );
    Ok(())
}

#[test]
fn an_evicting_server_is_refused() -> TestResult {
    // With `maxmemory-policy allkeys-lru` Redis deletes keys it likes
    // least when memory runs out: a PROCESSING record, the token counter,
    // a completed outcome. The open must refuse such a server (as it
    // refuses appendfsync everysec) unless the risk is accepted.
    let Some(s) = own_server(&["--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru"])? else {
        return Ok(());
    };
    let clock = ManualClock::new(1_000_000);
    let opened = engine(&s, &clock);
    let Ok(e) = opened else {
        let err = opened.err().ok_or("unreachable")?;
        assert!(err.to_string().contains("maxmemory"), "{err}");
        return Ok(());
    };
    // It opened: show what that costs. Claim one key, fill memory with
    // other claims, then ask for the first key again.
    let key = IdempotencyKey::new("evict", "first")?;
    let Begin::Claimed(first) = e.begin(&key, fp()?)? else {
        return Err("first claim".into());
    };
    let mut filler_errors = 0;
    for i in 0..20_000 {
        let k = IdempotencyKey::new("evict", format!("filler-{i:06}-{}", "x".repeat(150)))?;
        if e.begin(&k, fp()?).is_err() {
            filler_errors += 1;
        }
    }
    let again = e.begin(&key, fp()?)?;
    let twice = matches!(again, Begin::Claimed(_));
    drop(first);
    panic!(
        "opened on a server with maxmemory-policy allkeys-lru; after filling it, \
         begin of the held key {key} was claimed a second time: {twice} \
         ({filler_errors} filler begins failed)"
    );
}
