//! What the suite's test bodies share: the harness, outcome helpers, keys
//! and fingerprints, the start instant of every `ManualClock`.

pub(crate) use super::super::common::{claimed, replay, unknown};
pub(crate) use crate::harness::{run, run_format2, run_format3, Backend, Harness, TestResult};

use idempotency::{Fingerprint, FingerprintError, IdempotencyKey};

/// Where every `ManualClock` starts: 2023-11-14, ms since the epoch.
pub(crate) const T0: u64 = 1_700_000_000_000;

/// A key in the suite's one scope.
pub(crate) fn key(k: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("tenant-1:create_payment", k)
}

/// The fingerprint of `{"amount": <amount>, "currency": "EUR"}`.
pub(crate) fn fp(amount: u64) -> Result<Fingerprint, FingerprintError> {
    Fingerprint::of_json(
        format!(r#"{{"amount": {amount}, "currency": "EUR"}}"#).as_bytes(),
        &[],
    )
}
