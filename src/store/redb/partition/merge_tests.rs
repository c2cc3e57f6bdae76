//! The merge's building blocks alone: which partitions are due, the
//! merged partition's number, and a copy and a drop step on plain tables,
//! also when their time runs out (a clock that says so after a count of
//! looks, never a sleep).

use redb::backends::InMemoryBackend;
use redb::{Database, ReadableTable, ReadableTableMetadata};

use super::super::catalog::{HISTORY, RECORDS, STEPS};
use super::super::filter::FilterChecksum;
use super::super::row::{PartitionRow, PartitionState};
use super::super::slot::{slot_key, BUILT_PARTITIONS};
use super::{
    copy_step, drop_step, due_sources, merging_row, next_built, MergeTables, COPY_CHUNK,
    MERGE_GRACE_MS, MERGE_SPAN_MS, MIN_STEP_RECORDS,
};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Runs `f` on the three tables a merge step writes, in `txn`.
fn with_tables<T>(
    txn: &redb::WriteTransaction,
    f: impl FnOnce(&mut MergeTables<'_, '_>) -> R<T>,
) -> R<T> {
    let mut records = txn.open_table(RECORDS)?;
    let mut steps = txn.open_table(STEPS)?;
    let mut history = txn.open_table(HISTORY)?;
    f(&mut MergeTables {
        records: &mut records,
        steps: &mut steps,
        history: &mut history,
    })
}

const DAY: u64 = 86_400_000;
/// The start of a span.
const H0: u64 = 500_000 * MERGE_SPAN_MS;

fn sealed(first: u64, last: u64) -> PartitionRow {
    let mut row = PartitionRow::hot(first, first + DAY);
    row.last_claim_ms = last;
    row.state = PartitionState::Sealed;
    row.filter_checksum = Some(FilterChecksum([1; 32]));
    row
}

fn hot(first: u64) -> PartitionRow {
    PartitionRow::hot(first, first + DAY)
}

#[test]
fn the_oldest_closed_span_is_due_and_nothing_else() {
    let rows = vec![
        (1, sealed(H0 + 1_000, H0 + 600_000)),
        (2, sealed(H0 + 600_000, H0 + 1_200_000)),
        (
            3,
            sealed(H0 + MERGE_SPAN_MS + 5, H0 + MERGE_SPAN_MS + 600_000),
        ),
        (4, hot(H0 + 2 * MERGE_SPAN_MS + 5)),
    ];
    // The first span has not ended, or ended within the grace: nothing.
    assert!(due_sources(rows.clone(), H0 + MERGE_SPAN_MS - 1, DAY).is_empty());
    let ended = H0 + MERGE_SPAN_MS + MERGE_GRACE_MS;
    assert!(due_sources(rows.clone(), ended - 1, DAY).is_empty());
    // Ended: its two partitions, not the next span's.
    assert_eq!(due_sources(rows.clone(), ended, DAY), [1, 2]);
    assert_eq!(
        due_sources(rows.clone(), H0 + 2 * MERGE_SPAN_MS + 10, DAY),
        [1, 2]
    );
    // A hot partition holds nothing back (it merges once sealed).
    let mut held = rows.clone();
    held[3].1 = hot(H0 + 10);
    assert_eq!(due_sources(held, ended, DAY), [1, 2]);
    // A merge under way: nothing more.
    let mut busy = rows.clone();
    busy.push((BUILT_PARTITIONS, merging_row(&[rows[0].1])));
    assert!(due_sources(busy, H0 + 3 * MERGE_SPAN_MS, DAY).is_empty());
    // Built partitions are never merged again.
    let built = vec![(BUILT_PARTITIONS, sealed(H0, H0 + 10)), (9, hot(H0 + DAY))];
    assert!(due_sources(built, H0 + 3 * MERGE_SPAN_MS, DAY).is_empty());
}

#[test]
fn records_about_to_expire_and_short_ttls_are_left_to_expiry() {
    let rows = vec![
        (1, sealed(H0 + 1_000, H0 + 600_000)),
        (2, hot(H0 + 5 * MERGE_SPAN_MS)),
    ];
    let now = H0 + 2 * MERGE_SPAN_MS;
    assert_eq!(due_sources(rows.clone(), now, DAY), [1]);
    // Its records expire within a span of now: not worth moving.
    let ttl = 3 * MERGE_SPAN_MS;
    assert!(due_sources(rows.clone(), now + ttl - 2 * MERGE_SPAN_MS, ttl).is_empty());
    // A TTL shorter than two spans: never.
    assert!(due_sources(rows, now, 2 * MERGE_SPAN_MS - 1).is_empty());
}

#[test]
fn the_merged_partition_takes_the_next_built_number() {
    assert_eq!(next_built([1, 2, 3]), Some(BUILT_PARTITIONS));
    assert_eq!(
        next_built([1, BUILT_PARTITIONS, BUILT_PARTITIONS + 4, 7]),
        Some(BUILT_PARTITIONS + 5)
    );
    assert_eq!(next_built([u64::MAX]), None);
    let row = merging_row(&[sealed(10, 20), sealed(5, 30)]);
    assert_eq!(
        (row.state, row.keys, row.first_claim_ms, row.last_claim_ms),
        (PartitionState::Merging, 0, 5, 30)
    );
    assert_eq!(row.filter_checksum, None);
    assert_eq!(PartitionRow::decode(3, &row.encode(3)).ok(), Some(row));
}

#[test]
fn a_copy_step_merges_in_key_order_and_a_drop_step_empties_a_partition() -> R<()> {
    let db = Database::builder().create_with_backend(InMemoryBackend::new())?;
    let txn = db.begin_write()?;
    {
        let mut records = txn.open_table(RECORDS)?;
        let mut steps = txn.open_table(STEPS)?;
        let mut history = txn.open_table(HISTORY)?;
        // Partition 1: b, d; partition 2: a, c, d (a duplicate: damage).
        for (p, k) in [(1u64, "b"), (1, "d"), (2, "a"), (2, "c"), (2, "d")] {
            let v = format!("{k}@{p}");
            records.insert(slot_key(p, k.as_bytes()).as_slice(), v.as_bytes())?;
        }
        steps.insert((slot_key(1, b"b").as_slice(), "charge"), b"s".as_slice())?;
        history.insert((slot_key(1, b"b").as_slice(), 0), b"h".as_slice())?;
        let mut t = MergeTables {
            records: &mut records,
            steps: &mut steps,
            history: &mut history,
        };
        let m = BUILT_PARTITIONS;
        let first = copy_step(&mut t, m, &[1, 2], None, 2, &|| false)?;
        assert_eq!(first.keys, [b"a".to_vec(), b"b".to_vec()]);
        assert!(!first.done);
        let second = copy_step(&mut t, m, &[1, 2], Some(b"b"), 2, &|| false)?;
        assert_eq!(second.keys, [b"c".to_vec(), b"d".to_vec()]);
        assert!(second.done);
        let copied: Vec<(Vec<u8>, Vec<u8>)> = t
            .records
            .range(slot_key(m, b"").as_slice()..)?
            .map(|e| e.map(|(k, v)| (k.value()[8..].to_vec(), v.value().to_vec())))
            .collect::<Result<_, _>>()?;
        assert_eq!(
            copied,
            [
                (b"a".to_vec(), b"a@2".to_vec()),
                (b"b".to_vec(), b"b@1".to_vec()),
                (b"c".to_vec(), b"c@2".to_vec()),
                // The newest source's copy of a duplicate.
                (b"d".to_vec(), b"d@2".to_vec()),
            ]
        );
        assert!(t
            .steps
            .get((slot_key(m, b"b").as_slice(), "charge"))?
            .is_some());
        assert!(t.history.get((slot_key(m, b"b").as_slice(), 0))?.is_some());
        // Nothing after the last key.
        let none = copy_step(&mut t, m, &[1, 2], Some(b"d"), 2, &|| false)?;
        assert!(none.keys.is_empty() && none.done);

        let step = drop_step(&mut t, 1, 1, &|| false)?;
        assert_eq!((step.records, step.done), (1, false));
        assert!(t
            .steps
            .get((slot_key(1, b"b").as_slice(), "charge"))?
            .is_none());
        assert!(t.history.get((slot_key(1, b"b").as_slice(), 0))?.is_none());
        let step = drop_step(&mut t, 1, 1, &|| false)?;
        assert_eq!((step.records, step.done), (1, true));
        let step = drop_step(&mut t, 1, 1, &|| false)?;
        assert_eq!((step.records, step.done), (0, true));
        // Partition 2 and the merged one are untouched.
        assert_eq!(t.records.len()?, 3 + 4);
    }
    txn.commit()?;
    Ok(())
}

/// The records of partition `p` (record key, value), in key order.
fn partition_records(
    records: &redb::Table<'_, &'static [u8], &'static [u8]>,
    p: u64,
) -> R<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut out = Vec::new();
    for entry in records.range(slot_key(p, b"").as_slice()..slot_key(p + 1, b"").as_slice())? {
        let (k, v) = entry?;
        out.push((k.value()[8..].to_vec(), v.value().to_vec()));
    }
    Ok(out)
}

/// A step's time as a count of looks: spent after `n` (`u32::MAX`: never).
fn spent_after(n: u32) -> impl Fn() -> bool {
    let looks = std::cell::Cell::new(0u32);
    move || {
        looks.set(looks.get().saturating_add(1));
        looks.get() > n
    }
}

/// Guards against a step bounded in time starving the merge (a step that
/// stops before its first record copies nothing, forever) and against a
/// cut step that a replay cannot repeat: a step whose time is spent at
/// once still copies a chunk, or deletes a record; the merge ends in a
/// bounded count of such steps; and a replay with the count the step did
/// (its frame's) does the same to the same state.
#[test]
fn steps_out_of_time_still_finish_the_merge_and_replay_alike() -> R<()> {
    let n = 3 * COPY_CHUNK + 5;
    let build = |txn: &redb::WriteTransaction| -> R<()> {
        let mut records = txn.open_table(RECORDS)?;
        let mut steps = txn.open_table(STEPS)?;
        let mut history = txn.open_table(HISTORY)?;
        for i in 0..n {
            let p = 1 + (i % 3) as u64;
            let k = format!("k{i:04}");
            records.insert(slot_key(p, k.as_bytes()).as_slice(), k.as_bytes())?;
            steps.insert((slot_key(p, k.as_bytes()).as_slice(), "s"), b"s".as_slice())?;
            history.insert((slot_key(p, k.as_bytes()).as_slice(), 0), b"h".as_slice())?;
        }
        Ok(())
    };
    let m = BUILT_PARTITIONS;
    // Stepped with no time at all: each step copies one chunk.
    let db = Database::builder().create_with_backend(InMemoryBackend::new())?;
    let txn = db.begin_write()?;
    build(&txn)?;
    let mut counts = Vec::new();
    with_tables(&txn, |t| {
        let mut after: Option<Vec<u8>> = None;
        loop {
            let step = copy_step(t, m, &[1, 2, 3], after.as_deref(), 512, &|| true)?;
            assert!(
                !step.keys.is_empty() || step.done,
                "a step copies a record while any is left"
            );
            assert!(step.keys.len() <= COPY_CHUNK);
            counts.push(step.keys.len());
            after = step.keys.last().cloned().or(after);
            if step.done {
                break;
            }
            assert!(counts.len() <= n, "the merge does not end");
        }
        assert_eq!(counts.iter().sum::<usize>(), n);
        assert_eq!(counts.len(), n.div_ceil(COPY_CHUNK));
        // Dropped with no time: the floor of records a step.
        let mut drops = Vec::new();
        loop {
            let step = drop_step(t, 1, 512, &|| true)?;
            drops.push((step.records, step.limit));
            if step.done {
                break;
            }
            assert!(drops.len() <= n, "the drop does not end");
        }
        assert!(drops[..drops.len() - 1]
            .iter()
            .all(|&(records, limit)| records == MIN_STEP_RECORDS as u64
                && limit == MIN_STEP_RECORDS as u64));
        assert!(partition_records(t.records, 1)?.is_empty());
        Ok(())
    })?;
    let timed = partition_records(&txn.open_table(RECORDS)?, m)?;
    txn.abort()?;

    // The same merge untimed, one step per count the timed one did (as a
    // replay runs the frames): the same copy.
    let db = Database::builder().create_with_backend(InMemoryBackend::new())?;
    let txn = db.begin_write()?;
    build(&txn)?;
    with_tables(&txn, |t| {
        let mut after: Option<Vec<u8>> = None;
        for count in &counts {
            let step = copy_step(t, m, &[1, 2, 3], after.as_deref(), *count, &|| false)?;
            assert_eq!(step.keys.len(), *count);
            after = step.keys.last().cloned().or(after);
        }
        assert_eq!(partition_records(t.records, m)?, timed);
        assert_eq!(t.steps.len()?, 2 * n as u64);
        assert_eq!(t.history.len()?, 2 * n as u64);
        Ok(())
    })?;
    txn.abort()?;
    // A drop step cut after the floor and 2 more records of a 40-record
    // limit says limit 18, and a step with that limit on the same state
    // (its replay) does the same; so does a cut that leaves the
    // partition's last record. Time is first asked at the floor.
    let cut = MIN_STEP_RECORDS + 2;
    for (records, limit, looks) in [(40, 40, 2), (cut + 1, 40, 2)] {
        let mut after = Vec::new();
        for spent in [&spent_after(looks) as &dyn Fn() -> bool, &|| false] {
            let db = Database::builder().create_with_backend(InMemoryBackend::new())?;
            let txn = db.begin_write()?;
            let mut records_t = txn.open_table(RECORDS)?;
            let mut steps = txn.open_table(STEPS)?;
            let mut history = txn.open_table(HISTORY)?;
            for i in 0..records {
                let k = format!("k{i:04}");
                records_t.insert(slot_key(1, k.as_bytes()).as_slice(), k.as_bytes())?;
                steps.insert((slot_key(1, k.as_bytes()).as_slice(), "s"), b"s".as_slice())?;
            }
            let mut t = MergeTables {
                records: &mut records_t,
                steps: &mut steps,
                history: &mut history,
            };
            let step_limit = after.first().map_or(limit, |&(_, l, _)| l);
            let step = drop_step(&mut t, 1, step_limit, spent)?;
            after.push((
                partition_records(t.records, 1)?,
                usize::try_from(step.limit)?,
                (step.records, step.done, t.steps.len()?),
            ));
        }
        assert_eq!(after[0].1, cut, "the cut step's limit");
        assert_eq!(after[0].2, (cut as u64, false, (records - cut) as u64));
        assert_eq!(after[0], after[1], "the replay does the same");
    }
    Ok(())
}
