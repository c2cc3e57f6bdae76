//! One round of a kill loop: this test binary's `child_entry` test runs in
//! a child process, works for a while, and is SIGKILLed.

#![allow(dead_code)] // each kill-loop file uses what it needs

use std::error::Error;
use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Set (to `child`) in the child process: its `child_entry` works.
const ROLE_VAR: &str = "IDEM_KILL_ROLE";
/// The child's database file.
const DB_VAR: &str = "IDEM_KILL_DB";
/// The round the child runs in.
const ROUND_VAR: &str = "IDEM_KILL_ROUND";
/// The file the child appends its acknowledged writes to.
const LOG_VAR: &str = "IDEM_KILL_LOG";
/// The line the child prints once its engine is open.
const READY: &str = "KILL CHILD READY";

/// What a child of [`kill_round`] works on.
pub struct Child {
    /// Its database file.
    pub db: PathBuf,
    /// Its round.
    pub round: u64,
    /// Its acknowledgement log, opened for appending.
    pub log: File,
}

/// In a child started by [`kill_round`]: what it works on; `None` when
/// `child_entry` runs in the ordinary test run (it then does nothing).
///
/// # Errors
///
/// A variable is missing or malformed, or the log does not open.
pub fn child() -> Result<Option<Child>, Box<dyn Error + Send + Sync>> {
    if std::env::var_os(ROLE_VAR).is_none() {
        return Ok(None);
    }
    Ok(Some(Child {
        db: PathBuf::from(std::env::var(DB_VAR)?),
        round: std::env::var(ROUND_VAR)?.parse()?,
        log: OpenOptions::new()
            .create(true)
            .append(true)
            .open(std::env::var(LOG_VAR)?)?,
    }))
}

/// Tells the parent the child is ready (its engine is open).
///
/// # Errors
///
/// Writing to stdout failed.
pub fn say_ready() -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{READY}")?;
    out.flush()
}

/// Ends the child with exit code 4 after 120 s, should the parent never
/// kill it (a hung child fails its round instead of hanging the test).
pub fn exit_if_never_killed() {
    std::thread::spawn(|| {
        std::thread::sleep(std::time::Duration::from_secs(120));
        std::process::exit(4);
    });
}

/// One round: starts this binary's `child_entry` on `db` with its
/// acknowledgement log `log` (see [`child`]), waits until it is ready,
/// lets it run for `delay` and SIGKILLs it (see [`run_then_kill`]).
///
/// # Errors
///
/// As [`run_then_kill`].
pub fn kill_round(
    round: u64,
    db: &Path,
    log: &Path,
    stderr: &Path,
    delay: Duration,
) -> Result<(), Box<dyn Error + Send + Sync>> {
    let round_text = round.to_string();
    run_then_kill(
        round,
        &[
            (ROLE_VAR, "child".as_ref()),
            (DB_VAR, db.as_os_str()),
            (ROUND_VAR, round_text.as_ref()),
            (LOG_VAR, log.as_os_str()),
        ],
        READY,
        stderr,
        delay,
    )
}

/// A seed for kill delays that differs from run to run.
pub fn time_seed() -> Result<u64, std::time::SystemTimeError> {
    Ok(std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64)
}

/// The next seed, and a delay of `base` plus up to `spread` ms drawn from it.
pub fn next_delay(seed: u64, base: u64, spread: u64) -> (u64, Duration) {
    let seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (seed, Duration::from_millis(base + (seed >> 33) % spread))
}

/// The name of the including file's `child_entry` test for `--exact`:
/// `child_entry` when the file is its own test binary, `<file>::child_entry`
/// when it is a module of a combined one. This module is declared in that
/// file, so the file's module path is this one's without its last segment
/// (and without the crate's name).
fn child_entry() -> String {
    let file = module_path!()
        .rsplit_once("::")
        .map_or("", |(file, _)| file);
    match file.split_once("::") {
        Some((_, module)) => format!("{module}::child_entry"),
        None => "child_entry".to_owned(),
    }
}

/// Starts `child_entry` of this test binary with `envs` (core dumps off,
/// its stderr in `stderr`), waits for the line holding `ready`, lets it
/// run for `delay`, and SIGKILLs it.
///
/// # Errors
///
/// Spawning or waiting failed, or the child ended by itself before the
/// kill (the error holds its stderr), naming `round`.
pub fn run_then_kill(
    round: u64,
    envs: &[(&str, &OsStr)],
    ready: &str,
    stderr: &Path,
    delay: Duration,
) -> Result<(), Box<dyn Error + Send + Sync>> {
    let mut command = Command::new("/bin/sh");
    command
        .arg("-c")
        .arg(r#"ulimit -c 0 2>/dev/null; exec "$0" "$@""#)
        .arg(std::env::current_exe()?)
        .args(["--exact", &child_entry(), "--nocapture", "--test-threads=1"]);
    for (name, value) in envs {
        command.env(name, value);
    }
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(File::create(stderr)?)
        .spawn()?;
    let mut out = BufReader::new(child.stdout.take().ok_or("no stdout")?);
    let mut line = String::new();
    while out.read_line(&mut line)? > 0 && !line.contains(ready) {}
    std::thread::sleep(delay);
    let early = child.try_wait()?;
    child.kill()?;
    let status = child.wait()?;
    if early.is_some() || status.signal() != Some(9) {
        return Err(format!(
            "round {round}: the child ended by itself ({status:?}): {}",
            std::fs::read_to_string(stderr).unwrap_or_default()
        )
        .into());
    }
    Ok(())
}
