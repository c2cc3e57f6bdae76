//! Breaker 22B, PostgreSQL: two engines on one schema race on the same keys
//! while one of them writes its claims' steps in place. Engine A claims
//! each key and runs reserve, confirm, a second reserve, a deferred
//! confirmation and the completion (fresh claims: every write goes in
//! place); engine B, on other threads, purges the same keys with
//! `PurgeMode::Force` and sweeps, at the same time. Guards against an
//! in-place write landing on a purged key (steps or log without a record:
//! a resurrected key), a log with a gap or a step written twice, and an
//! answer that disagrees with the rows (A told Ok for a completion whose
//! record never held it, with B's purge not after it).
#![cfg(unix)]

#[path = "common/pg_chaos.rs"]
mod pg_chaos;

use std::error::Error;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey, PurgeMode, State};

type TestResult<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

const KEYS: usize = 150;

#[test]
fn purge_and_sweep_from_another_engine_never_resurrect_or_split_a_key() -> TestResult {
    let Some(url) = pg_chaos::pg_url() else {
        return Ok(());
    };
    let prefix = pg_chaos::unique_prefix("b22b_race");
    let builder = || {
        Engine::builder()
            .table_prefix(prefix.as_str())
            .pool_size(3)
            .lease(Duration::from_secs(30))
            .sweep_interval(None)
    };
    let a = Arc::new(builder().open_postgres(&url)?);
    let b = Arc::new(builder().open_postgres(&url)?);
    let keys: Vec<IdempotencyKey> = (0..KEYS)
        .map(|i| IdempotencyKey::new("shop:pay", format!("race-{i}")))
        .collect::<Result<_, _>>()?;
    let done = Arc::new(AtomicBool::new(false));
    let current = Arc::new(AtomicUsize::new(0));
    let purger = {
        let (b, keys, done, current) = (b.clone(), keys.clone(), done.clone(), current.clone());
        std::thread::spawn(move || -> TestResult<usize> {
            let mut purged = 0;
            let mut i = 0usize;
            while !done.load(Ordering::Relaxed) {
                // The key A works on now, so purges fall between A's
                // writes of the same key.
                let k = &keys[current.load(Ordering::Relaxed) % KEYS];
                match b.purge(k, PurgeMode::Force) {
                    Ok(Some(_)) => purged += 1,
                    Ok(None) | Err(idempotency::Error::NotFound { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
                if i.is_multiple_of(16) {
                    b.sweep_now()?;
                }
                i = i.wrapping_add(1);
            }
            Ok(purged)
        })
    };
    let mut answers = Vec::new();
    for (n, k) in keys.iter().enumerate() {
        current.store(n, Ordering::Relaxed);
        let fp = Fingerprint::of_json(br#"{"a":1}"#, &[])?;
        let Begin::Claimed(c) = a.begin(k, fp)? else {
            answers.push((k.clone(), "not claimed".to_owned()));
            continue;
        };
        let mut log = Vec::new();
        log.push(format!("effect {:?}", c.effect("charge").is_ok()));
        log.push(format!(
            "confirm {:?}",
            c.confirm("charge", b"ch_1").is_ok()
        ));
        log.push(format!("effect {:?}", c.effect("receipt").is_ok()));
        log.push(format!(
            "deferred {:?}",
            c.confirm_deferred("receipt", b"r_1").is_ok()
        ));
        let r = a.complete(c, Envelope::new(1, 201, "paid"));
        log.push(format!(
            "complete {:?}",
            r.as_ref().map_err(|e| e.to_string())
        ));
        answers.push((k.clone(), log.join(", ")));
    }
    done.store(true, Ordering::Relaxed);
    let purged = purger.join().map_err(|_| "purger panicked")??;
    let mut bad = Vec::new();
    for (k, said) in &answers {
        let record = b.record(k)?;
        let steps = b.steps(k)?;
        let log = b.history(k)?;
        let seqs: Vec<u32> = log.iter().map(|e| e.seq).collect();
        let contiguous = seqs.iter().enumerate().all(|(i, s)| *s as usize == i);
        let resurrected = record.is_none() && (!steps.is_empty() || !log.is_empty());
        let completed = record.as_ref().is_some_and(|r| r.state == State::Completed);
        // A completed record has both steps confirmed and five entries.
        let torn = completed && (steps.len() != 2 || log.len() != 5);
        if resurrected || !contiguous || torn {
            bad.push(format!(
                "{k}: A said [{said}]; record {:?}, steps {:?}, log {:?}",
                record.map(|r| r.state),
                steps.iter().map(|s| (&s.name, s.state)).collect::<Vec<_>>(),
                log.iter()
                    .map(|e| format!("{}:{:?}:{}->{}", e.seq, e.step, e.from, e.to))
                    .collect::<Vec<_>>()
            ));
        }
    }
    let interrupted = answers
        .iter()
        .filter(|(_, said)| said.contains("false") || said.contains("Err"))
        .count();
    eprintln!(
        "B purged {purged} times; {interrupted} of A's claims saw a refusal; {} keys bad",
        bad.len()
    );
    drop((a, b));
    let mut client = pg_chaos::connect(&url)?;
    pg_chaos::drop_prefix(&mut client, &prefix)?;
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    Ok(())
}
