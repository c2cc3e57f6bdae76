//! Snapshot reads: each sees the last commit and never waits for the
//! writer.

use redb::{
    ReadOnlyTable, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition,
};

use crate::error::{Error, Result};
use crate::key::IdempotencyKey;
use crate::message::OutboxEntry;
use crate::store::codec;
use crate::store::record::{EntityState, Record};
use crate::store::Scanned;

use super::tables::{Context, ENTITIES, EXPIRY, LEASES, OUTBOX, RECORDS, RECOVERY};
use super::RedbStore;

impl RedbStore {
    /// One engine table in a fresh read transaction.
    fn table<K: redb::Key + 'static, V: redb::Value + 'static>(
        &self,
        table: TableDefinition<K, V>,
        what: &'static str,
    ) -> Result<ReadOnlyTable<K, V>> {
        let txn = self.db.begin_read().context(what)?;
        txn.open_table(table).context(what)
    }

    pub(super) fn read_record(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        let what = "reading a record";
        let table = self.table(RECORDS, what)?;
        let value = table.get(key.to_record_key().as_slice()).context(what)?;
        value.map(|v| decode_record(key, v.value())).transpose()
    }

    pub(super) fn read_in_doubt(&self, limit: usize) -> Result<Vec<(IdempotencyKey, Record)>> {
        let what = "reading the recovery queue";
        // One snapshot for both tables, so every queue entry has its record.
        let txn = self.db.begin_read().context(what)?;
        let queue = txn.open_table(RECOVERY).context(what)?;
        let records = txn.open_table(RECORDS).context(what)?;
        let mut out = Vec::new();
        for entry in queue.iter().context(what)? {
            if out.len() >= limit {
                break;
            }
            let (k, _) = entry.context(what)?;
            let (_, rkey) = k.value();
            let Some(key) = IdempotencyKey::from_record_key(rkey) else {
                continue;
            };
            let Some(v) = records.get(rkey).context(what)? else {
                continue;
            };
            // One corrupt record must not hide the rest of the queue;
            // listings show it with its error.
            match decode_record(&key, v.value()) {
                Ok(rec) => out.push((key, rec)),
                Err(e) => tracing::error!(error = %e, "skipping a corrupt UNKNOWN record"),
            }
        }
        Ok(out)
    }

    pub(super) fn read_scan(&self, visit: &mut dyn FnMut(Scanned) -> bool) -> Result<()> {
        let what = "listing records";
        let table = self.table(RECORDS, what)?;
        for entry in table.iter().context(what)? {
            let (k, v) = entry.context(what)?;
            let key = IdempotencyKey::from_record_key(k.value()).ok_or_else(|| k.value().to_vec());
            if !visit((key, codec::decode(v.value()))) {
                break;
            }
        }
        Ok(())
    }

    pub(super) fn read_oldest_in_doubt(&self) -> Result<Option<u64>> {
        let what = "reading the recovery queue";
        let queue = self.table(RECOVERY, what)?;
        let first = queue.first().context(what)?;
        Ok(first.map(|(k, _)| k.value().0))
    }

    pub(super) fn read_sweep_due(&self, now_ms: u64) -> Result<bool> {
        let what = "checking for sweep work";
        for table in [LEASES, EXPIRY] {
            let index = self.table(table, what)?;
            let first = index.first().context(what)?;
            if first.is_some_and(|(k, _)| k.value().0 <= now_ms) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    pub(super) fn read_outbox(&self, limit: usize) -> Result<Vec<OutboxEntry>> {
        let what = "reading the outbox";
        let table = self.table(OUTBOX, what)?;
        let mut out = Vec::new();
        for entry in table.iter().context(what)?.take(limit) {
            let (seq, bytes) = entry.context(what)?;
            let entry =
                codec::decode_outbox(bytes.value()).map_err(|e| Error::CorruptOutboxMessage {
                    seq: seq.value(),
                    reason: e.to_string(),
                })?;
            out.push(entry);
        }
        Ok(out)
    }

    pub(super) fn read_outbox_len(&self) -> Result<u64> {
        let what = "counting the outbox";
        self.table(OUTBOX, what)?.len().context(what)
    }

    pub(super) fn read_entity(&self, entity: &str) -> Result<Option<EntityState>> {
        let what = "reading an entity";
        let table = self.table(ENTITIES, what)?;
        let Some(v) = table.get(entity).context(what)? else {
            return Ok(None);
        };
        codec::decode_entity(v.value())
            .map(Some)
            .map_err(|e| Error::CorruptEntity {
                entity: entity.to_owned(),
                reason: e.to_string(),
            })
    }
}

fn decode_record(key: &IdempotencyKey, bytes: &[u8]) -> Result<Record> {
    codec::decode(bytes).map_err(|e| Error::CorruptRecord {
        key: key.clone(),
        reason: e.to_string(),
    })
}
