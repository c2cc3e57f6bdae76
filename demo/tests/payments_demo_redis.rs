//! The payments demo with its idempotency records on Redis (`--store
//! redis://…`): the same traffic, crash and restart as on redb, and the
//! same audit of the provider's ledger. Guards against a payment charged
//! twice or lost when claims, outcomes and recovery go through the Redis
//! backend, across server processes that share the server.
//!
//! Needs `IDEMPOTENCY_TEST_REDIS` (set by `scripts/with-redis`, which
//! `scripts/with-services` runs). Without it the test is skipped, or fails
//! under `CI=true`.

mod common;

#[test]
fn payments_demo_on_redis_charges_every_payment_exactly_once(
) -> Result<(), Box<dyn std::error::Error>> {
    let Some(url) = std::env::var("IDEMPOTENCY_TEST_REDIS")
        .ok()
        .filter(|c| !c.is_empty())
    else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "IDEMPOTENCY_TEST_REDIS is not set and CI=true: the Redis tests may not be \
             skipped (run them through scripts/with-redis or scripts/with-services)"
        );
        println!("skipped: IDEMPOTENCY_TEST_REDIS not set (run through scripts/with-redis)");
        return Ok(());
    };
    common::run_demo_and_check_audit(&["--store", &url])
}
