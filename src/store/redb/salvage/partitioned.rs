//! Salvage of a format-3 file (partitioned records, docs/format3-plan.md):
//! which partitions the file has, where the records walk looks for the
//! keys the indexes and the journal name, and the step from slot keys
//! (`[partition u64 BE][record key]`, `partition/slot.rs`) back to record
//! keys, where a key found in two partitions is weighed.
//!
//! Partitions are taken from every place that names one: the rows of
//! `idempotency.partitions` and the keys of `idempotency.filters` (as far
//! as they walk), the journal's frames, and the slot-key prefixes every
//! walk met. A damaged rows table so hides no partition whose records,
//! steps or log still read. Rows and filters are never copied: the new
//! file's one partition is built anew (`write.rs`).

use std::collections::{BTreeMap, BTreeSet};

use redb::ReadableDatabase;

use crate::salvage::Lost;
use crate::store::codec;
use crate::store::record::hex;

use super::super::journal::{Change, Frame};
use super::super::partition::row::{FILTERS, PARTITIONS};
use super::super::partition::slot::{self, BUILT_PARTITIONS, FIRST_PARTITION};
use super::frames::Work;
use super::gathered::{Entries, Reasons};
use super::walk::{walk_table, Gap};
use super::Named;

/// The widest run of partition numbers, between the last key read before
/// a records gap and the first read after it, whose every number is
/// looked in (partitions that took claims are numbered one after the
/// other, so a run between two found is partitions whose rows may be
/// lost).
const MAX_SPANNED: u64 = 4_096;

/// The partitions the file names outside its records table: rows and
/// filters, the frames, and the prefixes of the steps and log walks.
pub(super) fn known_partitions(
    db: &impl ReadableDatabase,
    frames: &[(u64, Frame)],
    steps: &BTreeMap<(Vec<u8>, String), Vec<u8>>,
    history: &BTreeMap<(Vec<u8>, u32), Vec<u8>>,
) -> BTreeSet<u64> {
    let own = |(k, _): (redb::AccessGuard<'_, u64>, redb::AccessGuard<'_, &[u8]>)| (k.value(), ());
    let mut known: BTreeSet<u64> = walk_table(db, PARTITIONS, own)
        .entries
        .into_keys()
        .collect();
    known.extend(walk_table(db, FILTERS, own).entries.into_keys());
    known.extend(prefixes(steps.keys().map(|(s, _)| s.as_slice())));
    known.extend(prefixes(history.keys().map(|(s, _)| s.as_slice())));
    for (_, frame) in frames {
        for change in &frame.changes {
            if let Some((key, _)) = change.record_write() {
                known.extend(slot::split(key).map(|(p, _)| p));
            }
            match change {
                Change::PutStep { key, .. }
                | Change::DelStep { key, .. }
                | Change::PutHistory { key, .. }
                | Change::DelHistory { key, .. } => {
                    known.extend(slot::split(key).map(|(p, _)| p));
                }
                Change::PutPartition { partition, .. }
                | Change::DelPartition { partition }
                | Change::PutFilter { partition, .. }
                | Change::DelFilter { partition }
                | Change::MergeDrop { partition, .. }
                | Change::MergeCopy {
                    target: partition, ..
                } => {
                    known.insert(*partition);
                }
                _ => {}
            }
        }
    }
    known
}

/// The distinct partition numbers of `slots` (in key order, so a run of
/// one partition's keys is one number).
fn prefixes<'a>(slots: impl Iterator<Item = &'a [u8]>) -> BTreeSet<u64> {
    let mut out = BTreeSet::new();
    let mut last = None;
    for p in slots.filter_map(|s| slot::split(s).map(|(p, _)| p)) {
        if last != Some(p) {
            out.insert(p);
            last = Some(p);
        }
    }
    out
}

/// The slot keys the records walk goes on from and looks up, where damage
/// left `gap` (`None`: the walks met every entry, nothing to look for):
/// the frames' slot keys, and each named record key the walks did not
/// meet, in every partition whose slot key for it lies in the gap. Partitions: `known`, the
/// prefixes the walks met (`walked`), the first claim partition and the
/// built one, and every number between the gap's two ends when that run
/// is short ([`MAX_SPANNED`]).
pub(super) fn seeds(
    named: &Named,
    known: &BTreeSet<u64>,
    gap: Option<&Gap<Vec<u8>>>,
    walked: &Entries,
) -> BTreeSet<Vec<u8>> {
    let mut out = named.slots.clone();
    let Some(gap) = gap else {
        return out;
    };
    let mut parts = known.clone();
    parts.extend(prefixes(walked.keys().map(Vec::as_slice)));
    parts.insert(FIRST_PARTITION);
    parts.insert(BUILT_PARTITIONS);
    let lo = gap
        .after
        .as_deref()
        .and_then(slot::split)
        .map_or(0, |(p, _)| p);
    let hi = gap
        .before
        .as_deref()
        .and_then(slot::split)
        .map_or(u64::MAX, |(p, _)| p);
    let run_lo = lo.max(FIRST_PARTITION);
    let run_hi = if hi == u64::MAX {
        parts
            .range(..BUILT_PARTITIONS)
            .next_back()
            .copied()
            .unwrap_or(0)
    } else {
        hi
    };
    if run_lo <= run_hi && run_hi - run_lo <= MAX_SPANNED {
        parts.extend(run_lo..=run_hi);
    }
    // A key the walks met is not looked for elsewhere: a second copy
    // would be damage the writer never makes, and the lookups of every
    // key in every partition would cost (keys × partitions) when the gap
    // is the whole table.
    let met: BTreeSet<&[u8]> = walked
        .keys()
        .filter_map(|s| slot::split(s).map(|(_, rkey)| rkey))
        .collect();
    let missing: Vec<&Vec<u8>> = named
        .record_keys
        .iter()
        .filter(|k| !met.contains(k.as_slice()))
        .collect();
    for p in parts.range(lo..=hi) {
        for rkey in &missing {
            let s = slot::slot_key(*p, rkey);
            if gap.holds(&s) {
                out.insert(s);
            }
        }
    }
    out
}

/// The record key and partition of a slot key (`None`: too short to be
/// one).
fn unslotted(slot: &[u8]) -> Option<(Vec<u8>, u64)> {
    slot::split(slot).map(|(p, rkey)| (rkey.to_vec(), p))
}

/// Why a key found in several partitions is not copied.
fn in_partitions(parts: &[u64]) -> String {
    let list: Vec<String> = parts.iter().map(u64::to_string).collect();
    format!(
        "found in partitions {} (a key is in one partition only: all but one copy is damage); \
         neither the journal nor the index entries tell which copy is current, so none is copied",
        list.join(" and ")
    )
}

/// Turns `work`'s records, steps and log from slot keys into record keys
/// (format 2's shapes, which the checks that follow read), after the
/// frames were applied.
///
/// A record key whose value was found in one partition takes that value
/// (a failed lookup of it in another partition is not a second copy: the
/// writer never puts a key in two partitions). A key found in several is
/// damage: the copy the journal's last write of the key names is taken,
/// else the one copy whose state the index entries match; else none, and
/// the key is listed naming the partitions. A key whose last write comes
/// before an unreadable frame, or whose lookups failed and no copy was
/// found, is listed with the partition. Steps and log entries go with
/// their record's partition; those under another partition are listed.
/// `failed`: the records walk's failed lookups, by slot key.
pub(super) fn unslot(
    work: &mut Work,
    frames: &[(u64, Frame)],
    mut failed: Reasons,
    lost: &mut Vec<Lost>,
) {
    // The partition of each record key's last write in the frames
    // (`None`: a delete).
    let mut last_put: BTreeMap<Vec<u8>, Option<u64>> = BTreeMap::new();
    for (_, frame) in frames {
        for change in &frame.changes {
            if let Some((key, put)) = change.record_write() {
                // A slot a frame wrote is settled by it.
                failed.remove(key);
                if let Some((rkey, p)) = unslotted(key) {
                    last_put.insert(rkey, put.then_some(p));
                }
            }
        }
    }
    let mut copies: BTreeMap<Vec<u8>, Vec<(u64, Vec<u8>)>> = BTreeMap::new();
    for (s, value) in std::mem::take(&mut work.records) {
        match unslotted(&s) {
            Some((rkey, p)) => copies.entry(rkey).or_default().push((p, value)),
            None => lost.push(short_slot(&s)),
        }
    }
    // Reasons still in `work.unreadable` are frames' (a last write before
    // an unreadable frame): the key is not copied whatever was found.
    let mut reasons: Reasons = BTreeMap::new();
    for (s, reason) in std::mem::take(&mut work.unreadable) {
        match unslotted(&s) {
            Some((rkey, p)) => {
                copies.remove(&rkey);
                reasons.insert(rkey, format!("in partition {p}: {reason}"));
            }
            None => lost.push(short_slot(&s)),
        }
    }
    for (s, reason) in failed {
        match unslotted(&s) {
            Some((rkey, p)) if !copies.contains_key(&rkey) => {
                reasons
                    .entry(rkey)
                    .or_insert_with(|| format!("in partition {p}: {reason}"));
            }
            Some(_) => {}
            None => lost.push(short_slot(&s)),
        }
    }
    let mut chosen: BTreeMap<Vec<u8>, u64> = BTreeMap::new();
    for (rkey, mut found) in copies {
        let by_journal = last_put.get(&rkey).copied().flatten();
        let pick = pick_copy(&rkey, &found, by_journal, &work.index);
        if let Some(i) = pick {
            let (p, value) = found.swap_remove(i);
            chosen.insert(rkey.clone(), p);
            work.records.insert(rkey, value);
        } else {
            let parts: Vec<u64> = found.iter().map(|(p, _)| *p).collect();
            reasons.insert(rkey, in_partitions(&parts));
        }
    }
    work.unreadable = reasons;
    work.steps = beside(
        std::mem::take(&mut work.steps),
        &chosen,
        |(rkey, name), why| Lost::Step {
            key_hex: hex(&rkey),
            step: name,
            reason: why,
        },
        lost,
    );
    work.history = beside(
        std::mem::take(&mut work.history),
        &chosen,
        |(rkey, seq), why| Lost::HistoryEntry {
            key_hex: hex(&rkey),
            seq,
            reason: why,
        },
        lost,
    );
}

/// Which of `found` (partition, value) copies of record key `rkey` is
/// taken: the only one; else twins of a merge (one copy in a built
/// partition, the same bytes as its source's: `partition/merge.rs`); else
/// the one in the partition of the journal's last write (`by_journal`),
/// else the one in a built partition (a merge switched: its sources hold
/// stale copies), else the one copy whose state the index entries
/// (`index`) match; `None`: none can be told apart.
fn pick_copy(
    rkey: &[u8],
    found: &[(u64, Vec<u8>)],
    by_journal: Option<u64>,
    index: &BTreeSet<super::gathered::IndexEntry>,
) -> Option<usize> {
    let one = |v: Vec<usize>| match v.as_slice() {
        [one] => Some(*one),
        _ => None,
    };
    if found.len() == 1 {
        return Some(0);
    }
    let built = one((0..found.len())
        .filter(|&i| found[i].0 >= BUILT_PARTITIONS)
        .collect());
    // Twins in two partitions that took claims are damage the writer
    // never makes.
    if built.is_some() && found.iter().all(|(_, v)| *v == found[0].1) {
        return built;
    }
    by_journal
        .and_then(|p| found.iter().position(|(q, _)| *q == p))
        .or(built)
        .or_else(|| {
            one((0..found.len())
                .filter(|&i| {
                    codec::decode(rkey, &found[i].1).is_ok_and(|rec| {
                        let (name, at) = rec.index();
                        index.contains(&(name, at, rkey.to_vec()))
                    })
                })
                .collect())
        })
}

/// `entries` (keyed by slot key and a name or number) keyed by record
/// key: those in the partition of their record's copy (`chosen`), or of a
/// record not copied (the checks list them with it); the others are
/// listed through `listed`.
fn beside<T: Ord + Clone>(
    entries: BTreeMap<(Vec<u8>, T), Vec<u8>>,
    chosen: &BTreeMap<Vec<u8>, u64>,
    listed: impl Fn((Vec<u8>, T), String) -> Lost,
    lost: &mut Vec<Lost>,
) -> BTreeMap<(Vec<u8>, T), Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut twins = BTreeSet::new();
    for ((s, t), value) in &entries {
        if let Some((rkey, p)) = unslotted(s) {
            if chosen.get(&rkey) != Some(&p) {
                let beside_record = slot::slot_key(chosen.get(&rkey).copied().unwrap_or(p), &rkey);
                if entries.get(&(beside_record, t.clone())) == Some(value) {
                    twins.insert((s.clone(), t.clone()));
                }
            }
        }
    }
    for ((s, t), value) in entries {
        if twins.contains(&(s.clone(), t.clone())) {
            // A merge's twin of the entry kept beside the record.
            continue;
        }
        match unslotted(&s) {
            Some((rkey, p)) => match chosen.get(&rkey) {
                Some(q) if *q != p => lost.push(listed(
                    (rkey, t),
                    format!("it is in partition {p}, its record in partition {q}"),
                )),
                _ => {
                    out.insert((rkey, t), value);
                }
            },
            None => lost.push(listed(
                (s, t),
                "its key is not a slot key (shorter than a partition number)".to_owned(),
            )),
        }
    }
    out
}

/// A records key too short to be a slot key (a damaged page).
fn short_slot(s: &[u8]) -> Lost {
    Lost::Record {
        key_hex: hex(s),
        reason: "its key is not a slot key (shorter than a partition number)".to_owned(),
    }
}

/// A steps or log walk's gap with its ends' record keys (the partitions
/// named in its reason).
pub(super) fn unslot_gap<T>(gap: Option<Gap<(Vec<u8>, T)>>) -> Option<Gap<(Vec<u8>, T)>> {
    let gap = gap?;
    let part = |end: &Option<(Vec<u8>, T)>| {
        end.as_ref()
            .and_then(|(s, _)| slot::split(s))
            .map_or_else(|| "-".to_owned(), |(p, _)| p.to_string())
    };
    let reason = format!(
        "{}; from partition {} to partition {}",
        gap.reason,
        part(&gap.after),
        part(&gap.before)
    );
    let rekey = |end: Option<(Vec<u8>, T)>| {
        end.map(|(s, t)| match unslotted(&s) {
            Some((rkey, _)) => (rkey, t),
            None => (s, t),
        })
    };
    Some(Gap {
        after: rekey(gap.after),
        before: rekey(gap.before),
        reason,
    })
}

/// The records walks' gap (slot keys) as lost ranges of record keys: one
/// per partition it touches (the first partition after its last key read,
/// every partition between, the last before its first key read after).
pub(super) fn lost_range(gap: &Gap<Vec<u8>>) -> Vec<Lost> {
    let end = |k: &Option<Vec<u8>>| k.as_deref().and_then(unslotted);
    let (after, before) = (end(&gap.after), end(&gap.before));
    let range = |after: Option<&Vec<u8>>, before: Option<&Vec<u8>>, which: String| Lost::Range {
        table: "records",
        after_hex: after.map(|k| hex(k)),
        before_hex: before.map(|k| hex(k)),
        reason: format!("{} ({which})", gap.reason),
    };
    match (after, before) {
        (Some((a, pa)), Some((b, pb))) if pa == pb => {
            vec![range(Some(&a), Some(&b), format!("in partition {pa}"))]
        }
        (Some((a, pa)), Some((b, pb))) => {
            let mut out = vec![range(Some(&a), None, format!("in partition {pa}"))];
            if pb > pa.saturating_add(1) {
                out.push(range(
                    None,
                    None,
                    format!("every partition from {} to {}", pa + 1, pb - 1),
                ));
            }
            out.push(range(None, Some(&b), format!("in partition {pb}")));
            out
        }
        (Some((a, pa)), None) => vec![
            range(Some(&a), None, format!("in partition {pa}")),
            range(None, None, format!("every partition after {pa}")),
        ],
        (None, Some((b, pb))) => vec![
            range(None, None, format!("every partition before {pb}")),
            range(None, Some(&b), format!("in partition {pb}")),
        ],
        (None, None) => vec![range(None, None, "every partition".to_owned())],
    }
}

#[cfg(test)]
#[path = "partitioned_tests.rs"]
mod tests;
