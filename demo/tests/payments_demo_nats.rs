//! The payments demo with its events on NATS JetStream (`--nats URL`): each
//! successful payment's `payment.succeeded` event is stored in the outbox
//! with its completion, relayed by the servers (one of them aborted after
//! a charge, one SIGKILLed between the two calls) and by the in-process
//! phases, and booked by the demo's ledger consumer. Guards against an event lost, published twice
//! or booked twice across duplicates, a tampered retry, crashes and
//! restarts, as well as against the payments' own double or lost charges.
//!
//! Needs `IDEMPOTENCY_TEST_NATS` (set by `scripts/with-nats`, which
//! `scripts/with-services` runs). Without it the test is skipped, or fails
//! under `CI=true`.

mod common;

#[test]
fn payments_demo_on_nats_publishes_and_books_every_payment_exactly_once(
) -> Result<(), Box<dyn std::error::Error>> {
    let Some(url) = std::env::var("IDEMPOTENCY_TEST_NATS")
        .ok()
        .filter(|c| !c.is_empty())
    else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "IDEMPOTENCY_TEST_NATS is not set and CI=true: the NATS tests may not be \
             skipped (run them through scripts/with-nats or scripts/with-services)"
        );
        println!("skipped: IDEMPOTENCY_TEST_NATS not set (run through scripts/with-nats)");
        return Ok(());
    };
    let stdout = common::run_demo_and_check(&["--nats", &url])?;
    let events = stdout
        .lines()
        .find(|line| line.starts_with("audit of the payment events"))
        .ok_or_else(|| format!("no events audit line:\n{stdout}"))?;
    // "... payments): N payments: N published once, 0 twice; N booked once,
    // 0 twice; 0 lost; ..."
    let numbers: Vec<u64> = events
        .split_once("): ")
        .ok_or_else(|| format!("unexpected events audit line: {events}"))?
        .1
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .collect();
    let [payments, published, published_twice, booked, booked_twice, lost, ..] = numbers[..] else {
        return Err(format!("unexpected events audit line: {events}").into());
    };
    // Every payment the client saw succeed, the in-process phases' too.
    let succeeded: u64 = stdout
        .lines()
        .find_map(|line| line.strip_prefix("audit of both providers' ledgers: "))
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("no providers' audit line:\n{stdout}"))?;
    assert_eq!(payments, succeeded, "{events}");
    assert!(payments >= 10, "{events}");
    assert_eq!(published, payments, "{events}");
    assert_eq!(booked, payments, "{events}");
    assert_eq!((published_twice, booked_twice, lost), (0, 0, 0), "{events}");
    Ok(())
}
