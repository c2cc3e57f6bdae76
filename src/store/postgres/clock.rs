//! The database's clock, read through the app server's own clock.
//!
//! Leases and expiry on a shared database must not depend on every app
//! server's clock agreeing. [`DatabaseClock`] measures the offset between
//! the local clock and PostgreSQL's `clock_timestamp()` (at open, then at
//! most once a second when the sweeper looks for work, so about once per
//! sweep interval) and adds it to
//! every local reading. All engines on one database then read the same
//! time to within half a round trip plus the local clocks' drift between
//! two measurements; how far apart the app servers' own clocks are does
//! not matter.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

use super::client::{Client, PgError};

use crate::clock::Clock;

/// The local clock plus the last measured offset to the database's clock.
#[derive(Debug)]
pub(crate) struct DatabaseClock {
    local: Arc<dyn Clock>,
    /// Database time minus local time, in ms.
    offset_ms: AtomicI64,
    /// Local time of the last measurement, in ms.
    synced_at_ms: AtomicU64,
}

/// Shortest time between two measurements, in ms (the sweeper may call
/// several times per tick).
const RESYNC_MS: u64 = 1_000;

impl DatabaseClock {
    pub(crate) fn new(local: Arc<dyn Clock>) -> DatabaseClock {
        DatabaseClock {
            local,
            offset_ms: AtomicI64::new(0),
            synced_at_ms: AtomicU64::new(0),
        }
    }

    /// Whether the last measurement is older than a second.
    pub(crate) fn due(&self) -> bool {
        let last = self.synced_at_ms.load(Ordering::Relaxed);
        self.local.now_ms().abs_diff(last) >= RESYNC_MS
    }

    /// Measures the offset again: the database's reading against the
    /// midpoint of the local readings before and after the query.
    pub(crate) fn sync(&self, client: &mut Client) -> Result<(), PgError> {
        let before = self.local.now_ms();
        let row = client.query_one(
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint",
            &[],
        )?;
        let after = self.local.now_ms();
        let database: i64 = row.get(0);
        let midpoint = i64::try_from(before / 2 + after / 2).unwrap_or(i64::MAX);
        self.offset_ms
            .store(database.saturating_sub(midpoint), Ordering::Relaxed);
        self.synced_at_ms.store(after, Ordering::Relaxed);
        Ok(())
    }
}

impl Clock for DatabaseClock {
    fn now_ms(&self) -> u64 {
        let local = i64::try_from(self.local.now_ms()).unwrap_or(i64::MAX);
        let now = local.saturating_add(self.offset_ms.load(Ordering::Relaxed));
        u64::try_from(now).unwrap_or(0)
    }
}
