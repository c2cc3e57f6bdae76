//! `EngineBuilder::cache_size` bounds redb's page cache, the largest share
//! of an embedded engine's memory (docs/operations.md, "Memory").
//!
//! Two child processes (this binary again, `cache_child_entry`) each
//! create a file, store 768 COMPLETED records of 64 KiB responses
//! (48 MiB) from 8 threads, replay every one, and print their peak RSS (`VmHWM`): one
//! with redb's default cache (1 GiB, which keeps every page read or
//! written), one with `cache_size(2 MiB)`. The small cache must keep the
//! peak at least 24 MiB lower, and its replays must be the same. Memory,
//! not speed: nothing here is timed. Linux only (`/proc/self/status`).
//!
//! Any size is accepted: 0, 1, 4,096 bytes and `usize::MAX` each open,
//! serve, and replay after a reopen.

use std::time::Duration;

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const CHILD_VAR: &str = "IDEMPOTENCY_CACHE_SIZE_CHILD";
const RECORDS: usize = 768;
const THREADS: usize = 8;
const RESPONSE_BYTES: usize = 64 << 10;

fn key(i: usize) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("cache", format!("request-{i:05}"))
}

fn body(i: usize) -> Vec<u8> {
    let mut b = format!("response {i} ").into_bytes();
    b.resize(RESPONSE_BYTES, b'a' + (i % 26) as u8);
    b
}

/// Peak resident memory of this process, KiB.
fn vm_hwm_kib() -> Result<u64, Box<dyn std::error::Error>> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .ok_or("no VmHWM line in /proc/self/status")?;
    Ok(line
        .split_whitespace()
        .nth(1)
        .ok_or("a VmHWM line without a number")?
        .parse()?)
}

/// The child: `IDEMPOTENCY_CACHE_SIZE_CHILD=<dir>:<cache bytes or "default">`.
#[test]
fn cache_child_entry() -> TestResult {
    let Ok(arg) = std::env::var(CHILD_VAR) else {
        return Ok(());
    };
    let (dir, cache) = arg.rsplit_once(':').ok_or("DIR:CACHE")?;
    let mut builder = Engine::builder()
        .sweep_interval(None)
        .lease(Duration::from_secs(3600));
    if cache != "default" {
        builder = builder.cache_size(cache.parse()?);
    }
    let engine = builder.open(std::path::Path::new(dir).join("cache.redb"))?;
    let fp = |i: usize| Fingerprint::from_bytes([(i % 251) as u8; 32]);
    let store = |t: usize| -> Result<(), String> {
        for i in (t..RECORDS).step_by(THREADS) {
            let key = key(i).map_err(|e| e.to_string())?;
            match engine.begin(&key, fp(i)).map_err(|e| e.to_string())? {
                Begin::Claimed(claim) => engine
                    .complete(claim, Envelope::new(1, 200, body(i)))
                    .map_err(|e| e.to_string())?,
                other => return Err(format!("key {i}: {other:?}")),
            }
        }
        Ok(())
    };
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS).map(|t| s.spawn(move || store(t))).collect();
        workers
            .into_iter()
            .map(|w| w.join().map_err(|_| "a writer panicked".to_owned())?)
            .collect::<Result<Vec<()>, String>>()
    })?;
    for i in 0..RECORDS {
        match engine.begin(&key(i)?, fp(i))? {
            Begin::Replay(replay) if replay.envelope.body == body(i) => {}
            other => return Err(format!("key {i} did not replay its response: {other:?}").into()),
        }
    }
    println!("CHILD VmHWM {}", vm_hwm_kib()?);
    Ok(())
}

/// Runs the child with `cache`; its peak RSS in KiB.
fn child_peak(cache: &str) -> Result<u64, Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let out = std::process::Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            // `<file>::cache_child_entry` where this file is a module of a test binary.
            concat!(module_path!(), "::cache_child_entry")
                .split_once("::")
                .map_or("cache_child_entry", |(_, t)| t),
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_VAR, format!("{}:{cache}", dir.path().display()))
        .stdin(std::process::Stdio::null())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let peak = stdout
        .lines()
        .find_map(|l| l.split_once("CHILD VmHWM ").map(|(_, n)| n))
        .ok_or_else(|| {
            format!(
                "the child ({cache}) failed: {:?}\n{stdout}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
    Ok(peak.trim().parse()?)
}

#[test]
fn a_small_cache_keeps_the_engine_s_memory_down() -> TestResult {
    if !cfg!(target_os = "linux") {
        return Ok(());
    }
    let default = child_peak("default")?;
    let small = child_peak(&(2usize << 20).to_string())?;
    eprintln!("peak RSS: default cache {default} KiB, 2 MiB cache {small} KiB");
    assert!(
        small + 24 * 1024 <= default,
        "2 MiB cache peaked at {small} KiB, the default at {default} KiB: \
         the setting did not bound redb's cache"
    );
    Ok(())
}

#[test]
fn any_cache_size_opens_and_serves() -> TestResult {
    for cache in [0, 1, 4096, usize::MAX] {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("any.redb");
        for round in 0..2 {
            let engine = Engine::builder()
                .cache_size(cache)
                .sweep_interval(None)
                .open(&path)?;
            let fp = Fingerprint::from_bytes([7; 32]);
            for i in 0..50 {
                match (round, engine.begin(&key(i)?, fp)?) {
                    (0, Begin::Claimed(claim)) => {
                        engine.complete(claim, Envelope::new(1, 200, body(i)))?;
                    }
                    (1, Begin::Replay(replay)) if replay.envelope.body == body(i) => {}
                    (_, other) => {
                        return Err(
                            format!("cache {cache}, round {round}, key {i}: {other:?}").into()
                        )
                    }
                }
            }
        }
    }
    Ok(())
}
