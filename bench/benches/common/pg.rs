//! Baseline on PostgreSQL: a hand-written idempotency table, one connection
//! per client thread with prepared statements. The claim is one autocommit
//! `INSERT … ON CONFLICT DO NOTHING RETURNING token` (the token from a
//! sequence inside the same statement), the completion one autocommit
//! `UPDATE … WHERE key AND token` (fenced by the token). Durability is the
//! server's: each statement commits with its `synchronous_commit`.
//!
//! The table carries what the engine's needs for this workload: a key,
//! the state, a token, the fingerprint, the response, and partial indexes
//! for stuck claims (`state = 0` by lease end) and for expiry (`state = 1`
//! by expiry), which the engine also keeps and updates on the same
//! transitions.

use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use idempotency::postgres::{Client, NoTls, Statement};

/// A connection and its prepared statements.
struct Conn {
    client: Client,
    claim: Statement,
    complete: Statement,
}

pub struct Baseline {
    /// One per client thread; a thread only ever locks its own.
    conns: Vec<Mutex<Conn>>,
    table: String,
    tokens: String,
}

fn now_ms() -> i64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970");
    i64::try_from(since.as_millis()).expect("ms fit i64")
}

impl Baseline {
    /// Creates the table under `prefix` and opens `threads` connections.
    pub fn create(url: &str, prefix: &str, threads: usize) -> Baseline {
        let table = format!("{prefix}idem");
        let tokens = format!("{prefix}idem_tokens");
        let mut admin = Client::connect(url, NoTls).expect("connect to PostgreSQL");
        admin
            .batch_execute(&format!(
                "CREATE TABLE {table} (
                     scope text COLLATE \"C\" NOT NULL,
                     key text COLLATE \"C\" NOT NULL,
                     state smallint NOT NULL,
                     token bigint NOT NULL,
                     fingerprint bytea NOT NULL,
                     lease_until_ms bigint NOT NULL,
                     expires_at_ms bigint NOT NULL,
                     response bytea,
                     PRIMARY KEY (scope, key));
                 CREATE INDEX {table}_leases ON {table} (lease_until_ms) WHERE state = 0;
                 CREATE INDEX {table}_expiry ON {table} (expires_at_ms) WHERE state = 1;
                 CREATE SEQUENCE {tokens} AS bigint;"
            ))
            .expect("create the baseline table");
        let claim_sql = format!(
            "INSERT INTO {table} (scope, key, state, token, fingerprint, lease_until_ms, expires_at_ms)
             VALUES ($1, $2, 0, nextval('{tokens}'), $3, $4, 0)
             ON CONFLICT (scope, key) DO NOTHING
             RETURNING token"
        );
        let complete_sql = format!(
            "UPDATE {table} SET state = 1, response = $4, expires_at_ms = $5
             WHERE scope = $1 AND key = $2 AND token = $3 AND state = 0"
        );
        let conns = (0..threads)
            .map(|_| {
                let mut client = Client::connect(url, NoTls).expect("connect to PostgreSQL");
                let claim = client.prepare(&claim_sql).expect("prepare claim");
                let complete = client.prepare(&complete_sql).expect("prepare complete");
                Mutex::new(Conn {
                    client,
                    claim,
                    complete,
                })
            })
            .collect();
        Baseline {
            conns,
            table,
            tokens,
        }
    }

    /// One request on thread `t`'s connection: claim `key` (it must be
    /// fresh), then store a response fenced by the claim's token.
    pub fn request(&self, t: usize, scope: &str, key: &str, fp: &[u8], body: &[u8]) {
        let mut guard = self.conns[t].lock().expect("connection lock");
        let conn = &mut *guard;
        let now = now_ms();
        let row = conn
            .client
            .query_opt(&conn.claim, &[&scope, &key, &fp, &(now + 30_000)])
            .expect("claim");
        let token: i64 = row.expect("a fresh key must be claimed").get(0);
        let n = conn
            .client
            .execute(
                &conn.complete,
                &[&scope, &key, &token, &body, &(now + 86_400_000)],
            )
            .expect("complete");
        assert_eq!(n, 1, "the claim's token must still own the row");
    }

    /// Drops the table and its sequence.
    pub fn drop_schema(self, url: &str) {
        let Baseline {
            conns,
            table,
            tokens,
        } = self;
        drop(conns);
        let mut admin = Client::connect(url, NoTls).expect("connect to PostgreSQL");
        admin
            .batch_execute(&format!(
                "DROP TABLE IF EXISTS {table}; DROP SEQUENCE IF EXISTS {tokens};"
            ))
            .expect("drop the baseline table");
    }
}
