//! What the PostgreSQL fault tests count to catch a double execution: a
//! business table of the test's own (one row per execution of a local
//! write, no unique constraint, so a second execution shows as a second
//! row), and a fake payment provider (one entry per executed charge, keyed
//! by the claim's reference) with the resolver that queries it.
//!
//! Used through `#[path = "common/pg_business.rs"] mod pg_business;`
//! beside `pg_chaos.rs`.

#![allow(dead_code)] // each test file uses some of these

use std::collections::BTreeMap;
use std::error::Error;
use std::sync::{Arc, Mutex, PoisonError};

use idempotency::{BoxError, Envelope, InDoubt, LocalTx, Resolution};

use super::pg_chaos;

type TestResult<T = ()> = Result<T, Box<dyn Error + Send + Sync>>;

/// `<prefix>business`: one row per execution of a local write.
pub struct Business {
    pub table: String,
    url: String,
}

impl Business {
    /// Creates the table on the test server (`url` goes straight to it).
    pub fn create(url: &str, prefix: &str) -> TestResult<Business> {
        let table = format!("{prefix}business");
        let mut c = pg_chaos::connect(url)?;
        c.batch_execute(&format!(
            "CREATE TABLE {table} (id bigserial PRIMARY KEY, key text NOT NULL, note text NOT NULL)"
        ))?;
        Ok(Business {
            table,
            url: url.to_string(),
        })
    }

    /// A local write that inserts one row for `key` and answers an
    /// envelope naming it.
    pub fn write(
        &self,
        key: &str,
        note: &str,
    ) -> impl FnOnce(&mut LocalTx<'_>) -> Result<Envelope, BoxError> + Send + 'static {
        let sql = format!("INSERT INTO {} (key, note) VALUES ($1, $2)", self.table);
        let (key, note) = (key.to_string(), note.to_string());
        move |tx| {
            let pg = tx.postgres().ok_or("the engine is not on PostgreSQL")?;
            pg.execute(sql.as_str(), &[&key, &note])?;
            Ok(Envelope::new(
                1,
                201,
                format!(r#"{{"booked":"{key}","note":"{note}"}}"#),
            ))
        }
    }

    /// Rows for `key`, on a fresh direct connection.
    pub fn rows(&self, key: &str) -> TestResult<i64> {
        let mut c = pg_chaos::connect(&self.url)?;
        let row = c.query_one(
            &format!("SELECT count(*) FROM {} WHERE key = $1", self.table),
            &[&key],
        )?;
        Ok(row.get(0))
    }
}

/// A payment provider: charges by reference, counts every charge, and
/// answers a resolver's query without charging.
#[derive(Clone, Default)]
pub struct Provider {
    charges: Arc<Mutex<BTreeMap<String, Vec<Vec<u8>>>>>,
}

impl Provider {
    /// Executes a charge for `reference` (each call counts) and returns the
    /// response body.
    pub fn charge(&self, key: &str, reference: &str) -> Vec<u8> {
        let body = format!(r#"{{"charged":"{key}","ref":"{reference}"}}"#).into_bytes();
        self.lock()
            .entry(reference.to_string())
            .or_default()
            .push(body.clone());
        body
    }

    /// Charges executed for any reference so far.
    pub fn executions(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }

    /// A resolver that asks this provider: the charge's response if it
    /// ran, `NotExecuted` if it never did.
    pub fn resolver(&self) -> impl Fn(&InDoubt) -> Resolution + Send + Sync + 'static {
        let me = self.clone();
        move |d: &InDoubt| match me.lock().get(&d.reference).and_then(|b| b.first()) {
            Some(body) => Resolution::Completed(Envelope::new(1, 201, body.clone())),
            None => Resolution::NotExecuted,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<Vec<u8>>>> {
        self.charges.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
