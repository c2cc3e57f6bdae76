//! One PostgreSQL transaction as the shared operations see it
//! (`store/ops.rs`): records are loaded with `SELECT … FOR UPDATE`, so two
//! engines changing one key are serialized by its row lock, and a key that
//! has no row yet is claimed with `INSERT … ON CONFLICT DO NOTHING`, so a
//! concurrent twin loses the insert and the whole transaction is retried.

use tokio_postgres::types::{ToSql, Type};

use crate::dead_letter::DeadLetter;
use crate::key::IdempotencyKey;
use crate::message::OutgoingMessage;
use crate::store::codec;
use crate::store::config::StoreConfig;
use crate::store::ops::{Loaded, LoadedStep, Txn};
use crate::store::record::{EntityState, Record, RecordState};
use crate::store::step::{HistoryRecord, StepRecord};

use super::client::{PgError, Transaction};
use super::schema::Names;

/// A storage failure inside a PostgreSQL transaction.
#[derive(Debug)]
pub(crate) enum Fault {
    Db(PgError),
    /// Another transaction inserted the key first: retry the transaction.
    Race,
}

impl From<PgError> for Fault {
    fn from(e: PgError) -> Fault {
        Fault::Db(e)
    }
}

/// A u64 instant or counter as a `bigint`, saturating (instants beyond
/// `i64::MAX` ms only occur for leases and TTLs of "forever"; the exact value
/// stays in the encoded record).
pub(super) fn sql_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// A `bigint` read back as u64 (negative values, which the engine never
/// writes, read as 0).
pub(super) fn sql_u64(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

/// A record read from a row, with the row's `token` column: a claim made
/// by the one-statement fast path (`PgStore::claim_or_read`) stores its
/// record with token 0, since the token is drawn in the same statement;
/// its token is the column's and its reference derives from it, as every
/// claim's does (`record::reference`).
pub(super) fn with_token(mut rec: Record, token: u64, key: &IdempotencyKey) -> Record {
    if rec.token == 0 {
        rec.token = token;
        rec.reference = crate::store::record::reference(key.record_key(), token);
    }
    rec
}

pub(super) fn state_code(state: RecordState) -> i16 {
    state as i16
}

pub(crate) struct PgTxn<'t, 'c> {
    pub(super) tx: &'t mut Transaction<'c>,
    pub(super) names: &'t Names,
    pub(super) now: u64,
    pub(super) cfg: StoreConfig,
}

impl Txn for PgTxn<'_, '_> {
    type Fatal = Fault;

    fn now(&self) -> u64 {
        self.now
    }

    fn cfg(&self) -> StoreConfig {
        self.cfg
    }

    fn load(&mut self, key: &IdempotencyKey) -> Result<Loaded<Record>, Fault> {
        let sql = format!(
            "SELECT record, token FROM {} WHERE scope = $1 AND key = $2 FOR UPDATE",
            self.names.records
        );
        let row = self.tx.query_typed_opt(
            &sql,
            &[(&key.scope(), Type::TEXT), (&key.key(), Type::TEXT)],
        )?;
        Ok(row.map(|row| {
            codec::decode(key.record_key(), row.get::<_, &[u8]>(0))
                .map(|rec| with_token(rec, sql_u64(row.get(1)), key))
        }))
    }

    fn store(
        &mut self,
        key: &IdempotencyKey,
        old: Option<&Record>,
        new: &Record,
    ) -> Result<(), Fault> {
        let bytes = codec::encode(key.record_key(), new);
        let params: [(&(dyn ToSql + Sync), Type); 8] = [
            (&key.scope(), Type::TEXT),
            (&key.key(), Type::TEXT),
            (&state_code(new.state), Type::INT2),
            (&sql_i64(new.token), Type::INT8),
            (&sql_i64(new.lease_until_ms), Type::INT8),
            (&sql_i64(new.unknown_since_ms), Type::INT8),
            (&sql_i64(new.expires_at_ms), Type::INT8),
            (&bytes, Type::BYTEA),
        ];
        let records = &self.names.records;
        if old.is_some() {
            // The row is locked by `load`.
            let sql = format!(
                "UPDATE {records} SET state = $3, token = $4, lease_until_ms = $5,
                     unknown_since_ms = $6, expires_at_ms = $7, record = $8
                 WHERE scope = $1 AND key = $2"
            );
            self.tx.execute_typed(&sql, &params)?;
        } else {
            let sql = format!(
                "INSERT INTO {records}
                     (scope, key, state, token, lease_until_ms, unknown_since_ms, expires_at_ms, record)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
                 ON CONFLICT (scope, key) DO NOTHING"
            );
            if self.tx.execute_typed(&sql, &params)? == 0 {
                return Err(Fault::Race);
            }
        }
        Ok(())
    }

    fn remove(&mut self, key: &IdempotencyKey, _old: Option<&Record>) -> Result<(), Fault> {
        let sql = format!(
            "DELETE FROM {} WHERE scope = $1 AND key = $2",
            self.names.records
        );
        self.tx.execute_typed(
            &sql,
            &[(&key.scope(), Type::TEXT), (&key.key(), Type::TEXT)],
        )?;
        Ok(())
    }

    fn next_token(&mut self) -> Result<u64, Fault> {
        let sql = format!("SELECT nextval('{}')", self.names.tokens);
        let row = self.tx.query_typed_one(&sql, &[])?;
        Ok(sql_u64(row.get(0)))
    }

    fn push_outbox(&mut self, id: String, message: OutgoingMessage) -> Result<(), Fault> {
        let sql = format!(
            "INSERT INTO {} (seq, id, topic, payload, created_at_ms)
             VALUES (nextval('{}'), $1, $2, $3, $4)",
            self.names.outbox, self.names.outbox_seq
        );
        self.tx.execute_typed(
            &sql,
            &[
                (&id, Type::TEXT),
                (&message.topic, Type::TEXT),
                (&message.payload, Type::BYTEA),
                (&sql_i64(self.now), Type::INT8),
            ],
        )?;
        Ok(())
    }

    fn remove_outbox(&mut self, seq: u64) -> Result<bool, Fault> {
        let sql = format!("DELETE FROM {} WHERE seq = $1", self.names.outbox);
        Ok(self
            .tx
            .execute_typed(&sql, &[(&sql_i64(seq), Type::INT8)])?
            > 0)
    }

    fn push_dead_letter(&mut self, mut letter: DeadLetter) -> Result<u64, Fault> {
        let sql = format!("SELECT nextval('{}')", self.names.dead_letters_seq);
        let row = self.tx.query_typed_one(&sql, &[])?;
        let seq = sql_u64(row.get(0));
        letter.seq = seq;
        letter.dead_at_ms = self.now;
        let value = codec::encode_dead_letter(seq, &letter);
        let sql = format!(
            "INSERT INTO {} (seq, consumer, letter) VALUES ($1, $2, $3)",
            self.names.dead_letters
        );
        self.tx.execute_typed(
            &sql,
            &[
                (&sql_i64(seq), Type::INT8),
                (&letter.consumer, Type::TEXT),
                (&value, Type::BYTEA),
            ],
        )?;
        Ok(seq)
    }

    fn load_dead_letter(&mut self, seq: u64) -> Result<Loaded<DeadLetter>, Fault> {
        let sql = format!(
            "SELECT letter FROM {} WHERE seq = $1 FOR UPDATE",
            self.names.dead_letters
        );
        let rows = self.tx.query_typed(&sql, &[(&sql_i64(seq), Type::INT8)])?;
        Ok(rows
            .first()
            .map(|row| codec::decode_dead_letter(seq, row.get::<_, &[u8]>(0))))
    }

    fn remove_dead_letter(&mut self, seq: u64) -> Result<(), Fault> {
        let sql = format!("DELETE FROM {} WHERE seq = $1", self.names.dead_letters);
        self.tx
            .execute_typed(&sql, &[(&sql_i64(seq), Type::INT8)])?;
        Ok(())
    }

    fn load_steps(&mut self, key: &IdempotencyKey) -> Result<Vec<LoadedStep>, Fault> {
        let sql = format!(
            "SELECT name, step FROM {} WHERE scope = $1 AND key = $2 ORDER BY name",
            self.names.steps
        );
        let rows = self.tx.query_typed(
            &sql,
            &[(&key.scope(), Type::TEXT), (&key.key(), Type::TEXT)],
        )?;
        Ok(rows
            .iter()
            .map(|row| {
                let name: String = row.get(0);
                let step = codec::decode_step(key.record_key(), &name, row.get::<_, &[u8]>(1));
                (name, step)
            })
            .collect())
    }

    fn store_step(&mut self, key: &IdempotencyKey, step: &StepRecord) -> Result<(), Fault> {
        let bytes = codec::encode_step(key.record_key(), step);
        let sql = format!(
            "INSERT INTO {} (scope, key, name, step) VALUES ($1, $2, $3, $4)
             ON CONFLICT (scope, key, name) DO UPDATE SET step = EXCLUDED.step",
            self.names.steps
        );
        self.tx.execute_typed(
            &sql,
            &[
                (&key.scope(), Type::TEXT),
                (&key.key(), Type::TEXT),
                (&step.name, Type::TEXT),
                (&bytes, Type::BYTEA),
            ],
        )?;
        Ok(())
    }

    fn remove_steps(&mut self, key: &IdempotencyKey) -> Result<(), Fault> {
        let sql = format!(
            "DELETE FROM {} WHERE scope = $1 AND key = $2",
            self.names.steps
        );
        self.tx.execute_typed(
            &sql,
            &[(&key.scope(), Type::TEXT), (&key.key(), Type::TEXT)],
        )?;
        Ok(())
    }

    fn history_span(&mut self, key: &IdempotencyKey) -> Result<Option<(u32, u32)>, Fault> {
        let sql = format!(
            "SELECT min(seq), max(seq) FROM {} WHERE scope = $1 AND key = $2",
            self.names.history
        );
        let row = self.tx.query_typed_one(
            &sql,
            &[(&key.scope(), Type::TEXT), (&key.key(), Type::TEXT)],
        )?;
        let first: Option<i64> = row.get(0);
        let last: Option<i64> = row.get(1);
        let seq = |v: i64| u32::try_from(v).unwrap_or(u32::MAX);
        Ok(first.zip(last).map(|(f, l)| (seq(f), seq(l))))
    }

    fn append_history(&mut self, key: &IdempotencyKey, entry: &HistoryRecord) -> Result<(), Fault> {
        let bytes = codec::encode_history(key.record_key(), entry);
        let sql = format!(
            "INSERT INTO {} (scope, key, seq, entry) VALUES ($1, $2, $3, $4)",
            self.names.history
        );
        self.tx.execute_typed(
            &sql,
            &[
                (&key.scope(), Type::TEXT),
                (&key.key(), Type::TEXT),
                (&i64::from(entry.seq), Type::INT8),
                (&bytes, Type::BYTEA),
            ],
        )?;
        Ok(())
    }

    fn remove_history(&mut self, key: &IdempotencyKey) -> Result<(), Fault> {
        let sql = format!(
            "DELETE FROM {} WHERE scope = $1 AND key = $2",
            self.names.history
        );
        self.tx.execute_typed(
            &sql,
            &[(&key.scope(), Type::TEXT), (&key.key(), Type::TEXT)],
        )?;
        Ok(())
    }

    /// One statement per table, each deleting only while the key has no
    /// record on that statement's snapshot: a step or log entry visible
    /// there was written after its claim's record committed, so a live
    /// key's record is visible too and nothing of it is deleted (READ
    /// COMMITTED reads per statement; a claim can commit between this
    /// transaction's reads).
    fn remove_orphan_steps(&mut self, key: &IdempotencyKey) -> Result<(), Fault> {
        for table in [&self.names.steps, &self.names.history] {
            let sql = format!(
                "DELETE FROM {table} WHERE scope = $1 AND key = $2
                 AND NOT EXISTS (SELECT 1 FROM {} r WHERE r.scope = $1 AND r.key = $2)",
                self.names.records
            );
            self.tx.execute_typed(
                &sql,
                &[(&key.scope(), Type::TEXT), (&key.key(), Type::TEXT)],
            )?;
        }
        Ok(())
    }

    fn load_entity(&mut self, entity: &str) -> Result<Loaded<EntityState>, Fault> {
        let sql = format!(
            "SELECT state, version, updated_at_ms FROM {} WHERE entity = $1 FOR UPDATE",
            self.names.entities
        );
        let row = self.tx.query_typed_opt(&sql, &[(&entity, Type::TEXT)])?;
        Ok(row.map(|row| {
            Ok(EntityState {
                state: row.get(0),
                version: sql_u64(row.get(1)),
                updated_at_ms: sql_u64(row.get(2)),
            })
        }))
    }

    fn store_entity(&mut self, entity: &str, state: &EntityState) -> Result<(), Fault> {
        // A first transition of an entity races like a first claim: the
        // loser of the insert retries and then sees the winner's row.
        let sql = if state.version == 1 {
            format!(
                "INSERT INTO {} (entity, state, version, updated_at_ms) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (entity) DO NOTHING",
                self.names.entities
            )
        } else {
            format!(
                "UPDATE {} SET state = $2, version = $3, updated_at_ms = $4 WHERE entity = $1",
                self.names.entities
            )
        };
        let written = self.tx.execute_typed(
            &sql,
            &[
                (&entity, Type::TEXT),
                (&state.state, Type::TEXT),
                (&sql_i64(state.version), Type::INT8),
                (&sql_i64(state.updated_at_ms), Type::INT8),
            ],
        )?;
        if written == 0 {
            return Err(Fault::Race);
        }
        Ok(())
    }
}
