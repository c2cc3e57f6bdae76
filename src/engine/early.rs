//! Settling a dropped claim before its lease ends.
//!
//! A dropped claim (UNKNOWN, its lease still running: the holder let go of
//! it, or its process ended) may still have work in flight: a request to the
//! provider sent before the crash can land after a "not executed" answer.
//! So only a resolver's positive answer (the provider has the reference)
//! settles such a key at once; "not executed" and "still unknown" leave it
//! Processing until the lease ends, as without a resolver.
//!
//! A crowd of retries must not turn into a crowd of provider queries:
//! [`Asked`] lets `begin` ask about one claim at most once per
//! `resolver_interval`, and not again before the lease end after "not
//! executed" (only the lease end can change what that answer allows).
//! Retries in between answer Processing, with the time to the next
//! question as their hint.

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;

use crate::engine::begin::Begin;
use crate::engine::core::Core;
use crate::error::{Error, Result};
use crate::key::IdempotencyKey;
use crate::resolver::{Resolution, Resolver};
use crate::store::step::Actor;
use crate::store::{ClaimRequest, Found, SettleRequest, Settled};

/// Claims remembered at most; past that, the entries whose next question
/// is due are forgotten (and, if all are still waiting, all of them: a few
/// extra questions, never an unbounded map).
const MAX_REMEMBERED: usize = 4_096;

/// When the resolver may next be asked about a dropped claim, per record
/// key and fencing token (ms of the engine's clock).
#[derive(Default)]
pub(crate) struct Asked {
    next: Mutex<HashMap<(Vec<u8>, u64), u64>>,
}

impl Asked {
    /// `Ok` when the claim (`record_key`, `token`) may be asked about at
    /// `now`, and the next question then waits until `until`; otherwise
    /// `Err` with the instant the next question is due.
    fn take(&self, record_key: &[u8], token: u64, now: u64, until: u64) -> Result<(), u64> {
        let mut next = self.next.lock();
        let id = (record_key.to_vec(), token);
        if let Some(&at) = next.get(&id) {
            if now < at {
                return Err(at);
            }
        }
        if next.len() >= MAX_REMEMBERED {
            next.retain(|_, at| *at > now);
            if next.len() >= MAX_REMEMBERED {
                next.clear();
            }
        }
        next.insert(id, until);
        Ok(())
    }

    /// The next question about the claim waits until `until`.
    fn defer(&self, record_key: &[u8], token: u64, until: u64) {
        self.next.lock().insert((record_key.to_vec(), token), until);
    }
}

impl Core {
    /// Asks `resolver` about a dropped claim whose lease still runs (at
    /// most once per interval) and settles the key if the provider has the
    /// reference. `None`: another settler won the race, look again.
    pub(crate) async fn settle_early(
        &self,
        key: &IdempotencyKey,
        found: &Found,
        resolver: &dyn Resolver,
        claim: ClaimRequest,
    ) -> Result<Option<Begin>> {
        let record = &found.record;
        let now_ms = found.now_ms;
        let lease_end = record.lease_until_ms;
        let processing = |until: u64| {
            self.counters.processing_answers.add(1);
            let wait = until.min(lease_end).saturating_sub(now_ms).max(1);
            Some(Begin::Processing {
                retry_after: Duration::from_millis(wait),
            })
        };
        let rkey = key.record_key();
        let next_question = now_ms.saturating_add(self.cfg.resolver_interval_ms());
        if let Err(due) = self.asked.take(rkey, record.token, now_ms, next_question) {
            return Ok(processing(due));
        }
        let envelope =
            match resolver.resolve(&Self::in_doubt_of(key.clone(), record, Vec::new(), now_ms)) {
                Resolution::Completed(envelope) => envelope,
                Resolution::NotExecuted => {
                    self.asked.defer(rkey, record.token, lease_end);
                    return Ok(processing(lease_end));
                }
                Resolution::StillInDoubt => return Ok(processing(next_question)),
            };
        let req = SettleRequest {
            key: key.clone(),
            token: record.token,
            settlement: self.settlement(key, Resolution::Completed(envelope))?,
            actor: Actor::Resolver,
        };
        match self.store.settle_then_claim_pending(req, claim).await {
            Ok(Settled::Completed(record)) => {
                tracing::info!(key = %key, token = record.token, "dropped claim settled before its lease ended: the provider has its reference");
                self.counters.resolved.add(1);
                self.counters.replays.add(1);
                Ok(Some(Begin::Replay(self.replay(key, record)?)))
            }
            // A completed settlement yields nothing else; answered as
            // they come all the same.
            Ok(Settled::NotExecuted(claimed)) => Ok(Some(Begin::Claimed(self.claim(key, claimed)))),
            Ok(Settled::StillInDoubt(_)) => Ok(processing(next_question)),
            Err(Error::Fenced { .. } | Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Asked;

    #[test]
    fn one_question_per_interval_and_claim() {
        let asked = Asked::default();
        assert_eq!(asked.take(b"k", 1, 0, 100), Ok(()));
        assert_eq!(asked.take(b"k", 1, 50, 150), Err(100));
        // Another claim of the key, or another key, is asked at once.
        assert_eq!(asked.take(b"k", 2, 50, 150), Ok(()));
        assert_eq!(asked.take(b"j", 1, 50, 150), Ok(()));
        assert_eq!(asked.take(b"k", 1, 100, 200), Ok(()));
        asked.defer(b"k", 1, 1_000);
        assert_eq!(asked.take(b"k", 1, 999, 1_099), Err(1_000));
    }

    #[test]
    fn the_map_stays_bounded() {
        let asked = Asked::default();
        for n in 0..(super::MAX_REMEMBERED as u64 + 10) {
            assert_eq!(asked.take(&n.to_le_bytes(), 1, 0, 100), Ok(()));
        }
        assert!(asked.next.lock().len() <= super::MAX_REMEMBERED);
    }
}
