//! A shared backend opened read-only (PostgreSQL's `open_postgres_read_only`,
//! Redis's `open_redis_read_only`): [`ReadOnly`] passes every read to the
//! store and refuses every write with `Error::ReadOnly` before it reaches
//! the server (`refuse.rs`). redb's reader is its own type
//! (`store/redb/read_only.rs`): it reads a file no writer holds.

use crate::error::Result;
use crate::key::IdempotencyKey;
use crate::message::OutboxEntry;
use crate::store::record::{EntityState, Record};
use crate::store::{Backend, ClaimRequest, HistoryRecord, ReadOrClaim, Scanned, StepRecord};

/// A store opened read-only: reads go to `B`, writes are refused with
/// `Error::ReadOnly`, and `begin` answers from the record alone (a key
/// with none is refused, as a claim).
pub(crate) struct ReadOnly<B>(pub(crate) B);

impl<B: Backend> Backend for ReadOnly<B> {
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

    fn scan_in_key_order(&self, visit: &mut (dyn FnMut(Scanned) -> bool + Send)) -> Result<()> {
        self.0.scan_in_key_order(visit)
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

    fn steps(&self, key: &IdempotencyKey) -> Result<Vec<StepRecord>> {
        self.0.steps(key)
    }

    fn history(&self, key: &IdempotencyKey) -> Result<Vec<HistoryRecord>> {
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
