//! Tests of `partitioned.rs`: the gap listed per partition, the lookups
//! a gap asks for, and the step from slot keys to record keys.

use super::*;

fn gap(after: Option<(u64, &[u8])>, before: Option<(u64, &[u8])>) -> Gap<Vec<u8>> {
    let slot = |end: Option<(u64, &[u8])>| end.map(|(p, k)| slot::slot_key(p, k));
    Gap {
        after: slot(after),
        before: slot(before),
        reason: "a damaged page".into(),
    }
}

fn ranges(lost: &[Lost]) -> Vec<(Option<String>, Option<String>)> {
    lost.iter()
        .map(|l| match l {
            Lost::Range {
                table: "records",
                after_hex,
                before_hex,
                ..
            } => (after_hex.clone(), before_hex.clone()),
            other => panic!("not a records range: {other:?}"),
        })
        .collect()
}

#[test]
fn a_gap_is_listed_by_record_key_one_range_per_partition() {
    let (a, b) = (hex(b"a"), hex(b"b"));
    let one = lost_range(&gap(Some((4, b"a")), Some((4, b"b"))));
    assert_eq!(ranges(&one), vec![(Some(a.clone()), Some(b.clone()))]);
    assert!(one[0].to_string().contains("in partition 4"), "{}", one[0]);
    let across = lost_range(&gap(Some((2, b"a")), Some((5, b"b"))));
    assert_eq!(
        ranges(&across),
        vec![
            (Some(a.clone()), None),
            (None, None),
            (None, Some(b.clone()))
        ]
    );
    assert!(
        across[1].to_string().contains("from 3 to 4"),
        "{}",
        across[1]
    );
    let next = lost_range(&gap(Some((2, b"a")), Some((3, b"b"))));
    assert_eq!(ranges(&next), vec![(Some(a), None), (None, Some(b))]);
    assert_eq!(ranges(&lost_range(&gap(None, None))), vec![(None, None)]);
}

#[test]
fn seeds_look_for_a_named_key_in_every_partition_the_gap_spans() {
    let named = Named {
        // "a" was met by the walks: not looked for again.
        record_keys: [b"a".to_vec(), b"c".to_vec()].into(),
        slots: [slot::slot_key(9, b"z")].into(),
    };
    // Rows name 1 and 2 only; the walks met 7; 3 to 6 have no row.
    let known: BTreeSet<u64> = [1, 2].into();
    let walked: Entries = [(slot::slot_key(7, b"a"), Vec::new())].into();
    let g = gap(Some((2, b"b")), Some((7, b"a")));
    let got = seeds(&named, &known, Some(&g), &walked);
    let mut want: BTreeSet<Vec<u8>> = (2..=6).map(|p| slot::slot_key(p, b"c")).collect();
    want.insert(slot::slot_key(9, b"z"));
    assert_eq!(got, want);
    // Without a gap, only the frames' slots.
    assert_eq!(seeds(&named, &known, None, &walked), named.slots);
}

fn work(records: Entries, steps: Vec<(Vec<u8>, &str)>) -> Work {
    Work {
        records,
        index: BTreeSet::new(),
        outbox: BTreeMap::new(),
        entities: BTreeMap::new(),
        unreadable: BTreeMap::new(),
        next_token: 0,
        next_outbox: 0,
        stale_entities: Vec::new(),
        steps: steps
            .into_iter()
            .map(|(s, name)| ((s, name.to_owned()), b"step".to_vec()))
            .collect(),
        history: BTreeMap::new(),
    }
}

#[test]
fn the_journal_says_which_copy_of_a_key_in_two_partitions_is_current() {
    let (k, j) = (b"k".to_vec(), b"j".to_vec());
    let records: Entries = [
        (slot::slot_key(3, &k), b"old".to_vec()),
        (slot::slot_key(5, &k), b"new".to_vec()),
    ]
    .into();
    let mut w = work(
        records.clone(),
        vec![
            (slot::slot_key(3, &k), "charge"),
            (slot::slot_key(5, &k), "ship"),
        ],
    );
    let frames = vec![(
        7,
        Frame {
            next_token: 1,
            next_outbox: 1,
            changes: vec![Change::PutRecord {
                key: slot::slot_key(5, &k),
                value: b"new".to_vec(),
            }],
        },
    )];
    // A failed lookup of `k` elsewhere is no second copy; one of `j`,
    // found nowhere, lists it.
    let failed: Reasons = [
        (slot::slot_key(9, &k), "its lookup failed".to_owned()),
        (slot::slot_key(9, &j), "its lookup failed".to_owned()),
    ]
    .into();
    let mut lost = Vec::new();
    unslot(&mut w, &frames, failed, &mut lost);
    assert_eq!(w.records, [(k.clone(), b"new".to_vec())].into());
    assert_eq!(
        w.steps.keys().cloned().collect::<Vec<_>>(),
        vec![(k.clone(), "ship".to_owned())]
    );
    assert!(
        matches!(&lost[..], [Lost::Step { step, reason, .. }]
            if step == "charge" && reason.contains("partition 3") && reason.contains("partition 5")),
        "{lost:?}"
    );
    assert_eq!(w.unreadable.keys().cloned().collect::<Vec<_>>(), vec![j]);
    assert!(w.unreadable.values().all(|r| r.contains("partition 9")));
    // Without the frame, nothing tells the copies apart (neither
    // decodes, no index entry matches): the key is listed, naming both.
    let mut w = work(records, Vec::new());
    unslot(&mut w, &[], Reasons::new(), &mut Vec::new());
    assert!(w.records.is_empty());
    let reason = &w.unreadable[&k];
    assert!(reason.contains("partitions 3 and 5"), "{reason}");
}
