//! Helpers that act on the test server's processes (`scripts/with-postgres`
//! sets where it lives): restart it, and freeze (SIGSTOP) its postmaster or
//! one backend with a guard that always thaws it (SIGCONT), even when the
//! test panics, so a failed test never leaves a stopped server behind for
//! the rest of the suite.
//!
//! Used through `#[path = "common/pg_server.rs"] mod pg_server;` beside
//! `pg_chaos.rs`. Unix only.

#![allow(dead_code)] // each test file uses some of these

use std::error::Error;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::pg_chaos;

type TestResult<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

/// The `pg_ctl` to use: on PATH, else the newest under
/// `/usr/lib/postgresql/*/bin` (where scripts/with-postgres also looks).
pub fn pg_ctl() -> TestResult<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("pg_ctl"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    if let Some(found) = on_path.into_iter().find(|p| p.is_file()) {
        return Ok(found);
    }
    let mut installed: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|e| format!("pg_ctl is not on PATH and /usr/lib/postgresql: {e}"))?
        .filter_map(|entry| {
            let dir = entry.ok()?.path();
            let major = dir.file_name()?.to_str()?.parse().ok()?;
            let bin = dir.join("bin/pg_ctl");
            bin.is_file().then_some((major, bin))
        })
        .collect();
    installed.sort();
    installed
        .pop()
        .map(|(_, p)| p)
        .ok_or_else(|| "pg_ctl not found on PATH or in /usr/lib/postgresql/*/bin".into())
}

/// `pg_ctl -D <data> restart -m immediate -w` as the server's OS user
/// (through `runuser` when this process is root). The restarted server
/// logs to `<data>/test_restart.log` (its own user can write
/// there), so pg_ctl's pipes close when it exits.
pub fn restart_server() -> TestResult<Duration> {
    let data = std::env::var(pg_chaos::PG_DATA_VAR)
        .map_err(|_| format!("{} is not set", pg_chaos::PG_DATA_VAR))?;
    let user = std::env::var(pg_chaos::PG_USER_VAR).unwrap_or_default();
    let uid = Command::new("id").arg("-u").output()?;
    let root = String::from_utf8_lossy(&uid.stdout).trim() == "0";
    let log = Path::new(&data).join("test_restart.log");
    let pg_ctl = pg_ctl()?;
    let pg_ctl_args: [&OsStr; 8] = [
        OsStr::new("-D"),
        OsStr::new(&data),
        OsStr::new("-l"),
        log.as_os_str(),
        OsStr::new("restart"),
        OsStr::new("-m"),
        OsStr::new("immediate"),
        OsStr::new("-w"),
    ];
    let mut cmd = if root {
        if user.is_empty() {
            return Err(
                format!("running as root, but {} is not set", pg_chaos::PG_USER_VAR).into(),
            );
        }
        let mut c = Command::new("runuser");
        c.args(["-u", &user, "--"]).arg(&pg_ctl);
        c
    } else {
        Command::new(&pg_ctl)
    };
    // A directory the server's user can enter, whoever runs the test.
    cmd.current_dir("/");
    let t = Instant::now();
    let out = cmd
        .args(pg_ctl_args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run pg_ctl: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "pg_ctl restart failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    Ok(t.elapsed())
}

/// The postmaster's pid: the first line of `<data>/postmaster.pid`.
pub fn postmaster_pid() -> TestResult<u32> {
    let data = std::env::var(pg_chaos::PG_DATA_VAR)
        .map_err(|_| format!("{} is not set", pg_chaos::PG_DATA_VAR))?;
    let path = Path::new(&data).join("postmaster.pid");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let first = text.lines().next().unwrap_or("").trim();
    Ok(first
        .parse()
        .map_err(|e| format!("{}: first line {first:?}: {e}", path.display()))?)
}

fn signal(pid: u32, sig: &str) -> TestResult {
    let out = Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run kill: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "kill -{sig} {pid} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
        .into())
    }
}

/// A process stopped with SIGSTOP until this guard is dropped (SIGCONT),
/// on every path out of the test, panics included.
pub struct Frozen {
    pid: u32,
    thawed: bool,
}

impl Frozen {
    /// Sends SIGSTOP to `pid`.
    pub fn stop(pid: u32) -> TestResult<Frozen> {
        signal(pid, "STOP")?;
        Ok(Frozen { pid, thawed: false })
    }

    /// Sends SIGCONT now (the drop then does nothing).
    pub fn thaw(mut self) -> TestResult {
        self.thawed = true;
        signal(self.pid, "CONT")
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        if !self.thawed {
            if let Err(e) = signal(self.pid, "CONT") {
                eprintln!("COULD NOT THAW pid {}: {e}", self.pid);
            }
        }
    }
}

/// Runs `f` on a thread and waits for it at most `limit`: `Err` if it has
/// not returned by then (the thread is left behind: a hang is the bug the
/// caller reports) or if it panicked. Returns the value and how long `f`
/// took.
pub fn within<T: Send + 'static>(
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> TestResult<(T, Duration)> {
    let (tx, rx) = std::sync::mpsc::channel();
    let t = Instant::now();
    std::thread::Builder::new()
        .name("within".into())
        .spawn(move || {
            let v = f();
            let _ = tx.send((v, t.elapsed()));
        })?;
    match rx.recv_timeout(limit) {
        Ok(v) => Ok(v),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            Err(format!("the call hung: no answer after {limit:?}").into())
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err("the call panicked".into()),
    }
}
