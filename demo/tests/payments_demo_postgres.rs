//! The payments demo with its idempotency records on PostgreSQL
//! (`--store`): the same traffic, crash and restart as on redb, and the
//! same audit of the provider's ledger. Guards against a payment charged
//! twice or lost when claims, outcomes and recovery go through the
//! PostgreSQL backend, across server processes that share the database.
//!
//! Needs `IDEMPOTENCY_TEST_PG` (set by `scripts/with-postgres`). Without
//! it the test is skipped, or fails under `CI=true`.

mod common;

#[test]
fn payments_demo_on_postgres_charges_every_payment_exactly_once(
) -> Result<(), Box<dyn std::error::Error>> {
    let Some(conn) = std::env::var("IDEMPOTENCY_TEST_PG")
        .ok()
        .filter(|c| !c.is_empty())
    else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "IDEMPOTENCY_TEST_PG is not set and CI=true: the PostgreSQL tests may not be \
             skipped (run them through scripts/with-postgres)"
        );
        println!("skipped: IDEMPOTENCY_TEST_PG not set (run through scripts/with-postgres)");
        return Ok(());
    };
    common::run_demo_and_check_audit(&["--store", &conn])
}
