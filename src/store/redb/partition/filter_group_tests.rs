//! Grouped filters answer exactly as the filters they were copied from,
//! groups stay within their width, and dropped partitions leave them.

use std::sync::Arc;

use super::super::filter::{FilterHasher, FilterProblem, GroupAnswers};
use super::*;

const SEED: [u8; 16] = *b"seed-of-the-file";

fn key(partition: u64, i: u64) -> Vec<u8> {
    format!("\x04shop/p{partition}-request-{i}").into_bytes()
}

/// A filter of `partition` sized for `capacity` keys, holding `keys` of
/// them, and a checksum naming it.
fn filter(
    hasher: &FilterHasher,
    partition: u64,
    capacity: u64,
    keys: u64,
) -> Result<(FilterChecksum, Arc<PartitionFilter>), Box<dyn std::error::Error>> {
    let mut f = PartitionFilter::with_capacity(partition, capacity, hasher)?;
    for i in 0..keys {
        f.insert(&key(partition, i))?;
    }
    let (_, sum) = f.encode();
    Ok((sum, Arc::new(f)))
}

type TestResult = Result<(), Box<dyn std::error::Error>>;

#[test]
fn a_grouped_filter_answers_and_encodes_as_its_own_copy() -> TestResult {
    let hasher = FilterHasher::new(&SEED);
    let mut kept = Kept::default();
    let mut originals = Vec::new();
    for p in 1..=70 {
        let (sum, f) = filter(&hasher, p, 500, 400)?;
        kept.keep(p, sum, f.clone());
        originals.push((p, sum, f));
    }
    for (p, sum, original) in &originals {
        let grouped = kept.get(*p, sum).ok_or("kept")?;
        assert!(grouped.is_grouped(), "partition {p}");
        assert_eq!(grouped.encode(), original.encode(), "partition {p}");
        assert_eq!(grouped.len(), original.len());
        // Its own keys, other partitions' keys, and keys of none.
        for other in [*p, p + 1, 1_000] {
            for i in 0..600 {
                let h = hasher.hash(&key(other, i));
                assert_eq!(
                    grouped.may_contain_hash(&h),
                    original.may_contain_hash(&h),
                    "partition {p}, key {other}/{i}"
                );
            }
        }
        for i in 0..400 {
            assert!(grouped.may_contain(&key(*p, i)), "an inserted key, {p}/{i}");
        }
    }
    Ok(())
}

#[test]
fn groups_hold_at_most_their_width_and_one_block_count() -> TestResult {
    let hasher = FilterHasher::new(&SEED);
    let mut kept = Kept::default();
    for p in 1..=130 {
        let (sum, f) = filter(&hasher, p, 500, 10)?;
        kept.keep(p, sum, f);
    }
    // Another block count, between them: a group of its own.
    let (odd_sum, odd) = filter(&hasher, 1_000, 5_000, 10)?;
    kept.keep(1_000, odd_sum, odd.clone());
    let (sum, f) = filter(&hasher, 131, 500, 10)?;
    kept.keep(131, sum, f);
    let mut widths = std::collections::BTreeMap::new();
    for (p, (_, f)) in &kept.by_partition {
        let Some((group, slot)) = f.group_slot() else {
            return Err(format!("partition {p} is not grouped").into());
        };
        assert!(slot < group.width());
        assert_eq!(group.blocks(), f.block_count());
        assert_eq!(
            group.is_sliced(),
            group.width() == GROUP_WIDTH,
            "full groups are sliced"
        );
        widths.insert(
            Arc::as_ptr(group).cast::<()>() as usize,
            (group.width(), group.blocks()),
        );
    }
    let mut seen: Vec<(usize, usize)> = widths.into_values().collect();
    seen.sort_unstable();
    let small = blocks_of(500);
    let large = blocks_of(5_000);
    assert_eq!(
        seen,
        [
            (1, large),
            (3, small),
            (GROUP_WIDTH, small),
            (GROUP_WIDTH, small)
        ],
        "131 filters of one block count in 64 + 64 + 3, the other alone"
    );
    Ok(())
}

fn blocks_of(capacity: u64) -> usize {
    usize::try_from(super::super::filter::blocks_for(capacity)).unwrap_or(usize::MAX)
}

#[test]
fn a_large_filter_stays_on_its_own_and_a_grouped_one_takes_no_insert() -> TestResult {
    let hasher = FilterHasher::new(&SEED);
    let mut kept = Kept::default();
    let (sum, big) = filter(&hasher, 1 << 63, 400_000, 10)?;
    let got = kept.keep(1 << 63, sum, big.clone());
    assert!(!got.is_grouped(), "past MAX_GROUPED_BLOCKS");
    assert!(Arc::ptr_eq(&got, &big));
    let (sum, f) = filter(&hasher, 1, 500, 10)?;
    let mut grouped = (*kept.keep(1, sum, f)).clone();
    assert!(grouped.is_grouped());
    let e = grouped
        .insert(b"one more")
        .err()
        .ok_or("an insert into a grouped filter")?;
    assert_eq!(e.problem, FilterProblem::Grouped);
    assert_eq!(e.partition, 1);
    Ok(())
}

#[test]
fn keeping_a_partition_again_does_not_take_a_second_slot() -> TestResult {
    let hasher = FilterHasher::new(&SEED);
    let mut kept = Kept::default();
    let (sum1, f1) = filter(&hasher, 1, 500, 10)?;
    let first = kept.keep(1, sum1, f1.clone());
    let again = kept.keep(1, sum1, f1);
    assert!(Arc::ptr_eq(&first, &again));
    // Rebuilt under another checksum: the old slot is left behind.
    let (sum2, f2) = filter(&hasher, 2, 500, 10)?;
    kept.keep(2, sum2, f2);
    let (resum, refilter) = filter(&hasher, 1, 500, 20)?;
    kept.keep(1, resum, refilter.clone());
    assert!(kept.get(1, &sum1).is_none());
    let now = kept.get(1, &resum).ok_or("kept")?;
    assert_eq!(now.encode(), refilter.encode());
    let Some((group, _)) = now.group_slot() else {
        return Err("grouped".into());
    };
    assert_eq!(group.width(), 2, "partition 2 and the rebuilt 1");
    Ok(())
}

#[test]
fn dropped_partitions_leave_the_tail_and_free_their_group() -> TestResult {
    let hasher = FilterHasher::new(&SEED);
    let mut kept = Kept::default();
    for p in 1..=5 {
        let (sum, f) = filter(&hasher, p, 500, 10)?;
        kept.keep(p, sum, f);
    }
    let tail = Arc::downgrade(kept.tails.values().next().ok_or("a tail")?);
    for p in 1..=3 {
        kept.forget(p);
    }
    let (sum, f) = filter(&hasher, 6, 500, 10)?;
    let six = kept.keep(6, sum, f);
    let Some((group, slot)) = six.group_slot() else {
        return Err("grouped".into());
    };
    assert_eq!((group.width(), slot), (3, 2), "4, 5 and 6");
    drop(six);
    assert!(tail.upgrade().is_none(), "the old tail is freed");
    for p in 4..=6 {
        kept.forget(p);
    }
    assert!(kept.tails.is_empty() && kept.by_partition.is_empty());
    Ok(())
}

#[test]
fn one_lookup_s_answers_through_its_groups_are_each_filter_s_own() -> TestResult {
    let hasher = FilterHasher::new(&SEED);
    let mut kept = Kept::default();
    let mut originals = Vec::new();
    // 150 filters: groups of 64, 64 and 22, probed newest first as a
    // lookup does, with filters of another block count between them.
    for p in 1..=150 {
        let capacity = if p % 50 == 0 { 900 } else { 500 };
        let (sum, f) = filter(&hasher, p, capacity, 450)?;
        kept.keep(p, sum, f.clone());
        originals.push((p, sum, f));
    }
    let probed: Vec<_> = originals
        .iter()
        .rev()
        .map(|(p, sum, f)| Ok((f.clone(), kept.get(*p, sum).ok_or("kept")?)))
        .collect::<Result<_, &str>>()?;
    let sliced = probed
        .iter()
        .filter(|(_, g)| g.group_slot().is_some_and(|(group, _)| group.is_sliced()))
        .count();
    assert_eq!(sliced, 128, "two full groups of 64, bit-sliced");
    let mut maybes = 0;
    for k in 0..3_000u64 {
        // Keys of some partitions, and of none.
        let key = key(1 + k % 200, k % 500);
        let h = hasher.hash(&key);
        let mut seen = GroupAnswers::default();
        for (original, grouped) in &probed {
            let want = original.may_contain_hash(&h);
            assert_eq!(grouped.may_contain_seen(&h, &mut seen), want, "key {k}");
            assert_eq!(grouped.may_contain_hash(&h), want, "key {k}, alone");
            maybes += usize::from(want);
        }
    }
    // 2,100 of the keys are in a partition (a filter has no false "absent").
    assert!(
        maybes >= 2_100,
        "the keys that are in a partition say maybe: {maybes}"
    );
    // A hash of another seed: "maybe" from every member, never "absent".
    let other = FilterHasher::new(b"another-seed-16b").hash(b"\x04shop/x");
    let mut seen = GroupAnswers::default();
    for (_, grouped) in &probed {
        assert!(grouped.may_contain_seen(&other, &mut seen));
    }
    Ok(())
}

#[test]
fn transpose64_moves_bit_c_of_row_r_to_bit_r_of_row_c() {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..20 {
        let mut a = [0u64; 64];
        for row in &mut a {
            // xorshift64: rows of mixed bits.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *row = x;
        }
        let before = a;
        super::transpose64(&mut a);
        for (r, row) in a.iter().enumerate() {
            for (c, was) in before.iter().enumerate() {
                assert_eq!((row >> c) & 1, (was >> r) & 1, "row {r}, column {c}");
            }
        }
    }
}

#[test]
fn an_open_groups_its_filters_at_once_after_the_tail() -> TestResult {
    let hasher = FilterHasher::new(&SEED);
    let mut kept = Kept::default();
    let mut originals = Vec::new();
    // A tail of 3 from before, then 130 kept while deferred.
    for p in 1..=133 {
        if p == 4 {
            kept.defer();
        }
        let (sum, f) = filter(&hasher, p, 500, 300)?;
        let got = kept.keep(p, sum, f.clone());
        assert_eq!(got.is_grouped(), p < 4, "partition {p}");
        originals.push((p, sum, f));
    }
    kept.group_deferred();
    let mut widths = std::collections::BTreeMap::new();
    for (p, sum, original) in &originals {
        let grouped = kept.get(*p, sum).ok_or("kept")?;
        let (group, slot) = grouped.group_slot().ok_or("grouped")?;
        widths.insert(
            Arc::as_ptr(group).cast::<()>() as usize,
            (group.width(), group.is_sliced()),
        );
        assert_eq!(
            grouped.encode(),
            original.encode(),
            "partition {p}, slot {slot}"
        );
        for i in 0..400 {
            let h = hasher.hash(&key(*p, i));
            assert_eq!(grouped.may_contain_hash(&h), original.may_contain_hash(&h));
        }
    }
    let mut seen: Vec<_> = widths.into_values().collect();
    seen.sort_unstable();
    assert_eq!(
        seen,
        [(5, false), (64, true), (64, true)],
        "3 + 130 = 64 + 64 + 5"
    );
    // Seals after the open group one by one again.
    let (sum, f) = filter(&hasher, 134, 500, 300)?;
    let got = kept.keep(134, sum, f);
    assert_eq!(got.group_slot().map(|(g, s)| (g.width(), s)), Some((6, 5)));
    Ok(())
}
