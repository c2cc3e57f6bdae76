//! The engine settings, key and fingerprints the committed fixtures
//! (`tests/fixtures/format*.redb`) were written with, shared by the tests
//! that open them: a fixture answers as written only under the same TTL,
//! tombstone policy and scope.

#![allow(dead_code)] // each test file uses what it needs

use std::time::Duration;

use idempotency::{Engine, EngineBuilder, ExpiryPolicy, Fingerprint, IdempotencyKey, ManualClock};

/// One day.
pub const DAY: Duration = Duration::from_secs(24 * 60 * 60);

/// An engine builder as the fixtures' writers had it: `clock`, no
/// sweeper, a 30-day TTL, a 30 s lease, tombstones kept 10 days.
pub fn builder(clock: &ManualClock) -> EngineBuilder {
    Engine::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .ttl(30 * DAY)
        .lease(Duration::from_secs(30))
        .expiry_policy(ExpiryPolicy::Tombstone { keep: 10 * DAY })
}

/// The key `k` in the fixtures' scope, `shop:pay`.
pub fn key(k: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("shop:pay", k)
}

/// The fingerprint of a payment of `amount` EUR.
pub fn fp(amount: u32) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(
        format!(r#"{{"amount":{amount},"currency":"EUR"}}"#).as_bytes(),
        &[],
    )
}
