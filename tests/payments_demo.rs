//! The payments example's demo, run as a user would run it: a child
//! process that starts the API as its own child, drives HTTP traffic,
//! crashes it between a provider charge and the recorded outcome, restarts
//! it, and audits the provider's ledger. Guards against any payment being
//! charged twice or lost across duplicates, timeouts and a process crash:
//! the demo exits non-zero if one was.

use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn payments_demo_charges_every_payment_exactly_once() -> Result<(), Box<dyn std::error::Error>> {
    // Built with the profile this test was built with, so the dependency
    // tree is already compiled.
    let mut cmd = Command::new(env!("CARGO"));
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["run", "--quiet", "--example", "payments"]);
    if !cfg!(debug_assertions) {
        cmd.arg("--release");
    }
    cmd.args(["--", "demo"]);
    let started = Instant::now();
    let output = cmd.output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "demo failed with {}\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        output.status
    );
    assert!(
        stdout.contains("0 charged twice, 0 lost"),
        "no clean audit line:\n{stdout}"
    );
    assert!(stdout.contains("OK: every payment"), "{stdout}");
    // Building may take a while on a cold cache; the demo itself is quick.
    assert!(started.elapsed() < Duration::from_secs(600));
    Ok(())
}
