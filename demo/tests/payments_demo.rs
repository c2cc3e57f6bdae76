//! The payments demo, run as a user would run it: the binary starts the API
//! as its own child, drives HTTP traffic, crashes it between a provider
//! charge and the recorded outcome, restarts it, and audits the provider's
//! ledger. Guards against any payment being charged twice or lost across
//! duplicates, timeouts and a process crash, and against a torn or
//! unparsable ledger: the demo exits non-zero if one was found.

use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn payments_demo_charges_every_payment_exactly_once() -> Result<(), Box<dyn std::error::Error>> {
    // Cargo builds the binary, in this test's profile, before the test.
    let started = Instant::now();
    let output = Command::new(env!("CARGO_BIN_EXE_payments"))
        .arg("demo")
        .output()?;
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
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "the demo took {:?}",
        started.elapsed()
    );
    Ok(())
}
