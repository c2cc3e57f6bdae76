//! The payments demo, run as a user would run it: the binary starts the API
//! as its own child, drives HTTP traffic, crashes it between a provider
//! charge and the recorded outcome, restarts it, and audits the provider's
//! ledger. Guards against any payment being charged twice or lost across
//! duplicates, timeouts, a process crash, an expired key and a full disk,
//! and against a torn or unparsable ledger: the demo exits non-zero if one
//! was found.

mod common;

#[test]
fn payments_demo_charges_every_payment_exactly_once() -> Result<(), Box<dyn std::error::Error>> {
    common::run_demo_and_check_audit(&[])
}
