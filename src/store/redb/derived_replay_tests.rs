//! Format 3's derived record changes (`journal/derived.rs`, `delta.rs`):
//! the frames the live path writes replay to exactly the tables it wrote
//! (records, index entries, outbox, rows, filters, steps, log), byte for
//! byte, for claims, completions, failures, steps, lease ends, expiry and
//! the merge; a frame that does not fit the stored records is refused with
//! an error, never applied or a panic; a format-2 file's frames keep the
//! plain changes a released build reads.

use crate::envelope::Envelope;
use crate::policy::ExpiryPolicy;
use crate::store::ops::Ops;
use crate::store::record::StoredResponse;
use crate::store::{Abandon, CompleteRequest, Completion, InDoubtRequest};

use super::journal::{Change, Frame};
use super::partition::catalog::SealRule;
use super::tables::{Sequences, Tables};
use super::test_requests::{claim_in, complete_in, finish_charge};
use super::test_writer::{cfg, key, mem, Writer, R};

/// Partitions of 8 keys, so the history below seals several.
const RULE: SealRule = SealRule {
    interval_ms: 60_000,
    max_keys: 8,
};
const LEASE_MS: u64 = 30_000;

fn e<T: std::fmt::Debug>(err: T) -> String {
    format!("{err:?}")
}

/// How many changes of each derived kind, and of the plain index kinds,
/// `frames` hold: (new, delta, delete, index).
fn kinds(frames: &[Frame]) -> (usize, usize, usize, usize) {
    let mut n = (0, 0, 0, 0);
    for change in frames.iter().flat_map(|f| &f.changes) {
        match change {
            Change::PutNewRecord { .. } => n.0 += 1,
            Change::PutRecordDelta { .. } => n.1 += 1,
            Change::DelIndexedRecord { .. } => n.2 += 1,
            Change::PutIndex { .. } | Change::DelIndex { .. } => n.3 += 1,
            _ => {}
        }
    }
    n
}

/// Claims, completions, a final failure, a release, a claim given up, a
/// lease extended, effect steps, a lease run out, expiry to tombstones and
/// deletes, and a merge: after each group the writer's tables are what its
/// frames replay to.
#[test]
fn every_kind_of_write_replays_to_the_tables_it_wrote() -> R<()> {
    let mut w = Writer::new(RULE)?;
    w.cfg.expiry = ExpiryPolicy::Tombstone {
        keep: std::time::Duration::from_secs(3_600),
    };
    let keys: Vec<_> = (200..212).map(key).collect::<R<_>>()?;
    w.now += 1_000;
    let tokens = w.group(|t| {
        keys.iter()
            .map(|k| claim_in(t, k, LEASE_MS))
            .collect::<R<Vec<u64>>>()
    })?;
    w.assert_replays("claims")?;
    w.now += 1_000;
    w.group(|t| {
        for i in 0..4 {
            complete_in(t, &keys[i], tokens[i])?;
        }
        t.complete(CompleteRequest {
            key: keys[4].clone(),
            token: tokens[4],
            completion: Completion::FinalFailure,
            response: StoredResponse::new(Envelope::new(1, 422, b"no".to_vec()), None),
            messages: vec![crate::message::OutgoingMessage {
                topic: "orders".into(),
                payload: b"failed".to_vec(),
            }],
            finished: Vec::new(),
        })
        .map_err(e)?;
        t.release(&keys[5], tokens[5]).map_err(e)?;
        t.mark_in_doubt(InDoubtRequest {
            key: keys[6].clone(),
            token: tokens[6],
            reason: "gave up".into(),
            by: Abandon::Explicit,
        })
        .map_err(e)?;
        t.extend(&keys[7], tokens[7], 5 * LEASE_MS).map_err(e)?;
        finish_charge(t, &keys[8], tokens[8])?;
        complete_in(t, &keys[8], tokens[8])?;
        Ok(())
    })?;
    w.assert_replays("completions, failures, steps")?;
    // Keys 9..12 (and 7's extended lease later) run out: UNKNOWN.
    w.now += 2 * LEASE_MS;
    let counts = w.group(|t| t.sweep(64).map_err(e).map_err(Into::into))?;
    assert!(counts.moved_to_unknown >= 3, "{counts:?}");
    w.assert_replays("lease ends")?;
    // A day later the completed keys expire into tombstones; an hour
    // after that the tombstones go.
    w.now += cfg().ttl_ms;
    let counts = w.group(|t| t.sweep(64).map_err(e).map_err(Into::into))?;
    assert!(counts.tombstoned >= 5, "{counts:?}");
    w.assert_replays("tombstones")?;
    w.now += 3_600_000 + 1;
    let counts = w.group(|t| t.sweep(64).map_err(e).map_err(Into::into))?;
    assert!(counts.deleted >= 5, "{counts:?}");
    w.assert_replays("expiry")?;
    // The merge of closed partitions, with writes to merged records.
    w.cfg = cfg();
    let merged = w.completed(24, LEASE_MS, &[2, 17])?;
    w.merge_to_switch()?;
    w.assert_replays("merge to its switch")?;
    w.now += 1_000;
    w.group(|t| {
        let token = claim_in(t, &key(100)?, LEASE_MS)?;
        complete_in(t, &key(100)?, token)?;
        Ok(())
    })?;
    for _ in 0..40 {
        if !w.merge_step(7)?.more {
            break;
        }
    }
    w.assert_replays("merge dropped")?;
    w.now += cfg().ttl_ms + 1;
    w.group(|t| t.sweep(64).map_err(e).map_err(Into::into))?;
    w.assert_replays("merged records expired")?;
    assert!(!merged.is_empty());
    let (new, delta, delete, index) = kinds(&w.frames);
    assert!(new > 0 && delta > 0 && delete > 0, "{new} {delta} {delete}");
    assert_eq!(index, 0, "every index change here is derivable");
    Ok(())
}

/// A frame whose derived changes do not fit the records stored (its base
/// missing, another value, one already there, a delete of nothing, a
/// format-2 file) is refused with an error.
#[test]
fn a_derived_change_that_does_not_fit_is_refused() -> R<()> {
    let mut w = Writer::new(RULE)?;
    let k = key(1)?;
    w.now += 1_000;
    let token = w.group(|t| claim_in(t, &k, LEASE_MS))?;
    w.now += 1_000;
    w.group(|t| complete_in(t, &k, token))?;
    w.now += cfg().ttl_ms + 1;
    w.group(|t| t.sweep(64).map_err(e).map_err(Into::into))?;
    w.assert_replays("one key")?;
    let (claim, done, swept) = (
        w.frames[1].clone(),
        w.frames[2].clone(),
        w.frames[3].clone(),
    );
    let replay = |frames: &[&Frame], partitioned: bool| -> R<Result<(), String>> {
        let db = mem()?;
        let txn = db.begin_write()?;
        {
            let mut meta = txn.open_table(super::tables::META)?;
            super::meta::create_format_3(&mut meta, super::test_writer::SEED)?;
        }
        let mut out = Ok(());
        for frame in std::iter::once(&w.frames[0]).chain(frames.iter().copied()) {
            if let Err(err) = super::recover::apply(&txn, frame, partitioned) {
                out = Err(format!("{err:?}"));
                break;
            }
        }
        Ok(out)
    };
    assert_eq!(replay(&[&claim, &done, &swept], true)?, Ok(()));
    let refused = |out: Result<(), String>, what: &str| -> R<()> {
        match out {
            Err(msg) if msg.contains("does not fit") => Ok(()),
            other => Err(format!("{what}: {other:?}").into()),
        }
    };
    refused(replay(&[&done], true)?, "a delta of a record not stored")?;
    refused(replay(&[&swept], true)?, "a delete of a record not stored")?;
    refused(replay(&[&claim, &claim], true)?, "a new record over one")?;
    refused(replay(&[&claim, &done], false)?, "a format-2 file")?;
    let mut other = done.clone();
    for change in &mut other.changes {
        if let Change::PutRecordDelta { base, .. } = change {
            base[0] ^= 1;
        }
    }
    refused(replay(&[&claim, &other], true)?, "a delta of another value")?;
    let mut damaged = claim.clone();
    for change in &mut damaged.changes {
        if let Change::PutNewRecord { value, .. } = change {
            value[3] ^= 1;
        }
    }
    refused(
        replay(&[&damaged], true)?,
        "a new record that does not decode",
    )?;
    Ok(())
}

/// A format-2 file's writes log the plain changes a released build reads.
#[test]
fn format_2_logs_plain_changes() -> R<()> {
    let db = mem()?;
    let txn = db.begin_write()?;
    let seq = Sequences {
        token: 1,
        outbox: 1,
    };
    let k = key(1)?;
    let changes = {
        let mut t = Tables::open(&txn, seq, super::test_writer::T0, cfg())?;
        t.keep_changes();
        let token = claim_in(&mut t, &k, LEASE_MS)?;
        complete_in(&mut t, &k, token)?;
        t.changes.take().unwrap_or_default()
    };
    let frame = Frame {
        next_token: 2,
        next_outbox: 1,
        changes,
    };
    assert_eq!(kinds(std::slice::from_ref(&frame)), (0, 0, 0, 3));
    assert!(frame.changes.iter().all(|c| matches!(
        c,
        Change::PutRecord { .. } | Change::PutIndex { .. } | Change::DelIndex { .. }
    )));
    Ok(())
}
