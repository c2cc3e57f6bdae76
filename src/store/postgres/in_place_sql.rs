//! The one statement that sends a claim's writes decided in place
//! (`in_place.rs`), and the read that settles it when its answer was lost.
//!
//! ```sql
//! WITH chk AS (UPDATE records SET … WHERE scope, key, token AND record = $old RETURNING 1),
//!      s AS (INSERT INTO steps … SELECT … FROM unnest(names, steps) WHERE EXISTS (SELECT 1 FROM chk)
//!            ON CONFLICT (scope, key, name) DO UPDATE SET step = EXCLUDED.step RETURNING 1),
//!      h AS (INSERT INTO history … SELECT … FROM unnest(seqs, entries) WHERE EXISTS (SELECT 1 FROM chk)
//!            RETURNING 1)
//! SELECT (SELECT count(*) FROM chk), (SELECT count(*) FROM s), (SELECT count(*) FROM h)
//! ```
//!
//! `chk` locks the record row and PostgreSQL re-checks its condition on the
//! row's latest version, so the rest is written only when the row is still
//! the remembered one; a record the op leaves as it is is only locked
//! (`SELECT 1 … FOR UPDATE`, re-checked the same way). A log entry written meanwhile makes `h` fail on
//! the primary key, which aborts the whole statement: nothing is written.

use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use crate::error::Result;
use crate::key::IdempotencyKey;
use crate::store::codec;
use crate::store::record::RecordState;
use crate::store::CompleteRequest;

use super::client::PgError;
use super::in_place::{View, Writes};
use super::schema::Names;
use super::shared::{Conn, Shared};
use super::txn::{sql_i64, state_code};

/// Whether the writes landed (`Ok(false)`: the row or the log changed
/// meanwhile, nothing was written, take the full path). An `Err` comes
/// from the statement itself; unless the server refused it
/// ([`PgError::as_db_error`] and not `shared::lost`), its outcome is
/// unknown.
pub(super) fn send(
    conn: &mut Conn,
    names: &Names,
    key: &IdempotencyKey,
    old: &View,
    writes: &Writes,
) -> std::result::Result<bool, PgError> {
    let records = &names.records;
    let matches = "scope = $1 AND key = $2 AND token = $3 AND record = $4";
    // A record the op leaves as it is is only locked (no new row version);
    // `chk` is read three times, so it runs once (materialized).
    let (chk, record_types): (String, &[Type]) = match writes.record {
        Some(_) => (
            format!(
                "UPDATE {records} SET state = $5, token = $6, lease_until_ms = $7,
                     unknown_since_ms = $8, expires_at_ms = $9, record = $10
                 WHERE {matches} RETURNING 1"
            ),
            &[
                Type::INT2,
                Type::INT8,
                Type::INT8,
                Type::INT8,
                Type::INT8,
                Type::BYTEA,
            ],
        ),
        None => (
            format!("SELECT 1 FROM {records} WHERE {matches} FOR UPDATE"),
            &[],
        ),
    };
    let n = 5 + record_types.len();
    let sql = format!(
        "WITH chk AS ({chk}), s AS (
             INSERT INTO {steps} (scope, key, name, step)
             SELECT $1, $2, u.name, u.step FROM unnest(${n0}::text[], ${n1}::bytea[]) AS u(name, step)
             WHERE EXISTS (SELECT 1 FROM chk)
             ON CONFLICT (scope, key, name) DO UPDATE SET step = EXCLUDED.step
             RETURNING 1
         ), h AS (
             INSERT INTO {history} (scope, key, seq, entry)
             SELECT $1, $2, u.seq, u.entry FROM unnest(${n2}::int8[], ${n3}::bytea[]) AS u(seq, entry)
             WHERE EXISTS (SELECT 1 FROM chk)
             RETURNING 1
         )
         SELECT (SELECT count(*) FROM chk), (SELECT count(*) FROM s), (SELECT count(*) FROM h)",
        steps = names.steps,
        history = names.history,
        n0 = n,
        n1 = n + 1,
        n2 = n + 2,
        n3 = n + 3,
    );
    let mut types = vec![Type::TEXT, Type::TEXT, Type::INT8, Type::BYTEA];
    types.extend_from_slice(record_types);
    types.extend_from_slice(&[
        Type::TEXT_ARRAY,
        Type::BYTEA_ARRAY,
        Type::INT8_ARRAY,
        Type::BYTEA_ARRAY,
    ]);
    let statement = conn.prepared(&sql, &types)?;

    let rkey = key.record_key();
    let record_values = writes.record.as_ref().map(|(new, bytes)| {
        (
            state_code(new.state),
            sql_i64(new.token),
            sql_i64(new.lease_until_ms),
            sql_i64(new.unknown_since_ms),
            sql_i64(new.expires_at_ms),
            bytes,
        )
    });
    let step_names: Vec<&str> = writes.steps.iter().map(|s| s.name.as_str()).collect();
    let step_bytes: Vec<Vec<u8>> = writes
        .steps
        .iter()
        .map(|s| codec::encode_step(rkey, s))
        .collect();
    let seqs: Vec<i64> = writes.history.iter().map(|e| i64::from(e.seq)).collect();
    let entries: Vec<Vec<u8>> = writes
        .history
        .iter()
        .map(|e| codec::encode_history(rkey, e))
        .collect();
    let (scope, k, token) = (key.scope(), key.key(), sql_i64(old.record.token));
    let mut params: Vec<&(dyn ToSql + Sync)> = vec![&scope, &k, &token, &old.bytes];
    if let Some((state, token, lease, unknown, expires, bytes)) = &record_values {
        params.extend_from_slice(&[state, token, lease, unknown, expires, *bytes]);
    }
    params.extend_from_slice(&[&step_names, &step_bytes, &seqs, &entries]);
    match conn.query_one(&statement, &params) {
        Ok(row) => Ok(row.get::<_, i64>(0) == 1),
        // A log entry written meanwhile: nothing was written.
        Err(e) if e.code() == Some(&SqlState::UNIQUE_VIOLATION) => Ok(false),
        Err(e) => Err(e),
    }
}

impl Shared {
    /// After the answer of [`send`] was lost and its backend is gone
    /// (`Shared::fence`): `Some(true)` if its writes are in the database
    /// (the statement ran), `Some(false)` if not (the statement never ran,
    /// and the full path decides). An op that appends to the log is told
    /// by its first entry (the statement is atomic: that entry, byte for
    /// byte, at its sequence number means all of it landed); a completion
    /// that writes only the record, by the record.
    pub(super) fn in_place_landed(
        &self,
        key: &IdempotencyKey,
        old: &View,
        writes: &Writes,
        complete: Option<&CompleteRequest>,
    ) -> Result<Option<bool>> {
        if let Some(first) = writes.history.first() {
            let ours = codec::encode_history(key.record_key(), first);
            let sql = format!(
                "SELECT entry FROM {} WHERE scope = $1 AND key = $2 AND seq = $3",
                self.names.history
            );
            let seq = i64::from(first.seq);
            let row = self.read("reading the evidence log after a lost write", |conn| {
                conn.query_typed_opt(
                    &sql,
                    &[
                        (&key.scope(), Type::TEXT),
                        (&key.key(), Type::TEXT),
                        (&seq, Type::INT8),
                    ],
                )
            })?;
            return Ok(Some(row.is_some_and(|row| row.get::<_, &[u8]>(0) == ours)));
        }
        let Some(req) = complete else {
            return Ok(None);
        };
        let sql = format!(
            "SELECT record FROM {} WHERE scope = $1 AND key = $2",
            self.names.records
        );
        let row = self.read("reading a record after a lost completion", |conn| {
            conn.query_typed_opt(
                &sql,
                &[(&key.scope(), Type::TEXT), (&key.key(), Type::TEXT)],
            )
        })?;
        let Some(row) = row else {
            return Ok(Some(false));
        };
        let bytes: &[u8] = row.get(0);
        if bytes == old.bytes {
            return Ok(Some(false));
        }
        let landed = self.record(key)?.is_some_and(|rec| {
            rec.token == req.token
                && matches!(
                    rec.state,
                    RecordState::Completed | RecordState::FinalFailure
                )
        });
        Ok(Some(landed))
    }
}
