//! One bounded sweep step on PostgreSQL. Each step locks at most `limit`
//! due rows per kind with `FOR UPDATE SKIP LOCKED`, so engines sweeping
//! the same database at once take disjoint rows and never wait for each
//! other, and every row is handled by the shared per-record step.

use postgres::types::Type;

use crate::key::IdempotencyKey;
use crate::report::SweepCounts;
use crate::store::codec;
use crate::store::ops::{OpResult, Ops, Swept};

use super::txn::{sql_i64, Fault, PgTxn};

impl PgTxn<'_, '_> {
    pub(super) fn sweep(&mut self, limit: usize) -> OpResult<SweepCounts, Fault> {
        let r = &self.names.records;
        let due = [
            // Stale PROCESSING → UNKNOWN (a lease ending at `now` has run
            // out).
            format!(
                "SELECT scope, key, record FROM {r} WHERE state = 0 AND lease_until_ms <= $1
                 ORDER BY lease_until_ms LIMIT $2 FOR UPDATE SKIP LOCKED"
            ),
            // Expired COMPLETED / FINAL_FAILURE / TOMBSTONE.
            format!(
                "SELECT scope, key, record FROM {r} WHERE state IN (1, 2, 4) AND expires_at_ms <= $1
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
            let mut handled = 0;
            for row in rows {
                let (scope, key): (&str, &str) = (row.get(0), row.get(1));
                let Ok(key) = IdempotencyKey::parse_any(scope, key) else {
                    tracing::error!(scope, key, "sweep skipped a row whose key is not valid");
                    continue;
                };
                let rec = match codec::decode(row.get::<_, &[u8]>(2)) {
                    Ok(rec) => rec,
                    Err(e) => {
                        tracing::error!(%key, error = %e, "sweep skipped a corrupt record");
                        continue;
                    }
                };
                handled += 1;
                match self.sweep_record(&key, &rec)? {
                    Some(Swept::MovedToUnknown) => counts.moved_to_unknown += 1,
                    Some(Swept::Tombstoned) => counts.tombstoned += 1,
                    Some(Swept::Deleted) => counts.deleted += 1,
                    None => {}
                }
            }
            counts.more |= handled == limit;
        }
        Ok(counts)
    }
}
