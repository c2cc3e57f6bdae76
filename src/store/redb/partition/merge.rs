//! Format 3's merge of closed partitions: the sealed partitions whose
//! first claim fell in one closed hour are copied, a bounded step at a
//! time, in record-key order into one partition the engine builds
//! ([`slot::BUILT_PARTITIONS`] and up), whose leaves redb packs because
//! every copy lands past the last key of the table. A partition filled
//! in random key order keeps its leaves about 64 % full (730 bytes of
//! pages a record at 461 encoded bytes); a merged one about 90 % (526
//! bytes), and a fresh key probes one filter for the hour instead of one
//! per ten minutes (BENCHMARKS.md, "The open questions, measured").
//!
//! # The steps (docs/format3-plan.md, "Recommended layout", item 2)
//!
//! 1. **Begin**, in one transaction: the merged partition's row is written
//!    *merging* (lookups skip it) and each source's row becomes a *merge
//!    source* (still read, with its filter).
//! 2. **Copy**, [`MERGE_STEP_RECORDS`] records a step at most, fewer once
//!    the step has held the writer [`MERGE_STEP_TIME`] while a client waits
//!    ([`copy_step`]), each with its effect steps and log entries. The cursor is the last
//!    record key copied; it is never stored, since it is the last key of
//!    the merged partition's range (a record deleted after its copy is
//!    deleted from both, see below, so nothing lies between). While the
//!    merge runs, the writer applies every change to a source's record,
//!    step or log entry whose record key is at or below the cursor to the
//!    copy too (`tables.rs`), so the copy stays the source's twin.
//! 3. **Switch**, in one transaction, once nothing is left to copy: the
//!    merged partition gets its filter and is sealed (lookups read it from
//!    that commit on), the sources become *dropping* (lookups skip them
//!    from the same commit: a key is answered from one partition only)
//!    and lose their filters.
//! 4. **Drop**: a dropping partition's records, steps and log entries are
//!    deleted a bounded step at a time ([`drop_step`], bounded as a copy
//!    step), then its row.
//!
//! The index tables name record keys, not slot keys, so no index entry
//! moves. Every step is journaled: the begin, switch and drop as the
//! rows, filters and deletes they write; a copy as one
//! `Change::MergeCopy`, which replay runs again (the same state gives the
//! same copy). A crash at any point leaves either the sources live (the
//! merge resumes at open from the merged range's last key, its filter
//! rebuilt from that range) or the merged partition live (the drop goes
//! on).
//!
//! Store layer (layer 2).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ops::Bound;

use redb::{ReadableTable, Table};

use super::row::{PartitionRow, PartitionState};
use super::slot::{self, BUILT_PARTITIONS};

/// Claims of one merged partition: partitions whose first claim fell in
/// the same span of this many ms (an hour) merge together.
pub(crate) const MERGE_SPAN_MS: u64 = 60 * 60 * 1000;
/// Records a copy or drop step handles at most: a step held the writer
/// 13 ms at most at 1M records in the prototype (BENCHMARKS.md, "The open
/// questions, measured", run F).
pub(crate) const MERGE_STEP_RECORDS: usize = 512;
/// Time a copy or drop step may hold the writer while a client waits on
/// it (about one group commit's time beside 64 clients, BENCHMARKS.md
/// "The merge's writer stall"): a step stops at [`MERGE_STEP_RECORDS`],
/// or once this much time has gone and a client waits, whichever comes
/// first, having done at least [`MIN_STEP_RECORDS`] (so a merge always
/// finishes, in at most one step per that many records).
/// The count it did is in its journal frame, so a replay does the same
/// without a clock. The cut costs writes: a merge in short steps spans
/// more redb commits, each copying its last leaves again (the `steady`
/// bench, whose clients always wait: 4.9 KB per request at the device
/// against 3.5 KB with steps never cut; BENCHMARKS.md, run G).
pub(crate) const MERGE_STEP_TIME: std::time::Duration = std::time::Duration::from_millis(1);
/// Records a copy step reads from the sources at a time, between looks
/// at its time.
const COPY_CHUNK: usize = 16;
/// The fewest records a copy or drop step does before its time may cut
/// it (fewer only when fewer are left): a step has costs of its own (its
/// frame, its group), and on pages the cache does not hold one record can
/// take the whole 1 ms, so a floor of one record could stretch a drop
/// into a step per record.
pub(crate) const MIN_STEP_RECORDS: usize = COPY_CHUNK;

/// The tables a copy or drop step writes.
pub(crate) struct MergeTables<'a, 't> {
    /// Slot key → encoded record.
    pub(crate) records: &'a mut Table<'t, &'static [u8], &'static [u8]>,
    /// (slot key, step name) → encoded step.
    pub(crate) steps: &'a mut Table<'t, (&'static [u8], &'static str), &'static [u8]>,
    /// (slot key, seq) → encoded log entry.
    pub(crate) history: &'a mut Table<'t, (&'static [u8], u32), &'static [u8]>,
}

/// What a copy step did.
#[derive(Debug, Default)]
pub(crate) struct Copied {
    /// The record keys copied, ascending.
    pub(crate) keys: Vec<Vec<u8>>,
    /// Whether nothing is left to copy.
    pub(crate) done: bool,
    /// Bytes copied: keys and values of records, steps and log entries.
    pub(crate) bytes: u64,
}

/// One record of a source, met by the k-way merge.
struct Met {
    rkey: Vec<u8>,
    value: Vec<u8>,
}

/// The k-way merge's heap entry: smallest record key first; for equal
/// keys (only damage makes them) the highest source index first, so the
/// newest source's record is the one kept, as a lookup would find it.
type Head = Reverse<(Vec<u8>, Reverse<usize>)>;

/// Copies from partitions `sources` (ascending) into partition `target`
/// the first `limit` records in record-key order after record key `after`
/// (`None`: from the first), each with its effect steps and log entries,
/// under the same record key. A key two sources hold (damage) is copied
/// from the newest (highest) one only. It reads [`COPY_CHUNK`] records
/// at a time and stops early, with fewer than `limit` copied, once
/// `spent()` says its time is up (asked after each chunk, so at least one
/// record is copied when any is left); the first `n` records are the same
/// however many chunks they took, so a replay of a step that copied `n`
/// passes `limit` = `n` and never stops early.
///
/// # Errors
///
/// The storage error of reading or writing the tables.
pub(crate) fn copy_step(
    t: &mut MergeTables<'_, '_>,
    target: u64,
    sources: &[u64],
    after: Option<&[u8]>,
    limit: usize,
    spent: &dyn Fn() -> bool,
) -> Result<Copied, redb::StorageError> {
    let mut out = Copied::default();
    let mut cursor = after.map(<[u8]>::to_vec);
    loop {
        let want = limit.saturating_sub(out.keys.len()).min(COPY_CHUNK);
        let chunk = copy_records(t, target, sources, cursor.as_deref(), want)?;
        out.bytes = out.bytes.saturating_add(chunk.bytes);
        out.keys.extend(chunk.keys);
        out.done = chunk.done;
        if out.done || out.keys.len() >= limit || spent() {
            return Ok(out);
        }
        cursor = out.keys.last().cloned();
    }
}

/// [`copy_step`]'s copy of the next `limit` records after `after`, all at
/// once.
fn copy_records(
    t: &mut MergeTables<'_, '_>,
    target: u64,
    sources: &[u64],
    after: Option<&[u8]>,
    limit: usize,
) -> Result<Copied, redb::StorageError> {
    let (batch, done) = next_records(t.records, sources, after, limit)?;
    let mut keys = Vec::with_capacity(batch.len());
    let mut bytes = 0usize;
    for (from, met) in batch {
        let from_slot = slot::slot_key(from, &met.rkey);
        let to_slot = slot::slot_key(target, &met.rkey);
        let mut steps = Vec::new();
        for entry in t.steps.range((from_slot.as_slice(), "")..)? {
            let (k, v) = entry?;
            let (at, name) = k.value();
            if at != from_slot.as_slice() {
                break;
            }
            steps.push((name.to_owned(), v.value().to_vec()));
        }
        let mut log = Vec::new();
        for entry in t
            .history
            .range((from_slot.as_slice(), 0)..=(from_slot.as_slice(), u32::MAX))?
        {
            let (k, v) = entry?;
            log.push((k.value().1, v.value().to_vec()));
        }
        t.records.insert(to_slot.as_slice(), met.value.as_slice())?;
        bytes = bytes
            .saturating_add(to_slot.len())
            .saturating_add(met.value.len());
        for (name, value) in steps {
            bytes = bytes.saturating_add(to_slot.len() + name.len() + value.len());
            t.steps
                .insert((to_slot.as_slice(), name.as_str()), value.as_slice())?;
        }
        for (seq, value) in log {
            bytes = bytes.saturating_add(to_slot.len() + 4 + value.len());
            t.history
                .insert((to_slot.as_slice(), seq), value.as_slice())?;
        }
        keys.push(met.rkey);
    }
    Ok(Copied {
        keys,
        done,
        bytes: u64::try_from(bytes).unwrap_or(u64::MAX),
    })
}

/// The next `limit` records of `sources` after record key `after`, in
/// record-key order, each with the partition it is in, and whether none
/// is left after them.
fn next_records(
    records: &Table<'_, &'static [u8], &'static [u8]>,
    sources: &[u64],
    after: Option<&[u8]>,
    limit: usize,
) -> Result<(Vec<(u64, Met)>, bool), redb::StorageError> {
    let mut iters = Vec::with_capacity(sources.len());
    for &p in sources {
        let (lo, hi) = slot::range_of(p);
        let from = after.map(|a| slot::slot_key(p, a));
        let start = match &from {
            Some(f) => Bound::Excluded(f.as_slice()),
            None => Bound::Included(&lo[..]),
        };
        let end = match &hi {
            Some(h) => Bound::Excluded(&h[..]),
            None => Bound::Unbounded,
        };
        iters.push(records.range::<&[u8]>((start, end))?);
    }
    let mut heap: BinaryHeap<Head> = BinaryHeap::new();
    let mut values: Vec<Option<Vec<u8>>> = vec![None; iters.len()];
    for i in 0..iters.len() {
        pull(i, &mut iters, &mut heap, &mut values)?;
    }
    let mut out: Vec<(u64, Met)> = Vec::new();
    while let Some(Reverse((rkey, Reverse(i)))) = heap.pop() {
        let duplicate = out.last().is_some_and(|(_, last)| last.rkey == rkey);
        if !duplicate && out.len() == limit {
            heap.push(Reverse((rkey, Reverse(i))));
            break;
        }
        let value = values[i].take().unwrap_or_default();
        pull(i, &mut iters, &mut heap, &mut values)?;
        if duplicate {
            // The one kept came from the newer source.
            continue;
        }
        out.push((sources[i], Met { rkey, value }));
    }
    let done = heap.is_empty();
    Ok((out, done))
}

/// Puts the next record of source `i`'s range, if any, into the heap.
fn pull(
    i: usize,
    iters: &mut [redb::Range<'_, &'static [u8], &'static [u8]>],
    heap: &mut BinaryHeap<Head>,
    values: &mut [Option<Vec<u8>>],
) -> Result<(), redb::StorageError> {
    for entry in iters[i].by_ref() {
        let (k, v) = entry?;
        // Every key of a partition's range holds its prefix.
        if let Some((_, rkey)) = slot::split(k.value()) {
            heap.push(Reverse((rkey.to_vec(), Reverse(i))));
            values[i] = Some(v.value().to_vec());
            break;
        }
    }
    Ok(())
}

/// Deletes from partition `partition` the first `limit` records of its
/// range, each with its effect steps and log entries; once its records
/// are gone, up to `limit` steps and as many log entries left in its
/// range too (none this build writes). Returns how many records it
/// deleted and whether the ranges are empty. It stops early once
/// `spent()` says its time is up (asked after each record from the
/// [`MIN_STEP_RECORDS`]th on, so at least that many are deleted when that
/// many are left): it has then done what a step with
/// `limit` = the records it deleted does, and says so in
/// [`Dropped::limit`], the limit its replay passes.
///
/// # Errors
///
/// The storage error of reading or writing the tables.
pub(crate) fn drop_step(
    t: &mut MergeTables<'_, '_>,
    partition: u64,
    limit: usize,
    spent: &dyn Fn() -> bool,
) -> Result<Dropped, redb::StorageError> {
    let (lo, hi) = slot::range_of(partition);
    let end = match &hi {
        Some(h) => Bound::Excluded(h.to_vec()),
        None => Bound::Unbounded,
    };
    let mut slots = Vec::new();
    {
        let range = t
            .records
            .range::<&[u8]>((Bound::Included(&lo[..]), as_ref(&end)))?;
        for entry in range.take(limit.saturating_add(1)) {
            slots.push(entry?.0.value().to_vec());
        }
    }
    let mut more = slots.len() > limit;
    slots.truncate(limit);
    let mut out = Dropped {
        records: 0,
        done: false,
        limit: limit as u64,
    };
    for (i, s) in slots.iter().enumerate() {
        if i >= MIN_STEP_RECORDS && spent() {
            // Records are left: a step with limit `i` stops here too.
            more = true;
            out.limit = i as u64;
            break;
        }
        out.records += 1;
        t.records.remove(s.as_slice())?;
        let mut names = Vec::new();
        for entry in t.steps.range((s.as_slice(), "")..)? {
            let (k, _) = entry?;
            let (at, name) = k.value();
            if at != s.as_slice() {
                break;
            }
            names.push(name.to_owned());
        }
        for name in names {
            t.steps.remove((s.as_slice(), name.as_str()))?;
        }
        let mut seqs = Vec::new();
        for entry in t
            .history
            .range((s.as_slice(), 0)..=(s.as_slice(), u32::MAX))?
        {
            seqs.push(entry?.0.value().1);
        }
        for seq in seqs {
            t.history.remove((s.as_slice(), seq))?;
        }
    }
    if more {
        return Ok(out);
    }
    // No record left: steps or log entries without a record (none this
    // build writes) go too, so the range is empty when the row goes.
    let lo_key = lo.to_vec();
    let stray_steps: Vec<(Vec<u8>, String)> = {
        let mut v = Vec::new();
        for entry in t.steps.range((lo_key.as_slice(), "")..)? {
            let (k, _) = entry?;
            let (at, name) = k.value();
            if !in_range(at, hi.as_ref()) || v.len() >= limit {
                break;
            }
            v.push((at.to_vec(), name.to_owned()));
        }
        v
    };
    let stray_log: Vec<(Vec<u8>, u32)> = {
        let mut v = Vec::new();
        for entry in t.history.range((lo_key.as_slice(), 0)..)? {
            let (k, _) = entry?;
            let (at, seq) = k.value();
            if !in_range(at, hi.as_ref()) || v.len() >= limit {
                break;
            }
            v.push((at.to_vec(), seq));
        }
        v
    };
    let strays = stray_steps.len() + stray_log.len();
    for (s, name) in stray_steps {
        t.steps.remove((s.as_slice(), name.as_str()))?;
    }
    for (s, seq) in stray_log {
        t.history.remove((s.as_slice(), seq))?;
    }
    out.done = strays == 0;
    Ok(out)
}

/// What a drop step deleted.
#[derive(Debug, Default)]
pub(crate) struct Dropped {
    /// Records deleted.
    pub(crate) records: u64,
    /// Whether the partition's ranges are empty: its row can go.
    pub(crate) done: bool,
    /// The limit a step that does the same passes: the step's own, or the
    /// records it deleted when its time ran out first.
    pub(crate) limit: u64,
}

fn as_ref(b: &Bound<Vec<u8>>) -> Bound<&[u8]> {
    match b {
        Bound::Included(v) => Bound::Included(v.as_slice()),
        Bound::Excluded(v) => Bound::Excluded(v.as_slice()),
        Bound::Unbounded => Bound::Unbounded,
    }
}

/// Whether slot key `at` is below `hi` (the end of a partition's range).
fn in_range(at: &[u8], hi: Option<&[u8; slot::PREFIX_BYTES]>) -> bool {
    hi.is_none_or(|h| at < &h[..])
}

/// Time after a span ends before its partitions merge: longer than the
/// default seal interval (ten minutes), so that the partition hot when
/// the span ended is sealed by then (sealed by time before the first group
/// or sweep after its interval) and merges with the rest of its span.
pub(crate) const MERGE_GRACE_MS: u64 = MERGE_SPAN_MS / 4;

/// The sealed partitions to merge next at `now_ms` with records kept
/// `ttl_ms`, ascending; empty: none. Of the partitions that took claims
/// (numbers below [`BUILT_PARTITIONS`]) and are sealed, those whose first
/// claim fell in the oldest span of [`MERGE_SPAN_MS`] that ended
/// [`MERGE_GRACE_MS`] ago or more. A partition whose oldest records
/// expire within a span of now is left to expiry (moving it would be
/// wasted work), and so is every partition of a store whose TTL is shorter than
/// two spans. One merge at a time: none while one is under way.
pub(crate) fn due_sources(
    rows: impl IntoIterator<Item = (u64, PartitionRow)>,
    now_ms: u64,
    ttl_ms: u64,
) -> Vec<u64> {
    if ttl_ms < 2 * MERGE_SPAN_MS {
        return Vec::new();
    }
    let mut sealed: Vec<(u64, PartitionRow)> = Vec::new();
    for (p, row) in rows {
        match row.state {
            PartitionState::Merging | PartitionState::MergeSource => return Vec::new(),
            PartitionState::Sealed if p < BUILT_PARTITIONS => sealed.push((p, row)),
            PartitionState::Hot | PartitionState::Sealed | PartitionState::Dropping => {}
        }
    }
    // By the first claim: a seal moves `last_claim_ms` up to the seal's
    // time, while no record of the partition was claimed before the first.
    let worth = |row: &PartitionRow| {
        row.first_claim_ms.saturating_add(ttl_ms) > now_ms.saturating_add(MERGE_SPAN_MS)
    };
    let ended = |span: u64| {
        span.saturating_add(1)
            .saturating_mul(MERGE_SPAN_MS)
            .saturating_add(MERGE_GRACE_MS)
            <= now_ms
    };
    let span = sealed
        .iter()
        .filter(|(_, row)| worth(row))
        .map(|(_, row)| row.first_claim_ms / MERGE_SPAN_MS)
        .filter(|s| ended(*s))
        .min();
    let Some(span) = span else {
        return Vec::new();
    };
    let mut out: Vec<u64> = sealed
        .iter()
        .filter(|(_, row)| worth(row) && row.first_claim_ms / MERGE_SPAN_MS == span)
        .map(|(p, _)| *p)
        .collect();
    out.sort_unstable();
    out
}

/// The row the merged partition of `sources` starts with: merging, no
/// key counted yet, the sources' claim span and latest expiry.
pub(crate) fn merging_row(sources: &[PartitionRow]) -> PartitionRow {
    let mut row = PartitionRow::hot(0, 0);
    row.state = PartitionState::Merging;
    row.keys = 0;
    row.first_claim_ms = sources.iter().map(|r| r.first_claim_ms).min().unwrap_or(0);
    row.last_claim_ms = sources
        .iter()
        .map(|r| r.last_claim_ms)
        .max()
        .unwrap_or(0)
        .max(row.first_claim_ms);
    row.max_expires_at_ms = sources
        .iter()
        .map(|r| r.max_expires_at_ms)
        .max()
        .unwrap_or(0);
    row
}

/// The number of the next partition the engine builds, above every number
/// `known` holds at or above [`BUILT_PARTITIONS`], so that its keys land
/// past the last key of the records table; `None`: none is left.
pub(crate) fn next_built(known: impl IntoIterator<Item = u64>) -> Option<u64> {
    match known.into_iter().filter(|p| *p >= BUILT_PARTITIONS).max() {
        Some(top) => top.checked_add(1),
        None => Some(BUILT_PARTITIONS),
    }
}

#[cfg(test)]
#[path = "merge_tests.rs"]
mod tests;
