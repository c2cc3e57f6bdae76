//! Break-it tests of the merge of closed partitions (`merge_step.rs`,
//! `partition/merge.rs`): what salvage, verify and an open make of a file
//! a merge left between its switch and its last drop step.

use redb::{Database, ReadableDatabase};

use crate::key::IdempotencyKey;
use crate::report::SweepCounts;
use crate::store::ops::{Ops, Txn};

use super::partition::catalog::SealRule;
use super::partition::merge::MERGE_SPAN_MS;
use super::partition::row::PartitionState;
use super::partition::slot::BUILT_PARTITIONS;
use super::test_requests::{claim_in, complete_in};
use super::test_writer::{key, rows, Writer, R};

const RULE: SealRule = SealRule {
    interval_ms: 60_000,
    max_keys: 8,
};
const LEASE_MS: u64 = 10 * MERGE_SPAN_MS;

#[derive(Debug, Clone, Copy)]
struct Fixed(u64);
impl crate::Clock for Fixed {
    fn now_ms(&self) -> u64 {
        self.0
    }
}

/// 40 completed keys over five partitions of one span, then the merge run
/// up to its switch (the sources dropping, none dropped yet).
fn switched(w: &mut Writer) -> R<Vec<IdempotencyKey>> {
    let keys = w.completed(40, LEASE_MS, &[])?;
    w.merge_to_switch()?;
    Ok(keys)
}

/// A key deleted from the merged partition after the switch, while the
/// (stale) copy in its dropping source still waits for its drop step, must
/// not come back through a salvage, nor be reported lost (the file is
/// sound: verify says so).
#[test]
fn salvage_between_switch_and_drop_keeps_a_deleted_key_deleted() -> R<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("f3.redb");
    let mut w = Writer::on(Database::create(&path)?, RULE)?;
    let keys = switched(&mut w)?;
    let gone = keys[17].clone();
    w.group(|t| {
        let old = t
            .raw(gone.record_key())?
            .ok_or("a record to delete")?
            .map_err(|e| format!("{e}"))?;
        t.delete(&gone, &old).map_err(|e| format!("{e:?}"))?;
        Ok(())
    })?;
    assert!(
        w.group(|t| Ok(t.raw(gone.record_key())?.is_none()))?,
        "deleted for the writer"
    );
    let (damage, _) = super::verify::verify(&w.db)?;
    assert_eq!(damage, [], "verify");
    let now = w.now;
    drop(w);

    let out = dir.path().join("salvaged.redb");
    let report = crate::Engine::salvage(&path, &out)?;
    let engine = crate::Engine::builder()
        .clock(Fixed(now))
        .sweep_interval(None)
        .open_existing(&out)?;
    let seen = engine.record(&gone)?;
    eprintln!(
        "salvage report: records {} lost {:?}",
        report.records, report.lost
    );
    assert!(
        seen.is_none(),
        "salvage brought back a key deleted after the switch from its dropping source: \
         {seen:?} (report: {report:?})"
    );
    for k in keys.iter().filter(|k| **k != gone) {
        assert!(engine.record(k)?.is_some(), "{k} kept");
    }
    // The file was sound (verify above): nothing is lost. The stale copy
    // of the deleted key in its dropping source is not a lost record.
    assert!(
        report.lost.is_empty(),
        "salvage of a sound file between a merge's switch and its drops reports a loss: {:?}",
        report.lost
    );
    Ok(())
}

/// All of a merge's source records deleted while it copies: the switch
/// seals an empty built partition. It must not linger as a row and a
/// probe forever (nothing deletes from it, so `drop_if_emptied` never runs).
#[test]
fn a_merge_whose_sources_empty_leaves_no_empty_partition() -> R<()> {
    let mut w = Writer::new(RULE)?;
    let keys = w.completed(16, LEASE_MS, &[])?;
    w.now += 2 * MERGE_SPAN_MS;
    assert!(w.merge_step(3)?.more, "the merge begins");
    w.merge_step(3)?; // three copied
    w.group(|t| {
        for k in &keys {
            let old = t
                .raw(k.record_key())?
                .ok_or("a record to delete")?
                .map_err(|e| format!("{e}"))?;
            t.delete(k, &old).map_err(|e| format!("{e:?}"))?;
        }
        Ok(())
    })?;
    let mut steps = 0;
    while w.merge_step(3)?.more {
        steps += 1;
        assert!(steps < 40, "the merge ends");
    }
    let (damage, _) = super::verify::verify(&w.db)?;
    assert_eq!(damage, [], "verify");
    let left: Vec<(u64, PartitionState, u64)> = rows(&w.db)?
        .iter()
        .map(|(p, r)| (*p, r.state, r.keys))
        .collect();
    assert!(
        left.iter().all(|(p, _, _)| *p < BUILT_PARTITIONS),
        "an empty merged partition is left: {left:?}"
    );
    Ok(())
}

/// Each key's view through the writer: its record and steps, as text.
fn views(w: &mut Writer, keys: &[IdempotencyKey]) -> R<Vec<String>> {
    w.group(|t| {
        let mut out = Vec::new();
        for k in keys {
            let rec = t.raw(k.record_key())?;
            let steps = t.load_steps(k)?;
            out.push(format!("{rec:?} {steps:?}"));
        }
        Ok(out)
    })
}

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % n
    }
}

/// One random request on `k` in `t`; refusals are fine (the view is taken
/// from the writer afterwards, so the model is what it answers).
fn poke(t: &mut super::tables::Tables<'_>, k: &IdempotencyKey, what: u64) -> R<()> {
    use crate::store::record::RecordState;
    use crate::store::{Abandon, FinishStepRequest, InDoubtRequest, StepRequest};
    let rec = match t.raw(k.record_key())? {
        Some(Ok(r)) => Some(r),
        Some(Err(e)) => return Err(format!("{k}: {e}").into()),
        None => None,
    };
    let _ = match (what, rec) {
        (_, None) => claim_in(t, k, LEASE_MS).map(|_| ()),
        (0, Some(r)) if r.state == RecordState::Processing => complete_in(t, k, r.token),
        (1, Some(r)) if r.state == RecordState::Processing => {
            t.release(k, r.token).map_err(|e| format!("{e:?}").into())
        }
        (2, Some(r)) if r.state == RecordState::Processing => t
            .extend(k, r.token, LEASE_MS * 2)
            .map(|_| ())
            .map_err(|e| format!("{e:?}").into()),
        (3, Some(r)) if r.state == RecordState::Processing => {
            let name = format!("s{}", t.now() % 7);
            let _ = t.reserve_step(StepRequest {
                key: k.clone(),
                token: r.token,
                name: name.clone(),
                finished: Vec::new(),
            });
            t.finish_step(FinishStepRequest {
                key: k.clone(),
                token: r.token,
                name,
                confirmed: true,
                evidence: b"ev".to_vec(),
            })
            .map(|_| ())
            .map_err(|e| format!("{e:?}").into())
        }
        (4, Some(r)) if r.state == RecordState::Processing => t
            .mark_in_doubt(InDoubtRequest {
                key: k.clone(),
                token: r.token,
                reason: "test".into(),
                by: Abandon::Explicit,
            })
            .map_err(|e| format!("{e:?}").into()),
        (5, Some(_)) => t
            .purge(k, crate::PurgeMode::Force)
            .map(|_| ())
            .map_err(|e| format!("{e:?}").into()),
        // A delete as expiry makes it (`Ops::sweep_record`): the record
        // with its steps and log (no request deletes a record alone, and
        // verify names steps left without one).
        (6, Some(r)) => t
            .delete(k, &r)
            .and_then(|()| crate::store::step_ops::drop_steps(t, k))
            .map_err(|e| format!("{e:?}").into()),
        _ => Ok(()),
    };
    Ok(())
}

/// Random requests (claims, completions, releases, extensions, steps,
/// in-doubt marks, purges, deletes, re-claims) between and beside merge
/// steps, on keys both sides of the cursor and at it, with catalog reloads
/// (an open after a crash): no merge step changes any key's view, verify
/// stays sound, and the frames replay to the same tables.
#[test]
fn random_requests_during_a_merge_change_no_answer() -> R<()> {
    random_requests(false)
}

/// As [`random_requests_during_a_merge_change_no_answer`], with the clock
/// jumped past the TTL and the leases mid-merge and whole sweep steps
/// (partition drain, merge step, index sweep) instead of bare merge steps:
/// the drain and the per-record sweep delete and move records of the merge
/// sources on both sides of the cursor. A key's answer may then change
/// only to none (expired) or UNKNOWN (lease ended).
#[test]
fn random_requests_and_expiry_during_a_merge() -> R<()> {
    random_requests(true)
}

fn random_requests(expire: bool) -> R<()> {
    for seed in 0..12u64 {
        let mut rng = Rng(seed);
        let mut w = Writer::new(RULE)?;
        let keys: Vec<IdempotencyKey> = (0..120).map(key).collect::<R<_>>()?;
        for group in 0..30usize {
            w.now += 1_000;
            w.group(|t| {
                for k in keys.iter().skip(group * 4).take(4) {
                    let token = claim_in(t, k, LEASE_MS)?;
                    if group % 3 != 0 {
                        complete_in(t, k, token)?;
                    }
                }
                Ok(())
            })?;
        }
        w.now += 2 * MERGE_SPAN_MS;
        let mut model = views(&mut w, &keys)?;
        let mut steps = 0;
        let mut began = false;
        let mut changed = 0usize;
        loop {
            w.now += 10;
            // Requests before the step, in its group, after it.
            let before: Vec<(usize, u64)> = (0..rng.below(4))
                .map(|_| (rng.below(120) as usize, rng.below(8)))
                .collect();
            let after: Vec<(usize, u64)> = (0..rng.below(3))
                .map(|_| (rng.below(120) as usize, rng.below(8)))
                .collect();
            // The key at the cursor, often.
            let at_cursor = w
                .catalog
                .merging()
                .and_then(|m| m.cursor.clone())
                .and_then(|c| keys.iter().position(|k| k.record_key() == c.as_slice()));
            let cursor_op = at_cursor
                .filter(|_| rng.below(2) == 0)
                .map(|i| (i, rng.below(8)));
            let mut counts = SweepCounts::default();
            let limit = 1 + rng.below(9) as usize;
            w.group(|t| {
                for (i, what) in &before {
                    poke(t, &keys[*i], *what)?;
                }
                if expire {
                    counts = t.sweep(limit).map_err(|e| format!("{e:?}"))?;
                } else {
                    t.merge_step(limit, &mut counts)
                        .map_err(|e| format!("{e:?}"))?;
                }
                for (i, what) in after.iter().chain(cursor_op.iter()) {
                    poke(t, &keys[*i], *what)?;
                }
                Ok(())
            })?;
            began |= w.catalog.merging().is_some();
            if expire && steps == 6 {
                // Past every lease and TTL of the records made before.
                w.now += 30 * MERGE_SPAN_MS;
            }
            // The model: the writer's answers, which only requests change
            // (a merge step between two reads changes none).
            let now = views(&mut w, &keys)?;
            let touched: std::collections::BTreeSet<usize> = before
                .iter()
                .chain(after.iter())
                .chain(cursor_op.iter())
                .map(|(i, _)| *i)
                .collect();
            for (i, (m, n)) in model.iter().zip(&now).enumerate() {
                let swept = expire && (n.starts_with("None") || n.contains("state: Unknown"));
                if !touched.contains(&i) && m != n && !swept {
                    return Err(format!(
                        "seed {seed} step {steps}: {} changed without a request:\n was {m}\n now {n}",
                        keys[i]
                    )
                    .into());
                }
            }
            changed += model.iter().zip(&now).filter(|(a, b)| a != b).count();
            model = now;
            let (damage, _) = super::verify::verify(&w.db)?;
            if !damage.is_empty() {
                return Err(format!("seed {seed} step {steps}: verify: {damage:?}").into());
            }
            if rng.below(5) == 0 {
                w.catalog = w.loaded_catalog(RULE)?;
                let again = views(&mut w, &keys)?;
                if again != model {
                    return Err(
                        format!("seed {seed} step {steps}: a reload changed answers").into(),
                    );
                }
            }
            steps += 1;
            if began && !counts.more {
                break;
            }
            assert!(steps < 400, "seed {seed}: the merge ends");
        }
        eprintln!("seed {seed}: {steps} steps, {changed} answers changed by requests");
        let r = rows(&w.db)?;
        assert!(
            r.values().all(|row| !matches!(
                row.state,
                PartitionState::Merging | PartitionState::MergeSource | PartitionState::Dropping
            )),
            "seed {seed}: merge done: {r:?}"
        );
        w.assert_replays(&format!("seed {seed}"))?;
    }
    Ok(())
}

/// What an engine answers for `keys`: each record as listed by `record`,
/// the listing of every record, and key 1's steps.
fn engine_answers(
    e: &crate::Engine,
    keys: &[IdempotencyKey],
) -> R<(Vec<String>, Vec<String>, String)> {
    let mut one = Vec::new();
    for k in keys {
        one.push(format!(
            "{:?}",
            e.record(k)?.map(|r| (r.state, r.fencing_token))
        ));
    }
    let mut listed = Vec::new();
    for r in e.records(&crate::RecordFilter::default())? {
        let r = r?;
        listed.push(format!("{} {:?} {}", r.key, r.state, r.fencing_token));
    }
    let steps = format!("{:?}", e.steps(&keys[1])?.len());
    // A writable open puts the claims of the process before in doubt.
    let norm = |v: Vec<String>| -> Vec<String> {
        v.into_iter()
            .map(|s| s.replace("Processing", "Unknown"))
            .collect()
    };
    Ok((norm(one), norm(listed), steps))
}

/// An engine opened on a file a merge left mid-copy, or between its
/// switch and its drops, read-only and writable (with a TTL too short for
/// new merges), answers every key as before, lists each once, and
/// finishes the merge with `sweep_now`.
#[test]
fn engines_opened_mid_merge_answer_and_list_each_key_once() -> R<()> {
    for stop_after_switch in [false, true] {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("f3.redb");
        let mut w = Writer::on(Database::create(&path)?, RULE)?;
        let keys: Vec<IdempotencyKey> = (0..40).map(key).collect::<R<_>>()?;
        let mut tokens = Vec::new();
        for group in 0..10usize {
            w.now += 1_000;
            let got = w.group(|t| {
                let mut got = Vec::new();
                for (i, k) in keys.iter().enumerate().skip(group * 4).take(4) {
                    let token = claim_in(t, k, LEASE_MS)?;
                    if i % 3 != 1 {
                        complete_in(t, k, token)?;
                    }
                    got.push(token);
                }
                Ok(got)
            })?;
            tokens.extend(got);
        }
        w.group(|t| {
            use crate::store::{FinishStepRequest, StepRequest};
            t.reserve_step(StepRequest {
                key: keys[1].clone(),
                token: tokens[1],
                name: "charge".into(),
                finished: Vec::new(),
            })
            .map_err(|e| format!("{e:?}"))?;
            t.finish_step(FinishStepRequest {
                key: keys[1].clone(),
                token: tokens[1],
                name: "charge".into(),
                confirmed: true,
                evidence: b"ch".to_vec(),
            })
            .map_err(|e| format!("{e:?}"))?;
            Ok(())
        })?;
        let base_now = w.now;
        let fresh = || {
            crate::Engine::builder()
                .clock(Fixed(base_now))
                .sweep_interval(None)
        };
        w.now += 2 * MERGE_SPAN_MS;
        assert!(w.merge_step(7)?.more);
        w.merge_step(7)?;
        w.merge_step(7)?;
        if stop_after_switch {
            while w.catalog.merging().is_some() {
                w.merge_step(7)?;
            }
            w.merge_step(7)?; // one drop step
        }
        let now = w.now;
        let states: Vec<(u64, PartitionState)> =
            rows(&w.db)?.iter().map(|(p, r)| (*p, r.state)).collect();
        drop(w);
        // The answers before the merge: from a copy of the file, merged
        // partitions or not, opened read-only (probes skip copies).
        let want = {
            let e = fresh().open_read_only(&path)?;
            engine_answers(&e, &keys)?
        };
        assert_eq!(
            want.1.len(),
            40,
            "{states:?}: each key listed once: {:?}",
            want.1
        );
        assert!(
            want.0.iter().all(|s| s != "None"),
            "{states:?}: every key found"
        );
        assert_eq!(want.2, "1", "key 1's step");
        let clock = Fixed(now);
        let e = crate::Engine::builder()
            .clock(clock)
            .sweep_interval(None)
            .ttl(std::time::Duration::from_secs(3_600))
            .open_existing(&path)?;
        assert_eq!(
            engine_answers(&e, &keys)?,
            want,
            "{states:?}: writable open"
        );
        let report = e.verify()?;
        assert!(report.is_sound(), "{states:?}: {:?}", report.damage);
        e.sweep_now()?;
        assert_eq!(
            engine_answers(&e, &keys)?,
            want,
            "{states:?}: after the sweep"
        );
        let report = e.verify()?;
        assert!(report.is_sound(), "{states:?}: {:?}", report.damage);
        drop(e);
        let left: Vec<(u64, PartitionState)> = {
            let db = Database::open(&path)?;
            rows(&db)?.iter().map(|(p, r)| (*p, r.state)).collect()
        };
        assert!(
            left.iter()
                .all(|(_, s)| matches!(s, PartitionState::Hot | PartitionState::Sealed)),
            "{states:?}: the merge finished: {left:?}"
        );
    }
    Ok(())
}

/// A merge copy that lacks a record its source holds below the copy's
/// last key (a lost write, or a mirror write the writer missed) is lost
/// for good at the switch, when the source turns dropping. `verify`, which
/// "checks each merge copy against its source", must name it before that.
#[test]
fn verify_names_a_record_missing_from_a_merge_copy() -> R<()> {
    use super::partition::catalog;
    use super::partition::slot;
    let mut w = Writer::new(RULE)?;
    let keys = w.completed(40, LEASE_MS, &[])?;
    w.now += 2 * MERGE_SPAN_MS;
    w.merge_step(7)?;
    w.merge_step(7)?;
    w.merge_step(7)?;
    let m = w.catalog.merging().ok_or("a merge")?;
    let target = m.target;
    // The second-lowest record key copied: below the copy's last key.
    let copied: Vec<Vec<u8>> = {
        let txn = w.db.begin_read()?;
        let records = txn.open_table(catalog::RECORDS)?;
        let mut out = Vec::new();
        for e in catalog::range(&records, target)? {
            let (k, _) = e?;
            out.push(slot::split(k.value()).ok_or("slot")?.1.to_vec());
        }
        out
    };
    assert!(copied.len() >= 3);
    let lost_rkey = copied[1].clone();
    {
        let txn = w.db.begin_write()?;
        txn.open_table(catalog::RECORDS)?
            .remove(slot::slot_key(target, &lost_rkey).as_slice())?;
        txn.commit()?;
    }
    let (damage, _) = super::verify::verify(&w.db)?;
    let lost = keys
        .iter()
        .find(|k| k.record_key() == lost_rkey.as_slice())
        .ok_or("the key")?
        .clone();
    // What the file loses once the merge goes on.
    while w.merge_step(7)?.more {}
    let after = w.group(|t| Ok(t.raw(lost.record_key())?.is_some()))?;
    assert!(
        !damage.is_empty(),
        "verify found the file sound while the merge copy lacked {lost}; the merge then \
         switched and dropped its source: the record is {}",
        if after { "still there" } else { "gone" }
    );
    Ok(())
}

/// A bit flip in a record of the merging copy (a copy nothing reads yet):
/// verify names it, the key still answers from its source, and the switch
/// must not make the damaged copy the live record while its intact source
/// is dropped.
#[test]
fn a_damaged_merge_copy_is_not_switched_in_over_its_intact_source() -> R<()> {
    use super::partition::catalog;
    use super::partition::slot;
    let mut w = Writer::new(RULE)?;
    w.completed(40, LEASE_MS, &[])?;
    w.now += 2 * MERGE_SPAN_MS;
    w.merge_step(7)?;
    w.merge_step(7)?;
    let target = w.catalog.merging().ok_or("a merge")?.target;
    let (slot_key, mut value) = {
        let txn = w.db.begin_read()?;
        let records = txn.open_table(catalog::RECORDS)?;
        let mut it = catalog::range(&records, target)?;
        let (k, v) = it.next().ok_or("a copy")??;
        (k.value().to_vec(), v.value().to_vec())
    };
    let rkey = slot::split(&slot_key).ok_or("slot")?.1.to_vec();
    let at = value.len() / 2;
    value[at] ^= 0x40;
    {
        let txn = w.db.begin_write()?;
        txn.open_table(catalog::RECORDS)?
            .insert(slot_key.as_slice(), value.as_slice())?;
        txn.commit()?;
    }
    let (damage, _) = super::verify::verify(&w.db)?;
    assert!(!damage.is_empty(), "verify names the damaged copy");
    let before = w.group(|t| Ok(format!("{:?}", t.raw(&rkey)?)))?;
    assert!(
        before.starts_with("Some(Ok("),
        "answered from the source: {before}"
    );
    while w.merge_step(7)?.more {}
    let after = w.group(|t| Ok(format!("{:?}", t.raw(&rkey)?)))?;
    assert_eq!(
        after, before,
        "the merge switched a damaged copy in and dropped the intact source"
    );
    Ok(())
}

/// A live record lost from the merged partition after the switch (a
/// raw delete, as a lost page would leave it): verify names its dropping
/// twin, and the drop step writes the record back from the twin instead
/// of deleting the last copy; the key then answers as before, and the
/// file is sound.
#[test]
fn a_live_copy_lost_after_the_switch_is_written_back_from_its_twin() -> R<()> {
    use super::partition::catalog;
    use super::partition::slot;
    let mut w = Writer::new(RULE)?;
    let keys = switched(&mut w)?;
    let lost = keys[9].clone();
    let rkey = lost.record_key().to_vec();
    let before = w.group(|t| Ok(format!("{:?}", t.raw(&rkey)?)))?;
    assert!(before.starts_with("Some(Ok("), "{before}");
    let live = w
        .group(|t| Ok(t.locate(&rkey)?))?
        .ok_or("the merged partition holds the key")?;
    assert!(
        live >= BUILT_PARTITIONS,
        "live in the merged partition: {live}"
    );
    {
        let txn = w.db.begin_write()?;
        txn.open_table(catalog::RECORDS)?
            .remove(slot::slot_key(live, &rkey).as_slice())?;
        txn.commit()?;
    }
    let (damage, _) = super::verify::verify(&w.db)?;
    assert!(
        format!("{damage:?}").contains("has no live copy"),
        "verify names the dropping twin without a live copy: {damage:?}"
    );
    while w.merge_step(7)?.more {}
    let after = w.group(|t| Ok(format!("{:?}", t.raw(&rkey)?)))?;
    assert_eq!(after, before, "the drop wrote the lost record back");
    let (damage, _) = super::verify::verify(&w.db)?;
    assert_eq!(damage, [], "sound once the drop is done");
    for k in &keys {
        assert!(
            w.group(|t| Ok(t.raw(k.record_key())?.is_some()))?,
            "{k} kept"
        );
    }
    Ok(())
}

/// A record deleted after the switch is deleted from its dropping twin
/// too (so nothing can bring it back), and verify finds the file sound.
#[test]
fn a_delete_after_the_switch_reaches_the_dropping_twin() -> R<()> {
    use super::partition::catalog;
    use super::partition::slot;
    let mut w = Writer::new(RULE)?;
    let keys = switched(&mut w)?;
    let gone = keys[3].clone();
    let kept = keys[5].clone();
    w.group(|t| {
        let old = t
            .raw(gone.record_key())?
            .ok_or("a record")?
            .map_err(|e| format!("{e}"))?;
        t.delete(&gone, &old).map_err(|e| format!("{e:?}"))?;
        Ok(())
    })?;
    let (damage, _) = super::verify::verify(&w.db)?;
    assert_eq!(damage, [], "twins stay equal through a delete");
    let dropping: Vec<u64> = rows(&w.db)?
        .iter()
        .filter(|(_, r)| r.state == PartitionState::Dropping)
        .map(|(p, _)| *p)
        .collect();
    let txn = w.db.begin_read()?;
    let records = txn.open_table(catalog::RECORDS)?;
    let twin_of = |k: &IdempotencyKey| -> R<usize> {
        let mut n = 0;
        for &d in &dropping {
            if records
                .get(slot::slot_key(d, k.record_key()).as_slice())?
                .is_some()
            {
                n += 1;
            }
        }
        Ok(n)
    };
    assert_eq!(twin_of(&gone)?, 0, "the delete reached the twin");
    assert_eq!(twin_of(&kept)?, 1, "an untouched key keeps its twin");
    Ok(())
}
