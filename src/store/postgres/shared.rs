//! What every call of the PostgreSQL backend shares: the pool, the names,
//! the settings and the clock; and the runner that applies one operation
//! in one transaction.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use std::time::Duration;

use tokio_postgres::types::Type;
use tokio_postgres::{Config, Statement};

use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::store::config::StoreConfig;
use crate::store::ops::{OpError, OpResult};

use super::client::{Backend, Client, PgError, Transaction, Xact};
use super::clock::DatabaseClock;
use super::schema::Names;
use super::txn::{Fault, PgTxn};

pub(super) type Pool = r2d2::Pool<Manager>;
pub(super) type Conn = r2d2::PooledConnection<Manager>;

/// Statements prepared per connection at most; beyond this, statements are
/// prepared for one use (the hot path has a handful).
const PREPARED: usize = 64;

/// A pooled connection and the statements prepared on it. Parsing and
/// planning a statement on every call (an unnamed statement, as
/// `query_typed` sends) was over 40% of the server's CPU per request.
pub(super) struct PgConn {
    client: Client,
    prepared: HashMap<String, Statement>,
    /// The pool's generation when this connection was last known good
    /// (see `Shared::conn`).
    generation: u64,
}

impl Deref for PgConn {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.client
    }
}

impl DerefMut for PgConn {
    fn deref_mut(&mut self) -> &mut Client {
        &mut self.client
    }
}

impl PgConn {
    /// `sql`, prepared with parameter `types` on this connection once.
    pub(super) fn prepared(
        &mut self,
        sql: &str,
        types: &[Type],
    ) -> std::result::Result<Statement, PgError> {
        if let Some(statement) = self.prepared.get(sql) {
            return Ok(statement.clone());
        }
        let statement = self.client.prepare_typed(sql, types)?;
        if self.prepared.len() < PREPARED {
            self.prepared.insert(sql.to_owned(), statement.clone());
        }
        Ok(statement)
    }
}

/// The pool's connection manager: connections with a deadline on every
/// round trip (`client.rs`), a statement cache per connection, and the
/// pool's generation (raised whenever a call finds a connection lost).
#[derive(Debug)]
pub(super) struct Manager {
    pub(super) config: Config,
    pub(super) tls: super::tls::Tls,
    /// Explains a refused connection (TLS mode and host).
    pub(super) plan: super::tls::Plan,
    /// SQL run first on every new session (`Client::connect`'s `setup`).
    pub(super) setup: &'static str,
    /// The bound on connecting (socket, startup, authentication).
    pub(super) connect_timeout: Duration,
    /// The bound on each later round trip.
    pub(super) deadline: Duration,
    pub(super) generation: Arc<AtomicU64>,
}

impl r2d2::ManageConnection for Manager {
    type Connection = PgConn;
    type Error = PgError;

    fn connect(&self) -> std::result::Result<PgConn, PgError> {
        Ok(PgConn {
            client: Client::connect(
                &self.config,
                &self.tls,
                &self.plan,
                self.setup,
                self.connect_timeout,
                self.deadline,
            )?,
            prepared: HashMap::new(),
            generation: self.generation.load(Ordering::Acquire),
        })
    }

    fn is_valid(&self, conn: &mut PgConn) -> std::result::Result<(), PgError> {
        conn.client.batch_execute("")
    }

    fn has_broken(&self, conn: &mut PgConn) -> bool {
        conn.client.is_broken()
    }
}

/// How often a transaction that lost an insert race is retried. Each
/// retry sees the winner's row, so one retry is the norm.
const RACE_RETRIES: usize = 16;

pub(super) struct Shared {
    pub(super) pool: Pool,
    pub(super) names: Names,
    pub(super) cfg: StoreConfig,
    /// Where transactions read the time: the database's clock (through
    /// `database_clock`) or the builder's clock as is.
    pub(super) clock: Arc<dyn Clock>,
    pub(super) database_clock: Option<Arc<DatabaseClock>>,
    /// How long a call waits for a connection.
    pub(super) connect_timeout: Duration,
    /// The client's bound on each round trip (`statement_timeout` plus a
    /// margin); also how long a lost COMMIT is asked about.
    pub(super) deadline: Duration,
    /// Raised when a call finds a connection lost (a server restart kills
    /// them all): older pooled connections are probed before use.
    pub(super) generation: Arc<AtomicU64>,
}

/// Why one attempt at a transaction failed.
enum Attempt {
    /// The operation refused (nothing written).
    Refused(Error),
    Race,
    /// Failed before the commit was sent: nothing was written.
    Before(PgError),
    /// The commit itself failed: it may or may not have been applied
    /// (settled with `Shared::commit`'s rules).
    Commit(Error),
}

/// Whether `e` says the connection is gone (closed, reset by the server
/// or the network, or the server is shutting down or restarting and ended
/// the session): another connection may work. A statement in flight may
/// or may not have run, so callers retry only what is safe to send again
/// (reads, statements of a transaction before its commit, and the
/// one-statement claim, whose retry finds its own row).
pub(super) fn lost(e: &PgError) -> bool {
    use std::io::ErrorKind;
    use tokio_postgres::error::SqlState;
    let socket_gone = e
        .as_client()
        .and_then(std::error::Error::source)
        .and_then(|source| source.downcast_ref::<std::io::Error>())
        .is_some_and(|io| {
            matches!(
                io.kind(),
                ErrorKind::ConnectionReset
                    | ErrorKind::ConnectionAborted
                    | ErrorKind::BrokenPipe
                    | ErrorKind::UnexpectedEof
                    | ErrorKind::NotConnected
            )
        });
    // A deadline that ran out is not "lost": the server may still be
    // working on the statement, and another try would wait as long again.
    e.as_client().is_some_and(tokio_postgres::Error::is_closed)
        || socket_gone
        || e.code().is_some_and(|code| {
            [
                SqlState::ADMIN_SHUTDOWN,
                SqlState::CRASH_SHUTDOWN,
                SqlState::CANNOT_CONNECT_NOW,
                SqlState::CONNECTION_FAILURE,
            ]
            .contains(code)
        })
}

/// A client error as the engine's: [`Error::Timeout`] for a deadline
/// that ran out, [`Error::Storage`] otherwise.
pub(super) fn storage(context: &'static str) -> impl FnOnce(PgError) -> Error {
    move |e| match e.timed_out_after() {
        Some(after) => Error::Timeout { context, after },
        None => Error::Storage {
            context,
            source: Box::new(e),
        },
    }
}

/// The answer of the database about a transaction whose COMMIT answer
/// was lost.
const XACT_STATUS: &str = "SELECT pg_xact_status($1::xid8)";

/// Ends the backend still running a transaction whose client gave up on
/// it (matched by process id and transaction id, so no other session is
/// touched): afterwards its transaction is settled either way.
const FENCE: &str = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
     WHERE pid = $1 AND backend_xid::text = $2";

/// Ends a connection's backend (matched by process id and start time).
const END_BACKEND: &str = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
     WHERE pid = $1 AND backend_start::text = $2";

/// Whether a connection's backend still runs.
const BACKEND_ALIVE: &str = "SELECT count(*) FROM pg_stat_activity
     WHERE pid = $1 AND backend_start::text = $2";

/// How often a COMMIT still "in progress" is asked about again.
const SETTLE_POLL: Duration = Duration::from_millis(20);

impl Shared {
    /// A pooled connection. After a call has found a connection lost, the
    /// connections pooled before are probed with an empty query before use
    /// (a dead one is dropped and the next tried), so a statement whose
    /// outcome could not be told on a broken connection (an autocommitted
    /// write) rarely meets one.
    pub(super) fn conn(&self, context: &'static str) -> Result<Conn> {
        let mut left = self.reconnects();
        loop {
            let mut conn = self
                .pool
                .get_timeout(self.connect_timeout)
                .map_err(|e| self.no_connection(context, &e))?;
            let current = self.generation.load(Ordering::Acquire);
            if conn.generation >= current {
                return Ok(conn);
            }
            match conn.client.batch_execute("") {
                Ok(()) => {
                    conn.generation = current;
                    return Ok(conn);
                }
                Err(e) if lost(&e) && left > 0 => {
                    tracing::debug!(error = %e, context, "dropping a pooled connection that did not answer");
                    left -= 1;
                }
                Err(e) => return Err(storage(context)(e)),
            }
        }
    }

    /// Why no connection came within `connect_timeout`: every pooled one
    /// stayed busy, or new ones could not be made.
    fn no_connection(&self, context: &'static str, e: &r2d2::Error) -> Error {
        let size = self.pool.max_size();
        let state = self.pool.state();
        let waited = self.connect_timeout;
        let source = if state.connections >= size && state.idle_connections == 0 {
            format!(
                "all {size} connections of the pool stayed busy for {waited:?} \
                 (EngineBuilder::pool_size, connect_timeout)"
            )
        } else {
            format!("no connection to PostgreSQL within {waited:?}: {e}")
        };
        Error::Storage {
            context,
            source: source.into(),
        }
    }

    /// A call found a connection lost: probe the older ones before use.
    pub(super) fn suspect(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// How many broken connections one call may meet before it gives up:
    /// after a server restart every pooled connection is dead, and each is
    /// noticed (and dropped by the pool) only when a statement fails on it.
    pub(super) fn reconnects(&self) -> usize {
        usize::try_from(self.pool.max_size())
            .unwrap_or(usize::MAX)
            .saturating_add(1)
    }

    /// A pooled connection that has just answered a round trip (for calls
    /// that cannot simply be repeated on another connection halfway).
    pub(super) fn live_conn(&self, context: &'static str) -> Result<Conn> {
        self.on_live_conn(context, |conn| conn.batch_execute(""), storage(context))
            .map(|(conn, ())| conn)
    }

    /// Runs one read (statements that write nothing) on a pooled
    /// connection, again on another one while the connection turns out to
    /// be broken.
    pub(super) fn read<T>(
        &self,
        context: &'static str,
        read: impl FnMut(&mut Conn) -> std::result::Result<T, PgError>,
    ) -> Result<T> {
        self.on_live_conn(context, read, storage(context))
            .map(|(_, value)| value)
    }

    /// Runs `f` on a pooled connection, and again on another one while
    /// the connection turns out to be lost (at most `pool_size + 1` times),
    /// for statements that are safe to send again; returns the connection
    /// it worked on. Any other error is mapped with `fail`.
    pub(super) fn on_live_conn<T>(
        &self,
        context: &'static str,
        mut f: impl FnMut(&mut Conn) -> std::result::Result<T, PgError>,
        fail: impl FnOnce(PgError) -> Error,
    ) -> Result<(Conn, T)> {
        let mut left = self.reconnects();
        loop {
            let mut conn = self.conn(context)?;
            match f(&mut conn) {
                Ok(value) => return Ok((conn, value)),
                Err(e) if lost(&e) && left > 0 => {
                    self.suspect();
                    left -= 1;
                }
                Err(e) => return Err(fail(e)),
            }
        }
    }

    /// Runs `op` in one transaction and commits it. A lost insert race is
    /// retried; so is a connection found broken before anything was sent
    /// for commit (a server restart leaves dead connections in the pool).
    /// A failed commit is never retried: its outcome is unknown, and the
    /// caller hears a storage error.
    pub(super) fn write<T>(
        &self,
        context: &'static str,
        mut op: impl FnMut(&mut PgTxn<'_, '_>) -> OpResult<T, Fault>,
    ) -> Result<T> {
        let mut reconnects = self.reconnects();
        let mut races = RACE_RETRIES;
        while races > 0 {
            let mut conn = self.conn(context)?;
            match self.attempt(context, &mut conn, &mut op) {
                Ok(value) => return Ok(value),
                Err(Attempt::Refused(e) | Attempt::Commit(e)) => return Err(e),
                Err(Attempt::Race) => races -= 1,
                Err(Attempt::Before(e)) if lost(&e) && reconnects > 0 => {
                    self.suspect();
                    tracing::warn!(error = %e, context, "PostgreSQL connection lost; retrying on another one");
                    reconnects -= 1;
                }
                Err(Attempt::Before(e)) => return Err(storage(context)(e)),
            }
        }
        Err(Error::Storage {
            context,
            source: "too many concurrent inserts of the same key or entity".into(),
        })
    }

    fn attempt<T>(
        &self,
        context: &'static str,
        conn: &mut Conn,
        op: &mut impl FnMut(&mut PgTxn<'_, '_>) -> OpResult<T, Fault>,
    ) -> std::result::Result<T, Attempt> {
        let mut tx = conn.transaction_tracked().map_err(Attempt::Before)?;
        let result = op(&mut PgTxn {
            tx: &mut tx,
            names: &self.names,
            now: self.clock.now_ms(),
            cfg: self.cfg,
        });
        match result {
            Ok(value) => {
                self.commit(context, tx).map_err(Attempt::Commit)?;
                Ok(value)
            }
            // Dropping the transaction rolls it back.
            Err(OpError::Refused(e)) => Err(Attempt::Refused(e)),
            Err(OpError::Fatal(Fault::Race)) => Err(Attempt::Race),
            Err(OpError::Fatal(Fault::Db(e))) => Err(Attempt::Before(e)),
        }
    }

    /// Commits `tx`. A COMMIT the server refused did not happen
    /// ([`Error::NotCommitted`]). A COMMIT whose answer was lost (the
    /// connection broke, or the deadline ran out) is settled by asking the
    /// server on another connection (`pg_xact_status` of the transaction
    /// id learnt at BEGIN): committed, the call succeeds; aborted,
    /// [`Error::NotCommitted`]; still in progress, the backend running it
    /// is ended (it belongs to this engine and its client is gone) and the
    /// question asked again, for up to one deadline. When the server
    /// cannot tell, the outcome is unknown ([`Error::Storage`]).
    pub(super) fn commit(&self, context: &'static str, tx: Transaction<'_>) -> Result<()> {
        let xact = tx.xact().cloned();
        let Err(e) = tx.commit() else {
            return Ok(());
        };
        if e.as_db_error().is_some() && !lost(&e) {
            tracing::warn!(error = %e, context, "the server refused the COMMIT; nothing was written");
            return Err(Error::NotCommitted {
                context,
                key: None,
                step: None,
            });
        }
        let unknown = |e: PgError| {
            tracing::error!(error = %e, context, "COMMIT's answer lost; its outcome is unknown");
            Error::Storage {
                context: "committing to PostgreSQL (the outcome is unknown)",
                source: Box::new(e),
            }
        };
        let Some(xact) = xact else {
            return Err(unknown(e));
        };
        self.suspect();
        match self.settle_commit(&xact) {
            Some(true) => {
                tracing::warn!(error = %e, context, xid = %xact.xid, "COMMIT's answer lost; the server says it committed");
                Ok(())
            }
            Some(false) => {
                tracing::warn!(error = %e, context, xid = %xact.xid, "COMMIT's answer lost; the server says it did not commit");
                Err(Error::NotCommitted {
                    context,
                    key: None,
                    step: None,
                })
            }
            None => Err(unknown(e)),
        }
    }

    /// Whether the transaction `xact` committed (`Some(true)`) or not
    /// (`Some(false)`), as the server says; `None` when it cannot tell
    /// (unreachable, or the id is too old).
    fn settle_commit(&self, xact: &Xact) -> Option<bool> {
        let what = "asking PostgreSQL whether a lost COMMIT went through";
        let until = std::time::Instant::now() + self.deadline;
        let mut fenced = false;
        loop {
            let status = self.read(what, |conn| {
                conn.query_typed_one(XACT_STATUS, &[(&xact.xid, Type::TEXT)])
                    .map(|row| row.get::<_, Option<String>>(0))
            });
            match status.as_ref().map(Option::as_deref) {
                Ok(Some("committed")) => return Some(true),
                Ok(Some("aborted")) => return Some(false),
                Ok(Some("in progress")) if std::time::Instant::now() < until => {
                    if !fenced {
                        fenced = true;
                        let xid32 = xact.xid32().unwrap_or_default();
                        let ended = self.read(what, |conn| {
                            conn.query_typed(
                                FENCE,
                                &[(&xact.pid, Type::INT4), (&xid32, Type::TEXT)],
                            )
                        });
                        if let Err(e) = ended {
                            tracing::warn!(error = %e, "could not end the backend of a lost COMMIT");
                        }
                    }
                    std::thread::sleep(SETTLE_POLL);
                }
                _ => {
                    tracing::error!(?status, xid = %xact.xid, "the server cannot tell whether a lost COMMIT went through");
                    return None;
                }
            }
        }
    }

    /// Makes sure the backend of a connection whose answer was lost runs
    /// nothing more: ends it and waits (up to one deadline) until it is
    /// gone. Afterwards, whatever it was doing has either happened or
    /// never will. `false`: the server could not be asked, or the backend
    /// outlived the wait.
    pub(super) fn fence(&self, backend: &Backend) -> bool {
        let what = "ending the server process of a lost connection";
        let until = std::time::Instant::now() + self.deadline;
        let params: [(&(dyn tokio_postgres::types::ToSql + Sync), Type); 2] =
            [(&backend.pid, Type::INT4), (&backend.started, Type::TEXT)];
        if let Err(e) = self.read(what, |conn| conn.query_typed(END_BACKEND, &params)) {
            tracing::warn!(error = %e, pid = backend.pid, "could not end a lost connection's backend");
            return false;
        }
        loop {
            let alive = self.read(what, |conn| {
                conn.query_typed_one(BACKEND_ALIVE, &params)
                    .map(|row| row.get::<_, i64>(0))
            });
            match alive {
                Ok(0) => return true,
                Ok(_) if std::time::Instant::now() < until => std::thread::sleep(SETTLE_POLL),
                _ => return false,
            }
        }
    }

    /// Measures the database clock's offset again (when it is in use).
    pub(super) fn sync_clock(&self) {
        let Some(clock) = self.database_clock.as_ref().filter(|c| c.due()) else {
            return;
        };
        let synced = self
            .conn("reading the database clock")
            .and_then(|mut conn| {
                clock
                    .sync(&mut conn)
                    .map_err(storage("reading the database clock"))
            });
        if let Err(e) = synced {
            tracing::warn!(error = %e, "could not read the database clock; keeping the last offset");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::super::client::Client;
    use super::super::{PgOptions, PgStore};
    use crate::store::config::StoreConfig;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    /// A store on fresh tables of the test server, and its connection
    /// string; `None` without `IDEMPOTENCY_TEST_PG`.
    fn store(tag: &str) -> Result<Option<(PgStore, String)>, Box<dyn std::error::Error>> {
        let Ok(url) = std::env::var("IDEMPOTENCY_TEST_PG") else {
            return Ok(None);
        };
        let opts = PgOptions {
            url: url.clone(),
            prefix: format!("t_{}_{tag}_", std::process::id()),
            pool_size: 2,
            connect_timeout: Duration::from_secs(10),
            statement_timeout: Duration::from_secs(5),
            pool_idle_timeout: None,
            pool_max_lifetime: None,
            database_clock: false,
            mode: super::super::Mode::Create,
        };
        let cfg = StoreConfig {
            ttl_ms: 60_000,
            expiry: crate::policy::ExpiryPolicy::Forget,
            max_response_bytes: 1 << 20,
        };
        let (store, _, _) = PgStore::open(&opts, cfg, false, Arc::new(crate::clock::SystemClock))?;
        Ok(Some((store, url)))
    }

    fn connect(url: &str) -> Result<Client, Box<dyn std::error::Error>> {
        crate::store::postgres::client::tests::connect_url(
            url,
            Duration::from_secs(10),
            Duration::from_secs(10),
        )
    }

    /// A lost COMMIT is settled by the server's word: committed, rolled
    /// back, or still open (its backend is then ended, so it is rolled
    /// back).
    #[test]
    fn a_lost_commit_is_settled_by_asking() -> TestResult {
        let Some((store, config)) = store("settle")? else {
            return Ok(());
        };
        let shared = store.shared()?;

        let mut client = connect(&config)?;
        let tx = client.transaction_tracked()?;
        let committed = tx.xact().cloned().ok_or("no transaction id")?;
        tx.commit()?;
        assert_eq!(shared.settle_commit(&committed), Some(true));

        let tx = client.transaction_tracked()?;
        let rolled_back = tx.xact().cloned().ok_or("no transaction id")?;
        drop(tx);
        assert_eq!(shared.settle_commit(&rolled_back), Some(false));

        // Still open, as when the COMMIT never reached the server and the
        // server has not noticed the client is gone.
        let mut open = connect(&config)?;
        let mut tx = open.transaction_tracked()?;
        tx.batch_execute("CREATE TEMP TABLE settle_probe (x int)")?;
        let pending = tx.xact().cloned().ok_or("no transaction id")?;
        assert_eq!(shared.settle_commit(&pending), Some(false));
        assert!(
            tx.batch_execute("SELECT 1").is_err(),
            "its backend still runs"
        );
        Ok(())
    }

    /// Fencing a connection's backend ends it, and only it.
    #[test]
    fn fencing_ends_only_that_backend() -> TestResult {
        let Some((store, config)) = store("fence")? else {
            return Ok(());
        };
        let shared = store.shared()?;
        let mut victim = connect(&config)?;
        let mut bystander = connect(&config)?;
        let backend = victim.backend().cloned().ok_or("no backend")?;
        assert!(shared.fence(&backend));
        assert!(victim.batch_execute("SELECT 1").is_err());
        bystander.batch_execute("SELECT 1")?;
        // Gone already: nothing to wait for.
        assert!(shared.fence(&backend));
        Ok(())
    }

    /// After a lost in-place completion, the row tells whether it ran:
    /// the claim's old bytes (it never ran) or the completion (it did).
    #[test]
    fn a_lost_in_place_completion_is_read_from_the_row() -> TestResult {
        use crate::store::record::{Completion, StoredResponse};
        use crate::store::{Backend, ClaimRequest, ClaimResult, CompleteRequest};

        let Some((store, _)) = store("inplace")? else {
            return Ok(());
        };
        let key = crate::IdempotencyKey::new("settle", "in-place")?;
        let claimed = store.claim(ClaimRequest {
            key: key.clone(),
            fingerprint: crate::Fingerprint::of_json(b"{}", &[])?,
            lease_ms: 60_000,
        })?;
        let ClaimResult::Claimed(claimed) = claimed else {
            return Err("a fresh key must be claimed".into());
        };
        let old = store
            .remembered
            .take(&key, claimed.token)
            .ok_or("the claim was not remembered")?;
        let req = CompleteRequest {
            key: key.clone(),
            token: claimed.token,
            completion: Completion::Success,
            response: StoredResponse::new(crate::Envelope::new(1, 200, b"ok".to_vec()), None),
            messages: Vec::new(),
            finished: Vec::new(),
        };
        let shared = store.shared()?;
        let writes = super::super::in_place::Writes::default();
        let landed =
            |shared: &super::Shared| shared.in_place_landed(&key, &old, &writes, Some(&req));
        assert_eq!(landed(shared)?, Some(false));
        store.complete(req.clone())?;
        assert_eq!(landed(shared)?, Some(true));
        Ok(())
    }
}
