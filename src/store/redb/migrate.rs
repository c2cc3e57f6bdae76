//! Migrating a format-1 redb file to format 2 (`store/codec.rs`): every
//! record, outbox message and entity state is re-encoded with its checksum,
//! every meta value is rewritten with its own (`meta.rs`), and
//! `format_version` becomes 2, in one durable write transaction. A crash
//! or a failure part way leaves the file as it was (format 1), and the next
//! writable open migrates it again.
//!
//! A value that does not decode in format 1 is left exactly as it is, never
//! dropped: it stays an error naming its key at request time, and
//! `Engine::verify` lists it. A meta value that is not what its key holds
//! is different: the counters and the journal's position cannot be
//! guessed, so it fails the migration (`OpenError::Corrupt` naming
//! `Corrupted::Meta`) and nothing is written. Index tables hold no values and are not touched.

use std::path::Path;

use redb::{Database, Durability, ReadableTable, Table, WriteTransaction};

use crate::error::OpenError;
use crate::store::codec::{self, DecodeError, FORMAT_VERSION_1};

use crate::store::redb::meta::{self, MetaError};
use crate::store::redb::tables::{ENTITIES, META, OUTBOX, RECORDS};

/// Values re-encoded per read of a table: bounds the memory a migration
/// holds at once (all of it is still one transaction).
const BATCH: usize = 1_024;

/// What a migration did, per table: values re-encoded, and values left as
/// they were because they do not decode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Migrated {
    pub(super) records: u64,
    pub(super) outbox: u64,
    pub(super) entities: u64,
    pub(super) undecodable: u64,
}

/// Re-encodes a format-1 database as format 2 (see the module docs);
/// `path` names it in errors.
pub(super) fn from_format_1(db: &Database, path: &Path) -> Result<Migrated, OpenError> {
    let what = "migrating the database from record format 1 to 2";
    let storage = |e: MetaError| e.open_error(path, what);
    let mut txn = db.begin_write().map_err(|e| storage(e.into()))?;
    txn.set_durability(Durability::Immediate)
        .map_err(|e| storage(e.into()))?;
    // On an error the transaction is dropped: nothing is written.
    let migrated = migrate(&txn).map_err(storage)?;
    txn.commit().map_err(|e| storage(e.into()))?;
    if migrated.undecodable > 0 {
        tracing::warn!(
            undecodable = migrated.undecodable,
            "values that do not decode were left as they are; `idem verify` lists them"
        );
    }
    tracing::info!(
        records = migrated.records,
        outbox = migrated.outbox,
        entities = migrated.entities,
        "database migrated from record format 1 to 2"
    );
    Ok(migrated)
}

fn migrate(txn: &WriteTransaction) -> Result<Migrated, MetaError> {
    let mut m = Migrated::default();
    records(txn, &mut m)?;
    outbox(txn, &mut m)?;
    entities(txn, &mut m)?;
    // `format_version` last, in the same transaction.
    meta::migrate_from_format_1(&mut txn.open_table(META)?)?;
    Ok(m)
}

fn records(txn: &WriteTransaction, m: &mut Migrated) -> Result<(), redb::Error> {
    let mut records = txn.open_table(RECORDS)?;
    let mut after: Option<Vec<u8>> = None;
    loop {
        let mut batch = {
            let range = match &after {
                None => records.range::<&[u8]>(..)?,
                Some(last) => records.range::<&[u8]>((
                    std::ops::Bound::Excluded(last.as_slice()),
                    std::ops::Bound::Unbounded,
                ))?,
            };
            let mut batch = Vec::new();
            for entry in range.take(BATCH) {
                let (k, v) = entry?;
                let rkey = k.value().to_vec();
                let fresh = recode(
                    v.value(),
                    |b| codec::decode(&rkey, b),
                    |rec| codec::encode(&rkey, rec),
                );
                batch.push((rkey, fresh));
            }
            batch
        };
        let done = batch.len() < BATCH;
        for (rkey, fresh) in &batch {
            put(
                &mut records,
                rkey.as_slice(),
                fresh,
                &mut m.records,
                &mut m.undecodable,
            )?;
        }
        after = batch.pop().map(|(rkey, _)| rkey);
        if done {
            break;
        }
    }
    Ok(())
}

fn outbox(txn: &WriteTransaction, m: &mut Migrated) -> Result<(), redb::Error> {
    let mut outbox = txn.open_table(OUTBOX)?;
    let mut after: Option<u64> = None;
    loop {
        let mut batch = {
            let range = match after {
                None => outbox.range::<u64>(..)?,
                Some(last) => match last.checked_add(1) {
                    Some(next) => outbox.range::<u64>(next..)?,
                    None => break,
                },
            };
            let mut batch = Vec::new();
            for entry in range.take(BATCH) {
                let (k, v) = entry?;
                let seq = k.value();
                let fresh = recode(
                    v.value(),
                    |b| codec::decode_outbox(seq, b),
                    |e| codec::encode_outbox(seq, e),
                );
                batch.push((seq, fresh));
            }
            batch
        };
        let done = batch.len() < BATCH;
        for (seq, fresh) in &batch {
            put(&mut outbox, *seq, fresh, &mut m.outbox, &mut m.undecodable)?;
        }
        after = batch.pop().map(|(seq, _)| seq);
        if done {
            break;
        }
    }
    Ok(())
}

fn entities(txn: &WriteTransaction, m: &mut Migrated) -> Result<(), redb::Error> {
    let mut entities = txn.open_table(ENTITIES)?;
    let mut after: Option<String> = None;
    loop {
        let mut batch = {
            let range = match &after {
                None => entities.range::<&str>(..)?,
                Some(last) => entities.range::<&str>((
                    std::ops::Bound::Excluded(last.as_str()),
                    std::ops::Bound::Unbounded,
                ))?,
            };
            let mut batch = Vec::new();
            for entry in range.take(BATCH) {
                let (k, v) = entry?;
                let id = k.value().to_owned();
                let fresh = recode(
                    v.value(),
                    |b| codec::decode_entity(&id, b),
                    |s| codec::encode_entity(&id, s),
                );
                batch.push((id, fresh));
            }
            batch
        };
        let done = batch.len() < BATCH;
        for (id, fresh) in &batch {
            put(
                &mut entities,
                id.as_str(),
                fresh,
                &mut m.entities,
                &mut m.undecodable,
            )?;
        }
        after = batch.pop().map(|(id, _)| id);
        if done {
            break;
        }
    }
    Ok(())
}

/// What becomes of one stored value.
enum Fresh {
    /// Re-encoded in format 2.
    Encoded(Vec<u8>),
    /// Already format 2 (nothing to do).
    Current,
    /// Does not decode: left as it is.
    Undecodable(DecodeError),
}

fn recode<T>(
    bytes: &[u8],
    decode: impl FnOnce(&[u8]) -> Result<T, DecodeError>,
    encode: impl FnOnce(&T) -> Vec<u8>,
) -> Fresh {
    match decode(bytes) {
        Ok(value) if bytes.first() == Some(&FORMAT_VERSION_1) => Fresh::Encoded(encode(&value)),
        Ok(_) => Fresh::Current,
        Err(e) => Fresh::Undecodable(e),
    }
}

fn put<'k, K: redb::Key + 'static>(
    table: &mut Table<'_, K, &'static [u8]>,
    key: impl std::borrow::Borrow<K::SelfType<'k>>,
    fresh: &Fresh,
    encoded: &mut u64,
    undecodable: &mut u64,
) -> Result<(), redb::StorageError> {
    match fresh {
        Fresh::Encoded(bytes) => {
            table.insert(key, bytes.as_slice())?;
            *encoded += 1;
        }
        Fresh::Current => {}
        Fresh::Undecodable(e) => {
            tracing::warn!(error = %e, "a stored value does not decode in format 1; left as it is");
            *undecodable += 1;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Corrupted;
    use crate::message::OutboxEntry;
    use crate::store::codec::FORMAT_VERSION;
    use crate::store::record::EntityState;
    use crate::store::redb::meta::{Counter, Format, Found};
    use redb::ReadableDatabase;

    fn entity(version: u64) -> EntityState {
        EntityState {
            state: format!("s{version}"),
            version,
            updated_at_ms: 1,
        }
    }

    /// A format-1 database: `n` entities (a multiple of batches, to cross
    /// batch edges), an outbox message, and one value that does not decode.
    fn format_1(n: u64) -> Result<Database, Box<dyn std::error::Error>> {
        let db = Database::builder().create_with_backend(redb::backends::InMemoryBackend::new())?;
        let txn = db.begin_write()?;
        {
            let mut meta = txn.open_table(META)?;
            meta.insert("format_version", [FORMAT_VERSION_1].as_slice())?;
            meta.insert("next_token", 7_u64.to_le_bytes().as_slice())?;
            meta.insert("ttl_ms", 60_000_u64.to_le_bytes().as_slice())?;
            meta.insert("expiry_policy", [0_u8].as_slice())?;
            txn.open_table(RECORDS)?;
            let mut entities = txn.open_table(ENTITIES)?;
            for i in 0..n {
                entities.insert(
                    format!("e{i:05}").as_str(),
                    codec::encode_v1(&entity(i)).as_slice(),
                )?;
            }
            entities.insert("broken", [1u8, 0xff, 0xff].as_slice())?;
            let mut outbox = txn.open_table(OUTBOX)?;
            let entry = OutboxEntry {
                seq: u64::MAX,
                id: "k/0".into(),
                topic: "t".into(),
                payload: b"p".to_vec(),
                created_at_ms: 3,
            };
            outbox.insert(u64::MAX, codec::encode_v1(&entry).as_slice())?;
        }
        txn.commit()?;
        Ok(db)
    }

    #[test]
    fn every_value_is_reencoded_and_an_undecodable_one_is_kept(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let n = 2 * BATCH as u64 + 3;
        let db = format_1(n)?;
        let m = from_format_1(&db, Path::new("f1"))?;
        assert_eq!(
            m,
            Migrated {
                records: 0,
                outbox: 1,
                entities: n,
                undecodable: 1
            }
        );
        {
            let txn = db.begin_read()?;
            let entities = txn.open_table(ENTITIES)?;
            for i in 0..n {
                let id = format!("e{i:05}");
                let v = entities.get(id.as_str())?.ok_or("entity gone")?;
                assert_eq!(v.value()[0], FORMAT_VERSION);
                assert_eq!(codec::decode_entity(&id, v.value()), Ok(entity(i)));
            }
            let broken = entities.get("broken")?.ok_or("undecodable value dropped")?;
            assert_eq!(broken.value(), [1u8, 0xff, 0xff]);
            let outbox = txn.open_table(OUTBOX)?;
            let v = outbox.get(u64::MAX)?.ok_or("outbox message gone")?;
            assert!(codec::decode_outbox(u64::MAX, v.value()).is_ok());
            // Every meta value now carries its checksum, and the counters
            // are there: the stored one kept, the missing one at 1.
            let t = txn.open_table(META)?;
            assert_eq!(
                meta::read_format(&t).map_err(|e| format!("{e:?}"))?,
                Some(Found::Format(Format::V2))
            );
            assert!(meta::damage(&t, Format::V2)?.is_empty());
            let counter = |c| meta::read_counter(&t, c, Format::V2).map_err(|e| format!("{e:?}"));
            assert_eq!(counter(Counter::NextToken)?, Some(7));
            assert_eq!(counter(Counter::NextOutboxSeq)?, Some(1));
            assert_eq!(
                meta::read_expiry(&t, Format::V2).map_err(|e| format!("{e:?}"))?,
                Some((60_000, crate::policy::ExpiryPolicy::Forget))
            );
        }
        // A second run has nothing left to do.
        assert_eq!(
            from_format_1(&db, Path::new("f1"))?,
            Migrated {
                undecodable: 1,
                ..Migrated::default()
            }
        );
        Ok(())
    }

    #[test]
    fn a_damaged_meta_value_fails_the_migration_and_nothing_is_written(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let db = format_1(3)?;
        {
            let txn = db.begin_write()?;
            // Seven bytes: not a counter.
            txn.open_table(META)?
                .insert("next_token", [1_u8; 7].as_slice())?;
            txn.commit()?;
        }
        let err = from_format_1(&db, Path::new("f1.redb"))
            .err()
            .ok_or("migrated a damaged next_token")?;
        assert!(
            matches!(&err, OpenError::Corrupt { what: Corrupted::Meta("next_token"), path, .. } if path == Path::new("f1.redb")),
            "{err:?}"
        );
        let txn = db.begin_read()?;
        let meta = txn.open_table(META)?;
        let version = meta.get("format_version")?.ok_or("no version")?;
        assert_eq!(version.value(), [FORMAT_VERSION_1]);
        let entities = txn.open_table(ENTITIES)?;
        let v = entities.get("e00000")?.ok_or("entity gone")?;
        assert_eq!(v.value()[0], FORMAT_VERSION_1);
        Ok(())
    }
}
