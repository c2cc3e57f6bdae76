//! What every call of the PostgreSQL backend shares: the pool, the names,
//! the settings and the clock; and the runner that applies one operation
//! in one transaction.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use postgres::types::Type;
use postgres::{Client, Statement};

use r2d2_postgres::PostgresConnectionManager;

use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::store::config::StoreConfig;
use crate::store::ops::{OpError, OpResult};

use super::clock::DatabaseClock;
use super::described::Described;
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
    ) -> std::result::Result<Statement, postgres::Error> {
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

/// r2d2's PostgreSQL manager, with a statement cache per connection and
/// the pool's generation (raised whenever a call finds a connection lost).
#[derive(Debug)]
pub(super) struct Manager {
    pub(super) inner: PostgresConnectionManager<super::tls::Tls>,
    pub(super) generation: Arc<AtomicU64>,
}

impl r2d2::ManageConnection for Manager {
    type Connection = PgConn;
    type Error = postgres::Error;

    fn connect(&self) -> std::result::Result<PgConn, postgres::Error> {
        Ok(PgConn {
            client: self.inner.connect()?,
            prepared: HashMap::new(),
            generation: self.generation.load(Ordering::Acquire),
        })
    }

    fn is_valid(&self, conn: &mut PgConn) -> std::result::Result<(), postgres::Error> {
        self.inner.is_valid(&mut conn.client)
    }

    fn has_broken(&self, conn: &mut PgConn) -> bool {
        self.inner.has_broken(&mut conn.client)
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
    pub(super) connect_timeout: std::time::Duration,
    /// Raised when a call finds a connection lost (a server restart kills
    /// them all): older pooled connections are probed before use.
    pub(super) generation: Arc<AtomicU64>,
}

/// Why one attempt at a transaction failed.
enum Attempt {
    Refused(Error),
    Race,
    /// Failed before the commit was sent: nothing was written.
    Before(postgres::Error),
    /// The commit itself failed: it may or may not have been applied.
    Commit(postgres::Error),
}

/// Whether `e` says the connection is gone (closed, reset by the server
/// or the network, or the server is shutting down or restarting and ended
/// the session): another connection may work. A statement in flight may
/// or may not have run, so callers retry only what is safe to send again
/// (reads, statements of a transaction before its commit, and the
/// one-statement claim, whose retry finds its own row).
pub(super) fn lost(e: &postgres::Error) -> bool {
    use postgres::error::SqlState;
    use std::io::ErrorKind;
    let socket_gone = std::error::Error::source(e)
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
    e.is_closed()
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

pub(super) fn storage(context: &'static str) -> impl FnOnce(postgres::Error) -> Error {
    move |e| Error::Storage {
        context,
        source: Box::new(Described(e)),
    }
}

impl Shared {
    /// A pooled connection. After a call has found a connection lost, the
    /// connections pooled before are probed with an empty query before use
    /// (a dead one is dropped and the next tried), so a statement whose
    /// outcome could not be told on a broken connection (an autocommitted
    /// write) rarely meets one.
    pub(super) fn conn(&self, context: &'static str) -> Result<Conn> {
        let mut left = self.reconnects();
        loop {
            let mut conn =
                self.pool
                    .get_timeout(self.connect_timeout)
                    .map_err(|e| Error::Storage {
                        context,
                        source: Box::new(e),
                    })?;
            let current = self.generation.load(Ordering::Acquire);
            if conn.generation >= current {
                return Ok(conn);
            }
            match conn.client.batch_execute("") {
                Ok(()) => {
                    conn.generation = current;
                    return Ok(conn);
                }
                Err(e) if left > 0 => {
                    tracing::debug!(error = %e, context, "dropping a pooled connection that did not answer");
                    left -= 1;
                }
                Err(e) => return Err(storage(context)(e)),
            }
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
        read: impl FnMut(&mut Conn) -> std::result::Result<T, postgres::Error>,
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
        mut f: impl FnMut(&mut Conn) -> std::result::Result<T, postgres::Error>,
        fail: impl FnOnce(postgres::Error) -> Error,
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
            match self.attempt(&mut conn, &mut op) {
                Ok(value) => return Ok(value),
                Err(Attempt::Refused(e)) => return Err(e),
                Err(Attempt::Race) => races -= 1,
                Err(Attempt::Before(e)) if lost(&e) && reconnects > 0 => {
                    self.suspect();
                    tracing::warn!(error = %e, context, "PostgreSQL connection lost; retrying on another one");
                    reconnects -= 1;
                }
                Err(Attempt::Before(e)) => return Err(storage(context)(e)),
                Err(Attempt::Commit(e)) => {
                    tracing::error!(error = %e, context, "commit failed; its outcome is unknown");
                    return Err(Error::Storage {
                        context: "committing to PostgreSQL (the outcome is unknown)",
                        source: Box::new(e),
                    });
                }
            }
        }
        Err(Error::Storage {
            context,
            source: "too many concurrent inserts of the same key or entity".into(),
        })
    }

    fn attempt<T>(
        &self,
        conn: &mut Conn,
        op: &mut impl FnMut(&mut PgTxn<'_, '_>) -> OpResult<T, Fault>,
    ) -> std::result::Result<T, Attempt> {
        let mut tx = conn.transaction().map_err(Attempt::Before)?;
        let result = op(&mut PgTxn {
            tx: &mut tx,
            names: &self.names,
            now: self.clock.now_ms(),
            cfg: self.cfg,
        });
        match result {
            Ok(value) => {
                tx.commit().map_err(Attempt::Commit)?;
                Ok(value)
            }
            // Dropping the transaction rolls it back.
            Err(OpError::Refused(e)) => Err(Attempt::Refused(e)),
            Err(OpError::Fatal(Fault::Race)) => Err(Attempt::Race),
            Err(OpError::Fatal(Fault::Db(e))) => Err(Attempt::Before(e)),
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
