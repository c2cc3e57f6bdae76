//! Baselines on SQLite (WAL, `synchronous=FULL`): an insert-first
//! idempotency table, either one transaction per operation or batched by a
//! writer thread exactly as the engine batches (up to `max_batch` queued
//! operations per transaction, bounded queue, one reply channel per caller).

use std::path::Path;
use std::sync::Mutex;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use rusqlite::{params, Connection, OptionalExtension};

const SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS idem (
        key TEXT PRIMARY KEY,
        state INTEGER NOT NULL,
        fingerprint BLOB NOT NULL,
        created_ms INTEGER NOT NULL,
        expires_ms INTEGER,
        response BLOB
    );
    CREATE INDEX IF NOT EXISTS idem_expires ON idem(expires_ms);
";
const INSERT: &str = "INSERT INTO idem (key, state, fingerprint, created_ms) VALUES (?1, 0, ?2, ?3)
     ON CONFLICT(key) DO NOTHING";
const UPDATE: &str =
    "UPDATE idem SET state = 1, response = ?2, expires_ms = ?3 WHERE key = ?1 AND state = 0";
const SELECT: &str = "SELECT state, fingerprint, response FROM idem WHERE key = ?1";

pub fn open(path: &Path) -> Connection {
    let conn = Connection::open(path).expect("open sqlite");
    let mode: String = conn
        .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
        .expect("wal");
    assert_eq!(mode, "wal");
    conn.execute_batch("PRAGMA synchronous=FULL;")
        .expect("pragma");
    conn.execute_batch(SCHEMA).expect("schema");
    conn
}

/// Claims `key`; false if it already exists.
fn begin(conn: &Connection, key: &str, fp: &[u8]) -> bool {
    let mut st = conn.prepare_cached(INSERT).expect("prepare");
    st.execute(params![key, fp, 1_i64]).expect("insert") == 1
}

fn complete(conn: &Connection, key: &str, response: &[u8]) {
    let mut st = conn.prepare_cached(UPDATE).expect("prepare");
    let n = st
        .execute(params![key, response, 86_400_000_i64])
        .expect("update");
    assert_eq!(n, 1, "complete of an unclaimed key");
}

/// One connection shared behind a mutex, each statement its own (autocommit)
/// transaction. The mutex queues writers without SQLite's busy-sleep
/// backoff, the best case for one transaction per operation.
pub struct PerOp(Mutex<Connection>);

impl PerOp {
    pub fn create(path: &Path) -> PerOp {
        PerOp(Mutex::new(open(path)))
    }

    pub fn begin(&self, key: &str, fp: &[u8]) -> bool {
        begin(&self.0.lock().expect("lock"), key, fp)
    }

    pub fn complete(&self, key: &str, response: &[u8]) {
        complete(&self.0.lock().expect("lock"), key, response);
    }

    /// Stores completed records in one transaction (setup only).
    pub fn load(&self, keys: &[String], fp: &[u8], response: &[u8]) {
        let mut conn = self.0.lock().expect("lock");
        let txn = conn.transaction().expect("txn");
        for k in keys {
            begin(&txn, k, fp);
            complete(&txn, k, response);
        }
        txn.commit().expect("commit");
    }

    /// A point lookup with a cached prepared statement, copying the row out.
    pub fn get(&self, key: &str) -> Option<(i64, Vec<u8>, Vec<u8>)> {
        let conn = self.0.lock().expect("lock");
        let mut st = conn.prepare_cached(SELECT).expect("prepare");
        st.query_row(params![key], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .optional()
            .expect("select")
    }
}

enum Op {
    Begin(String, [u8; 32]),
    Complete(String, Vec<u8>),
}

struct Req {
    op: Op,
    reply: Sender<bool>,
}

/// A writer thread that owns the connection and commits every queued
/// operation (up to `max_batch`) in one transaction, answering after commit.
pub struct Batched {
    tx: Option<Sender<Req>>,
    thread: Option<JoinHandle<()>>,
}

impl Batched {
    pub fn create(path: &Path, max_batch: usize, queue_capacity: usize) -> Batched {
        let conn = open(path);
        let (tx, rx) = crossbeam_channel::bounded(queue_capacity);
        let thread = std::thread::Builder::new()
            .name("sqlite-writer".into())
            .spawn(move || writer(conn, &rx, max_batch))
            .expect("spawn");
        Batched {
            tx: Some(tx),
            thread: Some(thread),
        }
    }

    fn submit(&self, op: Op) -> bool {
        let (reply, answer) = crossbeam_channel::bounded(1);
        let tx = self.tx.as_ref().expect("open");
        tx.send(Req { op, reply }).expect("send");
        answer.recv().expect("answer")
    }

    pub fn begin(&self, key: &str, fp: [u8; 32]) -> bool {
        self.submit(Op::Begin(key.to_string(), fp))
    }

    pub fn complete(&self, key: &str, response: &[u8]) {
        self.submit(Op::Complete(key.to_string(), response.to_vec()));
    }
}

impl Drop for Batched {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            t.join().expect("sqlite writer panicked");
        }
    }
}

fn writer(mut conn: Connection, rx: &Receiver<Req>, max_batch: usize) {
    let mut batch = Vec::with_capacity(max_batch);
    let mut results = Vec::with_capacity(max_batch);
    while let Ok(first) = rx.recv() {
        batch.push(first);
        while batch.len() < max_batch {
            match rx.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        let txn = conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .expect("begin");
        for req in &batch {
            results.push(match &req.op {
                Op::Begin(key, fp) => begin(&txn, key, fp),
                Op::Complete(key, response) => {
                    complete(&txn, key, response);
                    true
                }
            });
        }
        txn.commit().expect("commit");
        for (req, ok) in batch.drain(..).zip(results.drain(..)) {
            let _ = req.reply.send(ok);
        }
    }
}
