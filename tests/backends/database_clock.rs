//! `EngineBuilder::database_clock(true)` (the PostgreSQL default): leases
//! and expiry follow the database server's clock, not the app's, so two
//! app servers whose clocks disagree still agree on when a lease ends. The
//! rest of the suite turns it off to move time with a `ManualClock`.

use std::time::Duration;

use idempotency::{Begin, Clock, Envelope, SystemClock};

use super::support::*;

/// An app clock an hour behind.
#[derive(Debug)]
struct HourBehind;

impl Clock for HourBehind {
    fn now_ms(&self) -> u64 {
        SystemClock.now_ms() - 3_600_000
    }
}

/// PostgreSQL only: redb has no database clock.
#[test]
fn postgres_database_clock_overrides_a_skewed_app_clock() -> TestResult {
    let Some(h) = Harness::new(Backend::Postgres) else {
        return Ok(());
    };
    let h = h.database_clock(true);
    let lease = Duration::from_millis(1_500);
    let engine = h.open(h.builder().clock(HourBehind).lease(lease))?;
    let k = key("db-clock")?;
    let c = claimed(engine.begin(&k, fp(1)?)?)?;
    let real = SystemClock.now_ms();
    let skew = c.claimed_at_ms().abs_diff(real);
    assert!(
        skew < 60_000,
        "claimed at {} but the database's (and the real) time is {real}: off by {skew} ms",
        c.claimed_at_ms()
    );
    assert_eq!(c.lease_until_ms(), c.claimed_at_ms() + 1_500);
    match engine.begin(&k, fp(1)?)? {
        Begin::Processing { retry_after } => assert!(retry_after <= lease, "{retry_after:?}"),
        other => return Err(format!("expected Processing, got {other:?}").into()),
    }
    // The lease ends in real time (by the database's clock).
    std::thread::sleep(lease + Duration::from_millis(500));
    let p = unknown(engine.begin(&k, fp(1)?)?)?;
    assert!(p.reason.contains("lease"), "{}", p.reason);
    engine.complete(c, Envelope::new(1, 201, "late"))?;
    let r = replay(engine.begin(&k, fp(1)?)?)?;
    assert!(r.completed_at_ms.abs_diff(SystemClock.now_ms()) < 60_000);
    Ok(())
}
