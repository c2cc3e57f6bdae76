//! State the layer shares between requests: the capacity semaphore, the
//! per-route estimates of how long a claimed request takes, and the claims
//! this process holds (for `Retry-After` and for waiting duplicates).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{watch, Semaphore};

use crate::IdempotencyKey;

/// Weight of a new sample in the running estimate (an exponentially
/// weighted moving average).
const EWMA_WEIGHT: f64 = 0.2;

/// Shared between all services made by one layer (and its clones).
pub(crate) struct Runtime {
    pub(crate) permits: Arc<Semaphore>,
    /// Large JSON bodies fingerprinted at once: one per CPU. Canonicalizing
    /// takes CPU time and, for deeply nested documents, memory of up to
    /// ~90 times the body size, so this bounds both.
    pub(crate) fingerprints: Arc<Semaphore>,
    /// Route pattern (or `""` for requests matching no route) → estimated
    /// seconds from claim to recorded outcome. Bounded by the number of
    /// configured routes plus one.
    estimates: Mutex<HashMap<String, f64>>,
    in_flight: Mutex<HashMap<IdempotencyKey, InFlight>>,
}

#[derive(Clone)]
struct InFlight {
    started: Instant,
    /// Closed (sender dropped) when the claim's outcome is recorded.
    done: watch::Receiver<()>,
}

impl Runtime {
    pub(crate) fn new(max_in_flight: usize) -> Arc<Runtime> {
        Arc::new(Runtime {
            permits: Arc::new(Semaphore::new(
                max_in_flight.clamp(1, Semaphore::MAX_PERMITS),
            )),
            fingerprints: Arc::new(Semaphore::new(
                std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
            )),
            estimates: Mutex::new(HashMap::new()),
            in_flight: Mutex::new(HashMap::new()),
        })
    }

    /// Adds one observed duration (claim to recorded outcome) for `route`.
    pub(crate) fn observe(&self, route: &str, took: Duration) {
        let secs = took.as_secs_f64();
        let mut estimates = self.estimates.lock();
        match estimates.get_mut(route) {
            Some(e) => *e += EWMA_WEIGHT * (secs - *e),
            None => {
                estimates.insert(route.to_owned(), secs);
            }
        }
    }

    /// When a claim on `route` for `key`, still running, is likely to be
    /// done: the route's estimate minus the time the claim has run (if this
    /// process holds it), capped by the remaining lease. With no estimate
    /// yet, the remaining lease capped at one second.
    pub(crate) fn expected_remaining(
        &self,
        route: &str,
        key: &IdempotencyKey,
        lease_left: Duration,
    ) -> Duration {
        let estimate = self.estimates.lock().get(route).copied();
        let Some(estimate) = estimate else {
            return lease_left.min(Duration::from_secs(1));
        };
        let elapsed = self
            .in_flight
            .lock()
            .get(key)
            .map_or(Duration::ZERO, |f| f.started.elapsed());
        let estimate = Duration::try_from_secs_f64(estimate).unwrap_or(Duration::MAX);
        estimate.saturating_sub(elapsed).min(lease_left)
    }

    /// Registers a claim this process holds; dropping the guard marks it
    /// done and wakes duplicates waiting for it.
    pub(crate) fn hold(self: &Arc<Runtime>, key: IdempotencyKey, route: String) -> Holding {
        let (tx, rx) = watch::channel(());
        self.in_flight.lock().insert(
            key.clone(),
            InFlight {
                started: Instant::now(),
                done: rx,
            },
        );
        Holding {
            runtime: self.clone(),
            key,
            route,
            started: Instant::now(),
            done: Some(tx),
        }
    }

    /// A receiver that closes when this process's claim on `key` is done;
    /// `None` if this process holds no claim on it.
    pub(crate) fn watch(&self, key: &IdempotencyKey) -> Option<watch::Receiver<()>> {
        self.in_flight.lock().get(key).map(|f| f.done.clone())
    }
}

/// A claim held by this process, from `begin` until its outcome is recorded.
pub(crate) struct Holding {
    runtime: Arc<Runtime>,
    key: IdempotencyKey,
    route: String,
    started: Instant,
    done: Option<watch::Sender<()>>,
}

impl Holding {
    /// The outcome is recorded: feed the route's estimate, then release.
    pub(crate) fn finished(self) {
        self.runtime.observe(&self.route, self.started.elapsed());
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        self.runtime.in_flight.lock().remove(&self.key);
        // Dropping the sender closes every receiver: waiters wake up.
        drop(self.done.take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimate_is_capped_by_the_lease_and_defaults_to_a_second() {
        let rt = Runtime::new(4);
        let key = IdempotencyKey::new("s", "k").expect("valid key");
        let lease = Duration::from_secs(10);
        assert_eq!(
            rt.expected_remaining("/p", &key, lease),
            Duration::from_secs(1)
        );
        rt.observe("/p", Duration::from_millis(150));
        assert!(rt.expected_remaining("/p", &key, lease) <= Duration::from_millis(150));
        rt.observe("/slow", Duration::from_secs(60));
        assert_eq!(rt.expected_remaining("/slow", &key, lease), lease);
    }

    #[test]
    fn holding_wakes_watchers_when_dropped() {
        let rt = Runtime::new(4);
        let key = IdempotencyKey::new("s", "k").expect("valid key");
        let held = rt.hold(key.clone(), "/p".into());
        let rx = rt.watch(&key).expect("held");
        assert!(rx.has_changed().is_ok());
        held.finished();
        assert!(rx.has_changed().is_err(), "sender dropped");
        assert!(rt.watch(&key).is_none());
    }
}
