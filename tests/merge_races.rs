//! Guards the merge of closed partitions (format 3) against requests that
//! race it through the public API: while `sweep_now` copies, switches and
//! drops, another thread completes, fails and releases claims whose records
//! sit in the merge sources, and re-claims released keys; every answer it
//! got must still be given afterwards, listings must hold each key once,
//! and `verify` must find the file sound. A manual clock makes the hour
//! close at once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::{
    Begin, Engine, Envelope, Failure, Fingerprint, IdempotencyKey, RecordFilter, State,
};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Debug, Clone)]
struct Manual(Arc<AtomicU64>);
impl idempotency::Clock for Manual {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

const HOUR: u64 = 3_600_000;
const T0: u64 = 1_796_000_000_000 / HOUR * HOUR + 60_000;
const KEYS: usize = 3_000;

fn key(i: usize) -> R<IdempotencyKey> {
    Ok(IdempotencyKey::new("shop:pay", format!("order-{i}"))?)
}
fn fp(i: usize) -> Fingerprint {
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(&(i as u64).to_le_bytes());
    Fingerprint::from_bytes(b)
}
fn body(i: usize, round: u64) -> Envelope {
    Envelope::new(1, 200, format!("paid {i} {round}").into_bytes())
}

#[derive(Debug, Clone, PartialEq)]
enum Want {
    Replay(Envelope),
    Held,
}

#[test]
fn requests_racing_a_merge_keep_their_answers() -> R<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("race.redb");
    let now = Arc::new(AtomicU64::new(T0));
    let engine = Arc::new(
        Engine::builder()
            .clock(Manual(now.clone()))
            .ttl(Duration::from_secs(86_400))
            .lease(Duration::from_secs(10 * 3_600))
            .partition_limits(64, Duration::from_secs(600))
            .sweep_interval(None)
            .open(&path)?,
    );
    let mut held = Vec::new();
    let mut want: Vec<Want> = Vec::new();
    for i in 0..KEYS {
        now.store(T0 + (i as u64) * 1_000, Ordering::SeqCst);
        let Begin::Claimed(claim) = engine.begin(&key(i)?, fp(i))? else {
            return Err(format!("{i} not claimed").into());
        };
        if i % 3 == 0 {
            held.push(Some(claim));
            want.push(Want::Held);
        } else {
            held.push(None);
            engine.complete(claim, body(i, 0))?;
            want.push(Want::Replay(body(i, 0)));
        }
    }
    now.store(T0 + 3 * HOUR, Ordering::SeqCst);
    let held = Arc::new(Mutex::new(held));
    let want = Arc::new(Mutex::new(want));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let racer = {
        let (engine, held, want, stop) = (engine.clone(), held.clone(), want.clone(), stop.clone());
        std::thread::spawn(move || -> R<u64> {
            let mut round = 0u64;
            let mut i = 0usize;
            while !stop.load(Ordering::SeqCst) {
                round += 1;
                i = (i + 3 * 37) % KEYS; // multiples of 3: the held ones
                let claim = held.lock().map_err(|_| "lock")?[i].take();
                let Some(claim) = claim else { continue };
                match round % 3 {
                    0 => {
                        engine.complete(claim, body(i, round))?;
                        want.lock().map_err(|_| "lock")?[i] = Want::Replay(body(i, round));
                    }
                    1 => {
                        engine.fail(claim, Failure::Final(body(i, round)))?;
                        want.lock().map_err(|_| "lock")?[i] = Want::Replay(body(i, round));
                    }
                    _ => {
                        engine.fail(claim, Failure::Retryable)?;
                        match engine.begin(&key(i)?, fp(i))? {
                            Begin::Claimed(c) => {
                                held.lock().map_err(|_| "lock")?[i] = Some(c);
                            }
                            other => return Err(format!("{i}: released, then {other:?}").into()),
                        }
                    }
                }
                // The answer just given stands at once.
                let w = want.lock().map_err(|_| "lock")?[i].clone();
                if let Want::Replay(env) = w {
                    match engine.begin(&key(i)?, fp(i))? {
                        Begin::Replay(r) if r.envelope == env => {}
                        other => return Err(format!("{i} right after: {other:?}").into()),
                    }
                }
            }
            Ok(round)
        })
    };
    let counts = engine.sweep_now()?;
    let counts2 = engine.sweep_now()?;
    stop.store(true, Ordering::SeqCst);
    let rounds = racer.join().map_err(|_| "racer panicked")??;
    eprintln!("racer rounds {rounds}; sweeps {counts:?} {counts2:?}");
    let report = engine.verify()?;
    assert!(report.is_sound(), "{:?}", report.damage);
    let check = |engine: &Engine| -> R<()> {
        let want = want.lock().map_err(|_| "lock")?;
        for (i, w) in want.iter().enumerate() {
            match (w, engine.record(&key(i)?)?) {
                (Want::Replay(env), Some(r))
                    if matches!(r.state, State::Completed | State::FinalFailure) =>
                {
                    match engine.begin(&key(i)?, fp(i))? {
                        Begin::Replay(got) if got.envelope == *env => {}
                        other => return Err(format!("{i}: {other:?}, want {env:?}").into()),
                    }
                }
                (Want::Held, Some(r)) if matches!(r.state, State::Processing | State::Unknown) => {}
                (w, got) => return Err(format!("{i}: want {w:?}, record {got:?}").into()),
            }
        }
        let listed = engine.records(&RecordFilter::default())?;
        assert_eq!(listed.len(), KEYS, "each key listed once");
        Ok(())
    };
    check(&engine)?;
    drop(held);
    let engine = Arc::try_unwrap(engine).map_err(|_| "engine still shared")?;
    drop(engine);
    let engine = Engine::builder()
        .clock(Manual(now.clone()))
        .ttl(Duration::from_secs(86_400))
        .partition_limits(64, Duration::from_secs(600))
        .sweep_interval(None)
        .open_existing(&path)?;
    check(&engine)?;
    let report = engine.verify()?;
    assert!(report.is_sound(), "{:?}", report.damage);
    drop(engine);
    // The merge ran: a built partition (numbered from 1 << 63) holds the hour.
    use redb::ReadableDatabase;
    let db = redb::Database::open(&path)?;
    let txn = db.begin_read()?;
    let rows = txn.open_table(redb::TableDefinition::<u64, &[u8]>::new(
        "idempotency.partitions",
    ))?;
    let mut parts = Vec::new();
    for e in redb::ReadableTable::iter(&rows)? {
        parts.push(e?.0.value());
    }
    eprintln!("partitions at the end: {parts:?}");
    assert!(
        parts.iter().any(|p| *p >= 1 << 63),
        "no merge happened: {parts:?}"
    );
    Ok(())
}

#[path = "common/small_fs.rs"]
mod small_fs;

/// A disk that fills while a merge copies: the engine refuses (an error,
/// poisoned), loses no acknowledged answer, and once space is back a
/// reopen finishes the merge with every answer as before and `verify`
/// sound.
#[test]
fn a_full_disk_during_a_merge_loses_nothing() -> R<()> {
    let Some(fs) = small_fs::SmallFs::mount(64 * 1024).map_err(|e| e.to_string())? else {
        return Ok(());
    };
    let path = fs.mnt.join("full.redb");
    let now = Arc::new(AtomicU64::new(T0));
    let builder = || {
        Engine::builder()
            .clock(Manual(now.clone()))
            .ttl(Duration::from_secs(86_400))
            .lease(Duration::from_secs(10 * 3_600))
            .partition_limits(64, Duration::from_secs(600))
            .sweep_interval(None)
    };
    let engine = builder().open(&path)?;
    let n = 6_000usize;
    for i in 0..n {
        now.store(T0 + (i as u64) * 500, Ordering::SeqCst);
        let Begin::Claimed(claim) = engine.begin(&key(i)?, fp(i))? else {
            return Err(format!("{i} not claimed").into());
        };
        engine.complete(claim, body(i, 0))?;
    }
    engine.flush()?;
    now.store(T0 + 3 * HOUR, Ordering::SeqCst);
    // Fill the disk to the last byte.
    let filler = fs.mnt.join("filler");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&filler)?;
        let chunk = vec![0u8; 4096];
        while f.write_all(&chunk).is_ok() {}
        let _ = f.write_all(&[0u8; 1]);
        let _ = f.sync_all();
    }
    eprintln!(
        "free after filling: {:?}",
        fs.free_bytes().map_err(|e| e.to_string())?
    );
    let swept = engine.sweep_now();
    eprintln!(
        "sweep on a full disk: {swept:?}; poisoned: {:?}",
        engine.poisoned()
    );
    // More traffic on the full disk, to reach a checkpoint.
    for i in n..n + 200 {
        let r = engine.begin(&key(i)?, fp(i));
        if let Ok(Begin::Claimed(c)) = r {
            if let Err(e) = engine.complete(c, body(i, 0)) {
                eprintln!("write {i} refused on the full disk: {e}");
                break;
            }
        } else {
            eprintln!("begin {i} on the full disk: {r:?}");
            break;
        }
    }
    let again = engine.sweep_now();
    eprintln!(
        "second sweep: {again:?}; poisoned: {:?}",
        engine.poisoned().is_some()
    );
    let check = |engine: &Engine, when: &str| -> R<()> {
        for i in 0..n {
            match engine.begin(&key(i)?, fp(i)) {
                Ok(Begin::Replay(got)) if got.envelope == body(i, 0) => {}
                other => return Err(format!("{when}: {i}: {other:?}").into()),
            }
        }
        Ok(())
    };
    check(&engine, "on the full disk")?;
    drop(engine);
    std::fs::remove_file(&filler)?;
    let engine = builder().open_existing(&path)?;
    check(&engine, "reopened")?;
    let report = engine.verify()?;
    assert!(report.is_sound(), "{:?}", report.damage);
    engine.sweep_now()?;
    check(&engine, "after the merge")?;
    let report = engine.verify()?;
    assert!(report.is_sound(), "{:?}", report.damage);
    let listed = engine.records(&RecordFilter::default())?;
    let mut names: Vec<String> = Vec::new();
    for r in listed {
        names.push(r?.key.to_string());
    }
    let all = names.len();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), all, "each key listed once");
    assert!(all >= n);
    Ok(())
}
