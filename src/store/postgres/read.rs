//! Reads: each is one statement outside any explicit transaction, so it
//! sees the last commit and takes no row lock.

use tokio_postgres::types::Type;

use crate::dead_letter::DeadLetter;
use crate::error::{Corrupted, Error, Result};
use crate::key::IdempotencyKey;
use crate::message::OutboxEntry;
use crate::store::codec;
use crate::store::record::{EntityState, Record, RecordState};
use crate::store::step::{HistoryRecord, StepRecord};
use crate::store::Scanned;

use super::shared::Shared;
use super::txn::{sql_i64, sql_u64, state_code, with_token};

/// Rows per page of a full scan.
const SCAN_PAGE: i64 = 1_000;

/// `key`'s record from its stored bytes and its row's token column. The
/// checksum is verified on the bytes as stored, before `with_token` patches
/// in the token.
fn decode(key: &IdempotencyKey, bytes: &[u8], token: i64) -> Result<Record> {
    codec::decode(key.record_key(), bytes)
        .map(|rec| with_token(rec, sql_u64(token), key))
        .map_err(|e| Error::Corrupt {
            what: Corrupted::Record(key.clone()),
            reason: e.to_string(),
        })
}

/// Whether `e` says a table does not exist (the steps and history tables
/// of a schema that no writable open of this build has touched yet).
fn missing_table(e: &super::client::PgError) -> bool {
    e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE)
}

impl Shared {
    /// `key`'s effect steps in name order, as seen at `now_ms` (a step
    /// Reserved under a claim that no longer runs reads as Unknown), in
    /// one statement with the record's claim.
    pub(super) fn steps(&self, key: &IdempotencyKey, now_ms: u64) -> Result<Vec<StepRecord>> {
        let what = "reading effect steps";
        let sql = format!(
            "SELECT s.name, s.step, r.token, r.state, r.lease_until_ms
             FROM {} s LEFT JOIN {} r ON r.scope = s.scope AND r.key = s.key
             WHERE s.scope = $1 AND s.key = $2 ORDER BY s.name",
            self.names.steps, self.names.records
        );
        let rows = self.rows_of_key(what, &sql, key)?;
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            let name: String = row.get(0);
            let step = codec::decode_step(key.record_key(), &name, row.get::<_, &[u8]>(1))
                .map_err(|e| Error::Corrupt {
                    what: Corrupted::Step {
                        key: key.clone(),
                        step: name.clone(),
                    },
                    reason: e.to_string(),
                })?;
            let token: Option<i64> = row.get(2);
            let state: Option<i16> = row.get(3);
            let lease: Option<i64> = row.get(4);
            let claim = token.map(|token| {
                let live = state == Some(state_code(RecordState::Processing))
                    && lease.is_some_and(|l| sql_u64(l) > now_ms);
                (sql_u64(token), live)
            });
            out.push(step.as_seen(claim));
        }
        Ok(out)
    }

    /// The rows `sql` (parameters `$1` scope, `$2` key) returns for `key`;
    /// none when its table does not exist yet (a schema from before
    /// effect steps, opened without creating tables).
    fn rows_of_key(
        &self,
        what: &'static str,
        sql: &str,
        key: &IdempotencyKey,
    ) -> Result<Vec<tokio_postgres::Row>> {
        self.read(what, |conn| {
            match conn.query_typed(sql, &[(&key.scope(), Type::TEXT), (&key.key(), Type::TEXT)]) {
                Err(e) if missing_table(&e) => Ok(Vec::new()),
                other => other,
            }
        })
    }

    /// `key`'s evidence log, oldest first.
    pub(super) fn history(&self, key: &IdempotencyKey) -> Result<Vec<HistoryRecord>> {
        let what = "reading the evidence log";
        let sql = format!(
            "SELECT seq, entry FROM {} WHERE scope = $1 AND key = $2 ORDER BY seq",
            self.names.history
        );
        let rows = self.rows_of_key(what, &sql, key)?;
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            let seq = u32::try_from(row.get::<_, i64>(0)).unwrap_or(u32::MAX);
            let entry = codec::decode_history(key.record_key(), seq, row.get::<_, &[u8]>(1))
                .map_err(|e| Error::Corrupt {
                    what: Corrupted::History {
                        key: key.clone(),
                        seq,
                    },
                    reason: e.to_string(),
                })?;
            out.push(entry);
        }
        Ok(out)
    }

    pub(super) fn record(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        let what = "reading a record";
        let sql = format!(
            "SELECT record, token FROM {} WHERE scope = $1 AND key = $2",
            self.names.records
        );
        let row = self.read(what, |conn| {
            conn.query_typed_opt(
                &sql,
                &[(&key.scope(), Type::TEXT), (&key.key(), Type::TEXT)],
            )
        })?;
        row.map(|row| decode(key, row.get::<_, &[u8]>(0), row.get(1)))
            .transpose()
    }

    /// UNKNOWN records and PROCESSING ones whose lease ended at or before
    /// `now_ms`, oldest first by the instant they came into doubt.
    pub(super) fn in_doubt(
        &self,
        limit: usize,
        now_ms: u64,
    ) -> Result<Vec<(IdempotencyKey, Record)>> {
        let what = "reading the recovery queue";
        let r = &self.names.records;
        // The same order as the redb backend's: by the instant each came
        // into doubt, UNKNOWN before lease-expired at the same instant, then
        // by record key (scope length, scope bytes, key bytes).
        let sql = format!(
            "SELECT scope, key, record, token FROM (
                 (SELECT scope, key, record, token, unknown_since_ms AS since, 0 AS kind,
                         octet_length(scope) AS scope_len FROM {r}
                      WHERE state = 3
                      ORDER BY unknown_since_ms, octet_length(scope), scope, key LIMIT $2)
                 UNION ALL
                 (SELECT scope, key, record, token, lease_until_ms AS since, 1 AS kind,
                         octet_length(scope) AS scope_len FROM {r}
                      WHERE state = 0 AND lease_until_ms <= $1
                      ORDER BY lease_until_ms, octet_length(scope), scope, key LIMIT $2)
             ) AS in_doubt
             ORDER BY since, kind, scope_len, scope, key LIMIT $2"
        );
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self.read(what, |conn| {
            conn.query_typed(
                &sql,
                &[(&sql_i64(now_ms), Type::INT8), (&limit, Type::INT8)],
            )
        })?;
        let mut found = Vec::with_capacity(rows.len());
        for row in rows {
            let Ok(key) = IdempotencyKey::parse_any(row.get(0), row.get(1)) else {
                continue;
            };
            match decode(&key, row.get::<_, &[u8]>(2), row.get(3)) {
                Ok(rec) => found.push((key, rec)),
                Err(e) => tracing::error!(error = %e, "skipping a corrupt in-doubt record"),
            }
        }
        Ok(found)
    }

    /// Every record in key order (byte order of scope, then key), a page at
    /// a time, until `visit` returns false.
    pub(super) fn scan(&self, visit: &mut (dyn FnMut(Scanned) -> bool + Send)) -> Result<()> {
        let what = "listing records";
        let r = &self.names.records;
        let first =
            format!("SELECT scope, key, record, token FROM {r} ORDER BY scope, key LIMIT $1");
        let next = format!(
            "SELECT scope, key, record, token FROM {r} WHERE (scope, key) > ($2, $3)
             ORDER BY scope, key LIMIT $1"
        );
        let mut after: Option<(String, String)> = None;
        loop {
            let rows = self.read(what, |conn| match &after {
                None => conn.query_typed(&first, &[(&SCAN_PAGE, Type::INT8)]),
                Some((scope, key)) => conn.query_typed(
                    &next,
                    &[
                        (&SCAN_PAGE, Type::INT8),
                        (scope, Type::TEXT),
                        (key, Type::TEXT),
                    ],
                ),
            })?;
            let full = rows.len() == usize::try_from(SCAN_PAGE).unwrap_or(usize::MAX);
            for row in &rows {
                let scope: String = row.get(0);
                let key_text: String = row.get(1);
                let key = IdempotencyKey::parse_any(&scope, &key_text)
                    .map_err(|_| crate::key::record_key(&scope, &key_text));
                let token = sql_u64(row.get(3));
                let rkey = crate::key::record_key(&scope, &key_text);
                let value = codec::decode(&rkey, row.get::<_, &[u8]>(2)).map(|rec| match &key {
                    Ok(key) => with_token(rec, token, key),
                    Err(_) => rec,
                });
                if !visit((key, value)) {
                    return Ok(());
                }
                after = Some((scope, key_text));
            }
            if !full {
                return Ok(());
            }
        }
    }

    pub(super) fn oldest_in_doubt_ms(&self, now_ms: u64) -> Result<Option<u64>> {
        let what = "reading the recovery queue";
        let r = &self.names.records;
        let sql = format!(
            "SELECT LEAST(
                 (SELECT min(unknown_since_ms) FROM {r} WHERE state = 3),
                 (SELECT min(lease_until_ms) FROM {r} WHERE state = 0 AND lease_until_ms <= $1))"
        );
        let row = self.read(what, |conn| {
            conn.query_typed_one(&sql, &[(&sql_i64(now_ms), Type::INT8)])
        })?;
        Ok(row.get::<_, Option<i64>>(0).map(sql_u64))
    }

    pub(super) fn sweep_due(&self, now_ms: u64) -> Result<bool> {
        let what = "checking for sweep work";
        let r = &self.names.records;
        let sql = format!(
            "SELECT EXISTS (SELECT 1 FROM {r} WHERE state = 0 AND lease_until_ms <= $1)
                 OR EXISTS (SELECT 1 FROM {r} WHERE state IN (1, 2, 4) AND expires_at_ms <= $1)"
        );
        let row = self.read(what, |conn| {
            conn.query_typed_one(&sql, &[(&sql_i64(now_ms), Type::INT8)])
        })?;
        Ok(row.get(0))
    }

    pub(super) fn outbox(&self, limit: usize) -> Result<Vec<OutboxEntry>> {
        let what = "reading the outbox";
        let sql = format!(
            "SELECT seq, id, topic, payload, created_at_ms FROM {} ORDER BY seq LIMIT $1",
            self.names.outbox
        );
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self.read(what, |conn| conn.query_typed(&sql, &[(&limit, Type::INT8)]))?;
        Ok(rows
            .iter()
            .map(|row| OutboxEntry {
                seq: sql_u64(row.get(0)),
                id: row.get(1),
                topic: row.get(2),
                payload: row.get(3),
                created_at_ms: sql_u64(row.get(4)),
            })
            .collect())
    }

    /// Up to `limit` dead letters, oldest first (none where a read-only
    /// open finds no table yet).
    pub(super) fn dead_letters(&self, limit: usize) -> Result<Vec<DeadLetter>> {
        let what = "reading the dead letters";
        let table = self.names.dead_letters.clone();
        let sql = format!("SELECT seq, letter FROM {table} ORDER BY seq LIMIT $1");
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self.read(what, |conn| {
            let exists: bool = conn
                .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])?
                .get(0);
            if !exists {
                return Ok(Vec::new());
            }
            conn.query_typed(&sql, &[(&limit, Type::INT8)])
        })?;
        rows.iter()
            .map(|row| {
                let seq = sql_u64(row.get(0));
                codec::decode_dead_letter(seq, row.get::<_, &[u8]>(1)).map_err(|e| Error::Corrupt {
                    what: Corrupted::DeadLetter(seq),
                    reason: e.to_string(),
                })
            })
            .collect()
    }

    pub(super) fn outbox_len(&self) -> Result<u64> {
        let what = "counting the outbox";
        let sql = format!("SELECT count(*) FROM {}", self.names.outbox);
        let row = self.read(what, |conn| conn.query_typed_one(&sql, &[]))?;
        Ok(sql_u64(row.get(0)))
    }

    pub(super) fn entity(&self, entity: &str) -> Result<Option<EntityState>> {
        let what = "reading an entity";
        let sql = format!(
            "SELECT state, version, updated_at_ms FROM {} WHERE entity = $1",
            self.names.entities
        );
        let row = self.read(what, |conn| {
            conn.query_typed_opt(&sql, &[(&entity, Type::TEXT)])
        })?;
        Ok(row.map(|row| EntityState {
            state: row.get(0),
            version: sql_u64(row.get(1)),
            updated_at_ms: sql_u64(row.get(2)),
        }))
    }
}
