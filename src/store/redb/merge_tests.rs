//! The merge of closed partitions through the writer's [`Tables`]
//! (`merge_step.rs`, `partition/merge.rs`): every key stays found, with
//! its state, steps and log, while the merge copies, while requests
//! rewrite and delete records on both sides of its cursor, across a
//! reload of the catalog mid-merge (an open after a crash), and after the
//! switch and the drop; `verify` finds the file sound after every step
//! (it checks each copy against its source); and the journal's frames,
//! replayed on an empty file, rebuild the same tables.

use std::collections::BTreeMap;

use redb::ReadableDatabase;

use crate::key::IdempotencyKey;
use crate::store::ops::{Ops, Txn};
use crate::store::record::RecordState;

use super::partition::catalog::{self, SealRule};
use super::partition::merge::MERGE_SPAN_MS;
use super::partition::row::PartitionState;
use super::partition::slot::BUILT_PARTITIONS;
use super::test_requests::{claim_in, complete_in, finish_charge};
use super::test_writer::{key, rows, Writer, R};

const RULE: SealRule = SealRule {
    interval_ms: 60_000,
    max_keys: 8,
};
/// Long enough for the claims left PROCESSING to outlive the test.
const LEASE_MS: u64 = 10 * MERGE_SPAN_MS;

/// The rows of the file, by partition.
fn sound(w: &Writer) -> R<()> {
    let (damage, _) = super::verify::verify(&w.db)?;
    assert_eq!(damage, [], "verify");
    Ok(())
}

/// Each key's state as the writer finds it (`None`: no record).
fn states(w: &mut Writer, keys: &[IdempotencyKey]) -> R<Vec<Option<RecordState>>> {
    w.group(|t| {
        let mut out = Vec::new();
        for k in keys {
            out.push(match t.raw(k.record_key())? {
                Some(rec) => Some(rec.map_err(|e| format!("{k}: {e}"))?.state),
                None => None,
            });
        }
        Ok(out)
    })
}

#[test]
fn a_merge_keeps_every_key_found_through_writes_a_reload_and_a_replay() -> R<()> {
    let mut w = Writer::new(RULE)?;
    let keys: Vec<IdempotencyKey> = (0..40).map(key).collect::<R<_>>()?;
    let mut tokens = BTreeMap::new();
    // 40 keys over five partitions of one span: even keys paid, odd ones
    // left PROCESSING.
    for group in 0..10usize {
        w.now += 1_000;
        let got = w.group(|t| {
            let mut got = Vec::new();
            for (i, k) in keys.iter().enumerate().skip(group * 4).take(4) {
                let token = claim_in(t, k, LEASE_MS)?;
                if i % 2 == 0 {
                    complete_in(t, k, token)?;
                }
                got.push((i, token));
            }
            Ok(got)
        })?;
        tokens.extend(got);
    }
    w.group(|t| finish_charge(t, &keys[1], tokens[&1]))?;
    let before = states(&mut w, &keys)?;
    // Nothing is due while the span is open.
    assert!(!w.merge_step(7)?.more);
    assert!(w.catalog.merging().is_none());

    // The span ends: the hot partition is sealed, the merge begins.
    w.now += 2 * MERGE_SPAN_MS;
    assert!(w.merge_step(7)?.more);
    let target = w.catalog.merging().ok_or("a merge under way")?.target;
    assert_eq!(target, BUILT_PARTITIONS);
    let r = rows(&w.db)?;
    assert_eq!(r[&target].state, PartitionState::Merging);
    let sources: Vec<u64> = r
        .iter()
        .filter(|(_, row)| row.state == PartitionState::MergeSource)
        .map(|(p, _)| *p)
        .collect();
    assert_eq!(sources, [1, 2, 3, 4, 5]);
    sound(&w)?;

    // Seven copied.
    assert!(w.merge_step(7)?.more);
    let cursor = w
        .catalog
        .merging()
        .and_then(|m| m.cursor.clone())
        .ok_or("a cursor")?;
    sound(&w)?;
    let copied = |k: &IdempotencyKey| k.record_key() <= cursor.as_slice();
    let pick = |want_copied: bool, odd: bool| {
        (0..40)
            .find(|&i| (i % 2 == 1) == odd && copied(&keys[i]) == want_copied && i != 1)
            .ok_or("no such key")
    };
    let (done_copied, done_not) = (pick(true, true)?, pick(false, true)?);
    let gone = pick(true, false)?;
    // Requests on both sides of the cursor: completions, a delete, and a
    // step on key 1 (wherever it is).
    w.now += 1_000;
    w.group(|t| {
        complete_in(t, &keys[done_copied], tokens[&done_copied])?;
        complete_in(t, &keys[done_not], tokens[&done_not])?;
        let old = t
            .raw(keys[gone].record_key())?
            .ok_or("a record to delete")?
            .map_err(|e| format!("{e}"))?;
        t.delete(&keys[gone], &old).map_err(|e| format!("{e:?}"))?;
        Ok(())
    })?;
    sound(&w)?;

    // An open after a crash loads the same merge from the file.
    let reloaded = w.loaded_catalog(RULE)?;
    let m = reloaded.merging().ok_or("the merge, reloaded")?;
    assert_eq!((m.target, &m.sources), (target, &sources));
    assert!(m.cursor.as_deref() <= Some(cursor.as_slice()));
    w.catalog = reloaded;

    // On to the switch and the drops.
    let mut steps = 0;
    while w.merge_step(7)?.more {
        sound(&w)?;
        steps += 1;
        assert!(steps < 40, "the merge ends");
    }
    sound(&w)?;
    let r = rows(&w.db)?;
    let left: Vec<(u64, PartitionState)> = r.iter().map(|(p, row)| (*p, row.state)).collect();
    let hot = w.catalog.hot().partition;
    assert_eq!(
        left,
        [(hot, PartitionState::Hot), (target, PartitionState::Sealed)]
    );
    // The filter's keys: those in the range at the reload (one deleted
    // already), then every one copied since.
    assert_eq!(r[&target].keys, 39);
    let txn = w.db.begin_read()?;
    let records = txn.open_table(catalog::RECORDS)?;
    assert_eq!(catalog::partitions_in(&records)?, [target]);
    assert_eq!(catalog::count_keys(&records, target)?, 39);
    drop(records);
    drop(txn);

    // Every key as it was, but for the requests made during the merge.
    let mut want = before;
    want[done_copied] = Some(RecordState::Completed);
    want[done_not] = Some(RecordState::Completed);
    want[gone] = None;
    assert_eq!(states(&mut w, &keys)?, want);
    let charge = w.group(|t| Ok(t.load_steps(&keys[1])?))?;
    assert_eq!(charge.len(), 1, "key 1's step moved with it");

    // The frames, replayed on an empty file, give the same tables.
    w.assert_replays("the merge")?;
    Ok(())
}
