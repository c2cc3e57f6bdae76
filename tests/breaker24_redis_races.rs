//! Breaker 24, two engines on one Redis prefix: guards against two
//! winners of one key (claim against claim from several threads of two
//! engines), a fenced write accepted (a late complete after a takeover, a
//! settlement, or a forced purge), a complete that reports failure while
//! its outcome lands anyway, and fencing tokens that do not grow per key
//! across a release, a settlement or a purge and a re-claim.
//!
//! Each case starts its own `redis-server` (appendonly yes, appendfsync
//! always) on a free loopback port; both engines share one `ManualClock`
//! so a lease ends without sleeping. Skipped without the binary (a
//! failure under `CI=true`).

use std::collections::HashMap;
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use idempotency::{
    Begin, Engine, Envelope, Failure, Fingerprint, IdempotencyKey, ManualClock, OpenError,
    PurgeMode, Resolution, State,
};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;
use redis_server::BoxError;

const PREFIX: &str = "b24r:";
const LEASE: Duration = Duration::from_secs(30);

#[path = "common/redis_server.rs"]
mod redis_server;

use redis_server::{own_server, OwnServer as Server};

fn engine(s: &Server, clock: &ManualClock) -> Result<Engine, OpenError> {
    Engine::builder()
        .sweep_interval(None)
        .clock(clock.clone())
        .lease(LEASE)
        .redis_key_prefix(PREFIX)
        .redis_pool_size(8)
        .redis_connect_timeout(Duration::from_secs(2))
        .redis_command_timeout(Duration::from_secs(5))
        .open_redis(&s.url())
}

fn fp() -> Result<Fingerprint, BoxError> {
    Ok(Fingerprint::of_json(b"{\"amount\":1}", &[])?)
}

/// The body a replay of `key` serves (`None`: not a replay).
fn replayed_body(e: &Engine, key: &IdempotencyKey) -> Result<Option<Vec<u8>>, BoxError> {
    match e.begin(key, fp()?)? {
        Begin::Replay(r) => Ok(Some(r.envelope.body.to_vec())),
        _ => Ok(None),
    }
}

#[test]
fn claim_against_claim_from_two_engines_has_one_winner() -> TestResult {
    let Some(s) = own_server(&[])? else {
        return Ok(());
    };
    let clock = ManualClock::new(5_000_000);
    let engines = [Arc::new(engine(&s, &clock)?), Arc::new(engine(&s, &clock)?)];
    const KEYS: usize = 150;
    const THREADS_PER_ENGINE: usize = 3;
    let wins: Arc<Mutex<HashMap<usize, Vec<u64>>>> = Arc::default();
    let barrier = Arc::new(Barrier::new(2 * THREADS_PER_ENGINE));
    let mut threads = Vec::new();
    for e in &engines {
        for _ in 0..THREADS_PER_ENGINE {
            let (e, wins, barrier) = (e.clone(), wins.clone(), barrier.clone());
            threads.push(std::thread::spawn(move || -> TestResult {
                barrier.wait();
                for k in 0..KEYS {
                    let key = IdempotencyKey::new("race", format!("k{k}"))?;
                    if let Begin::Claimed(c) = e.begin(&key, fp()?)? {
                        let token = c.fencing_token();
                        wins.lock()
                            .map_err(|_| "poisoned")?
                            .entry(k)
                            .or_default()
                            .push(token);
                        e.complete(c, Envelope::new(1, 200, format!("t{token}")))?;
                    }
                }
                Ok(())
            }));
        }
    }
    for t in threads {
        t.join().map_err(|_| "a racing thread panicked")??;
    }
    let wins = wins.lock().map_err(|_| "poisoned")?;
    let doubles: Vec<_> = wins.iter().filter(|(_, t)| t.len() != 1).collect();
    assert!(
        doubles.is_empty(),
        "keys claimed more than once: {doubles:?}"
    );
    assert_eq!(wins.len(), KEYS, "every key claimed once");
    Ok(())
}

#[test]
fn a_late_complete_after_a_takeover_is_fenced() -> TestResult {
    let Some(s) = own_server(&[])? else {
        return Ok(());
    };
    let clock = ManualClock::new(5_000_000);
    let (a, b) = (engine(&s, &clock)?, engine(&s, &clock)?);
    let key = IdempotencyKey::new("takeover", "k")?;
    let Begin::Claimed(old) = a.begin(&key, fp()?)? else {
        return Err("first claim".into());
    };
    let old_token = old.fencing_token();
    clock.advance(LEASE + Duration::from_secs(1));
    // B finds it in doubt, settles it as never executed, and claims anew.
    let found = b.begin(&key, fp()?)?;
    assert!(
        !matches!(found, Begin::Claimed(_) | Begin::Replay(_)),
        "an ended lease is in doubt, not free: {found:?}"
    );
    b.resolve(&key, Resolution::NotExecuted, "provider has no such charge")?;
    let Begin::Claimed(new) = b.begin(&key, fp()?)? else {
        return Err("a settled-not-executed key must be claimable".into());
    };
    assert!(new.fencing_token() > old_token, "tokens must grow per key");
    let late = a.complete(old, Envelope::new(1, 200, "A-late"));
    assert!(late.is_err(), "the old holder's complete must be fenced");
    b.complete(new, Envelope::new(1, 200, "B"))?;
    assert_eq!(replayed_body(&a, &key)?, Some(b"B".to_vec()));
    Ok(())
}

#[test]
fn a_late_complete_after_a_settlement_is_fenced() -> TestResult {
    let Some(s) = own_server(&[])? else {
        return Ok(());
    };
    let clock = ManualClock::new(5_000_000);
    let (a, b) = (engine(&s, &clock)?, engine(&s, &clock)?);
    let key = IdempotencyKey::new("settle", "k")?;
    let Begin::Claimed(old) = a.begin(&key, fp()?)? else {
        return Err("first claim".into());
    };
    clock.advance(LEASE + Duration::from_secs(1));
    b.sweep_now()?;
    b.resolve(
        &key,
        Resolution::Completed(Envelope::new(1, 200, "settled")),
        "provider shows the charge",
    )?;
    let late = a.complete(old, Envelope::new(1, 200, "A-late"));
    assert!(
        late.is_err(),
        "a complete after the settlement must be refused"
    );
    assert_eq!(replayed_body(&b, &key)?, Some(b"settled".to_vec()));
    Ok(())
}

#[test]
fn a_forced_purge_fences_the_holder_and_tokens_keep_growing() -> TestResult {
    let Some(s) = own_server(&[])? else {
        return Ok(());
    };
    let clock = ManualClock::new(5_000_000);
    let (a, b) = (engine(&s, &clock)?, engine(&s, &clock)?);
    let key = IdempotencyKey::new("purge", "k")?;
    let mut last = 0;
    for round in 0..5 {
        let Begin::Claimed(held) = a.begin(&key, fp()?)? else {
            return Err(format!("round {round}: a purged key must be claimable").into());
        };
        let token = held.fencing_token();
        assert!(token > last, "round {round}: token {token} after {last}");
        last = token;
        let purged = b.purge(&key, PurgeMode::Force)?;
        assert_eq!(purged, Some(State::Processing));
        let late = a.complete(held, Envelope::new(1, 200, "after-purge"));
        assert!(
            late.is_err(),
            "round {round}: a complete after a purge must fail"
        );
        let rec = b.record(&key)?;
        assert!(
            rec.is_none(),
            "round {round}: a fenced complete wrote {rec:?}"
        );
    }
    Ok(())
}

#[test]
fn purge_racing_complete_never_half_lands() -> TestResult {
    // Threads: one completes each key, the other force-purges it. A
    // complete that reported an error must not have stored its outcome.
    let Some(s) = own_server(&[])? else {
        return Ok(());
    };
    let clock = ManualClock::new(5_000_000);
    let a = Arc::new(engine(&s, &clock)?);
    let b = Arc::new(engine(&s, &clock)?);
    const KEYS: usize = 120;
    let mut claims = Vec::new();
    for k in 0..KEYS {
        let key = IdempotencyKey::new("pr", format!("k{k}"))?;
        let Begin::Claimed(c) = a.begin(&key, fp()?)? else {
            return Err("fresh claim".into());
        };
        claims.push((key, c));
    }
    let keys: Vec<IdempotencyKey> = claims.iter().map(|(k, _)| k.clone()).collect();
    let barrier = Arc::new(Barrier::new(2));
    let (ba, bb) = (barrier.clone(), barrier);
    let completer = {
        let a = a.clone();
        std::thread::spawn(move || {
            ba.wait();
            claims
                .into_iter()
                .map(|(k, c)| (k, a.complete(c, Envelope::new(1, 200, "A")).is_ok()))
                .collect::<Vec<_>>()
        })
    };
    let purger = {
        let b = b.clone();
        std::thread::spawn(move || -> Result<(), String> {
            bb.wait();
            for k in keys.iter().rev() {
                b.purge(k, PurgeMode::Force).map_err(|e| e.to_string())?;
            }
            Ok(())
        })
    };
    let results = completer.join().map_err(|_| "completer panicked")?;
    purger.join().map_err(|_| "purger panicked")??;
    for (key, ok) in results {
        let rec = b.record(&key)?;
        if !ok {
            assert!(
                rec.is_none(),
                "{key}: complete failed but the record is {rec:?}"
            );
        }
        if let Some(info) = rec {
            assert_eq!(info.state, State::Completed, "{key}: {info:?}");
        }
    }
    Ok(())
}

#[test]
fn a_sweep_racing_late_completes_keeps_one_outcome() -> TestResult {
    // Leases run out while their holders are still completing; another
    // engine sweeps. Each key ends COMPLETED by its holder (if the
    // complete said Ok) or UNKNOWN (if it said Err), never both, never lost.
    let Some(s) = own_server(&[])? else {
        return Ok(());
    };
    let clock = ManualClock::new(5_000_000);
    let a = Arc::new(engine(&s, &clock)?);
    let b = Arc::new(engine(&s, &clock)?);
    const KEYS: usize = 120;
    let mut claims = Vec::new();
    for k in 0..KEYS {
        let key = IdempotencyKey::new("sw", format!("k{k}"))?;
        let Begin::Claimed(c) = a.begin(&key, fp()?)? else {
            return Err("fresh claim".into());
        };
        claims.push((key, c));
    }
    clock.advance(LEASE + Duration::from_secs(1));
    let sweeper = {
        let b = b.clone();
        std::thread::spawn(move || -> Result<(), String> {
            for _ in 0..20 {
                b.sweep_now().map_err(|e| e.to_string())?;
            }
            Ok(())
        })
    };
    let results: Vec<(IdempotencyKey, bool)> = claims
        .into_iter()
        .map(|(k, c)| (k, a.complete(c, Envelope::new(1, 200, "A")).is_ok()))
        .collect();
    sweeper.join().map_err(|_| "sweeper panicked")??;
    for (key, ok) in results {
        let info = b.record(&key)?.ok_or(format!("{key} lost"))?;
        let want = if ok { State::Completed } else { State::Unknown };
        assert_eq!(info.state, want, "{key}: complete ok={ok}, record {info:?}");
    }
    Ok(())
}

#[test]
fn tokens_grow_across_release_and_reclaim_by_the_other_engine() -> TestResult {
    let Some(s) = own_server(&[])? else {
        return Ok(());
    };
    let clock = ManualClock::new(5_000_000);
    let (a, b) = (engine(&s, &clock)?, engine(&s, &clock)?);
    let key = IdempotencyKey::new("rel", "k")?;
    let mut last = 0;
    for round in 0..10 {
        let e = if round % 2 == 0 { &a } else { &b };
        let Begin::Claimed(c) = e.begin(&key, fp()?)? else {
            return Err(format!("round {round}: released key must be claimable").into());
        };
        assert!(c.fencing_token() > last, "round {round}");
        last = c.fencing_token();
        e.fail(c, Failure::Retryable)?;
    }
    Ok(())
}
