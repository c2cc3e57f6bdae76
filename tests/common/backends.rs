//! One test body, every backend: a [`Harness`] opens (and reopens) an engine
//! on redb (a fresh file in a temp dir), on PostgreSQL (the server in
//! `IDEMPOTENCY_TEST_PG`, a table prefix of the test's own) or on Redis (the
//! server in `IDEMPOTENCY_TEST_REDIS`, a key prefix of the test's own), and
//! [`both_backends!`] turns one body into a `redb`, a `postgres` and a
//! `redis` test.
//!
//! Without `IDEMPOTENCY_TEST_PG` (or `IDEMPOTENCY_TEST_REDIS`) those
//! variants are skipped with a message, or fail when `CI=true` (CI must not
//! skip them silently): run them through `scripts/with-postgres` (and
//! `scripts/with-redis`).

#![allow(dead_code, unused_macros)] // each test file uses some of these

use std::error::Error;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use idempotency::{BoxError, Engine, EngineBuilder, LocalTx, OpenError};

/// What every suite test returns.
pub type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

/// Where an engine keeps its records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// A redb file.
    Redb,
    /// Tables in a PostgreSQL database.
    Postgres,
    /// Keys under a prefix on a Redis server.
    Redis,
}

/// The environment variable with the test server's connection string.
pub const PG_ENV: &str = "IDEMPOTENCY_TEST_PG";

/// The PostgreSQL test server, if there is one. Unset: `None` with a
/// message, or a panic when `CI=true`.
pub fn pg_url() -> Option<String> {
    match std::env::var(PG_ENV) {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ if std::env::var("CI").as_deref() == Ok("true") => panic!(
            "{PG_ENV} not set and CI=true: the PostgreSQL tests must run, not be skipped \
             (run them through scripts/with-postgres)"
        ),
        _ => {
            eprintln!("skipped: {PG_ENV} not set (run through scripts/with-postgres)");
            None
        }
    }
}

/// The environment variable with the Redis test server's URL
/// (`redis://127.0.0.1:PORT/`).
pub const REDIS_ENV: &str = "IDEMPOTENCY_TEST_REDIS";

/// The Redis test server, if there is one. Unset: `None` with a message,
/// or a panic when `CI=true`.
pub fn redis_url() -> Option<String> {
    match std::env::var(REDIS_ENV) {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ if std::env::var("CI").as_deref() == Ok("true") => panic!(
            "{REDIS_ENV} not set and CI=true: the Redis tests must run, not be skipped \
             (run them through scripts/with-redis)"
        ),
        _ => {
            eprintln!("skipped: {REDIS_ENV} not set (run through scripts/with-redis)");
            None
        }
    }
}

/// A table prefix no other test (in this process or another) uses.
fn unique_prefix() -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!(
        "t{}_{}_{}_",
        std::process::id(),
        secs % 1_000_000,
        NEXT.fetch_add(1, Ordering::SeqCst)
    )
}

/// How a redb harness creates its file.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RedbFormat {
    /// The builder's default: format 3, default partition limits (the
    /// suite's stores stay within one hot partition).
    Default,
    /// Format 3 with 4-key partitions: the suite seals, filters and drops
    /// partitions all through (`<name>::redb_format3`).
    SmallPartitions,
    /// Format 2, as users' existing files are (`<name>::redb_format2`).
    Format2,
}

enum Store {
    Redb {
        // Kept for its Drop: the directory goes with the harness.
        _dir: tempfile::TempDir,
        path: PathBuf,
        /// The format the file is created in, and its partition limits.
        format: RedbFormat,
    },
    Postgres {
        url: String,
        prefix: String,
    },
    Redis {
        url: String,
        prefix: String,
    },
}

/// One store on one backend; every `open` opens the same store again.
pub struct Harness {
    backend: Backend,
    store: Store,
    database_clock: bool,
}

impl std::fmt::Debug for Harness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.store {
            Store::Redb { path, .. } => write!(f, "redb {}", path.display()),
            Store::Postgres { prefix, .. } => write!(f, "postgres prefix {prefix}"),
            Store::Redis { prefix, .. } => write!(f, "redis prefix {prefix}"),
        }
    }
}

impl Harness {
    /// A fresh, empty store on `backend`; `None` when PostgreSQL is skipped
    /// (see [`pg_url`]).
    ///
    /// # Panics
    ///
    /// If a temp dir cannot be made, or without a PostgreSQL server under
    /// `CI=true`.
    pub fn new(backend: Backend) -> Option<Harness> {
        let store = match backend {
            Backend::Redb => {
                let dir = tempfile::tempdir().expect("a temp dir for the redb file");
                let path = dir.path().join("idem.redb");
                Store::Redb {
                    _dir: dir,
                    path,
                    format: RedbFormat::Default,
                }
            }
            Backend::Postgres => Store::Postgres {
                url: pg_url()?,
                prefix: unique_prefix(),
            },
            Backend::Redis => Store::Redis {
                url: redis_url()?,
                prefix: format!("test:{}", unique_prefix().replace('_', ":")),
            },
        };
        Some(Harness {
            backend,
            store,
            database_clock: false,
        })
    }

    /// A fresh redb store in format 3 with 4-key partitions, which the
    /// suite runs as `<name>::redb_format3`.
    pub fn format3() -> Harness {
        Harness::redb_in(RedbFormat::SmallPartitions)
    }

    /// A fresh redb store created in format 2 (what users' existing files
    /// are), which the suite runs as `<name>::redb_format2`.
    pub fn format2() -> Harness {
        Harness::redb_in(RedbFormat::Format2)
    }

    fn redb_in(format: RedbFormat) -> Harness {
        let mut h = Harness::new(Backend::Redb).expect("redb is always there");
        if let Store::Redb { format: f, .. } = &mut h.store {
            *f = format;
        }
        h
    }

    /// Another fresh store on the same backend (and format).
    pub fn another(&self) -> Harness {
        let mut h = match &self.store {
            Store::Redb { format, .. } => Harness::redb_in(*format),
            _ => Harness::new(self.backend).expect("the backend was available a moment ago"),
        };
        h.database_clock = self.database_clock;
        h
    }

    /// Whether a PostgreSQL engine takes time from the database
    /// (`EngineBuilder::database_clock`); off by default, since the suite
    /// moves time with a `ManualClock`. No effect on redb.
    pub fn database_clock(mut self, on: bool) -> Harness {
        self.database_clock = on;
        self
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn is_postgres(&self) -> bool {
        self.backend == Backend::Postgres
    }

    pub fn is_redis(&self) -> bool {
        self.backend == Backend::Redis
    }

    /// The URL and key prefix (Redis only).
    pub fn redis_store(&self) -> Option<(&str, &str)> {
        match &self.store {
            Store::Redis { url, prefix } => Some((url, prefix)),
            _ => None,
        }
    }

    /// A connection to the Redis test server (Redis only).
    pub fn redis_conn(&self) -> Result<redis::Connection, BoxError> {
        let (url, _) = self.redis_store().ok_or("not a Redis harness")?;
        Ok(redis::Client::open(url)?.get_connection()?)
    }

    /// The connection string and table prefix (PostgreSQL only).
    pub fn postgres_store(&self) -> Option<(&str, &str)> {
        match &self.store {
            Store::Postgres { url, prefix } => Some((url, prefix)),
            _ => None,
        }
    }

    /// The suite's builder: no background sweeper (sweeps are explicit),
    /// and on PostgreSQL a small pool, since many engines run at once.
    pub fn builder(&self) -> EngineBuilder {
        let b = Engine::builder().sweep_interval(None);
        match self.backend {
            Backend::Redb | Backend::Redis => b,
            Backend::Postgres => b.pool_size(4),
        }
    }

    /// Opens this harness's store with the suite's builder.
    pub fn engine(&self) -> Result<Engine, OpenError> {
        self.open(self.builder())
    }

    /// Opens this harness's store (the same file, or the same prefix) with
    /// `builder`: the first open creates it, later ones reopen it. On
    /// redb, drop the previous engine first (the file is locked).
    pub fn open(&self, builder: EngineBuilder) -> Result<Engine, OpenError> {
        match &self.store {
            Store::Redb { path, format, .. } => match format {
                RedbFormat::Default => builder.open(path),
                // Small partitions: the suite seals, filters and drops
                // partitions all through.
                RedbFormat::SmallPartitions => builder
                    .partition_limits(4, std::time::Duration::from_secs(60))
                    .open(path),
                RedbFormat::Format2 => builder.unstable_create_format_2().open(path),
            },
            Store::Postgres { url, prefix } => builder
                .table_prefix(prefix.as_str())
                .database_clock(self.database_clock)
                .open_postgres(url.as_str()),
            Store::Redis { url, prefix } => builder
                .redis_key_prefix(prefix.as_str())
                .open_redis(url.as_str()),
        }
    }

    /// Deletes `key`'s record behind the engine's back (as a bug or a lost
    /// row or page would), leaving its steps, log and index entries: on
    /// redb its row in format 2's records table or, in format 3, in every
    /// partition; its row on PostgreSQL; its key on Redis. On redb, drop
    /// the engine first (the file is locked). An error if there was none.
    pub fn remove_record_row(&self, key: &idempotency::IdempotencyKey) -> Result<(), BoxError> {
        let removed = match &self.store {
            Store::Redb { path, .. } => {
                use redb::{ReadableDatabase, ReadableTable, TableDefinition};
                type Def = TableDefinition<'static, &'static [u8], &'static [u8]>;
                const FORMAT_2: Def = TableDefinition::new("idempotency.records");
                const FORMAT_3: Def = TableDefinition::new("idempotency.partitioned.records");
                // `[scope length: u8][scope][key]`; format 3 prefixes the
                // partition number (8 bytes).
                let mut rkey = vec![u8::try_from(key.scope().len())?];
                rkey.extend_from_slice(key.scope().as_bytes());
                rkey.extend_from_slice(key.key().as_bytes());
                let db = redb::Database::open(path)?;
                let slots: Option<Vec<Vec<u8>>> = match db.begin_read()?.open_table(FORMAT_3) {
                    Ok(table) => {
                        let mut found = Vec::new();
                        for entry in table.iter()? {
                            let (k, _) = entry?;
                            let k = k.value();
                            if k.len() == 8 + rkey.len() && k[8..] == rkey[..] {
                                found.push(k.to_vec());
                            }
                        }
                        Some(found)
                    }
                    Err(redb::TableError::TableDoesNotExist(_)) => None,
                    Err(e) => return Err(e.into()),
                };
                let txn = db.begin_write()?;
                let mut removed = 0;
                {
                    let (mut table, slots) = match slots {
                        Some(slots) => (txn.open_table(FORMAT_3)?, slots),
                        None => (txn.open_table(FORMAT_2)?, vec![rkey]),
                    };
                    for slot in slots {
                        removed += u64::from(table.remove(slot.as_slice())?.is_some());
                    }
                }
                txn.commit()?;
                removed
            }
            Store::Postgres { prefix, .. } => self.pg_client()?.execute(
                &format!("DELETE FROM {prefix}records WHERE scope = $1 AND key = $2"),
                &[&key.scope(), &key.key()],
            )?,
            Store::Redis { prefix, .. } => {
                let mut name = format!("{prefix}r:{}", key.scope()).into_bytes();
                name.push(0);
                name.extend_from_slice(key.key().as_bytes());
                redis::cmd("DEL").arg(name).query(&mut self.redis_conn()?)?
            }
        };
        if removed == 0 {
            return Err(format!("{key} has no record to remove").into());
        }
        Ok(())
    }

    /// A client of the test server (PostgreSQL only).
    pub fn pg_client(&self) -> Result<idempotency::postgres::Client, BoxError> {
        let (url, _) = self.postgres_store().ok_or("not a PostgreSQL harness")?;
        Ok(idempotency::postgres::Client::connect(
            url,
            idempotency::postgres::NoTls,
        )?)
    }

    /// The app's own ledger table, beside the engine's tables: created
    /// here on PostgreSQL; on redb the first write creates it in the
    /// engine's file.
    pub fn ledger(&self) -> Result<Ledger, BoxError> {
        match &self.store {
            Store::Redb { .. } => Ok(Ledger {
                backend: Backend::Redb,
                table: "ledger".to_owned(),
            }),
            Store::Postgres { prefix, .. } => {
                let table = format!("{prefix}app_ledger");
                self.pg_client()?.batch_execute(&format!(
                    "CREATE TABLE IF NOT EXISTS {table} (id TEXT PRIMARY KEY, amount BIGINT NOT NULL)"
                ))?;
                Ok(Ledger {
                    backend: Backend::Postgres,
                    table,
                })
            }
            // The app's keys beside the engine's prefix, never under it.
            Store::Redis { prefix, .. } => Ok(Ledger {
                backend: Backend::Redis,
                table: format!("app-{prefix}ledger:"),
            }),
        }
    }

    /// The ledger's rows, sorted by id. On redb the engine must be dropped
    /// first (the file is locked while it is open).
    pub fn ledger_rows(&self, ledger: &Ledger) -> Result<Vec<(String, u64)>, BoxError> {
        match &self.store {
            Store::Redb { path, .. } => {
                use redb::{ReadableDatabase, ReadableTable};
                let db = redb::Database::open(path)?;
                let txn = db.begin_read()?;
                let table = match txn.open_table(ledger.redb_table()) {
                    Ok(t) => t,
                    Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                    Err(e) => return Err(e.into()),
                };
                let mut rows = Vec::new();
                for row in table.iter()? {
                    let (id, amount) = row?;
                    rows.push((id.value().to_owned(), amount.value()));
                }
                Ok(rows)
            }
            Store::Postgres { .. } => {
                let rows = self.pg_client()?.query(
                    &format!("SELECT id, amount FROM {} ORDER BY id", ledger.table),
                    &[],
                )?;
                rows.iter()
                    .map(|r| {
                        let amount: i64 = r.try_get(1)?;
                        Ok((r.try_get(0)?, u64::try_from(amount)?))
                    })
                    .collect()
            }
            Store::Redis { .. } => {
                let mut conn = self.redis_conn()?;
                let keys: Vec<String> = redis::cmd("KEYS")
                    .arg(format!("{}*", ledger.table))
                    .query(&mut conn)?;
                let mut rows = Vec::new();
                for key in keys {
                    let amount: u64 = redis::cmd("GET").arg(&key).query(&mut conn)?;
                    let id = key.strip_prefix(&ledger.table).ok_or("a ledger key")?;
                    rows.push((id.to_owned(), amount));
                }
                rows.sort();
                Ok(rows)
            }
        }
    }
}

/// The app's ledger table; [`Ledger::insert`] writes a row inside a local
/// write's transaction (`LocalTx::redb` or `LocalTx::postgres`).
#[derive(Clone, Debug)]
pub struct Ledger {
    backend: Backend,
    table: String,
}

impl Ledger {
    fn redb_table(&self) -> redb::TableDefinition<'_, &'static str, u64> {
        redb::TableDefinition::new(&self.table)
    }

    /// Inserts row `id` in the local write's transaction. A second row
    /// with the same id is an error on both backends: a double execution
    /// shows up as a failed write, not as an overwrite.
    pub fn insert(&self, tx: &mut LocalTx<'_>, id: &str, amount: u64) -> Result<(), BoxError> {
        match self.backend {
            Backend::Redb => {
                let txn = tx.redb().ok_or("LocalTx::redb() is None on redb")?;
                let mut table = txn.open_table(self.redb_table())?;
                if table.insert(id, amount)?.is_some() {
                    return Err(format!("ledger row {id} written twice").into());
                }
                Ok(())
            }
            Backend::Postgres => {
                let txn = tx
                    .postgres()
                    .ok_or("LocalTx::postgres() is None on PostgreSQL")?;
                let amount = i64::try_from(amount)?;
                txn.execute(
                    &format!("INSERT INTO {} (id, amount) VALUES ($1, $2)", self.table),
                    &[&id, &amount],
                )?;
                Ok(())
            }
            Backend::Redis => {
                let keys = tx.redis().ok_or("LocalTx::redis() is None on Redis")?;
                let key = format!("{}{id}", self.table);
                if keys.get(key.as_bytes())?.is_some() {
                    return Err(format!("ledger row {id} written twice").into());
                }
                keys.set(key.as_bytes(), amount.to_string().as_bytes())
            }
        }
    }
}

/// Runs `body` on a fresh redb store in format 3 with 4-key partitions.
pub fn run_format3(body: fn(&Harness) -> TestResult) -> TestResult {
    body(&Harness::format3())
}

/// Runs `body` on a fresh redb store created in format 2.
pub fn run_format2(body: fn(&Harness) -> TestResult) -> TestResult {
    body(&Harness::format2())
}

/// Runs `body` on a fresh store of `backend`; a skipped PostgreSQL run
/// passes.
pub fn run(backend: Backend, body: fn(&Harness) -> TestResult) -> TestResult {
    match Harness::new(backend) {
        Some(h) => body(&h),
        None => Ok(()),
    }
}

/// `fn name(h: &Harness) -> TestResult { .. }` becomes a module `name` with
/// the tests `name::redb` (a new file: format 3), `name::redb_format3`
/// (format 3 with 4-key partitions), `name::redb_format2` (a file created
/// in format 2, as users' existing files are), `name::postgres` and
/// `name::redis`, all running the same body.
macro_rules! both_backends {
    ($(#[$meta:meta])* fn $name:ident($h:ident: &Harness) -> TestResult $body:block) => {
        $(#[$meta])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            fn body($h: &Harness) -> TestResult $body

            #[test]
            fn redb() -> TestResult {
                run(Backend::Redb, body)
            }

            #[test]
            fn redb_format3() -> TestResult {
                run_format3(body)
            }

            #[test]
            fn redb_format2() -> TestResult {
                run_format2(body)
            }

            #[test]
            fn postgres() -> TestResult {
                run(Backend::Postgres, body)
            }

            #[test]
            fn redis() -> TestResult {
                run(Backend::Redis, body)
            }
        }
    };
}
