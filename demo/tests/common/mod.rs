//! Running the demo binary and checking its audit, for every store.

use std::process::Command;

/// Runs `payments demo` with `args` and checks that it succeeded, that its
/// audit of both providers' ledgers found 0 double and 0 lost charges and
/// receipts, that the SIGKILL between the two calls was followed by a
/// resume (the charge skipped, the receipt sent once), and that it took
/// under two minutes, with its narrative on stdout free of server and log
/// lines.
#[allow(dead_code)] // each test file compiles this module; not all use it
pub fn run_demo_and_check_audit(args: &[&str]) -> Result<(), Box<dyn std::error::Error>> {
    run_demo_and_check(args).map(drop)
}

/// [`run_demo_and_check_audit`], returning the demo's stdout for further
/// checks.
#[allow(dead_code)] // each test file compiles this module; not all use it
pub fn run_demo_and_check(args: &[&str]) -> Result<String, Box<dyn std::error::Error>> {
    // Cargo builds the binary, in this test's profile, before the test.
    let output = Command::new(env!("CARGO_BIN_EXE_payments"))
        .arg("demo")
        .args(args)
        .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "demo failed with {}\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        output.status
    );
    let audit = stdout
        .lines()
        .find(|line| line.starts_with("audit of both providers' ledgers: "))
        .ok_or_else(|| format!("no final audit line:\n{stdout}"))?;
    assert!(
        audit.contains("0 charged twice, 0 lost;") && audit.ends_with("0 receipted twice, 0 lost"),
        "{audit}"
    );
    assert!(stdout.contains("OK: every payment"), "{stdout}");
    // Every payment that was charged was receipted: the table's totals.
    let total: Vec<&str> = stdout
        .lines()
        .find(|line| line.starts_with("total "))
        .ok_or("no total row")?
        .split_whitespace()
        .collect();
    assert_eq!(total.get(2), total.get(3), "charges vs receipts: {total:?}");
    // The SIGKILL phase, the expiry and full-disk phases each end in an
    // audit line of their own.
    for phase in [
        "== SIGKILL between the 2 calls",
        "== key expired, retried",
        "== disk full, space freed",
    ] {
        assert!(stdout.contains(phase), "no phase {phase:?}:\n{stdout}");
    }
    // The kill came between the calls, and the retry resumed.
    let killed = stdout
        .find("server killed with SIGKILL before the receipt call")
        .ok_or("no kill line")?;
    let resumed = stdout
        .find("resumed: the retry found step \"charge\" confirmed")
        .ok_or("no resume line")?;
    assert!(killed < resumed, "{stdout}");
    // The narrative stays on stdout; the servers' lines and every log
    // event go to stderr.
    assert!(
        !stdout.contains("[server]") && !stdout.contains(" WARN "),
        "server or log lines on stdout:\n{stdout}"
    );
    // The crash scenario's lines come under its own heading.
    let heading = stdout
        .find("== server crash after charge")
        .ok_or("no crash heading")?;
    let exited = stdout.find("server exited:").ok_or("no crash line")?;
    assert!(heading < exited, "{stdout}");
    let phase_audits: Vec<&str> = stdout
        .lines()
        .filter(|line| line.trim_start().starts_with("audit: "))
        .collect();
    assert_eq!(phase_audits.len(), 3, "{stdout}");
    assert!(
        phase_audits.iter().all(|line| {
            line.contains("0 charged twice, 0 lost;") && line.ends_with("0 receipted twice, 0 lost")
        }),
        "{phase_audits:?}"
    );
    Ok(stdout.into_owned())
}
