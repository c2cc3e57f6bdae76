//! Guards against the background threads outliving their engine: opening and
//! dropping an engine many times (with the default sweep interval and with a
//! 1 ms one that keeps the sweeper busy) must never fail, and every drop must
//! join the writer and sweeper threads, so no `idempotency-*` thread is left.
//! Linux only (threads are counted in /proc/self/task).
#![cfg(target_os = "linux")]

use std::error::Error;
use std::sync::Mutex;
use std::time::Duration;

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey};

type TestResult = Result<(), Box<dyn Error>>;

/// Thread counts are per process: the tests in this file take turns.
static SERIAL: Mutex<()> = Mutex::new(());

fn engine_threads() -> Result<usize, std::io::Error> {
    let mut n = 0;
    for task in std::fs::read_dir("/proc/self/task")? {
        // A thread may exit between listing and reading: skip it.
        if let Ok(comm) = std::fs::read_to_string(task?.path().join("comm")) {
            if comm.starts_with("idempotency-") {
                n += 1;
            }
        }
    }
    Ok(n)
}

fn open_drop_loop(interval: Option<Duration>) -> TestResult {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.redb");
    let fp = Fingerprint::of_json(br#"{"amount": 10}"#, &[])?;
    let before = engine_threads()?;
    for i in 0..100 {
        // Threads name themselves once running, so they are only counted
        // after the engine is dropped and they are joined.
        let engine = Engine::builder().sweep_interval(interval).open(&path)?;
        if i % 10 == 0 {
            let k = IdempotencyKey::new("lifecycle", format!("k-{i}"))?;
            if let Begin::Claimed(c) = engine.begin(&k, fp)? {
                engine.complete(c, Envelope::new(1, 200, "ok"))?;
            }
        }
        drop(engine);
        assert_eq!(
            engine_threads()?,
            before,
            "iteration {i}: threads left after drop"
        );
    }
    // The file is intact and reopens with every record.
    let engine = Engine::builder()
        .sweep_interval(None)
        .open_existing(&path)?;
    assert_eq!(engine.stats()?.completed, 10);
    drop(engine);
    assert_eq!(engine_threads()?, before);
    Ok(())
}

#[test]
fn open_drop_default_interval() -> TestResult {
    open_drop_loop(Some(Duration::from_secs(1)))
}

#[test]
fn open_drop_one_ms_interval() -> TestResult {
    open_drop_loop(Some(Duration::from_millis(1)))
}

#[test]
fn open_drop_no_sweeper() -> TestResult {
    open_drop_loop(None)
}
