//! A synchronous PostgreSQL connection whose every round trip has a
//! deadline.
//!
//! The shape is the `postgres` crate's (a `tokio_postgres::Client` driven
//! by a current-thread runtime of the connection's own, its `Connection`
//! task spawned on that runtime), with one difference: each call runs
//! under `tokio::time::timeout`. A server that stops answering (a stopped
//! backend, a proxy that black-holes the socket while its kernel still
//! acknowledges the bytes) fails the call with [`PgError`] "did not answer
//! within …" instead of blocking it forever; the connection is then marked
//! broken and never used again (the pool drops it). Connecting (socket,
//! startup and authentication) is bounded the same way.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use tokio::runtime::Runtime;
use tokio::task::JoinHandle;
use tokio_postgres::error::{DbError, SqlState};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Config, Row, SimpleQueryMessage, Statement, ToStatement};

use super::described::describe;
use super::tls::{Plan, Tls};

/// An error of a PostgreSQL call: what the server or the socket said, or
/// a deadline that ran out.
///
/// Its text names what the server said (severity, SQLSTATE and message)
/// or, for a deadline, how long the call waited ("did not answer within
/// …").
#[derive(Debug)]
pub struct PgError {
    kind: Kind,
    /// A refused connection's explanation (TLS mode and host; never the
    /// password), shown instead of the client's own text.
    explained: Option<String>,
}

#[derive(Debug)]
enum Kind {
    /// The client's own error (a server error, a closed or reset socket).
    Client(tokio_postgres::Error),
    /// No answer within the deadline; the connection was given up.
    Timeout(Duration),
    /// The connection was given up earlier (after a deadline ran out).
    Broken,
    /// The connection's runtime could not be started.
    Io(std::io::Error),
}

impl PgError {
    fn client(e: tokio_postgres::Error) -> PgError {
        PgError {
            kind: Kind::Client(e),
            explained: None,
        }
    }

    fn timeout(after: Duration) -> PgError {
        PgError {
            kind: Kind::Timeout(after),
            explained: None,
        }
    }

    /// The server's error, when the server answered with one.
    pub fn as_db_error(&self) -> Option<&DbError> {
        match &self.kind {
            Kind::Client(e) => e.as_db_error(),
            _ => None,
        }
    }

    /// The server error's SQLSTATE, when the server answered with one.
    pub fn code(&self) -> Option<&SqlState> {
        match &self.kind {
            Kind::Client(e) => e.code(),
            _ => None,
        }
    }

    /// Whether the connection is gone (closed by either side, or given up
    /// after a deadline).
    pub fn is_closed(&self) -> bool {
        match &self.kind {
            Kind::Client(e) => e.is_closed(),
            Kind::Timeout(_) | Kind::Broken => true,
            Kind::Io(_) => false,
        }
    }

    /// How long the call waited, when a deadline ran out.
    pub fn timed_out_after(&self) -> Option<Duration> {
        match self.kind {
            Kind::Timeout(after) => Some(after),
            _ => None,
        }
    }

    /// The client's own error, if this is one.
    pub(crate) fn as_client(&self) -> Option<&tokio_postgres::Error> {
        match &self.kind {
            Kind::Client(e) => Some(e),
            _ => None,
        }
    }
}

impl fmt::Display for PgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(text) = &self.explained {
            return f.write_str(text);
        }
        match &self.kind {
            Kind::Client(e) => f.write_str(&describe(e)),
            Kind::Timeout(after) => write!(
                f,
                "PostgreSQL did not answer within {after:?}; the connection was given up"
            ),
            Kind::Broken => write!(
                f,
                "the connection was given up after an earlier call ran out of time"
            ),
            Kind::Io(e) => write!(f, "could not start the connection's runtime: {e}"),
        }
    }
}

impl std::error::Error for PgError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.kind {
            Kind::Client(e) => Some(e),
            Kind::Io(e) => Some(e),
            _ => None,
        }
    }
}

/// Whether `e` leaves the connection unusable: closed, or an I/O error on
/// its socket.
fn breaks(e: &tokio_postgres::Error) -> bool {
    e.is_closed()
        || std::error::Error::source(e)
            .is_some_and(|s| s.downcast_ref::<std::io::Error>().is_some())
}

/// Runs `future` (one round trip, or a few for a statement prepared on the
/// way) on `runtime`, waiting at most `deadline`.
fn block<T>(
    runtime: &Runtime,
    deadline: Duration,
    future: impl Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, PgError> {
    match runtime.block_on(async { tokio::time::timeout(deadline, future).await }) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(PgError::client(e)),
        Err(_) => Err(PgError::timeout(deadline)),
    }
}

/// Runs one call of `tokio_postgres::Client` on a [`Client`] under its
/// deadline: `run!(self, c => c.query(q, p))`.
macro_rules! run {
    ($client:expr, $c:ident => $call:expr) => {{
        let this: &mut Client = $client;
        this.check()?;
        let result = {
            let $c = &this.client;
            block(&this.runtime, this.deadline, $call)
        };
        this.note(result)
    }};
}

/// One connection: its runtime, the client, the deadline of each round
/// trip, and whether it was given up.
pub(crate) struct Client {
    runtime: Runtime,
    client: tokio_postgres::Client,
    connection: Option<JoinHandle<()>>,
    deadline: Duration,
    broken: bool,
    /// The server process serving this connection.
    backend: Option<Backend>,
}

/// The server process (backend) serving a connection: its process id and
/// start time (together unique: a process id is reused, never with the
/// same start time).
#[derive(Debug, Clone)]
pub(crate) struct Backend {
    pub(crate) pid: i32,
    pub(crate) started: String,
}

impl Client {
    /// Connects with `config`: the socket, the startup handshake and
    /// authentication together within `connect_timeout`. Each later round
    /// trip waits at most `deadline`. `setup` (SQL ending in `;`, or empty)
    /// runs first on the new session, in the round trip that asks for the
    /// backend's process id.
    pub(super) fn connect(
        config: &Config,
        tls: &Tls,
        plan: &Plan,
        setup: &str,
        connect_timeout: Duration,
        deadline: Duration,
    ) -> Result<Client, PgError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| PgError {
                kind: Kind::Io(e),
                explained: None,
            })?;
        let connected = runtime.block_on(async {
            tokio::time::timeout(connect_timeout, config.connect(tls.clone())).await
        });
        let (client, connection) = match connected {
            Ok(Ok(pair)) => pair,
            Ok(Err(e)) => {
                let explained = plan.explain_text(&e);
                return Err(PgError {
                    kind: Kind::Client(e),
                    explained: Some(explained),
                });
            }
            Err(_) => return Err(PgError::timeout(connect_timeout)),
        };
        let connection = runtime.spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "PostgreSQL connection ended");
            }
        });
        let mut client = Client {
            runtime,
            client,
            connection: Some(connection),
            deadline,
            broken: false,
            backend: None,
        };
        let rows = client.simple_query(&format!(
            "{setup} SELECT pg_backend_pid()::text, backend_start::text
             FROM pg_stat_activity WHERE pid = pg_backend_pid()"
        ))?;
        client.backend = rows.iter().find_map(|message| match message {
            SimpleQueryMessage::Row(row) => Some(Backend {
                pid: row.try_get(0).ok().flatten()?.parse().ok()?,
                started: row.try_get(1).ok().flatten()?.to_owned(),
            }),
            _ => None,
        });
        Ok(client)
    }

    /// The server process serving this connection, if the server said.
    pub(crate) fn backend(&self) -> Option<&Backend> {
        self.backend.as_ref()
    }

    /// Whether the connection is known to be unusable.
    pub(crate) fn is_broken(&self) -> bool {
        self.broken || self.client.is_closed()
    }

    /// Fails at once on a connection given up earlier.
    fn check(&self) -> Result<(), PgError> {
        if self.broken {
            Err(PgError {
                kind: Kind::Broken,
                explained: None,
            })
        } else {
            Ok(())
        }
    }

    /// A call's result; a deadline that ran out, or a socket that failed,
    /// breaks the connection.
    fn note<T>(&mut self, result: Result<T, PgError>) -> Result<T, PgError> {
        if let Err(e) = &result {
            match &e.kind {
                Kind::Client(e) if !breaks(e) => {}
                _ => self.broken = true,
            }
        }
        result
    }

    pub(crate) fn prepare_typed(
        &mut self,
        query: &str,
        types: &[Type],
    ) -> Result<Statement, PgError> {
        run!(self, c => c.prepare_typed(query, types))
    }

    pub(crate) fn execute<T>(
        &mut self,
        query: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, PgError>
    where
        T: ?Sized + ToStatement,
    {
        run!(self, c => c.execute(query, params))
    }

    pub(crate) fn query_one<T>(
        &mut self,
        query: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, PgError>
    where
        T: ?Sized + ToStatement,
    {
        run!(self, c => c.query_one(query, params))
    }

    pub(crate) fn query_typed(
        &mut self,
        query: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, PgError> {
        run!(self, c => c.query_typed(query, params))
    }

    pub(crate) fn query_typed_one(
        &mut self,
        query: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Row, PgError> {
        run!(self, c => c.query_typed_one(query, params))
    }

    pub(crate) fn query_typed_opt(
        &mut self,
        query: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Option<Row>, PgError> {
        run!(self, c => c.query_typed_opt(query, params))
    }

    pub(crate) fn batch_execute(&mut self, query: &str) -> Result<(), PgError> {
        run!(self, c => c.batch_execute(query))
    }

    pub(crate) fn simple_query(&mut self, query: &str) -> Result<Vec<SimpleQueryMessage>, PgError> {
        run!(self, c => c.simple_query(query))
    }

    /// Starts a transaction with `begin` (a `BEGIN` statement, possibly
    /// with isolation settings).
    pub(crate) fn transaction_with(&mut self, begin: &str) -> Result<Transaction<'_>, PgError> {
        self.batch_execute(begin)?;
        Ok(Transaction {
            client: self,
            done: false,
            xact: None,
        })
    }

    /// Starts a read-write transaction and learns its id and the server
    /// process running it, in the same round trip as the `BEGIN` (one
    /// simple-query batch), so that a COMMIT whose answer is lost can be
    /// settled by asking the server (`Shared::settle_commit`).
    pub(crate) fn transaction_tracked(&mut self) -> Result<Transaction<'_>, PgError> {
        let begun =
            self.simple_query("BEGIN; SELECT pg_current_xact_id()::text, pg_backend_pid()::text");
        let messages = match begun {
            Ok(messages) => messages,
            Err(e) => {
                // The BEGIN may have run: leave no transaction open on a
                // connection that goes back to the pool.
                if !self.broken && self.batch_execute("ROLLBACK").is_err() {
                    self.broken = true;
                }
                return Err(e);
            }
        };
        let xact = messages.iter().find_map(|message| match message {
            SimpleQueryMessage::Row(row) => {
                let xid = row.try_get(0).ok().flatten()?;
                let pid = row.try_get(1).ok().flatten()?.parse().ok()?;
                Some(Xact {
                    xid: xid.to_owned(),
                    pid,
                })
            }
            _ => None,
        });
        Ok(Transaction {
            client: self,
            done: false,
            xact,
        })
    }

    /// Starts a read-write transaction.
    pub(crate) fn transaction(&mut self) -> Result<Transaction<'_>, PgError> {
        self.transaction_with("BEGIN")
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        // Say goodbye (a Terminate message) when the connection still
        // works, as the `postgres` crate does, so the server logs no
        // unexpected end of file; never wait past the deadline.
        if self.broken {
            return;
        }
        self.client.__private_api_close();
        if let Some(connection) = self.connection.take() {
            let deadline = self.deadline;
            let _ = self
                .runtime
                .block_on(async { tokio::time::timeout(deadline, connection).await });
        }
    }
}

/// A PostgreSQL transaction on one of the engine's connections: the one a
/// local write's closure gets from [`crate::LocalTx::postgres`].
///
/// Its methods are those of `postgres::Transaction` (the same names,
/// arguments and results, with [`PgError`] as the error), and each round
/// trip has the engine's deadline (`EngineBuilder::statement_timeout` plus
/// a margin): a server that stops answering fails the call with
/// [`PgError`] instead of blocking it. Any error inside aborts the
/// transaction: return it from the closure, and nothing is written.
pub struct Transaction<'a> {
    client: &'a mut Client,
    done: bool,
    /// Its id and server process, when started with
    /// [`Client::transaction_tracked`].
    xact: Option<Xact>,
}

/// A transaction's id (a `xid8`, as text) and the process id of the
/// server backend running it.
#[derive(Debug, Clone)]
pub(crate) struct Xact {
    pub(crate) xid: String,
    pub(crate) pid: i32,
}

impl Xact {
    /// The id's low 32 bits, as `pg_stat_activity.backend_xid` shows it.
    pub(crate) fn xid32(&self) -> Option<String> {
        self.xid
            .parse::<u64>()
            .ok()
            .map(|xid| (xid & 0xffff_ffff).to_string())
    }
}

impl fmt::Debug for Transaction<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transaction").finish_non_exhaustive()
    }
}

impl Transaction<'_> {
    /// The transaction's id and server process, if it was started with
    /// [`Client::transaction_tracked`].
    pub(crate) fn xact(&self) -> Option<&Xact> {
        self.xact.as_ref()
    }

    /// Commits the transaction.
    pub(crate) fn commit(mut self) -> Result<(), PgError> {
        self.done = true;
        self.client.batch_execute("COMMIT")
    }

    /// Prepares `query` (parameters' types inferred by the server).
    ///
    /// # Errors
    /// A server error, a lost connection, or no answer within the deadline.
    pub fn prepare(&mut self, query: &str) -> Result<Statement, PgError> {
        run!(self.client, c => c.prepare(query))
    }

    /// Prepares `query` with the parameters' `types` (missing ones are
    /// inferred by the server).
    ///
    /// # Errors
    /// As [`Transaction::prepare`].
    pub fn prepare_typed(&mut self, query: &str, types: &[Type]) -> Result<Statement, PgError> {
        self.client.prepare_typed(query, types)
    }

    /// Runs a statement; returns the number of rows it changed.
    ///
    /// # Errors
    /// As [`Transaction::prepare`].
    pub fn execute<T>(&mut self, query: &T, params: &[&(dyn ToSql + Sync)]) -> Result<u64, PgError>
    where
        T: ?Sized + ToStatement,
    {
        self.client.execute(query, params)
    }

    /// Runs a statement with explicitly typed parameters (no preparation
    /// round trip); returns the number of rows it changed.
    ///
    /// # Errors
    /// As [`Transaction::prepare`].
    pub fn execute_typed(
        &mut self,
        query: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<u64, PgError> {
        run!(self.client, c => c.execute_typed(query, params))
    }

    /// Runs a query; returns its rows.
    ///
    /// # Errors
    /// As [`Transaction::prepare`].
    pub fn query<T>(
        &mut self,
        query: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, PgError>
    where
        T: ?Sized + ToStatement,
    {
        run!(self.client, c => c.query(query, params))
    }

    /// Runs a query that returns exactly one row.
    ///
    /// # Errors
    /// As [`Transaction::prepare`], or when the query returns no row or
    /// more than one.
    pub fn query_one<T>(
        &mut self,
        query: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, PgError>
    where
        T: ?Sized + ToStatement,
    {
        self.client.query_one(query, params)
    }

    /// Runs a query that returns at most one row.
    ///
    /// # Errors
    /// As [`Transaction::prepare`], or when the query returns more than one
    /// row.
    pub fn query_opt<T>(
        &mut self,
        query: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, PgError>
    where
        T: ?Sized + ToStatement,
    {
        run!(self.client, c => c.query_opt(query, params))
    }

    /// Runs a query with explicitly typed parameters; returns its rows.
    ///
    /// # Errors
    /// As [`Transaction::prepare`].
    pub fn query_typed(
        &mut self,
        query: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, PgError> {
        self.client.query_typed(query, params)
    }

    /// Runs a query with explicitly typed parameters that returns exactly
    /// one row.
    ///
    /// # Errors
    /// As [`Transaction::query_one`].
    pub fn query_typed_one(
        &mut self,
        query: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Row, PgError> {
        self.client.query_typed_one(query, params)
    }

    /// Runs a query with explicitly typed parameters that returns at most
    /// one row.
    ///
    /// # Errors
    /// As [`Transaction::query_opt`].
    pub fn query_typed_opt(
        &mut self,
        query: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Option<Row>, PgError> {
        self.client.query_typed_opt(query, params)
    }

    /// Runs one or more statements separated by semicolons, with no
    /// parameters and no rows returned (the simple query protocol).
    ///
    /// # Errors
    /// As [`Transaction::prepare`].
    pub fn batch_execute(&mut self, query: &str) -> Result<(), PgError> {
        self.client.batch_execute(query)
    }
}

impl Drop for Transaction<'_> {
    fn drop(&mut self) {
        // Not committed: roll back now, so the connection goes back to the
        // pool outside any transaction. A connection that fails even that
        // is broken, and the pool drops it.
        if !self.done && !self.client.broken {
            if let Err(e) = self.client.batch_execute("ROLLBACK") {
                tracing::debug!(error = %e, "could not roll a transaction back; dropping its connection");
                self.client.broken = true;
            }
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::net::TcpListener;
    use std::time::{Duration, Instant};

    use super::{Client, PgError, Xact};

    #[test]
    fn a_timeout_says_how_long_it_waited() {
        let e = PgError::timeout(Duration::from_millis(1500));
        assert!(e.to_string().contains("did not answer within 1.5s"), "{e}");
        assert!(e.is_closed());
        assert_eq!(e.timed_out_after(), Some(Duration::from_millis(1500)));
        assert!(e.as_db_error().is_none());
    }

    #[test]
    fn the_short_transaction_id_is_the_low_32_bits() {
        let xact = Xact {
            xid: (7u64 << 32 | 1234).to_string(),
            pid: 1,
        };
        assert_eq!(xact.xid32().as_deref(), Some("1234"));
        let bad = Xact {
            xid: "x".into(),
            pid: 1,
        };
        assert_eq!(bad.xid32(), None);
    }

    /// A connection to `url`, with its TLS as the string asks.
    pub(in crate::store::postgres) fn connect_url(
        url: &str,
        connect_timeout: Duration,
        deadline: Duration,
    ) -> Result<Client, Box<dyn std::error::Error>> {
        let (config, tls, plan) = crate::store::postgres::tls::configure(url)?;
        Ok(Client::connect(
            &config,
            &tls,
            &plan,
            "",
            connect_timeout,
            deadline,
        )?)
    }

    /// A server that accepts the socket and never answers the startup
    /// message (a stopped postmaster) fails the connect within its bound.
    #[test]
    fn a_silent_server_fails_the_connect_in_time() -> Result<(), Box<dyn std::error::Error>> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let url = format!("host=127.0.0.1 port={port} user=nobody dbname=nothing sslmode=disable");
        let started = Instant::now();
        let bound = Duration::from_millis(300);
        let (config, tls, plan) = crate::store::postgres::tls::configure(&url)?;
        let Err(e) = Client::connect(&config, &tls, &plan, "", bound, bound) else {
            return Err("connected to a server that never answered".into());
        };
        assert_eq!(e.timed_out_after(), Some(bound), "{e}");
        assert!(e.to_string().contains("did not answer within"), "{e}");
        // Generous: this only guards against a hang, not for speed.
        assert!(started.elapsed() < Duration::from_secs(60));
        drop(listener);
        Ok(())
    }

    /// With a server: a statement running past the client's deadline
    /// fails with a timeout and breaks the connection (skipped without
    /// `IDEMPOTENCY_TEST_PG`).
    #[test]
    fn a_slow_statement_hits_the_deadline() -> Result<(), Box<dyn std::error::Error>> {
        let Ok(url) = std::env::var("IDEMPOTENCY_TEST_PG") else {
            return Ok(());
        };
        let deadline = Duration::from_millis(200);
        let mut client = connect_url(&url, Duration::from_secs(10), deadline)?;
        assert!(client.backend().is_some_and(|b| b.pid > 0));
        let e = match client.batch_execute("SELECT pg_sleep(5)") {
            Ok(()) => return Err("a 5 s sleep finished within 200 ms".into()),
            Err(e) => e,
        };
        assert_eq!(e.timed_out_after(), Some(deadline), "{e}");
        assert!(client.is_broken());
        let again = client.batch_execute("SELECT 1");
        assert!(
            again.is_err_and(|e| e.is_closed()),
            "a broken connection was used again"
        );
        Ok(())
    }

    /// With a server: a tracked transaction knows its id and backend.
    #[test]
    fn a_tracked_transaction_knows_its_id() -> Result<(), Box<dyn std::error::Error>> {
        let Ok(url) = std::env::var("IDEMPOTENCY_TEST_PG") else {
            return Ok(());
        };
        let mut client = connect_url(&url, Duration::from_secs(10), Duration::from_secs(10))?;
        let pid = client.backend().map(|b| b.pid);
        let tx = client.transaction_tracked()?;
        let xact = tx.xact().cloned().ok_or("no transaction id")?;
        assert_eq!(Some(xact.pid), pid);
        tx.commit()?;
        let row = client.query_typed_one(
            "SELECT pg_xact_status($1::xid8)",
            &[(&xact.xid, tokio_postgres::types::Type::TEXT)],
        )?;
        assert_eq!(
            row.get::<_, Option<String>>(0).as_deref(),
            Some("committed")
        );
        Ok(())
    }
}
