//! The scrub behind `Engine::verify`: every stored value decodes and
//! passes its checksum (`store/codec.rs`), every record key is a valid key,
//! every record and entity a walk of its table meets is also found by a
//! lookup of its key (a damaged tree page can send a lookup astray while a
//! walk still meets every entry), and every index entry matches its record
//! and back (each record sits in exactly the index its state names, at the
//! instant it names). The meta table's values are checked too (`meta.rs`).

use std::collections::BTreeSet;

use redb::{ReadableDatabase, ReadableTable, TableError};

use crate::error::Result;
use crate::store::codec;
use crate::store::record::hex;
use crate::verify::Damage;

use super::meta::{self, Found, MetaError};
use super::tables::{
    Context, DEAD_LETTERS, ENTITIES, EXPIRY, HISTORY, LEASES, META, OUTBOX, RECORDS, RECOVERY,
    STEPS,
};

/// Scrubs the whole database in one read snapshot; returns every problem
/// found (none: the file is sound as far as the engine can tell) and how
/// many records were checked.
pub(super) fn verify(db: &impl ReadableDatabase) -> Result<(Vec<Damage>, u64)> {
    let what = "verifying the database";
    let txn = db.begin_read().context(what)?;
    let mut problems = meta_damage(&txn)?;
    let records = txn.open_table(RECORDS).context(what)?;
    // (index, instant, record key) every sound record expects.
    let mut expected = BTreeSet::new();
    // Keys of records that do not decode.
    let mut undecodable = BTreeSet::new();
    let mut checked = 0;
    for entry in records.iter().context(what)? {
        let (k, v) = entry.context(what)?;
        checked += 1;
        let rkey = k.value().to_vec();
        if crate::key::IdempotencyKey::from_record_key(&rkey).is_none() {
            problems.push(Damage::BadKey {
                key_hex: hex(&rkey),
            });
        }
        // A lookup must find what the walk met: a request only ever looks
        // its key up.
        let found = records.get(rkey.as_slice()).context(what)?;
        if found.is_none_or(|f| f.value() != v.value()) {
            problems.push(Damage::UnreachableRecord {
                key_hex: hex(&rkey),
            });
        }
        match codec::decode(&rkey, v.value()) {
            Ok(rec) => {
                let (index, at) = rec.index();
                expected.insert((index, at, rkey));
            }
            Err(e) => {
                problems.push(Damage::Undecodable {
                    key_hex: hex(&rkey),
                    reason: e.to_string(),
                });
                undecodable.insert(rkey);
            }
        }
    }
    let mut found = BTreeSet::new();
    for (name, table) in [
        ("leases", LEASES),
        ("recovery", RECOVERY),
        ("expiry", EXPIRY),
    ] {
        let index = txn.open_table(table).context(what)?;
        for entry in index.iter().context(what)? {
            let (k, _) = entry.context(what)?;
            let (at, rkey) = k.value();
            found.insert((name, at, rkey.to_vec()));
        }
    }
    for (index, at, rkey) in found.difference(&expected) {
        // A record that does not decode has no expected entry: its index
        // entry is not a second problem.
        if !undecodable.contains(rkey) {
            problems.push(Damage::StrayIndexEntry {
                index,
                at_ms: *at,
                key_hex: hex(rkey),
            });
        }
    }
    for (index, at, rkey) in expected.difference(&found) {
        problems.push(Damage::MissingIndexEntry {
            index,
            at_ms: *at,
            key_hex: hex(rkey),
        });
    }
    let outbox = txn.open_table(OUTBOX).context(what)?;
    for entry in outbox.iter().context(what)? {
        let (seq, v) = entry.context(what)?;
        if let Err(e) = codec::decode_outbox(seq.value(), v.value()) {
            problems.push(Damage::UndecodableOutboxMessage {
                seq: seq.value(),
                reason: e.to_string(),
            });
        }
    }
    let entities = txn.open_table(ENTITIES).context(what)?;
    for entry in entities.iter().context(what)? {
        let (id, v) = entry.context(what)?;
        let found = entities.get(id.value()).context(what)?;
        if found.is_none_or(|f| f.value() != v.value()) {
            problems.push(Damage::UnreachableEntity {
                entity: id.value().to_string(),
            });
        }
        if let Err(e) = codec::decode_entity(id.value(), v.value()) {
            problems.push(Damage::UndecodableEntity {
                entity: id.value().to_string(),
                reason: e.to_string(),
            });
        }
    }
    step_damage(&txn, &mut problems)?;
    dead_letter_damage(&txn, &mut problems)?;
    Ok((problems, checked))
}

/// Every dead letter decodes and passes its checksum under its seq (a
/// table a file has only once a message was given up).
fn dead_letter_damage(txn: &redb::ReadTransaction, problems: &mut Vec<Damage>) -> Result<()> {
    let what = "verifying the dead letters";
    match txn.open_table(DEAD_LETTERS) {
        Ok(letters) => {
            for entry in letters.iter().context(what)? {
                let (seq, v) = entry.context(what)?;
                if let Err(e) = codec::decode_dead_letter(seq.value(), v.value()) {
                    problems.push(Damage::UndecodableDeadLetter {
                        seq: seq.value(),
                        reason: e.to_string(),
                    });
                }
            }
        }
        Err(redb::TableError::TableDoesNotExist(_)) => {}
        Err(e) => return Err(e).context(what),
    }
    Ok(())
}

/// Every effect step and log entry decodes and passes its checksum under
/// the key it is stored at (tables a format-2 file may not have yet).
fn step_damage(txn: &redb::ReadTransaction, problems: &mut Vec<Damage>) -> Result<()> {
    let what = "verifying the effect steps";
    match txn.open_table(STEPS) {
        Ok(steps) => {
            for entry in steps.iter().context(what)? {
                let (k, v) = entry.context(what)?;
                let (rkey, name) = k.value();
                if let Err(e) = codec::decode_step(rkey, name, v.value()) {
                    problems.push(Damage::UndecodableStep {
                        key_hex: hex(rkey),
                        step: name.to_owned(),
                        reason: e.to_string(),
                    });
                }
            }
        }
        Err(TableError::TableDoesNotExist(_)) => {}
        Err(e) => return Err(e).context(what),
    }
    let what = "verifying the evidence log";
    match txn.open_table(HISTORY) {
        Ok(history) => {
            for entry in history.iter().context(what)? {
                let (k, v) = entry.context(what)?;
                let (rkey, seq) = k.value();
                if let Err(e) = codec::decode_history(rkey, seq, v.value()) {
                    problems.push(Damage::UndecodableHistory {
                        key_hex: hex(rkey),
                        seq,
                        reason: e.to_string(),
                    });
                }
            }
        }
        Err(TableError::TableDoesNotExist(_)) => {}
        Err(e) => return Err(e).context(what),
    }
    Ok(())
}

/// What is wrong with the meta table in `txn`'s snapshot.
fn meta_damage(txn: &redb::ReadTransaction) -> Result<Vec<Damage>> {
    let what = "verifying the meta table";
    let table = match txn.open_table(META) {
        Ok(table) => table,
        Err(TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
        Err(e) => return Err(e).context(what),
    };
    let bad = |key: &str, reason: String| Damage::BadMetaValue {
        key: key.to_string(),
        reason,
    };
    let format_key = meta::Key::FormatVersion.name();
    let format = match meta::read_format(&table) {
        Ok(Some(Found::Format(format))) => format,
        // No open gets this far with these; a file changed since is
        // reported, and its other values cannot be read without a format.
        Ok(None) => return Ok(vec![bad(format_key, "missing".into())]),
        Ok(Some(other)) => {
            return Ok(vec![bad(
                format_key,
                format!("not a format this build reads ({other:?})"),
            )])
        }
        Err(MetaError::Damaged { key, reason }) => return Ok(vec![bad(key.name(), reason)]),
        Err(MetaError::Storage(e)) => return Err(e).context(what),
    };
    Ok(meta::damage(&table, format)
        .context(what)?
        .into_iter()
        .map(|p| bad(&p.name, p.reason))
        .collect())
}
