//! The prefixed layout: every partition in one record table, keyed
//! `[p: u64 big-endian][record key]`, so a partition is a key range (the
//! newest one rightmost) instead of a table of its own. Its keys, its
//! ranges and its expiry: the oldest partition's range deleted in key
//! order, in bounded write transactions.

use std::ops::Bound;
use std::time::{Duration, Instant};

use redb::{Database, Durability, TableDefinition};

/// The name of the one record table of the prefixed layout.
pub(crate) const PREFIXED_NAME: &str = "records_prefixed";
/// That table.
pub(crate) const PREFIXED: TableDefinition<&[u8], &[u8]> = TableDefinition::new(PREFIXED_NAME);

/// The stored key of record key `k` in partition `p`. Big-endian, so
/// redb's byte order on `&[u8]` keys sorts partitions by number.
pub(crate) fn prefixed(p: u64, k: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(8 + k.len());
    v.extend_from_slice(&p.to_be_bytes());
    v.extend_from_slice(k);
    v
}

/// The bounds of partition `p`'s key range: `lo..hi`.
pub(crate) fn range_of(p: u64) -> ([u8; 8], [u8; 8]) {
    (p.to_be_bytes(), (p + 1).to_be_bytes())
}

/// [`range_of`] as bounds.
pub(crate) fn bounds<'a>(lo: &'a [u8; 8], hi: &'a [u8; 8]) -> (Bound<&'a [u8]>, Bound<&'a [u8]>) {
    (
        Bound::Included(lo.as_slice()),
        Bound::Excluded(hi.as_slice()),
    )
}

/// The record key of a stored key (the prefix stripped).
pub(crate) fn record_key(stored: &[u8]) -> &[u8] {
    &stored[8..]
}

/// What emptying one partition cost.
pub(crate) struct Emptied {
    pub(crate) records: u64,
    pub(crate) transactions: u64,
    pub(crate) longest: Duration,
}

/// Deletes the `records` keys of `table` in `range` in key order, at most
/// `step` per write transaction (`extract_from_if` over the range, closed
/// after `step` entries: unread entries stay), each a durable commit if
/// `durable`, else with `Durability::None` (the caller follows them with
/// a durable commit, as the engine's next checkpoint would make them
/// durable). The prefixed layout
/// empties a partition's range of its one table so; the partitioned one,
/// in `stepped` expiry, a whole table before dropping it.
pub(crate) fn empty_range(
    db: &Database,
    table: &str,
    range: (Bound<&[u8]>, Bound<&[u8]>),
    records: u64,
    step: usize,
    durable: bool,
) -> Emptied {
    let def: TableDefinition<&[u8], &[u8]> = TableDefinition::new(table);
    let mut out = Emptied {
        records: 0,
        transactions: 0,
        longest: Duration::ZERO,
    };
    while out.records < records {
        let t0 = Instant::now();
        let mut txn = db.begin_write().expect("txn");
        if !durable {
            txn.set_durability(Durability::None).expect("durability");
        }
        let n = {
            let mut t = txn.open_table(def).expect("t");
            let mut it = t
                .extract_from_if::<&[u8], _>(range, |_, _| true)
                .expect("extract");
            let mut n = 0u64;
            for e in it.by_ref().take(step) {
                e.expect("entry");
                n += 1;
            }
            it.close().expect("close");
            n
        };
        txn.commit().expect("commit");
        assert!(n > 0, "{table} ran out after {} records", out.records);
        out.records += n;
        out.transactions += 1;
        out.longest = out.longest.max(t0.elapsed());
    }
    out
}
