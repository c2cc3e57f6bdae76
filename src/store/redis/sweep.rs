//! One bounded sweep step on Redis: up to `limit` due members of the lease
//! index and of the expiry index, each handled by the shared per-record
//! step, all in one guarded commit (engines sweeping at once conflict and
//! rerun instead of both acting on one record).

use crate::report::SweepCounts;
use crate::store::ops::{OpError, OpResult, Ops, Swept, Txn};

use super::keys::key_of;
use super::script::Write;
use super::txn::{Fault, RedisTxn};

impl RedisTxn<'_> {
    pub(super) fn sweep(&mut self, limit: usize) -> OpResult<SweepCounts, Fault> {
        let mut counts = SweepCounts::default();
        let indexes = [self.keys.lease.clone(), self.keys.expiry.clone()];
        for index in indexes {
            let members: Vec<Vec<u8>> = redis::cmd("ZRANGE")
                .arg(&index)
                .arg("-inf")
                .arg(self.now)
                .arg("BYSCORE")
                .arg("LIMIT")
                .arg(0)
                .arg(limit)
                .query(&mut self.conn.conn)
                .map_err(|e| OpError::Fatal(Fault(e)))?;
            let full = members.len() == limit;
            for m in members {
                let key = match key_of(&m) {
                    Ok(key) => key,
                    Err(raw) => {
                        tracing::error!(key = %String::from_utf8_lossy(&raw), "sweep set aside an index entry whose key is not valid");
                        self.batch.writes.push(Write::Quarantine { member: m });
                        continue;
                    }
                };
                let rec = match self.load(&key).map_err(OpError::Fatal)? {
                    Some(Ok(rec)) => rec,
                    // A stray index entry: nothing to sweep.
                    None => {
                        self.batch
                            .writes
                            .push(Write::ZRem(index.as_bytes().to_vec(), m));
                        continue;
                    }
                    Some(Err(error)) => {
                        // Out of the sweep's way (its bytes stay for an
                        // operator: `verify` lists it, `purge` with force
                        // removes it), so it cannot stall later sweeps.
                        tracing::error!(key = %key, %error, "sweep set aside a record it cannot read");
                        self.batch.writes.push(Write::Quarantine { member: m });
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
}
