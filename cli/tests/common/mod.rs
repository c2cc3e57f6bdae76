//! Shared helpers: build a database with the library, run the `idem` binary.

#![allow(dead_code)] // Each test file uses a different subset.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use idempotency::{Begin, Claim, Engine, Fingerprint, IdempotencyKey};

pub type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// The `idem` binary as a command with `RUST_LOG` unset, so its stderr
/// holds what it prints by default (the library's warnings included),
/// whatever the shell running the tests sets. Add arguments and
/// environment, then run it.
pub fn idem_command() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.env_remove("RUST_LOG");
    cmd
}

/// Runs `idem` with `args` (as [`idem_command`]) and returns its output.
pub fn idem<I, S>(args: I) -> TestResult<Output>
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    Ok(idem_command().args(args).output()?)
}

/// `idem` that must succeed; returns stdout.
pub fn idem_ok<I, S>(args: I) -> TestResult<String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let out = idem(args)?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "idem failed: {:?}\n{stderr}",
        out.status
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// `idem` that must fail with exit code 1 and exactly one line on stderr;
/// returns that line.
pub fn idem_err<I, S>(args: I) -> TestResult<String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let out = idem(args)?;
    let stderr = String::from_utf8(out.stderr)?;
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "stderr: {stderr:?}");
    assert!(stderr.starts_with("idem: "), "stderr: {stderr:?}");
    assert!(
        out.stdout.is_empty(),
        "stdout: {:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(stderr.trim_end().to_string())
}

pub fn db_path(dir: &Path) -> PathBuf {
    dir.join("idem.redb")
}

/// An engine without a sweeper, so nothing changes behind the test's back.
pub fn engine(path: &Path) -> TestResult<Engine> {
    Ok(Engine::builder().sweep_interval(None).open(path)?)
}

pub fn key(scope: &str, key: &str) -> TestResult<IdempotencyKey> {
    Ok(IdempotencyKey::new(scope, key)?)
}

pub fn fp(body: &str) -> TestResult<Fingerprint> {
    Ok(Fingerprint::of_json(body.as_bytes(), &[])?)
}

/// Claims `key`, which must be new.
pub fn claim(engine: &Engine, key: &IdempotencyKey, fingerprint: Fingerprint) -> TestResult<Claim> {
    match engine.begin(key, fingerprint)? {
        Begin::Claimed(claim) => Ok(claim),
        other => Err(format!("expected a claim for {key}, got {other:?}").into()),
    }
}

pub mod pg;
pub mod raw_records;
