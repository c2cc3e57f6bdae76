//! The PostgreSQL backend: the same records, state machine and operations
//! as the redb backend (`store/ops.rs`), on a database that several app
//! servers share.
//!
//! Every write is one PostgreSQL transaction on a pooled connection,
//! committed (durably, with the server's `synchronous_commit`) before the
//! call returns. Row locks serialize writers of one key across processes;
//! a key's first claim is an `INSERT … ON CONFLICT DO NOTHING`, so of two
//! concurrent twins exactly one inserts. Reads are single statements that
//! see the last commit. Fencing tokens come from one sequence, so they grow
//! per key across every engine. Time comes from the database's clock by
//! default (see `clock.rs`).
//!
//! Unlike redb, a failed write does not poison the backend: the database
//! is the authority, the failed transaction was rolled back (or, when the
//! commit itself failed, its outcome is unknown and the caller is told),
//! and the next call may well succeed on a fresh connection.

#[cfg(test)]
mod breaker22b_tests;
mod client;
mod clock;
mod connstr;
mod described;
mod in_place;
mod in_place_sql;
#[cfg(test)]
mod in_place_tests;
mod local;
#[cfg(test)]
mod purge_race_tests;
mod read;
mod read_only;
mod schema;
mod shared;
#[cfg(test)]
mod step_tables_tests;
mod sweep;
mod tls;
mod txn;
mod verify;

use crate::store::{FinishStepRequest, HistoryRecord, SettleStepRequest, StepRecord, StepRequest};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::Sender;
use parking_lot::Mutex;
use tokio_postgres::types::Type;

use crate::clock::Clock;
use crate::error::{Corrupted, Error, OpenError, Result};
use crate::key::IdempotencyKey;
use crate::message::OutboxEntry;
use crate::policy::PurgeMode;
use crate::report::SweepCounts;
use crate::state::State;
use crate::store::config::StoreConfig;
use crate::store::ops::{OpResult, Ops};
use crate::store::record::{EntityState, Record};
use crate::store::{
    Backend, ClaimRequest, ClaimResult, Claimed, CompleteRequest, InDoubtRequest, LocalResult,
    LocalWrite, ReadOrClaim, Scanned, SettleRequest, Settled, TransitionRequest,
};
use crate::transition::Transition;

pub use self::client::{PgError, Transaction};
pub(crate) use self::clock::DatabaseClock;
pub(crate) use self::read_only::Mode;
pub(crate) use self::schema::DEFAULT_PREFIX;

use self::in_place::Remembered;
use self::shared::Shared;
use self::txn::sql_i64;

/// Keepalive idle time and TCP user timeout of every connection, unless the
/// connection string sets them.
const TCP_TIMEOUT: Duration = Duration::from_secs(30);

/// Dropped claims waiting to be marked UNKNOWN by the background thread.
const DETACHED_QUEUE: usize = 1_024;

/// Work for the dropped-claims thread.
enum Detached {
    /// Mark a dropped claim's record UNKNOWN.
    Mark(InDoubtRequest),
    /// Answer once everything queued before is done (`Engine::flush`).
    Flush(Sender<()>),
}

/// How the builder asked to reach the database.
#[derive(Debug, Clone)]
pub(crate) struct PgOptions {
    pub(crate) url: String,
    pub(crate) prefix: String,
    pub(crate) pool_size: u32,
    pub(crate) connect_timeout: Duration,
    pub(crate) statement_timeout: Duration,
    pub(crate) pool_idle_timeout: Option<Duration>,
    pub(crate) pool_max_lifetime: Option<Duration>,
    pub(crate) database_clock: bool,
    /// Whether the open may create the schema, and may write at all.
    pub(crate) mode: Mode,
}

/// How much longer than the server's `statement_timeout` the client waits
/// for an answer, so the server's own error (which names the statement)
/// usually arrives first.
pub(crate) const DEADLINE_MARGIN: Duration = Duration::from_secs(1);

impl PgOptions {
    /// The client-side bound on each round trip.
    fn deadline(&self) -> Duration {
        self.statement_timeout.saturating_add(DEADLINE_MARGIN)
    }
}

/// The PostgreSQL backend.
pub(crate) struct PgStore {
    /// `None` only while being dropped.
    shared: Option<Arc<Shared>>,
    /// Claims this engine inserted, for writing them in place.
    remembered: Remembered,
    /// How often those writes went in place or fell back.
    in_place: in_place::Counts,
    closed: AtomicBool,
    /// Dropped claims: `mark_in_doubt_detached` must never block, so a
    /// thread of its own does the write.
    detached: Mutex<Option<Sender<Detached>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

fn open_storage<E>(context: &'static str) -> impl FnOnce(E) -> OpenError
where
    E: std::error::Error + Send + Sync + 'static,
{
    move |e| OpenError::Storage {
        context,
        source: Box::new(e),
    }
}

/// The connection settings the engine adds unless the connection string
/// chose: connect timeout, keepalives and TCP user timeout, the server's
/// `statement_timeout`, and read-only sessions for a read-only open.
fn session_settings(config: &mut tokio_postgres::Config, opts: &PgOptions) {
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(opts.connect_timeout);
    }
    // A peer that vanished (a dead host, a partition) fails a call
    // within about 30 s instead of never: keepalives on idle pooled
    // connections, and a limit on unacknowledged data, unless the
    // connection string chose.
    if !config.get_keepalives() || config.get_keepalives_idle() > TCP_TIMEOUT {
        config.keepalives(true).keepalives_idle(TCP_TIMEOUT);
    }
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(TCP_TIMEOUT);
    }
    // The server ends a statement that runs too long (or waits too
    // long for a row lock) itself, with an error that names it, a
    // little before the client's own deadline would give up.
    let options = config.get_options().unwrap_or_default().to_owned();
    if !options.contains("statement_timeout") {
        let ms = opts.statement_timeout.as_millis().max(1);
        config.options(format!("{options} -c statement_timeout={ms}").trim_start());
    }
}

impl PgStore {
    /// [`PgStore::open`], on a thread of its own when called on an async
    /// runtime's thread (see [`guard`]), with a panic inside the client
    /// turned into an error.
    pub(crate) fn open_contained(
        opts: &PgOptions,
        cfg: StoreConfig,
        stored_expiry: bool,
        local_clock: Arc<dyn Clock>,
    ) -> std::result::Result<(PgStore, Arc<dyn Clock>, StoreConfig), OpenError> {
        let mut opened = None;
        let run = || {
            opened = Some(PgStore::open(opts, cfg, stored_expiry, local_clock));
            Ok(())
        };
        match guard("connecting to PostgreSQL", run) {
            Ok(()) => opened.unwrap_or_else(|| {
                Err(OpenError::Storage {
                    context: "connecting to PostgreSQL",
                    source: "the open did not finish".into(),
                })
            }),
            Err(Error::Storage { context, source }) => Err(OpenError::Storage { context, source }),
            Err(e) => Err(OpenError::Storage {
                context: "connecting to PostgreSQL",
                source: Box::new(e),
            }),
        }
    }

    /// Connects, creates or checks the schema, and measures the database
    /// clock. Returns the store, the clock the engine must use, and the
    /// settings (taken from the database with `stored_expiry`).
    pub(crate) fn open(
        opts: &PgOptions,
        cfg: StoreConfig,
        stored_expiry: bool,
        local_clock: Arc<dyn Clock>,
    ) -> std::result::Result<(PgStore, Arc<dyn Clock>, StoreConfig), OpenError> {
        let names = schema::Names::new(&opts.prefix)?;
        let (mut config, tls, plan) = tls::configure(&opts.url)?;
        session_settings(&mut config, opts);
        let setup = read_only::session_setup(opts.mode);
        // One connection first, outside the pool: a wrong database, user or
        // password, or a refused port, fails the open at once with what the
        // server or the socket said (the pool would retry until its timeout
        // and keep only "db error"). It prepares the schema.
        let mut first = client::Client::connect(
            &config,
            &tls,
            &plan,
            setup,
            opts.connect_timeout,
            opts.deadline(),
        )
        .map_err(|e| OpenError::Storage {
            context: "connecting to PostgreSQL",
            source: Box::new(e),
        })?;
        let cfg = match opts.mode {
            Mode::Create => schema::prepare(&mut first, &names, cfg, stored_expiry, true)?,
            Mode::Existing => schema::prepare(&mut first, &names, cfg, stored_expiry, false)?,
            Mode::ReadOnly => read_only::check(&mut first, &names, cfg, stored_expiry)?,
        };
        let (clock, database_clock): (Arc<dyn Clock>, _) = if opts.database_clock {
            let clock = Arc::new(DatabaseClock::new(local_clock));
            clock.sync(&mut first).map_err(|e| OpenError::Storage {
                context: "reading the database clock",
                source: Box::new(e),
            })?;
            (clock.clone(), Some(clock))
        } else {
            (local_clock, None)
        };
        drop(first);
        // Connections are checked by use, not by a probe per checkout: a
        // broken one fails its statement, is dropped by the pool, and the
        // write is retried once on a fresh one (see `Shared::write`).
        let generation = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let manager = shared::Manager {
            config,
            tls,
            plan,
            setup,
            connect_timeout: opts.connect_timeout,
            deadline: opts.deadline(),
            generation: generation.clone(),
        };
        let pool = r2d2::Pool::builder()
            .max_size(opts.pool_size.max(1))
            .min_idle(Some(1))
            .test_on_check_out(false)
            .connection_timeout(opts.connect_timeout.saturating_mul(5))
            .idle_timeout(opts.pool_idle_timeout)
            .max_lifetime(opts.pool_max_lifetime)
            .build(manager)
            .map_err(open_storage("connecting to PostgreSQL"))?;
        let shared = Arc::new(Shared {
            pool,
            names,
            cfg,
            clock: clock.clone(),
            database_clock,
            connect_timeout: opts.connect_timeout,
            deadline: opts.deadline(),
            generation,
        });
        let (tx, rx) = crossbeam_channel::bounded::<Detached>(DETACHED_QUEUE);
        let worker_shared = shared.clone();
        let worker = std::thread::Builder::new()
            .name("idempotency-pg-dropped-claims".into())
            .spawn(move || {
                for work in rx {
                    let req = match work {
                        Detached::Mark(req) => req,
                        Detached::Flush(done) => {
                            let _ = done.send(());
                            continue;
                        }
                    };
                    let key = req.key.clone();
                    let marked = worker_shared.write("marking a dropped claim UNKNOWN", |t| {
                        t.mark_in_doubt(req.clone())
                    });
                    if let Err(e) = marked {
                        tracing::warn!(%key, error = %e, "could not mark a dropped claim UNKNOWN; its lease running out has the same effect");
                    }
                }
            })
            .map_err(|source| OpenError::ThreadStart {
                thread: "dropped-claims",
                source,
            })?;
        let store = PgStore {
            shared: Some(shared),
            remembered: Remembered::default(),
            in_place: in_place::Counts::default(),
            closed: AtomicBool::new(false),
            detached: Mutex::new(Some(tx)),
            worker: Mutex::new(Some(worker)),
        };
        Ok((store, clock, cfg))
    }

    /// `begin`'s first step, and a claim's fast path, in one round trip:
    /// one autocommitted statement reads the key's row and, only when
    /// there is none, inserts the claim's PROCESSING record with a token
    /// drawn in the same statement (`INSERT … SELECT … nextval … WHERE NOT
    /// EXISTS … ON CONFLICT DO NOTHING RETURNING token`). The record's bytes
    /// are written before the token is known, so they carry token 0 and no
    /// reference: every read of a row takes the token from its column and
    /// derives the reference from it (`txn::with_token`).
    ///
    /// A connection found dead is replaced and the statement sent again:
    /// if the first one did insert (its answer lost), the second finds that
    /// record and answers it as held (PROCESSING, then UNKNOWN once its
    /// lease ends), never as a second claim.
    fn claim_or_read(&self, req: &ClaimRequest) -> Result<ReadOrClaim> {
        let what = "claiming a key";
        let s = self.shared()?;
        let r = &s.names.records;
        let sql = format!(
            "WITH existing AS (
                 SELECT token, record FROM {r} WHERE scope = $1 AND key = $2
             ), inserted AS (
                 INSERT INTO {r}
                     (scope, key, state, token, lease_until_ms, unknown_since_ms, expires_at_ms, record)
                 SELECT $1, $2, 0, nextval('{}'), $3, 0, 0, $4
                 WHERE NOT EXISTS (SELECT 1 FROM existing)
                 ON CONFLICT (scope, key) DO NOTHING
                 RETURNING token
             )
             SELECT (SELECT token FROM inserted), (SELECT token FROM existing),
                    (SELECT record FROM existing),
                    EXISTS (SELECT 1 FROM {} WHERE scope = $1 AND key = $2)
                    OR EXISTS (SELECT 1 FROM {} WHERE scope = $1 AND key = $2)",
            s.names.tokens, s.names.steps, s.names.history
        );
        let now = s.clock.now_ms();
        let (rec, _) = crate::store::ops::fresh_claim(req, 0, now);
        let rec = Record {
            reference: String::new(),
            ..rec
        };
        let bytes = crate::store::codec::encode(req.key.record_key(), &rec);
        let (_, row) = s.on_live_conn(
            what,
            |conn| {
                let statement =
                    conn.prepared(&sql, &[Type::TEXT, Type::TEXT, Type::INT8, Type::BYTEA])?;
                conn.query_one(
                    &statement,
                    &[
                        &req.key.scope(),
                        &req.key.key(),
                        &sql_i64(rec.lease_until_ms),
                        &bytes,
                    ],
                )
            },
            shared::storage("claiming a key on PostgreSQL (the outcome is unknown)"),
        )?;
        if let Some(token) = row.get::<_, Option<i64>>(0) {
            let token = txn::sql_u64(token);
            let record = txn::with_token(rec, token, &req.key);
            // A resumed key kept its steps: the claim sees them (one more
            // read, for such keys only), and writes through the full
            // path, which logs the completion. So does a key that kept a
            // log without steps (its view would not know the log).
            let steps = if row.get::<_, bool>(3) {
                s.steps(&req.key, now)?
            } else {
                self.remembered
                    .insert(&req.key, in_place::View::fresh(record.clone(), bytes));
                Vec::new()
            };
            let claimed = Claimed {
                token,
                reference: record.reference.clone(),
                claimed_at_ms: now,
                lease_until_ms: record.lease_until_ms,
                steps,
            };
            tracing::debug!(key = %req.key, token, reference = %claimed.reference, "claimed");
            return Ok(ReadOrClaim::Claimed(claimed));
        }
        match (row.get::<_, Option<i64>>(1), row.get::<_, Option<&[u8]>>(2)) {
            (Some(token), Some(bytes)) => {
                let record = crate::store::codec::decode(req.key.record_key(), bytes)
                    .map(|rec| txn::with_token(rec, txn::sql_u64(token), &req.key))
                    .map_err(|e| Error::Corrupt {
                        what: Corrupted::Record(req.key.clone()),
                        reason: e.to_string(),
                    })?;
                Ok(ReadOrClaim::Read(Some(record)))
            }
            // Another transaction inserted the key after this statement's
            // snapshot: the full claim decides.
            _ => Ok(ReadOrClaim::Read(None)),
        }
    }

    /// Runs `op` in one statement on the view remembered for claim
    /// `token` of `key` (see `in_place.rs`), and keeps the view after it
    /// (unless `complete`: the claim is done). `None`: nothing was
    /// written, take the full path. A statement whose answer was lost is
    /// settled by reading the rows once its backend is gone, as a lost
    /// COMMIT is; when that cannot be told, the error says the outcome is
    /// unknown (`unknown`).
    fn in_place<T: Send>(
        &self,
        (context, unknown): (&'static str, &'static str),
        key: &IdempotencyKey,
        token: u64,
        complete: Option<&CompleteRequest>,
        op: impl FnOnce(&mut in_place::Recorder<'_>) -> OpResult<T, ()> + Send,
    ) -> Result<Option<T>> {
        let Some(view) = self.remembered.take(key, token) else {
            return Ok(None);
        };
        let written = guard(context, || {
            let s = self.shared()?;
            let Some((answer, writes, after)) =
                in_place::decide(key, &view, s.clock.now_ms(), s.cfg, op)
            else {
                return Ok(None);
            };
            let mut conn = s.conn(context)?;
            let backend = conn.backend().cloned();
            let landed = match in_place_sql::send(&mut conn, &s.names, key, &view, &writes) {
                Ok(landed) => landed,
                // The statement's answer was lost: once the connection's
                // backend is gone, the rows say whether it ran.
                Err(e) if e.as_db_error().is_none() || shared::lost(&e) => {
                    drop(conn);
                    s.suspect();
                    let settled = backend
                        .filter(|backend| s.fence(backend))
                        .map(|_| s.in_place_landed(key, &view, &writes, complete))
                        .transpose()?
                        .flatten();
                    match settled {
                        Some(landed) => {
                            tracing::warn!(error = %e, key = %key, landed, context, "an in-place write's answer was lost; settled by reading the rows");
                            landed
                        }
                        None => return Err(shared::storage(unknown)(e)),
                    }
                }
                Err(e) => return Err(shared::storage(context)(e)),
            };
            Ok(landed.then_some((answer, after)))
        })?;
        self.in_place.count(written.is_some());
        Ok(written.map(|(answer, after)| {
            if complete.is_none() {
                self.remembered.insert(key, after);
            }
            answer
        }))
    }

    fn shared(&self) -> Result<&Shared> {
        self.shared.as_deref().ok_or(Error::Closed)
    }

    fn open_check(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    /// `Error::Reentrant` for a write from inside a local write closure of
    /// this engine (it would wait for its own transaction's row lock).
    fn write_check(&self) -> Result<()> {
        self.open_check()?;
        match self.shared() {
            Ok(shared) if local::inside(shared) => Err(Error::Reentrant),
            _ => Ok(()),
        }
    }

    fn write<T: Send>(
        &self,
        context: &'static str,
        op: impl FnMut(&mut txn::PgTxn<'_, '_>) -> crate::store::ops::OpResult<T, txn::Fault> + Send,
    ) -> Result<T> {
        self.write_check()?;
        guard(context, || self.shared()?.write(context, op))
    }
}

impl Backend for PgStore {
    fn check(&self) -> Result<()> {
        self.open_check()
    }

    fn record(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        self.open_check()?;
        guard("reading a record", || self.shared()?.record(key))
    }

    fn in_doubt(&self, limit: usize, now_ms: u64) -> Result<Vec<(IdempotencyKey, Record)>> {
        self.open_check()?;
        guard("reading the recovery queue", || {
            self.shared()?.in_doubt(limit, now_ms)
        })
    }

    fn scan(&self, visit: &mut (dyn FnMut(Scanned) -> bool + Send)) -> Result<()> {
        self.open_check()?;
        guard("listing records", || self.shared()?.scan(visit))
    }

    fn oldest_in_doubt_ms(&self, now_ms: u64) -> Result<Option<u64>> {
        self.open_check()?;
        guard("reading the recovery queue", || {
            self.shared()?.oldest_in_doubt_ms(now_ms)
        })
    }

    fn sweep_due(&self, now_ms: u64) -> Result<bool> {
        self.open_check()?;
        // The sweeper asks this every tick, busy or idle: a good moment to
        // measure the database clock again.
        guard("checking for sweep work", || {
            let shared = self.shared()?;
            shared.sync_clock();
            shared.sweep_due(now_ms)
        })
    }

    fn outbox(&self, limit: usize) -> Result<Vec<OutboxEntry>> {
        self.open_check()?;
        guard("reading the outbox", || self.shared()?.outbox(limit))
    }

    fn dead_letters(&self, limit: usize) -> Result<Vec<crate::dead_letter::DeadLetter>> {
        self.open_check()?;
        guard("reading the dead letters", || {
            self.shared()?.dead_letters(limit)
        })
    }

    fn outbox_len(&self) -> Result<u64> {
        self.open_check()?;
        guard("counting the outbox", || self.shared()?.outbox_len())
    }

    fn entity(&self, entity: &str) -> Result<Option<EntityState>> {
        self.open_check()?;
        guard("reading an entity", || self.shared()?.entity(entity))
    }

    fn steps(&self, key: &IdempotencyKey) -> Result<Vec<StepRecord>> {
        self.open_check()?;
        guard("reading effect steps", || {
            let shared = self.shared()?;
            shared.steps(key, shared.clock.now_ms())
        })
    }

    fn history(&self, key: &IdempotencyKey) -> Result<Vec<HistoryRecord>> {
        self.open_check()?;
        guard("reading the evidence log", || self.shared()?.history(key))
    }

    fn reserve_step(&self, req: StepRequest) -> Result<StepRecord> {
        self.open_check()?;
        let contexts = (
            "reserving an effect step",
            "reserving an effect step on PostgreSQL (the outcome is unknown)",
        );
        let in_place = self.in_place(contexts, &req.key, req.token, None, |t| {
            t.reserve_step(req.clone())
        })?;
        if let Some(step) = in_place {
            return Ok(step);
        }
        // The full path changes the rows behind any view.
        self.remembered.forget(&req.key);
        self.write(contexts.0, |t| t.reserve_step(req.clone()))
    }

    fn finish_step(&self, req: FinishStepRequest) -> Result<StepRecord> {
        self.open_check()?;
        let contexts = (
            "confirming an effect step",
            "confirming an effect step on PostgreSQL (the outcome is unknown)",
        );
        let in_place = self.in_place(contexts, &req.key, req.token, None, |t| {
            t.finish_step(req.clone())
        })?;
        if let Some(step) = in_place {
            return Ok(step);
        }
        self.remembered.forget(&req.key);
        self.write(contexts.0, |t| t.finish_step(req.clone()))
    }

    fn settle_step(&self, req: SettleStepRequest) -> Result<StepRecord> {
        self.write("settling an effect step", |t| t.settle_step(req.clone()))
    }

    fn read_or_claim(
        &self,
        key: &IdempotencyKey,
        claim: &dyn Fn() -> ClaimRequest,
    ) -> Result<ReadOrClaim> {
        if self.write_check().is_err() {
            // Only read; the claim that follows is refused.
            return self.record(key).map(ReadOrClaim::Read);
        }
        let req = claim();
        guard("claiming a key", || self.claim_or_read(&req))
    }

    fn claim(&self, req: ClaimRequest) -> Result<ClaimResult> {
        self.write_check()?;
        if let ReadOrClaim::Claimed(claimed) = guard("claiming a key", || self.claim_or_read(&req))?
        {
            return Ok(ClaimResult::Claimed(claimed));
        }
        self.write("claiming a key", |t| t.claim(&req))
    }

    fn complete(&self, req: CompleteRequest) -> Result<()> {
        self.open_check()?;
        let contexts = (
            "storing an outcome",
            "storing an outcome on PostgreSQL (the outcome is unknown)",
        );
        let in_place = self.in_place(contexts, &req.key, req.token, Some(&req), |t| {
            t.complete(req.clone())
        })?;
        if in_place.is_some() {
            tracing::debug!(key = %req.key, token = req.token, completion = ?req.completion, "completed");
            return Ok(());
        }
        // A retry (a connection found broken before the commit) needs the
        // request again.
        self.write("storing an outcome", |t| t.complete(req.clone()))
    }

    fn release(&self, key: IdempotencyKey, token: u64) -> Result<()> {
        self.remembered.forget(&key);
        self.write("releasing a claim", |t| t.release(&key, token))
    }

    fn mark_in_doubt(&self, req: InDoubtRequest) -> Result<()> {
        self.remembered.forget(&req.key);
        self.write("marking a claim UNKNOWN", |t| t.mark_in_doubt(req.clone()))
    }

    fn mark_in_doubt_detached(&self, req: InDoubtRequest) {
        self.remembered.forget(&req.key);
        if let Some(tx) = self.detached.lock().as_ref() {
            // Never blocks; when the queue is full the lease running out
            // has the same effect, later.
            let _ = tx.try_send(Detached::Mark(req));
        }
    }

    fn extend(&self, key: IdempotencyKey, token: u64, lease_ms: u64) -> Result<u64> {
        // The record changes: a view would no longer match it.
        self.remembered.forget(&key);
        self.write("extending a lease", |t| t.extend(&key, token, lease_ms))
    }

    fn settle(&self, req: SettleRequest) -> Result<Settled<()>> {
        self.write("settling an in-doubt record", |t| t.settle(req.clone()))
    }

    fn settle_then_claim(
        &self,
        req: SettleRequest,
        claim: ClaimRequest,
    ) -> Result<Settled<Claimed>> {
        self.write("settling an in-doubt record", |t| {
            t.settle_then_claim(req.clone(), &claim)
        })
    }

    fn sweep(&self, limit: usize) -> Result<SweepCounts> {
        self.open_check()?;
        guard("reading the database clock", || {
            self.shared()?.sync_clock();
            Ok(())
        })?;
        self.write("sweeping", |t| t.sweep(limit))
    }

    fn purge(&self, key: IdempotencyKey, mode: PurgeMode) -> Result<Option<State>> {
        self.write("purging a record", |t| t.purge(&key, mode))
    }

    fn transition(&self, req: TransitionRequest) -> Result<Transition> {
        self.write("changing an entity's state", |t| t.transition(req.clone()))
    }

    fn dead_letter(&self, req: crate::store::DeadLetterRequest) -> Result<u64> {
        self.write("giving a message up to the dead letters", |t| {
            t.dead_letter(req.clone())
        })
    }

    fn redrive(&self, seq: u64) -> Result<Option<String>> {
        self.write("redriving a dead letter", |t| t.redrive(seq))
    }

    fn mark_published(&self, seqs: Vec<u64>) -> Result<u64> {
        self.write("removing published outbox messages", |t| {
            t.mark_published(&seqs)
        })
    }

    fn flush(&self) -> Result<()> {
        // Every write is committed before it returns, except the notices
        // of dropped claims: wait for those queued so far.
        self.open_check()?;
        let queue = self.detached.lock().clone();
        if let Some(queue) = queue {
            let (done, finished) = crossbeam_channel::bounded(1);
            if queue.send(Detached::Flush(done)).is_ok() {
                let _ = finished.recv();
            }
        }
        Ok(())
    }

    fn local(&self, write: LocalWrite) -> Result<LocalResult> {
        self.write_check()?;
        // A local write finishes (or never had) a claim: its view goes as
        // for every other finishing write, or it would hold one of the
        // `REMEMBERED` places for good.
        self.remembered.forget(&write.key);
        guard("running a local write", || self.shared()?.local(write))
    }

    fn verify(&self) -> Result<(Vec<crate::verify::Damage>, u64)> {
        self.open_check()?;
        guard("verifying the database", || self.shared()?.verify())
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        // Closing the queue lets the thread finish what is queued and exit.
        drop(self.detached.lock().take());
        if let Some(worker) = self.worker.lock().take() {
            if worker.join().is_err() {
                tracing::error!("the dropped-claims thread panicked");
            }
        }
    }
}

impl Drop for PgStore {
    fn drop(&mut self) {
        self.close();
        // The client runs a runtime of its own, which may not be dropped
        // on an async runtime's thread (an app dropping its last engine
        // handle in an async task): drop the pool on a thread of ours.
        if let Some(shared) = self.shared.take() {
            let dropped = std::thread::Builder::new()
                .name("idempotency-pg-close".into())
                .spawn(move || drop(shared));
            if let Ok(thread) = dropped {
                let _ = thread.join();
            }
        }
    }
}

/// Runs a call into the PostgreSQL client. The synchronous client blocks
/// on a runtime of its own, which tokio forbids on an async runtime's
/// thread (it panics, and a second panic in the client's destructor aborts
/// the process): there, the call runs on a thread of its own and the
/// caller blocks for it, as it would on redb. A panic inside the client is
/// turned into `Error::Storage`.
fn guard<T: Send>(context: &'static str, call: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    if tokio::runtime::Handle::try_current().is_err() {
        return contain(context, call);
    }
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("idempotency-pg-call".into())
            .spawn_scoped(scope, || contain(context, call))
            .map_err(|e| Error::Storage {
                context,
                source: Box::new(e),
            })?
            .join()
            .unwrap_or_else(|panic| Err(panicked(context, panic.as_ref())))
    })
}

fn contain<T>(context: &'static str, call: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(call))
        .unwrap_or_else(|panic| Err(panicked(context, panic.as_ref())))
}

fn panicked(context: &'static str, panic: &(dyn std::any::Any + Send)) -> Error {
    let message = crate::store::panic_message(panic);
    tracing::error!(%message, context, "the PostgreSQL client panicked");
    Error::Storage {
        context,
        source: format!("the PostgreSQL client panicked: {message}").into(),
    }
}
