//! Breaker 22B finding: a claim completed through a local write
//! (`Engine::complete_local`, `Backend::local`) keeps its in-place view
//! (`in_place::Remembered`) for good, as `local` never forgets it. After
//! 4096 such claims the map is full, and no later fresh claim of this
//! engine writes in place any more: every step write silently takes the
//! full transaction again (the benchmark's gain is lost, with no error or
//! log). Guards against views of finished claims staying remembered.
//! Needs `IDEMPOTENCY_TEST_PG` (`scripts/with-postgres`).

use crate::clock::ManualClock;
use crate::envelope::Envelope;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::store::{
    Backend, ClaimRequest, ClaimResult, LocalResult, LocalTarget, LocalWrite, StepRequest,
};

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

#[test]
fn local_completions_do_not_use_up_the_in_place_views() -> R<()> {
    let Some(url) = url("local_completions_do_not_use_up_the_in_place_views") else {
        return Ok(());
    };
    let clock = ManualClock::new(T0);
    let store = open(&url, &prefix("b22b_local"), Mode::Create, &clock)?;
    // More local completions than views remembered (4096).
    for i in 0..4_100 {
        let key = IdempotencyKey::new("shop", format!("local-{i}"))?;
        let token = claim(&store, &key)?;
        let done = store.local(LocalWrite {
            key: key.clone(),
            target: LocalTarget::Claimed { token },
            run: Box::new(|_| Ok(Envelope::new(1, 200, "ok"))),
            finished: Vec::new(),
        })?;
        assert!(matches!(done, LocalResult::Executed), "{key}: {done:?}");
    }
    let key = IdempotencyKey::new("shop", "after")?;
    let token = claim(&store, &key)?;
    let before = store.in_place.get();
    store.reserve_step(StepRequest {
        key: key.clone(),
        token,
        name: "charge".into(),
        finished: Vec::new(),
    })?;
    assert_eq!(
        store.in_place.get(),
        (before.0 + 1, before.1),
        "a fresh claim's reservation after 4100 local completions did not go in place"
    );
    Ok(())
}
