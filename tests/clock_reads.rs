//! Guards against answers computed from two readings of the clock: a
//! `Retry-After` taken from one reading and checked against another can
//! underflow when the lease ends between the two (a debug build panicked; a
//! release build answered a retry hint of about 10^16 seconds). The clock
//! here moves forward on every read, so any answer that reads it twice
//! meets a lease ending between its reads.

use std::error::Error;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency::{Begin, Clock, Engine, Fingerprint, IdempotencyKey, InDoubt, Resolution};

type TestResult = Result<(), Box<dyn Error>>;

const LEASE_MS: u64 = 40;

/// A clock that advances by `step_ms` every time it is read.
#[derive(Debug, Clone)]
struct TickingClock {
    now_ms: Arc<AtomicU64>,
    step_ms: u64,
}

impl Clock for TickingClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.fetch_add(self.step_ms, Ordering::SeqCst)
    }
}

/// A dropped claim on an engine with a resolver answers `Processing` until
/// its lease ends: every such answer's retry hint lies within the lease,
/// whatever the phase of the clock's steps against the lease end.
#[test]
fn processing_hint_never_exceeds_the_lease_on_a_moving_clock() -> TestResult {
    let key = IdempotencyKey::new("tenant-1:create_payment", "ticking")?;
    let fp = Fingerprint::of_json(br#"{"amount": 10}"#, &[])?;
    for step_ms in [1, 2, 3] {
        for phase in 0..8 {
            let clock = TickingClock {
                now_ms: Arc::new(AtomicU64::new(1_700_000_000_000 + phase)),
                step_ms,
            };
            let engine = Engine::builder()
                .clock(clock)
                .lease(Duration::from_millis(LEASE_MS))
                .sweep_interval(None)
                .resolver(|_: &InDoubt| Resolution::NotExecuted)
                .in_memory()?;
            match engine.begin(&key, fp)? {
                Begin::Claimed(claim) => drop(claim),
                other => return Err(format!("a new key is claimed, got {other:?}").into()),
            }
            engine.flush()?;
            let mut processing = 0;
            // Each `begin` moves the clock on; the lease ends within a
            // bounded number of calls, and the resolver then frees the key.
            let settled = loop {
                match engine.begin(&key, fp)? {
                    Begin::Processing { retry_after } => {
                        assert!(
                            retry_after <= Duration::from_millis(LEASE_MS),
                            "step {step_ms} phase {phase}: retry hint {retry_after:?} \
                             beyond the {LEASE_MS} ms lease"
                        );
                        processing += 1;
                        assert!(processing <= LEASE_MS, "the lease never ended");
                    }
                    other => break other,
                }
            };
            assert!(
                matches!(settled, Begin::Claimed(_)),
                "step {step_ms} phase {phase}: {settled:?}"
            );
            assert!(processing > 0, "never saw the lease running");
        }
    }
    Ok(())
}
