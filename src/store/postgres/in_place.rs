//! Completing a claim in one statement, without a transaction block.
//!
//! The full path (`Shared::write`) is four round trips: `BEGIN`, `SELECT …
//! FOR UPDATE`, `UPDATE`, `COMMIT`. But a claim this engine inserted
//! itself knows its record exactly: the bytes it wrote. So the shared
//! operation (`Ops::complete`) runs against that remembered record, and
//! its one write is sent as an autocommitted compare-and-set:
//! `UPDATE … WHERE scope, key, token AND record = <the remembered bytes>`.
//! PostgreSQL re-checks the condition on the row's latest version under its
//! row lock, so the write lands only if the row is still exactly what the
//! operation decided on; the outcome is then the same as the full path's,
//! and durable (the statement commits) before the call returns. In every
//! other case (nothing remembered, the row changed meanwhile, the op
//! refuses, writes more than one row, or sends outbox messages) nothing was
//! written and the caller takes the full path, which decides on the row as
//! it is.

use std::collections::HashMap;

use parking_lot::Mutex;
use tokio_postgres::types::Type;

use crate::key::IdempotencyKey;
use crate::message::OutgoingMessage;
use crate::store::codec;
use crate::store::config::StoreConfig;
use crate::store::ops::{Loaded, LoadedStep, Ops, Txn};
use crate::store::record::{EntityState, Record, RecordState};
use crate::store::step::{HistoryRecord, StepRecord};
use crate::store::CompleteRequest;

use super::schema::Names;
use super::shared::Conn;
use super::txn::{sql_i64, state_code};

/// Claims remembered at most; beyond this, new claims are not remembered
/// and complete by the full path.
const REMEMBERED: usize = 4_096;

/// A claim's record as inserted, and its encoded bytes.
type Inserted = (Record, Vec<u8>);

/// The records of claims this engine inserted and has not finished yet.
#[derive(Default)]
pub(super) struct Remembered(Mutex<HashMap<IdempotencyKey, Inserted>>);

impl Remembered {
    pub(super) fn insert(&self, key: &IdempotencyKey, record: Record, bytes: Vec<u8>) {
        let mut map = self.0.lock();
        if map.len() < REMEMBERED {
            map.insert(key.clone(), (record, bytes));
        }
    }

    /// Takes the record remembered for `key`'s claim `token`.
    pub(super) fn take(&self, key: &IdempotencyKey, token: u64) -> Option<Inserted> {
        let mut map = self.0.lock();
        match map.get(key) {
            Some((record, _)) if record.token == token => map.remove(key),
            _ => None,
        }
    }

    pub(super) fn forget(&self, key: &IdempotencyKey) {
        self.0.lock().remove(key);
    }
}

/// A transaction that sees one remembered record and holds back the single
/// write the op makes; anything else it cannot do (`Err(())`).
struct OneRecord<'a> {
    key: &'a IdempotencyKey,
    record: &'a Record,
    now: u64,
    cfg: StoreConfig,
    write: Option<Record>,
}

impl Txn for OneRecord<'_> {
    type Fatal = ();

    fn now(&self) -> u64 {
        self.now
    }

    fn cfg(&self) -> StoreConfig {
        self.cfg
    }

    fn load(&mut self, key: &IdempotencyKey) -> Result<Loaded<Record>, ()> {
        if key == self.key && self.write.is_none() {
            Ok(Some(Ok(self.record.clone())))
        } else {
            Err(())
        }
    }

    fn store(
        &mut self,
        key: &IdempotencyKey,
        old: Option<&Record>,
        new: &Record,
    ) -> Result<(), ()> {
        if key == self.key && old == Some(self.record) && self.write.is_none() {
            self.write = Some(new.clone());
            Ok(())
        } else {
            Err(())
        }
    }

    fn remove(&mut self, _: &IdempotencyKey, _: Option<&Record>) -> Result<(), ()> {
        Err(())
    }

    fn next_token(&mut self) -> Result<u64, ()> {
        Err(())
    }

    fn push_outbox(&mut self, _: String, _: OutgoingMessage) -> Result<(), ()> {
        Err(())
    }

    fn remove_outbox(&mut self, _: u64) -> Result<bool, ()> {
        Err(())
    }

    fn load_entity(&mut self, _: &str) -> Result<Loaded<EntityState>, ()> {
        Err(())
    }

    fn store_entity(&mut self, _: &str, _: &EntityState) -> Result<(), ()> {
        Err(())
    }

    // A remembered claim has no steps: reserving one forgets it (see
    // `PgStore::reserve_step`), and a claim that found steps is never
    // remembered.
    fn load_steps(&mut self, _: &IdempotencyKey) -> Result<Vec<LoadedStep>, ()> {
        Ok(Vec::new())
    }

    fn store_step(&mut self, _: &IdempotencyKey, _: &StepRecord) -> Result<(), ()> {
        Err(())
    }

    fn remove_steps(&mut self, _: &IdempotencyKey) -> Result<(), ()> {
        Err(())
    }

    fn history_span(&mut self, _: &IdempotencyKey) -> Result<Option<(u32, u32)>, ()> {
        Ok(None)
    }

    fn append_history(&mut self, _: &IdempotencyKey, _: &HistoryRecord) -> Result<(), ()> {
        Err(())
    }

    fn remove_history(&mut self, _: &IdempotencyKey) -> Result<(), ()> {
        Err(())
    }
}

/// Whether the completion was written here; `Ok(false)`: nothing was
/// written, take the full path. An `Err` comes from the statement itself,
/// whose outcome is then unknown.
pub(super) fn complete(
    conn: &mut Conn,
    names: &Names,
    cfg: StoreConfig,
    now: u64,
    req: &CompleteRequest,
    (record, bytes): Inserted,
) -> Result<bool, super::client::PgError> {
    if !req.messages.is_empty() {
        return Ok(false);
    }
    let mut t = OneRecord {
        key: &req.key,
        record: &record,
        now,
        cfg,
        write: None,
    };
    if t.complete(req.clone()).is_err() {
        return Ok(false);
    }
    let Some(new) = t.write else {
        return Ok(false);
    };
    let sql = format!(
        "UPDATE {} SET state = $3, token = $4, lease_until_ms = $5,
             unknown_since_ms = $6, expires_at_ms = $7, record = $8
         WHERE scope = $1 AND key = $2 AND token = $9 AND record = $10",
        names.records
    );
    let encoded = codec::encode(req.key.record_key(), &new);
    let statement = conn.prepared(
        &sql,
        &[
            Type::TEXT,
            Type::TEXT,
            Type::INT2,
            Type::INT8,
            Type::INT8,
            Type::INT8,
            Type::INT8,
            Type::BYTEA,
            Type::INT8,
            Type::BYTEA,
        ],
    )?;
    let written = conn.execute(
        &statement,
        &[
            &req.key.scope(),
            &req.key.key(),
            &state_code(new.state),
            &sql_i64(new.token),
            &sql_i64(new.lease_until_ms),
            &sql_i64(new.unknown_since_ms),
            &sql_i64(new.expires_at_ms),
            &encoded,
            &sql_i64(record.token),
            &bytes,
        ],
    )?;
    Ok(written == 1)
}

impl super::shared::Shared {
    /// After an in-place completion's answer was lost and its backend is
    /// gone (`Shared::fence`): `Some(true)` if the row holds the claim's
    /// completion (the statement ran), `Some(false)` if it does not (the
    /// statement never ran, and the full path decides).
    pub(super) fn in_place_landed(
        &self,
        req: &CompleteRequest,
        old: &[u8],
    ) -> crate::error::Result<Option<bool>> {
        let what = "reading a record after a lost completion";
        let sql = format!(
            "SELECT record FROM {} WHERE scope = $1 AND key = $2",
            self.names.records
        );
        let row = self.read(what, |conn| {
            conn.query_typed_opt(
                &sql,
                &[(&req.key.scope(), Type::TEXT), (&req.key.key(), Type::TEXT)],
            )
        })?;
        let Some(row) = row else {
            return Ok(Some(false));
        };
        let bytes: &[u8] = row.get(0);
        if bytes == old {
            return Ok(Some(false));
        }
        let landed = self.record(&req.key)?.is_some_and(|rec| {
            rec.token == req.token
                && matches!(
                    rec.state,
                    RecordState::Completed | RecordState::FinalFailure
                )
        });
        Ok(Some(landed))
    }
}
