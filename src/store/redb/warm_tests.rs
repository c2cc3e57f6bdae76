//! The warm-up at open reads the hot partition's records, all of them and
//! no other partition's, up to its byte bound.
//!
//! That the pages it reads are then served from redb's cache is measured,
//! not tested: redb's own open (its integrity check, its repair) may have
//! cached them already when the file is smaller than the cache, so a test
//! file shows nothing. `bench/benches/scale10m.rs` measures it (its `COLD`
//! line: bytes read from the device per fresh key right after a reopen).

use redb::Database;

use super::super::partition::catalog::SealRule;
use super::super::test_writer::{rows, Writer, R};
use super::{warm, warm_hot_partition, Warmed};

/// A file with a sealed partition of 500 keys and a hot one of 300
/// (the first 500 of 800 completed keys), and the hot partition's number.
fn two_partitions() -> R<(Database, u64)> {
    let rule = SealRule {
        interval_ms: 1 << 40,
        max_keys: 500,
    };
    let mut w = Writer::new(rule)?;
    w.completed(800, 30_000, &[])?;
    let hot = w.catalog.hot().partition;
    let partitions = rows(&w.db)?.len();
    if partitions != 2 {
        return Err(format!("{partitions} partitions, not 2").into());
    }
    Ok((w.db, hot))
}

#[test]
fn the_warm_up_reads_the_hot_partition_only() -> R<()> {
    let (db, hot) = two_partitions()?;
    let warmed = warm_hot_partition(&db, hot);
    assert_eq!(warmed.records, 300, "{warmed:?}");
    assert!(warmed.bytes > 300 * 60, "{warmed:?}");
    // A partition with no records (the next one's number): nothing.
    assert_eq!(warm_hot_partition(&db, hot + 1), Warmed::default());
    Ok(())
}

#[test]
fn the_warm_up_stops_at_its_byte_bound() -> R<()> {
    let (db, hot) = two_partitions()?;
    let all = warm_hot_partition(&db, hot);
    let bounded = warm(&db, hot, all.bytes / 3);
    assert!(
        bounded.records > 0 && bounded.records < all.records / 2,
        "{bounded:?} of {all:?}"
    );
    assert!(bounded.bytes >= all.bytes / 3, "{bounded:?}");
    Ok(())
}
