//! What every call of the Redis backend shares (the pool, the key names,
//! the settings, the clock), and the runner that applies one operation as
//! one guarded script: run, commit, rerun on a conflict, settle a lost
//! answer by reading back.

use std::sync::Arc;
use std::time::Duration;

use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::store::config::StoreConfig;
use crate::store::ops::{OpError, OpResult};

use super::conn::{describe, lost, storage, Manager, RedisConn};
use super::keys::Keys;
use super::script::{Batch, Probe};
use super::txn::{Fault, RedisTxn};

pub(super) type Pool = r2d2::Pool<Manager>;
pub(super) type Conn = r2d2::PooledConnection<Manager>;

/// How often an op whose reads another engine changed before its commit
/// is run again before the call gives up. Each rerun reads the winner's
/// writes, so a handful is the norm even for a hot key.
pub(super) const CONFLICT_RETRIES: usize = 64;

pub(super) struct Shared {
    pub(super) pool: Pool,
    pub(super) keys: Keys,
    pub(super) index: [String; 4],
    pub(super) cfg: StoreConfig,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) script: redis::Script,
    pub(super) claim_script: redis::Script,
    /// The completion of a held claim (`script::SETTLE_HELD`).
    pub(super) settle_held_script: redis::Script,
    /// `WAIT`: replicas that must acknowledge each write, and for how long
    /// to wait for them.
    pub(super) wait_replicas: Option<(u32, Duration)>,
    /// The bound on one round trip.
    pub(super) command_timeout: Duration,
}

/// How one attempt of an op ended.
pub(super) enum Attempt<T> {
    Done(T),
    /// A guard failed (or the commit is known not to have run): run again.
    Again,
}

impl Shared {
    /// A pooled connection.
    pub(super) fn conn(&self, context: &'static str) -> Result<Conn> {
        self.pool.get().map_err(|e| Error::Storage {
            context,
            source: format!("no connection to Redis: {e}").into(),
        })
    }

    /// Runs `f` on a pooled connection, and again on a fresh one while the
    /// connection turns out to be lost (reads only: safe to send again).
    pub(super) fn read<T>(
        &self,
        context: &'static str,
        mut f: impl FnMut(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> Result<T> {
        let mut left = self.pool.max_size();
        loop {
            let mut conn = self.conn(context)?;
            match f(&mut conn.conn) {
                Ok(value) => return Ok(value),
                // A dead connection (a restarted server leaves the pool
                // full of them) is replaced; a silent server is not asked
                // again, so a call waits one timeout, not one per retry.
                Err(e) if lost(&e) && !e.is_timeout() && left > 0 => {
                    drop_broken(conn);
                    left -= 1;
                }
                Err(e) => {
                    if lost(&e) {
                        drop_broken(conn);
                    }
                    return Err(storage(context)(e));
                }
            }
        }
    }

    /// Runs `op` as one optimistic transaction and commits it with one
    /// guarded script (see `script.rs`). A conflict reruns the op; a read
    /// that finds the connection lost reruns it on another; a commit whose
    /// answer was lost is settled by reading back ([`Shared::settle`]).
    pub(super) fn write<T>(
        &self,
        context: &'static str,
        mut op: impl FnMut(&mut RedisTxn<'_>) -> OpResult<T, Fault>,
    ) -> Result<T> {
        self.write_with(context, |_| {}, &mut op)
    }

    /// [`Shared::write`], with `prime` run on each attempt's transaction
    /// before the op (to assume bytes it would otherwise read).
    pub(super) fn write_with<T>(
        &self,
        context: &'static str,
        mut prime: impl FnMut(&mut RedisTxn<'_>),
        op: &mut impl FnMut(&mut RedisTxn<'_>) -> OpResult<T, Fault>,
    ) -> Result<T> {
        let mut reconnects = self.pool.max_size();
        for attempt in 0..CONFLICT_RETRIES {
            let mut conn = self.conn(context)?;
            let now = self.clock.now_ms();
            // Only the first attempt may assume: a conflict means the
            // assumption (or a read) was wrong.
            let mut t = RedisTxn::new(&mut conn, &self.keys, now, self.cfg);
            if attempt == 0 {
                prime(&mut t);
            }
            let result = op(&mut t);
            let batch = std::mem::take(&mut t.batch);
            let reads = t.reads;
            let token_damaged = t.token_damaged;
            drop(t);
            match result {
                Ok(value) => match self.commit(context, &mut conn, &batch, reads)? {
                    Attempt::Done(()) => return Ok(value),
                    Attempt::Again => {}
                },
                Err(OpError::Refused(e)) => {
                    // A refusal decided on several reads stands only if
                    // they were all true at one instant.
                    let checked = Batch {
                        guards: batch.guards,
                        writes: Vec::new(),
                    };
                    match self.commit(context, &mut conn, &checked, reads)? {
                        Attempt::Done(()) => return Err(e),
                        Attempt::Again => {}
                    }
                }
                Err(OpError::Fatal(Fault(e))) if lost(&e) && !e.is_timeout() && reconnects > 0 => {
                    tracing::warn!(error = %describe(&e), context, "Redis connection lost before the commit; running the op again on another");
                    drop_broken(conn);
                    reconnects -= 1;
                }
                Err(OpError::Fatal(Fault(e))) if token_damaged => {
                    return Err(super::conn::token_counter_damaged(&e));
                }
                Err(OpError::Fatal(Fault(e))) => {
                    if lost(&e) {
                        drop_broken(conn);
                    }
                    return Err(storage(context)(e));
                }
            }
        }
        Err(Error::Storage {
            context,
            source: format!(
                "{CONFLICT_RETRIES} attempts in a row found their reads changed by \
                 other writers before they could commit"
            )
            .into(),
        })
    }

    /// Commits `batch`. A batch that writes nothing and read at most one
    /// key needs no script (one read is true at its instant).
    pub(super) fn commit(
        &self,
        context: &'static str,
        conn: &mut RedisConn,
        batch: &Batch,
        reads: usize,
    ) -> Result<Attempt<()>> {
        if batch.is_empty() && reads <= 1 {
            return Ok(Attempt::Done(()));
        }
        let index = [
            self.index[0].as_str(),
            self.index[1].as_str(),
            self.index[2].as_str(),
            self.index[3].as_str(),
        ];
        let scripts = super::script::Scripts {
            guarded: &self.script,
            settle_held: &self.settle_held_script,
        };
        let (cmd, script) = batch.command(&scripts, &index);
        match super::script::eval::<i64>(&mut conn.conn, script, &cmd) {
            Ok(0) => {
                if !batch.is_empty() {
                    self.wait_replicas(context, &mut conn.conn)?;
                }
                Ok(Attempt::Done(()))
            }
            Ok(guard) => {
                tracing::debug!(
                    guard,
                    context,
                    "a guarded write found its reads changed; running the op again"
                );
                Ok(Attempt::Again)
            }
            Err(e) if lost(&e) && !batch.is_empty() => {
                mark_broken(conn);
                self.settle(context, conn.id, batch, &e)
            }
            Err(e) if lost(&e) => {
                mark_broken(conn);
                Ok(Attempt::Again)
            }
            Err(e) => Err(storage(context)(e)),
        }
    }

    /// A commit whose answer was lost: ends its connection on the server
    /// (after `CLIENT KILL` answers, the script has either run or never
    /// will: Redis runs one command at a time and drops a killed client's
    /// unread input), then reads one key the commit changes. Its new bytes:
    /// the commit ran. Its old bytes: it did not, and the op runs again.
    /// Anything else (or no answer): the outcome is unknown, and the call
    /// says so; it never guesses.
    fn settle(
        &self,
        context: &'static str,
        id: i64,
        batch: &Batch,
        e: &redis::RedisError,
    ) -> Result<Attempt<()>> {
        let unknown = |why: String| {
            tracing::error!(error = %describe(e), context, why, "a write's answer was lost; its outcome is unknown");
            Error::Storage {
                context,
                source: format!(
                    "the answer to a write was lost and its outcome is unknown ({}; {why})",
                    describe(e)
                )
                .into(),
            }
        };
        let Some(probe) = batch.probe() else {
            return Err(unknown("it changes no key that tells".to_owned()));
        };
        let killed = self.read("ending a Redis connection whose answer was lost", |c| {
            redis::cmd("CLIENT")
                .arg("KILL")
                .arg("ID")
                .arg(id)
                .query::<i64>(c)
                .or_else(|k| match k.code() {
                    // "No such client": it is gone already.
                    Some("ERR") => Ok(0),
                    _ => Err(k),
                })
        });
        if let Err(k) = killed {
            return Err(unknown(format!("could not end its connection: {k}")));
        }
        let now = match self.read_probe(&probe) {
            Ok(now) => now,
            Err(r) => return Err(unknown(format!("could not read it back: {r}"))),
        };
        if now == probe.new {
            tracing::warn!(error = %describe(e), context, "a write's answer was lost; reading back shows it ran");
            if self.wait_replicas.is_some() {
                // `WAIT` counts the writes of its own connection: a no-op
                // write (INCRBY 0, propagated all the same) first puts the
                // lost write, earlier in the replication stream, behind it.
                let mut c = self.conn(context)?;
                let _: u64 = redis::cmd("INCRBY")
                    .arg(&self.keys.token)
                    .arg(0)
                    .query(&mut c.conn)
                    .map_err(storage(context))?;
                self.wait_replicas(context, &mut c.conn)?;
            }
            Ok(Attempt::Done(()))
        } else if now == probe.old {
            tracing::warn!(error = %describe(e), context, "a write's answer was lost; reading back shows it never ran; running it again");
            Ok(Attempt::Again)
        } else {
            Err(unknown(
                "the key it changes now holds other bytes".to_owned(),
            ))
        }
    }

    fn read_probe(&self, probe: &Probe) -> Result<Option<Vec<u8>>> {
        self.read(
            "reading back a write whose answer was lost",
            |c| match &probe.field {
                Some(field) => redis::cmd("HGET").arg(&probe.key).arg(field).query(c),
                None => redis::cmd("GET").arg(&probe.key).query(c),
            },
        )
    }

    /// `WAIT` for the configured replicas; fewer within the time is an
    /// error (the write stands on the primary).
    pub(super) fn wait_replicas(
        &self,
        context: &'static str,
        conn: &mut redis::Connection,
    ) -> Result<()> {
        let Some((replicas, timeout)) = self.wait_replicas else {
            return Ok(());
        };
        let ms = u64::try_from(timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        // The server answers within `ms`; the read timeout must not cut
        // that wait short.
        let _ = conn.set_read_timeout(Some(timeout.saturating_add(self.command_timeout)));
        let acked: redis::RedisResult<u32> = redis::cmd("WAIT").arg(replicas).arg(ms).query(conn);
        let _ = conn.set_read_timeout(Some(self.command_timeout));
        let acked = acked.map_err(storage(context))?;
        if acked < replicas {
            return Err(Error::Storage {
                context,
                source: format!(
                    "written on the primary, but only {acked} of {replicas} replicas acknowledged \
                     it within {timeout:?} (EngineBuilder::wait_replicas)"
                )
                .into(),
            });
        }
        Ok(())
    }
}

/// Drops a connection that must not go back to the pool (it may hold an
/// unread answer).
fn drop_broken(mut conn: Conn) {
    mark_broken(&mut conn);
}

/// Marks a connection so the pool discards it instead of reusing it.
pub(super) fn mark_broken(conn: &mut RedisConn) {
    conn.broken = true;
}
