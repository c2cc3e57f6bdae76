//! The claims a writable open finds: redb's file lock lets one process
//! hold the file at a time, so every PROCESSING record whose lease still
//! runs when the engine opens belongs to an engine that is gone (killed, or
//! closed with the claim unfinished). Each moves to UNKNOWN keeping its
//! lease end, exactly like a dropped claim: its work may still reach the
//! provider until then, so "not executed" waits for the lease, while a
//! resolver's positive answer settles it at once (`engine/early.rs`).
//! Records whose lease has already ended are left to read-time truth and
//! the sweep, which treat them as in doubt already.
//!
//! Only the engine's first open of a store does this, never a reopen after
//! a storage failure (the claims are then this process's own).

use redb::{ReadableDatabase, ReadableTable};

use crate::error::Result;
use crate::key::IdempotencyKey;
use crate::store::record::RecordState;

use super::tables::{Context, OpError, Tables, LEASES};

/// Why a PROCESSING record found at open is in doubt.
pub(super) const REASON: &str =
    "the process holding the claim ended (found PROCESSING when the database was opened)";

/// Whether any PROCESSING record's lease runs past `now_ms` (a read: an
/// open without such records writes nothing).
pub(super) fn any(db: &impl ReadableDatabase, now_ms: u64) -> Result<bool> {
    let what = "looking for claims of an ended process";
    let txn = db.begin_read().context(what)?;
    let leases = txn.open_table(LEASES).context(what)?;
    let mut running = leases
        .range((now_ms.saturating_add(1), &[][..])..)
        .context(what)?;
    Ok(running.next().is_some())
}

impl Tables<'_> {
    /// Moves every PROCESSING record whose lease runs past now to UNKNOWN,
    /// keeping its lease end; returns how many.
    pub(super) fn orphans_to_unknown(&mut self) -> Result<u64, OpError> {
        let now = self.now;
        let mut found = Vec::new();
        for entry in self.leases.range((now.saturating_add(1), &[][..])..)? {
            let (k, _) = entry?;
            let (at, rkey) = k.value();
            found.push((at, rkey.to_vec()));
        }
        let mut moved = 0;
        for (at, rkey) in found {
            // An index entry that does not match its record is the sweep's
            // business (it drops it once due).
            if let (Some(key), Some(Ok(rec))) =
                (IdempotencyKey::from_record_key(&rkey), self.raw(&rkey)?)
            {
                if rec.state == RecordState::Processing && rec.lease_until_ms == at {
                    tracing::warn!(key = %key, token = rec.token, lease_until_ms = at, "claim of an ended process moved to UNKNOWN");
                    let new = rec.in_doubt(REASON.to_owned(), at, now);
                    crate::store::step_ops::to_unknown(
                        self,
                        &key,
                        &rec,
                        &new,
                        &crate::store::Actor::Sweeper,
                    )?;
                    moved += 1;
                }
            }
        }
        Ok(moved)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::clock::ManualClock;
    use crate::envelope::Envelope;
    use crate::error::Error;
    use crate::fingerprint::Fingerprint;
    use crate::key::IdempotencyKey;
    use crate::policy::ExpiryPolicy;
    use crate::store::config::StoreConfig;
    use crate::store::record::{RecordState, StoredResponse};
    use crate::store::redb::{prepare, Opened, RedbStore};
    use crate::store::{
        Backend, ClaimRequest, ClaimResult, CompleteRequest, Completion, SettleRequest, Settled,
        Settlement,
    };

    type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

    const T0: u64 = 1_700_000_000_000;
    const LEASE_MS: u64 = 10_000;

    fn store(
        path: &std::path::Path,
        clock: &ManualClock,
    ) -> Result<RedbStore, Box<dyn std::error::Error + Send + Sync>> {
        let cfg = StoreConfig {
            ttl_ms: 3_600_000,
            expiry: ExpiryPolicy::Forget,
            max_response_bytes: 1 << 20,
        };
        let opened = Opened::path(path, None)?;
        let cfg = prepare(&opened.db, path, cfg, false)?;
        Ok(RedbStore::start(
            opened,
            cfg,
            Arc::new(clock.clone()),
            crate::store::redb::Sizes {
                max_batch: 16,
                max_group_bytes: 1 << 20,
                queue_capacity: 64,
                recovery_reserve: 0,
                seal_rule: crate::store::redb::PartitionSealRule::DEFAULT,
                migration: None,
            },
            None,
        )?)
    }

    fn claim(
        store: &RedbStore,
        key: &IdempotencyKey,
    ) -> Result<u64, Box<dyn std::error::Error + Send + Sync>> {
        match store.claim(ClaimRequest {
            key: key.clone(),
            fingerprint: Fingerprint::from_bytes([1; 32]),
            lease_ms: LEASE_MS,
        })? {
            ClaimResult::Claimed(c) => Ok(c.token),
            ClaimResult::Held(found) => Err(format!("held: {:?}", found.held).into()),
        }
    }

    fn settle(
        store: &RedbStore,
        key: &IdempotencyKey,
        token: u64,
        settlement: Settlement,
    ) -> crate::error::Result<Settled<()>> {
        store.settle(SettleRequest {
            key: key.clone(),
            token,
            settlement,
            actor: crate::store::Actor::Resolver,
        })
    }

    fn response(body: &str) -> StoredResponse {
        StoredResponse::new(Envelope::new(1, 201, body.to_owned()), None)
    }

    /// A claim left PROCESSING by a closed (or killed) engine is UNKNOWN
    /// after the next open, keeping its lease end; the store refuses "not
    /// executed" for it before that lease end but takes a positive answer
    /// at once, after which the old token is fenced.
    #[test]
    fn an_ended_process_claims_are_dropped_claims_at_the_next_open() -> TestResult {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("orphans.redb");
        let clock = ManualClock::new(T0);
        let (a, b) = (
            IdempotencyKey::new("s", "a")?,
            IdempotencyKey::new("s", "b")?,
        );
        let (ta, tb) = {
            let first = store(&path, &clock)?;
            let tokens = (claim(&first, &a)?, claim(&first, &b)?);
            first.close();
            tokens
        };
        clock.set(T0 + 1_000);
        let second = store(&path, &clock)?;
        for (key, token) in [(&a, ta), (&b, tb)] {
            let rec = second.record(key)?.ok_or("gone")?;
            assert_eq!((rec.state, rec.token), (RecordState::Unknown, token));
            assert_eq!(rec.lease_until_ms, T0 + LEASE_MS);
            assert_eq!(rec.reason, super::REASON);
            assert!(rec.may_still_run(T0 + LEASE_MS - 1) && !rec.may_still_run(T0 + LEASE_MS));
        }
        let err = settle(&second, &a, ta, Settlement::NotExecuted)
            .err()
            .ok_or("not executed taken before the lease end")?;
        assert!(matches!(err, Error::InvalidState { .. }), "{err:?}");
        assert_eq!(
            second.record(&a)?.ok_or("gone")?.state,
            RecordState::Unknown
        );
        let settled = settle(&second, &a, ta, Settlement::Completed(response("provider")))?;
        assert!(matches!(settled, Settled::Completed(_)), "{settled:?}");
        // The old holder's outcome, should one come, is fenced.
        let late = second.complete(CompleteRequest {
            key: a.clone(),
            token: ta,
            completion: Completion::Success,
            response: response("holder"),
            messages: Vec::new(),
            finished: Vec::new(),
        });
        assert!(matches!(late, Err(Error::Fenced { .. })), "{late:?}");
        let rec = second.record(&a)?.ok_or("gone")?;
        assert_eq!(rec.response.ok_or("no response")?.body, b"provider");
        // At the lease end "not executed" is taken.
        clock.set(T0 + LEASE_MS);
        let settled = settle(&second, &b, tb, Settlement::NotExecuted)?;
        assert!(matches!(settled, Settled::NotExecuted(())), "{settled:?}");
        second.close();
        Ok(())
    }

    /// A claim whose lease ended before the open is left as it is (stale
    /// PROCESSING: read-time truth and the sweep handle it).
    #[test]
    fn an_ended_lease_is_left_to_the_sweep() -> TestResult {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("stale.redb");
        let clock = ManualClock::new(T0);
        let a = IdempotencyKey::new("s", "a")?;
        {
            let first = store(&path, &clock)?;
            claim(&first, &a)?;
            first.close();
        }
        clock.set(T0 + LEASE_MS);
        let second = store(&path, &clock)?;
        assert_eq!(
            second.record(&a)?.ok_or("gone")?.state,
            RecordState::Processing
        );
        second.close();
        Ok(())
    }
}
