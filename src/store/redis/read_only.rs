//! Opening a key prefix that must already hold the engine's layout, and
//! opening it read-only, for operator tools (`idem`), as
//! `store/postgres/read_only.rs` does for tables.
//!
//! A read-only open checks only that the server is a single Redis (no
//! scripting check, no durability check: it runs no script and writes
//! nothing) and reads `<prefix>meta`; [`RedisReader`] refuses every write
//! with `Error::ReadOnly` before it reaches the server. Its reads are
//! plain commands (`GET`, `MGET`, `HGETALL`, `HMGET`, `ZRANGE`, `ZCOUNT`,
//! `ZCARD`, `EXISTS`, `SCAN`, and `MULTI`/`EXEC` around a record and its
//! effect steps), so a user whose ACL allows only those (and `INFO`,
//! `CLIENT ID`) can run it, and so can a replica.

use crate::error::Result;
use crate::key::IdempotencyKey;
use crate::message::OutboxEntry;
use crate::store::record::{EntityState, Record};
use crate::store::{Backend, ClaimRequest, ReadOrClaim, Scanned};

use super::RedisStore;

/// How an open treats the key prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Write the layout if the prefix has none (`open_redis`).
    Create,
    /// Use the layout; refuse a prefix without one (`open_redis_existing`).
    Existing,
    /// As `Existing`, and write nothing: writes refused
    /// (`open_redis_read_only`).
    ReadOnly,
}

/// A Redis store opened read-only: reads go to the store, writes are
/// refused with `Error::ReadOnly` before they reach the server.
pub(crate) struct RedisReader(pub(crate) RedisStore);

impl Backend for RedisReader {
    fn check(&self) -> Result<()> {
        self.0.check()
    }

    fn record(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        self.0.record(key)
    }

    fn in_doubt(&self, limit: usize, now_ms: u64) -> Result<Vec<(IdempotencyKey, Record)>> {
        self.0.in_doubt(limit, now_ms)
    }

    fn scan(&self, visit: &mut (dyn FnMut(Scanned) -> bool + Send)) -> Result<()> {
        self.0.scan(visit)
    }

    fn oldest_in_doubt_ms(&self, now_ms: u64) -> Result<Option<u64>> {
        self.0.oldest_in_doubt_ms(now_ms)
    }

    fn sweep_due(&self, now_ms: u64) -> Result<bool> {
        self.0.sweep_due(now_ms)
    }

    fn outbox(&self, limit: usize) -> Result<Vec<OutboxEntry>> {
        self.0.outbox(limit)
    }

    fn dead_letters(&self, limit: usize) -> Result<Vec<crate::dead_letter::DeadLetter>> {
        self.0.dead_letters(limit)
    }

    fn outbox_len(&self) -> Result<u64> {
        self.0.outbox_len()
    }

    fn entity(&self, entity: &str) -> Result<Option<EntityState>> {
        self.0.entity(entity)
    }

    fn steps(&self, key: &IdempotencyKey) -> Result<Vec<crate::store::StepRecord>> {
        self.0.steps(key)
    }

    fn history(&self, key: &IdempotencyKey) -> Result<Vec<crate::store::HistoryRecord>> {
        self.0.history(key)
    }

    fn read_or_claim(
        &self,
        key: &IdempotencyKey,
        _claim: &dyn Fn() -> ClaimRequest,
    ) -> Result<ReadOrClaim> {
        self.record(key).map(ReadOrClaim::Read)
    }

    crate::store::refuse::refuse_writes!();

    fn verify(&self) -> Result<(Vec<crate::verify::Damage>, u64)> {
        self.0.verify()
    }

    fn close(&self) {
        self.0.close();
    }
}
