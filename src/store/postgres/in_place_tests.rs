//! A claim's writes in one statement (`in_place.rs`): guards against the
//! fast path silently not being taken (the benchmark's step writes going
//! through the full transaction again), against it deciding differently
//! from the full path, against a change made meanwhile by another engine
//! being overwritten or written twice, and against a lost answer being
//! guessed instead of read from the rows. Needs `IDEMPOTENCY_TEST_PG`
//! (`scripts/with-postgres`); skipped with a note without it.

use crate::clock::ManualClock;
use crate::envelope::Envelope;
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::store::ops::Ops;
use crate::store::record::{RecordState, StoredResponse};
use crate::store::step::{Actor, StepFinish, StepStatus};
use crate::store::{
    Backend, ClaimRequest, ClaimResult, CompleteRequest, Completion, FinishStepRequest, StepRecord,
    StepRequest,
};

use super::in_place;
use super::step_tables_tests::{open, prefix, url, R, T0};
use super::{Mode, PgStore};

fn claim(store: &PgStore, key: &IdempotencyKey) -> R<u64> {
    match store.claim(ClaimRequest {
        key: key.clone(),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease_ms: 30_000,
    })? {
        ClaimResult::Claimed(c) => Ok(c.token),
        other => Err(format!("{key} was not claimed: {other:?}").into()),
    }
}

fn reserve(
    store: &PgStore,
    key: &IdempotencyKey,
    token: u64,
    name: &str,
    finished: Vec<StepFinish>,
) -> crate::error::Result<StepRecord> {
    store.reserve_step(StepRequest {
        key: key.clone(),
        token,
        name: name.into(),
        finished,
    })
}

fn finish(
    store: &PgStore,
    key: &IdempotencyKey,
    token: u64,
    name: &str,
    evidence: &str,
) -> crate::error::Result<StepRecord> {
    store.finish_step(FinishStepRequest {
        key: key.clone(),
        token,
        name: name.into(),
        confirmed: true,
        evidence: evidence.into(),
    })
}

fn confirmed(name: &str) -> StepFinish {
    StepFinish {
        name: name.into(),
        confirmed: true,
        evidence: name.into(),
    }
}

fn complete(store: &PgStore, key: &IdempotencyKey, token: u64, finished: Vec<StepFinish>) -> R<()> {
    store.complete(CompleteRequest {
        key: key.clone(),
        token,
        completion: Completion::Success,
        response: StoredResponse::new(Envelope::new(1, 200, b"ok".to_vec()), None),
        messages: Vec::new(),
        finished,
    })?;
    Ok(())
}

/// The benchmark's requests: two steps with deferred confirmations
/// (`deferred`) or durable ones, then the completion. With `full`, the
/// claim's view is dropped first, so every write takes the full path.
fn request(store: &PgStore, key: &IdempotencyKey, deferred: bool, full: bool) -> R<u64> {
    let token = claim(store, key)?;
    if full {
        store.remembered.forget(key);
    }
    if deferred {
        reserve(store, key, token, "charge", Vec::new())?;
        reserve(store, key, token, "receipt", vec![confirmed("charge")])?;
        complete(store, key, token, vec![confirmed("receipt")])?;
    } else {
        for name in ["charge", "receipt"] {
            reserve(store, key, token, name, Vec::new())?;
            finish(store, key, token, name, name)?;
        }
        complete(store, key, token, Vec::new())?;
    }
    Ok(token)
}

/// What a key's rows say, without what differs between two claims (the
/// token, and the references derived from it): each step's name, state
/// and evidence; each log entry's number, step, transition, evidence, and
/// whether the claim `token` wrote it; the record's state.
#[allow(clippy::type_complexity)]
fn summary(
    store: &PgStore,
    key: &IdempotencyKey,
    token: u64,
) -> R<(
    Vec<(String, StepStatus, Vec<u8>)>,
    Vec<(u32, Option<String>, String, String, Vec<u8>, bool)>,
    Option<RecordState>,
)> {
    let steps = store
        .steps(key)?
        .into_iter()
        .map(|s| (s.name, s.status, s.evidence))
        .collect();
    let log = store
        .history(key)?
        .into_iter()
        .map(|e| {
            let by_claim = e.actor == Actor::Claim { token };
            (e.seq, e.step, e.from, e.to, e.evidence, by_claim)
        })
        .collect();
    Ok((steps, log, store.record(key)?.map(|r| r.state)))
}

#[test]
fn a_fresh_claims_writes_go_in_place_and_match_the_full_path() -> R<()> {
    let Some(url) = url("a_fresh_claims_writes_go_in_place_and_match_the_full_path") else {
        return Ok(());
    };
    let clock = ManualClock::new(T0);
    let store = open(&url, &prefix("inplace"), Mode::Create, &clock)?;
    for deferred in [true, false] {
        let fast = IdempotencyKey::new("shop", format!("fast-{deferred}"))?;
        let full = IdempotencyKey::new("shop", format!("full-{deferred}"))?;
        let before = store.in_place.get();
        let fast_token = request(&store, &fast, deferred, false)?;
        let writes = if deferred { 3 } else { 5 };
        assert_eq!(
            store.in_place.get(),
            (before.0 + writes, before.1),
            "every write of the request went in place (deferred: {deferred})"
        );
        let full_token = request(&store, &full, deferred, true)?;
        assert_eq!(
            store.in_place.get(),
            (before.0 + writes, before.1),
            "no view: nothing in place"
        );
        let fast = summary(&store, &fast, fast_token)?;
        assert_eq!(fast, summary(&store, &full, full_token)?);
        assert_eq!(fast.2, Some(RecordState::Completed));
        assert_eq!(fast.0.len(), 2);
        // reserved, confirmed (×2), completed.
        assert_eq!(fast.1.len(), 5, "{:?}", fast.1);
    }
    Ok(())
}

#[test]
fn a_change_by_another_engine_makes_the_write_fall_back() -> R<()> {
    let Some(url) = url("a_change_by_another_engine_makes_the_write_fall_back") else {
        return Ok(());
    };
    let clock = ManualClock::new(T0);
    let p = prefix("fallback");
    let ours = open(&url, &p, Mode::Create, &clock)?;
    let other = open(&url, &p, Mode::Create, &clock)?;

    // The log changed meanwhile (the other engine confirmed the step):
    // the in-place confirmation fails on the log's next number, writes
    // nothing, and the full path refuses the second confirmation.
    let key = IdempotencyKey::new("shop", "log-changed")?;
    let token = claim(&ours, &key)?;
    reserve(&ours, &key, token, "charge", Vec::new())?;
    finish(&other, &key, token, "charge", "by-other")?;
    let before = ours.in_place.get();
    let second = finish(&ours, &key, token, "charge", "by-ours");
    assert!(
        matches!(second, Err(Error::StepReused { ref step, .. }) if step == "charge"),
        "{second:?}"
    );
    assert_eq!(ours.in_place.get(), (before.0, before.1 + 1));
    let log = ours.history(&key)?;
    assert_eq!(log.len(), 2, "{log:?}");
    assert_eq!(ours.steps(&key)?[0].evidence, b"by-other".to_vec());

    // The record changed meanwhile (the other engine extended the lease):
    // the compare-and-set does not match, and the full path reserves the
    // step without undoing the extension.
    let key = IdempotencyKey::new("shop", "record-changed")?;
    let token = claim(&ours, &key)?;
    reserve(&ours, &key, token, "charge", Vec::new())?;
    other.extend(key.clone(), token, 120_000)?;
    let before = ours.in_place.get();
    let step = reserve(&ours, &key, token, "receipt", Vec::new())?;
    assert_eq!(step.status, StepStatus::Reserved);
    assert_eq!(ours.in_place.get(), (before.0, before.1 + 1));
    let record = ours.record(&key)?.ok_or("the record is gone")?;
    assert_eq!(record.lease_until_ms, T0 + 120_000);
    let log = ours.history(&key)?;
    let seqs: Vec<u32> = log.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, vec![0, 1]);

    // With the view gone, the rest takes the full path and still works.
    finish(&ours, &key, token, "charge", "c")?;
    finish(&ours, &key, token, "receipt", "r")?;
    complete(&ours, &key, token, Vec::new())?;
    assert_eq!(
        ours.record(&key)?.map(|r| r.state),
        Some(RecordState::Completed)
    );
    Ok(())
}

#[test]
fn a_lost_in_place_step_write_is_read_from_the_log() -> R<()> {
    let Some(url) = url("a_lost_in_place_step_write_is_read_from_the_log") else {
        return Ok(());
    };
    let clock = ManualClock::new(T0);
    let store = open(&url, &prefix("lost"), Mode::Create, &clock)?;
    let key = IdempotencyKey::new("shop", "lost")?;
    let token = claim(&store, &key)?;
    let view = store
        .remembered
        .take(&key, token)
        .ok_or("the claim was not remembered")?;
    let req = StepRequest {
        key: key.clone(),
        token,
        name: "charge".into(),
        finished: Vec::new(),
    };
    let shared = store.shared()?;
    let (_, writes, _) =
        in_place::decide(&key, &view, T0, shared.cfg, |t| t.reserve_step(req.clone()))
            .ok_or("a reservation of a fresh claim is decided in place")?;
    assert_eq!(writes.history.len(), 1);
    assert_eq!(
        shared.in_place_landed(&key, &view, &writes, None)?,
        Some(false)
    );
    store.remembered.insert(&key, view.clone());
    store.reserve_step(req)?;
    assert_eq!(
        shared.in_place_landed(&key, &view, &writes, None)?,
        Some(true)
    );
    Ok(())
}
