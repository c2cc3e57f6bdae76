//! One bounded sweep step on PostgreSQL. Each step locks at most `limit`
//! due rows per kind with `FOR UPDATE SKIP LOCKED`, so engines sweeping
//! the same database at once take disjoint rows and never wait for each
//! other, and every row is handled by the shared per-record step.

use tokio_postgres::types::Type;

use crate::key::IdempotencyKey;
use crate::report::SweepCounts;
use crate::store::codec;
use crate::store::ops::{OpResult, Ops, Swept};

use super::txn::{sql_i64, sql_u64, with_token, Fault, PgTxn};

impl PgTxn<'_, '_> {
    pub(super) fn sweep(&mut self, limit: usize) -> OpResult<SweepCounts, Fault> {
        let r = &self.names.records;
        let due = [
            // Stale PROCESSING → UNKNOWN (a lease ending at `now` has run
            // out).
            format!(
                "SELECT scope, key, record, token FROM {r} WHERE state = 0 AND lease_until_ms <= $1
                 ORDER BY lease_until_ms LIMIT $2 FOR UPDATE SKIP LOCKED"
            ),
            // Expired COMPLETED / FINAL_FAILURE / TOMBSTONE.
            format!(
                "SELECT scope, key, record, token FROM {r} WHERE state IN (1, 2, 4) AND expires_at_ms <= $1
                 ORDER BY expires_at_ms LIMIT $2 FOR UPDATE SKIP LOCKED"
            ),
        ];
        let mut counts = SweepCounts::default();
        let now = sql_i64(self.now);
        let batch = i64::try_from(limit).unwrap_or(i64::MAX);
        for sql in due {
            let rows = self
                .tx
                .query_typed(&sql, &[(&now, Type::INT8), (&batch, Type::INT8)])
                .map_err(|e| crate::store::ops::OpError::Fatal(Fault::Db(e)))?;
            let full = rows.len() == limit;
            for row in rows {
                let (scope, key): (&str, &str) = (row.get(0), row.get(1));
                let parsed = IdempotencyKey::parse_any(scope, key)
                    .map_err(|e| e.to_string())
                    .and_then(|k| {
                        codec::decode(k.record_key(), row.get::<_, &[u8]>(2))
                            .map(|rec| {
                                let rec = with_token(rec, sql_u64(row.get(3)), &k);
                                (k, rec)
                            })
                            .map_err(|e| e.to_string())
                    });
                let (key, rec) = match parsed {
                    Ok(parsed) => parsed,
                    Err(error) => {
                        // Out of the sweep's way (its bytes stay for an
                        // operator: `verify` lists it, `purge` with force
                        // removes it), so it cannot stall later sweeps.
                        tracing::error!(scope, key, %error, "sweep set aside a record it cannot read");
                        self.quarantine(scope, key)?;
                        continue;
                    }
                };
                match self.sweep_record(&key, &rec)? {
                    Some(Swept::MovedToUnknown) => counts.moved_to_unknown += 1,
                    Some(Swept::Tombstoned) => counts.tombstoned += 1,
                    Some(Swept::Deleted) => counts.deleted += 1,
                    None => {}
                }
            }
            counts.more |= full;
        }
        Ok(counts)
    }

    /// Takes a row out of every partial index (state -1, which no index
    /// and no state means); its record bytes are left as they are.
    fn quarantine(&mut self, scope: &str, key: &str) -> OpResult<(), Fault> {
        let sql = format!(
            "UPDATE {} SET state = -1 WHERE scope = $1 AND key = $2",
            self.names.records
        );
        self.tx
            .execute_typed(&sql, &[(&scope, Type::TEXT), (&key, Type::TEXT)])
            .map_err(|e| crate::store::ops::OpError::Fatal(Fault::Db(e)))?;
        Ok(())
    }
}
