//! A force purge of steps left without a record, on PostgreSQL, when a
//! claim commits between the purge's reads (READ COMMITTED reads per
//! statement). CI saw it in `tests/breaker22b_races.rs`: the purge read no
//! record, then read the steps a claim committed just after, and deleted
//! them and their log; the claim then completed in place over a record
//! whose log began at sequence 3. Here the interleaving is made exactly:
//! the purge's transaction reads, another engine claims and reserves a
//! step, then the purge goes on. Needs `IDEMPOTENCY_TEST_PG`
//! (`scripts/with-postgres`).

use crate::clock::ManualClock;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::policy::PurgeMode;
use crate::state::State;
use crate::store::ops::{OpError, Ops, Txn};
use crate::store::{Backend, ClaimRequest, ClaimResult, StepRequest};

use super::step_tables_tests::{open, prefix, url, R, T0};
use super::txn::Fault;
use super::{Mode, PgStore};

/// Claims `key` and reserves one step on `store` (committed when it
/// returns).
fn claim_with_step(store: &PgStore, key: &IdempotencyKey) -> Result<(), String> {
    let claimed = store
        .claim(ClaimRequest {
            key: key.clone(),
            fingerprint: Fingerprint::from_bytes([3; 32]),
            lease_ms: 30_000,
        })
        .map_err(|e| e.to_string())?;
    let ClaimResult::Claimed(c) = claimed else {
        return Err(format!("{key} was not claimed: {claimed:?}"));
    };
    store
        .reserve_step(StepRequest {
            key: key.clone(),
            token: c.token,
            name: "charge".into(),
            finished: Vec::new(),
        })
        .map_err(|e| e.to_string())?;
    Ok(())
}

fn fatal(e: String) -> OpError<Fault> {
    OpError::Refused(crate::error::Error::Storage {
        context: "claiming on the other engine",
        source: e.into(),
    })
}

#[test]
fn orphan_delete_spares_a_claim_committed_after_the_first_read() -> R<()> {
    let Some(url) = url("orphan_delete_spares_a_claim_committed_after_the_first_read") else {
        return Ok(());
    };
    let clock = ManualClock::new(T0);
    let name = prefix("purge_race");
    let purger = open(&url, &name, Mode::Create, &clock)?;
    let claimer = open(&url, &name, Mode::Create, &clock)?;
    let key = IdempotencyKey::new("shop", "late-claim")?;
    purger.write("purging a record", |t| {
        // The purge's first read: no record yet.
        assert!(t.load(&key).map_err(OpError::Fatal)?.is_none());
        // A claim and its step commit on another connection meanwhile.
        claim_with_step(&claimer, &key).map_err(fatal)?;
        // The purge of "steps without a record" goes on.
        t.remove_orphan_steps(&key).map_err(OpError::Fatal)
    })?;
    assert_eq!(
        purger.record(&key)?.map(|r| State::from(r.state)),
        Some(State::Processing)
    );
    assert_eq!(
        purger.steps(&key)?.len(),
        1,
        "the live claim's step survives"
    );
    assert_eq!(
        purger.history(&key)?.len(),
        1,
        "the live claim's log survives"
    );
    Ok(())
}

#[test]
fn force_purge_that_raced_a_claim_purges_the_whole_key() -> R<()> {
    let Some(url) = url("force_purge_that_raced_a_claim_purges_the_whole_key") else {
        return Ok(());
    };
    let clock = ManualClock::new(T0);
    let name = prefix("purge_race_whole");
    let purger = open(&url, &name, Mode::Create, &clock)?;
    let claimer = open(&url, &name, Mode::Create, &clock)?;
    let key = IdempotencyKey::new("shop", "raced")?;
    let purged = purger.write("purging a record", |t| {
        assert!(t.load(&key).map_err(OpError::Fatal)?.is_none());
        claim_with_step(&claimer, &key).map_err(fatal)?;
        // What `Ops::purge` does next: the steps are there, so it reads
        // the record again (now visible and locked) and purges the key.
        t.purge(&key, PurgeMode::Force)
    })?;
    assert_eq!(purged, Some(State::Processing));
    assert!(purger.record(&key)?.is_none());
    assert!(purger.steps(&key)?.is_empty() && purger.history(&key)?.is_empty());
    Ok(())
}

#[test]
fn orphan_steps_without_a_record_are_purged() -> R<()> {
    let Some(url) = url("orphan_steps_without_a_record_are_purged") else {
        return Ok(());
    };
    let clock = ManualClock::new(T0);
    let store = open(&url, &prefix("purge_orphans"), Mode::Create, &clock)?;
    let key = IdempotencyKey::new("shop", "orphan")?;
    claim_with_step(&store, &key)?;
    // Steps and a log without a record (an older build's store).
    store.write("removing a record", |t| {
        t.remove(&key, None).map_err(OpError::Fatal)
    })?;
    assert_eq!(store.steps(&key)?.len(), 1);
    assert_eq!(store.purge(key.clone(), PurgeMode::Force)?, None);
    assert!(store.steps(&key)?.is_empty() && store.history(&key)?.is_empty());
    Ok(())
}
