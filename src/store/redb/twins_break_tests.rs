//! Break-it tests of a merge's twins (`twins.rs`): the repair a drop step
//! makes of a lost or damaged live copy from its dropping source, what
//! the journal replays of it, and what it leaves behind.

use redb::ReadableDatabase;

use crate::key::IdempotencyKey;
use crate::store::ops::Txn;

use super::journal::{Change, Frame};
use super::partition::catalog::{self, SealRule};
use super::partition::merge::MERGE_SPAN_MS;
use super::partition::slot::{self, BUILT_PARTITIONS};
use super::test_writer::{dump_history, dump_steps, rows, Writer, R};

const RULE: SealRule = SealRule {
    interval_ms: 60_000,
    max_keys: 8,
};
const LEASE_MS: u64 = 10 * MERGE_SPAN_MS;

/// A key's record, steps and log span as the writer answers them.
fn view(w: &mut Writer, k: &IdempotencyKey) -> R<String> {
    w.group(|t| {
        let rec = t.raw(k.record_key())?;
        let steps = t.load_steps(k)?;
        let span = t.history_span(k)?;
        Ok(format!("{rec:?} {steps:?} {span:?}"))
    })
}

/// Applies `changes` to the writer's file outside any group, and keeps
/// them as a frame: damage the journal holds too, so a replay starts from
/// the same damaged state.
fn damage(w: &mut Writer, changes: Vec<Change>) -> R<()> {
    let txn = w.db.begin_write()?;
    {
        let mut records = txn.open_table(catalog::RECORDS)?;
        for c in &changes {
            match c {
                Change::DelRecord { key } => {
                    records.remove(key.as_slice())?;
                }
                Change::PutRecord { key, value } => {
                    records.insert(key.as_slice(), value.as_slice())?;
                }
                other => return Err(format!("not a record change: {other:?}").into()),
            }
        }
    }
    txn.commit()?;
    w.frames.push(Frame {
        next_token: w.seq.token,
        next_outbox: w.seq.outbox,
        changes,
    });
    Ok(())
}

/// The live (merged) slot key of `k` after the switch.
fn live_slot(w: &mut Writer, k: &IdempotencyKey) -> R<Vec<u8>> {
    let rkey = k.record_key().to_vec();
    let live = w
        .group(|t| Ok(t.locate(&rkey)?))?
        .ok_or("the merged partition holds the key")?;
    assert!(
        live >= BUILT_PARTITIONS,
        "live in a merged partition: {live}"
    );
    Ok(slot::slot_key(live, &rkey))
}

/// A live record lost after the switch (its steps and log still beside
/// it) is written back from its twin by the drop step: the key answers
/// as before with its steps and log, verify finds the file sound, and the
/// journal's frames replay to the same tables.
#[test]
fn a_rescued_record_keeps_its_steps_and_log_and_replays() -> R<()> {
    let mut w = Writer::new(RULE)?;
    let keys = w.completed(40, LEASE_MS, &[9])?;
    w.merge_to_switch()?;
    let k = keys[9].clone();
    let before = view(&mut w, &k)?;
    assert!(before.contains("charge"), "{before}");
    let live = live_slot(&mut w, &k)?;
    damage(&mut w, vec![Change::DelRecord { key: live }])?;
    while w.merge_step(7)?.more {}
    let after = view(&mut w, &k)?;
    assert_eq!(after, before, "the rescue kept record, steps and log");
    let (found, _) = super::verify::verify(&w.db)?;
    assert_eq!(found, [], "sound once the drop is done");
    w.assert_replays("the rescue")
}

/// The rescue of a lost live record writes it back as a new key of the
/// hot partition, and its steps and log there too; the lost record's own
/// steps and log, left beside the slot it was lost from, must not stay
/// behind as entries without a record (nothing ever deletes them: the
/// merged partition drops when its records are gone, its steps are not
/// looked at, and a later merge may build a partition of that number
/// again, handing them to the key).
#[test]
fn a_lost_record_written_back_leaves_no_record_less_steps() -> R<()> {
    let mut w = Writer::new(RULE)?;
    let keys = w.completed(40, LEASE_MS, &[9])?;
    w.merge_to_switch()?;
    let k = keys[9].clone();
    let live = live_slot(&mut w, &k)?;
    damage(&mut w, vec![Change::DelRecord { key: live }])?;
    while w.merge_step(7)?.more {}
    let txn = w.db.begin_read()?;
    let records = txn.open_table(catalog::RECORDS)?;
    let mut orphans = Vec::new();
    for (at, name, _) in dump_steps(&w.db)? {
        if records.get(at.as_slice())?.is_none() {
            orphans.push(format!("step {name} at {}", crate::store::record::hex(&at)));
        }
    }
    for (at, seq, _) in dump_history(&w.db)? {
        if records.get(at.as_slice())?.is_none() {
            orphans.push(format!("log {seq} at {}", crate::store::record::hex(&at)));
        }
    }
    assert!(
        orphans.is_empty(),
        "steps and log entries left without a record after the rescue: {orphans:?}"
    );
    Ok(())
}

/// A key two merge sources hold (damage: the merge copies the newest
/// one, as a lookup reads it): the older source's record, with a step the
/// newest lacks, is no twin of the live copy. Its drop step must not add
/// that stale step to the live record, which the key never showed.
#[test]
fn an_older_duplicate_does_not_add_its_steps_to_the_live_record() -> R<()> {
    let mut w = Writer::new(RULE)?;
    // Key 2 is in the first partition, with a step.
    let keys = w.completed(40, LEASE_MS, &[2])?;
    let k = keys[2].clone();
    let rkey = k.record_key().to_vec();
    let (first, value) = {
        let txn = w.db.begin_read()?;
        let records = txn.open_table(catalog::RECORDS)?;
        let mut found = None;
        for (p, _) in rows(&w.db)? {
            if let Some(v) = records.get(slot::slot_key(p, &rkey).as_slice())? {
                found = Some((p, v.value().to_vec()));
            }
        }
        found.ok_or("key 2's record")?
    };
    let newest = *rows(&w.db)?
        .keys()
        .filter(|p| **p < BUILT_PARTITIONS && **p > first)
        .max()
        .ok_or("a later partition")?;
    // Its record (without the step) in a later partition too.
    {
        let txn = w.db.begin_write()?;
        txn.open_table(catalog::RECORDS)?
            .insert(slot::slot_key(newest, &rkey).as_slice(), value.as_slice())?;
        txn.commit()?;
    }
    let shown = view(&mut w, &k)?;
    eprintln!("shown before the merge: {shown}");
    w.merge_to_switch()?;
    let merged = view(&mut w, &k)?;
    assert_eq!(merged, shown, "the switch shows what the key showed");
    while w.merge_step(7)?.more {}
    let after = view(&mut w, &k)?;
    assert_eq!(
        after, shown,
        "the drop step of the older duplicate's source changed the key's answer"
    );
    Ok(())
}
