//! Baseline: the same insert-first protocol on plain redb, one durable write
//! transaction per operation (no group commit). Value: `[state][32-byte
//! fingerprint][response]`.

use std::path::Path;

use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};

const RECORDS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("records");
const PROCESSING: u8 = 0;
const COMPLETED: u8 = 1;

pub struct PlainRedb {
    pub db: Database,
}

/// The record key, laid out as the engine's: `[scope len][scope][key]`.
pub fn record_key(scope: &str, key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(1 + scope.len() + key.len());
    k.push(scope.len() as u8);
    k.extend_from_slice(scope.as_bytes());
    k.extend_from_slice(key.as_bytes());
    k
}

impl PlainRedb {
    pub fn create(path: &Path) -> PlainRedb {
        let db = Database::create(path).expect("create redb");
        let txn = db.begin_write().expect("write txn");
        txn.open_table(RECORDS).expect("table");
        txn.commit().expect("commit");
        PlainRedb { db }
    }

    /// Claims `key` in one durable transaction; false if it already exists.
    pub fn begin(&self, key: &[u8], fingerprint: &[u8; 32]) -> bool {
        let mut txn = self.db.begin_write().expect("write txn");
        txn.set_durability(Durability::Immediate)
            .expect("durability");
        let claimed = {
            let mut t = txn.open_table(RECORDS).expect("table");
            if t.get(key).expect("get").is_some() {
                false
            } else {
                let mut v = vec![PROCESSING];
                v.extend_from_slice(fingerprint);
                t.insert(key, v.as_slice()).expect("insert");
                true
            }
        };
        txn.commit().expect("commit");
        claimed
    }

    /// Stores the response in one durable transaction.
    pub fn complete(&self, key: &[u8], fingerprint: &[u8; 32], response: &[u8]) {
        let mut txn = self.db.begin_write().expect("write txn");
        txn.set_durability(Durability::Immediate)
            .expect("durability");
        {
            let mut t = txn.open_table(RECORDS).expect("table");
            let mut v = Vec::with_capacity(33 + response.len());
            v.push(COMPLETED);
            v.extend_from_slice(fingerprint);
            v.extend_from_slice(response);
            t.insert(key, v.as_slice()).expect("insert");
        }
        txn.commit().expect("commit");
    }

    /// Stores completed records in one transaction (setup only).
    pub fn load(&self, keys: &[Vec<u8>], value: &[u8]) {
        let txn = self.db.begin_write().expect("write txn");
        {
            let mut t = txn.open_table(RECORDS).expect("table");
            for k in keys {
                t.insert(k.as_slice(), value).expect("insert");
            }
        }
        txn.commit().expect("commit");
    }

    /// A point lookup in its own read transaction, copying the value out.
    pub fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        let txn = self.db.begin_read().expect("read txn");
        let t = txn.open_table(RECORDS).expect("table");
        t.get(key).expect("get").map(|v| v.value().to_vec())
    }
}

/// The records table of a [`PlainRedb`] in one read transaction kept open
/// across lookups (what a reader that keeps its snapshot pays per lookup).
pub struct KeptTable(redb::ReadOnlyTable<&'static [u8], &'static [u8]>);

impl PlainRedb {
    /// A read transaction and its records table, kept open.
    pub fn kept(&self) -> KeptTable {
        let txn = self.db.begin_read().expect("read txn");
        KeptTable(txn.open_table(RECORDS).expect("table"))
    }
}

impl KeptTable {
    /// A point lookup in the kept table, copying the value out.
    pub fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.0.get(key).expect("get").map(|v| v.value().to_vec())
    }
}
