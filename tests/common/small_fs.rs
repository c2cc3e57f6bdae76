//! A real small file system for disk-full tests: a tmpfs mounted in a
//! temporary directory (needs root), unmounted on drop, and a payment in the
//! demo's shape to fill it with.

#![allow(dead_code)]

use std::error::Error;
use std::path::{Path, PathBuf};

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey};

pub type TestResult<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

/// A mounted tmpfs; unmounted (even after a panic) when dropped.
pub struct SmallFs {
    _dir: tempfile::TempDir,
    pub mnt: PathBuf,
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.mnt).status();
    }
}

impl SmallFs {
    /// A tmpfs of `kib` KiB, or `None` (with a message) where mounting is
    /// not allowed.
    ///
    /// # Panics
    ///
    /// Under `CI=true` when it cannot mount: CI runs as root, and a skip
    /// there would hide the test.
    pub fn mount(kib: u64) -> TestResult<Option<SmallFs>> {
        let dir = tempfile::tempdir()?;
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt)?;
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={kib}k"), "tmpfs"])
            .arg(&mnt)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "cannot mount a tmpfs, and CI=true: the small-filesystem tests must run in CI"
            );
            eprintln!("cannot mount a tmpfs here (needs root); skipped");
            return Ok(None);
        }
        Ok(Some(SmallFs { _dir: dir, mnt }))
    }

    /// Grows (or shrinks, down to what is used) the file system to `kib`
    /// KiB: frees space without touching the engine's files.
    pub fn resize(&self, kib: u64) -> TestResult {
        let ok = std::process::Command::new("mount")
            .args(["-o", &format!("remount,size={kib}k")])
            .arg(&self.mnt)
            .status()?
            .success();
        if !ok {
            return Err(format!("remount to {kib} KiB failed").into());
        }
        Ok(())
    }

    /// Bytes free on the file system.
    pub fn free_bytes(&self) -> TestResult<u64> {
        let out = std::process::Command::new("df")
            .args(["-B1", "--output=avail"])
            .arg(&self.mnt)
            .output()?;
        let text = String::from_utf8(out.stdout)?;
        let avail = text
            .lines()
            .nth(1)
            .ok_or("df printed no value")?
            .trim()
            .parse()?;
        Ok(avail)
    }

    pub fn db(&self) -> PathBuf {
        self.mnt.join("pay.redb")
    }

    /// Sizes of the files on the file system, for messages.
    pub fn listing(&self) -> String {
        let mut out = Vec::new();
        if let Ok(entries) = std::fs::read_dir(&self.mnt) {
            for e in entries.flatten() {
                let len = e.metadata().map_or(0, |m| m.len());
                out.push(format!(
                    "{}={}K",
                    e.file_name().to_string_lossy(),
                    len / 1024
                ));
            }
        }
        out.sort();
        out.join(" ")
    }
}

/// The key of payment `i`.
pub fn pay_key(i: usize) -> TestResult<IdempotencyKey> {
    Ok(IdempotencyKey::new(
        "POST /payments",
        format!("pay-{i:06}"),
    )?)
}

fn pay_fingerprint(i: usize) -> TestResult<Fingerprint> {
    let body = format!(
        r#"{{"amount":{},"currency":"EUR","customer":"cus_{:04}"}}"#,
        1000 + i,
        i % 1000
    );
    Ok(Fingerprint::of_json(body.as_bytes(), &[])?)
}

/// The demo's 201 for payment `i` (demo/src/server.rs `payment_envelope`).
pub fn pay_envelope(i: usize) -> Envelope {
    let id = format!("ch_{i:016x}");
    let body = format!(
        r#"{{"id":"{id}","status":"succeeded","amount":{},"currency":"EUR","reference":"pay-{i:06}-ref"}}"#,
        1000 + i
    );
    Envelope::new(1, 201, body)
        .with_header("content-type", "application/json")
        .with_header("location", format!("/payments/{id}"))
}

/// Stores payment `i` (claim, then complete). `Ok(false)`: the engine
/// refused (storage full); the payment may be left claimed.
pub fn pay(engine: &Engine, i: usize) -> TestResult<bool> {
    let claim = match engine.begin(&pay_key(i)?, pay_fingerprint(i)?) {
        Ok(Begin::Claimed(claim)) => claim,
        Ok(other) => return Err(format!("payment {i}: not claimed: {other:?}").into()),
        Err(_) => return Ok(false),
    };
    Ok(engine.complete(claim, pay_envelope(i)).is_ok())
}

/// Stores payments from `from` until the engine refuses one (at most
/// `limit`); returns the index of the first one refused.
pub fn fill(engine: &Engine, from: usize, limit: usize) -> TestResult<usize> {
    for i in from..limit {
        if !pay(engine, i)? {
            return Ok(i);
        }
    }
    Err(format!("the disk never filled: {limit} payments stored").into())
}

/// Checks that payments `0..n` replay their stored 201 (`skip`: an index
/// whose outcome was not recorded).
pub fn replays(engine: &Engine, n: usize, skip: Option<usize>) -> TestResult {
    for i in (0..n).filter(|i| Some(*i) != skip) {
        match engine.begin(&pay_key(i)?, pay_fingerprint(i)?)? {
            Begin::Replay(r) => {
                if r.envelope != pay_envelope(i) {
                    return Err(format!("payment {i}: replay differs").into());
                }
            }
            other => return Err(format!("payment {i}: expected a replay, got {other:?}").into()),
        }
    }
    Ok(())
}

/// Waits (up to `secs`) for a poisoned engine to come back, asking it as a
/// probe would.
pub fn comes_back(engine: &Engine, secs: u64) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        if engine.poisoned().is_none() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

pub fn path_str(p: &Path) -> String {
    p.display().to_string()
}
