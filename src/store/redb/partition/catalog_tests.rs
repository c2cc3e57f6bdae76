//! The catalog against a real (in-memory) redb file: seal, reopen,
//! damaged and missing filters rebuilt, ranges without rows adopted, and
//! lookups that skip partitions only on a filter's "absent".

use std::cell::Cell;
use std::sync::Arc;

use redb::backends::InMemoryBackend;
use redb::{Database, ReadableDatabase, ReadableTable};

use super::*;
use crate::store::redb::partition::row::{FILTERS, PARTITIONS};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const SEED: [u8; 16] = *b"seed-of-the-file";
const RULE: SealRule = SealRule {
    interval_ms: 1_000,
    max_keys: 100,
};

fn db() -> Result<Database, Box<dyn std::error::Error>> {
    Ok(Database::builder().create_with_backend(InMemoryBackend::new())?)
}

fn filters() -> Arc<Filters> {
    Arc::new(Filters::new(FilterHasher::new(&SEED)))
}

fn rkey(i: u64) -> Vec<u8> {
    format!("\x04shoprequest-{i}").into_bytes()
}

/// The partition tables open in a test's write transaction.
struct Open<'t> {
    records: Table<'t, &'static [u8], &'static [u8]>,
    rows: Table<'t, u64, &'static [u8]>,
    stored: Table<'t, u64, &'static [u8]>,
}

impl<'t> Open<'t> {
    fn tables(&mut self) -> CatalogTables<'_, 't> {
        CatalogTables {
            records: &self.records,
            rows: &mut self.rows,
            filters: &mut self.stored,
        }
    }
}

/// Opens the catalog in a write transaction, runs `f`, commits.
fn with_catalog<T>(
    db: &Database,
    filters: &Arc<Filters>,
    now_ms: u64,
    f: impl FnOnce(
        &mut Catalog,
        &mut Open<'_>,
        &mut Vec<CatalogChange>,
    ) -> Result<T, Box<dyn std::error::Error>>,
) -> Result<(T, Vec<CatalogChange>), Box<dyn std::error::Error>> {
    let txn = db.begin_write()?;
    let out;
    let mut changes = Vec::new();
    {
        let mut o = Open {
            records: txn.open_table(RECORDS)?,
            rows: txn.open_table(PARTITIONS)?,
            stored: txn.open_table(FILTERS)?,
        };
        let mut catalog =
            Catalog::load(&mut o.tables(), filters.clone(), RULE, now_ms, &mut changes)?;
        out = f(&mut catalog, &mut o, &mut changes)?;
    }
    txn.commit()?;
    Ok((out, changes))
}

/// Inserts keys `keys` into the hot partition, as the writer does.
fn claim(
    catalog: &mut Catalog,
    records: &mut Table<'_, &'static [u8], &'static [u8]>,
    keys: std::ops::Range<u64>,
    now_ms: u64,
) -> TestResult {
    for i in keys {
        let slot = slot::slot_key(catalog.hot().partition, &rkey(i));
        records.insert(slot.as_slice(), b"record".as_slice())?;
        catalog.inserted_new_key(now_ms);
    }
    Ok(())
}

/// Where `probes` finds key `i`, and how many partitions it read.
fn find(
    probes: &Probes,
    hasher: &FilterHasher,
    records: &impl ReadableTable<&'static [u8], &'static [u8]>,
    i: u64,
) -> Result<(Option<u64>, usize), Box<dyn std::error::Error>> {
    let reads = Cell::new(0);
    let found = probes.locate(hasher, &rkey(i), |p| {
        reads.set(reads.get() + 1);
        let slot = slot::slot_key(p, &rkey(i));
        records.get(slot.as_slice()).map(|v| v.map(|_| ()))
    })?;
    Ok((found.map(|(p, ())| p), reads.get()))
}

/// Three partitions: keys 0..100 sealed by count in 1, 100..150 sealed by
/// time in 2, 150..160 hot in 3.
fn three_partitions(db: &Database, filters: &Arc<Filters>) -> TestResult {
    let (seals, changes) = with_catalog(db, filters, 0, |c, o, changes| {
        assert_eq!(
            c.hot().partition,
            FIRST_PARTITION,
            "a new file's hot partition"
        );
        let mut seals = Vec::new();
        claim(c, &mut o.records, 0..100, 10)?;
        seals.push(c.due_to_seal(20));
        c.seal(&mut o.tables(), 20, changes)?;
        claim(c, &mut o.records, 100..150, 30)?;
        seals.push(c.due_to_seal(999));
        seals.push(c.due_to_seal(1_020));
        c.seal(&mut o.tables(), 1_020, changes)?;
        claim(c, &mut o.records, 150..160, 1_030)?;
        seals.push(c.due_to_seal(1_030));
        Ok(seals)
    })?;
    assert_eq!(seals, [true, false, true, false]);
    // Rows of 1, 2, 3 opened; 1 and 2 sealed (filter, then row).
    let kinds: Vec<String> = changes
        .iter()
        .map(|c| match c {
            CatalogChange::Row(p, Some(_)) => format!("row {p}"),
            CatalogChange::Filter(p, Some(_)) => format!("filter {p}"),
            other => format!("{other:?}"),
        })
        .collect();
    assert_eq!(
        kinds,
        ["row 1", "filter 1", "row 1", "row 2", "filter 2", "row 2", "row 3"]
    );
    Ok(())
}

#[test]
fn sealed_partitions_are_found_through_their_filters() -> TestResult {
    let db = db()?;
    let filters = filters();
    three_partitions(&db, &filters)?;
    let txn = db.begin_read()?;
    let records = txn.open_table(RECORDS)?;
    let probes = Probes::read(&txn.open_table(PARTITIONS)?, &filters)?;
    let order: Vec<u64> = probes.iter().map(|p| p.partition).collect();
    assert_eq!(order, [3, 2, 1], "newest first");
    let hasher = filters.hasher();
    assert_eq!(find(&probes, hasher, &records, 155)?, (Some(3), 1));
    let (at, reads) = find(&probes, hasher, &records, 120)?;
    assert_eq!(at, Some(2));
    assert!(reads <= 2, "the hot partition, then 2: {reads}");
    assert_eq!(find(&probes, hasher, &records, 5)?.0, Some(1));
    // Absent keys: the hot partition is always read, the sealed ones
    // almost never.
    let mut reads = 0;
    for i in 10_000..12_000 {
        let (at, n) = find(&probes, hasher, &records, i)?;
        assert_eq!(at, None);
        reads += n;
    }
    assert!(reads < 2_000 + 20, "{reads} reads for 2,000 absent keys");
    Ok(())
}

#[test]
fn a_reopen_decodes_the_stored_filters_and_keeps_the_hot_partition() -> TestResult {
    let db = db()?;
    three_partitions(&db, &filters())?;
    let fresh = filters();
    let ((hot, probes), changes) = with_catalog(&db, &fresh, 2_000, |c, _, _| {
        Ok((c.hot(), c.probes().clone()))
    })?;
    assert!(changes.is_empty(), "nothing to repair: {changes:?}");
    assert_eq!((hot.partition, hot.row.keys), (3, 10));
    assert!(probes.iter().filter(|p| p.filter.is_some()).count() == 2);
    Ok(())
}

#[test]
fn a_damaged_or_missing_filter_is_rebuilt_never_taken_as_absent() -> TestResult {
    let db = db()?;
    three_partitions(&db, &filters())?;
    let txn = db.begin_write()?;
    {
        let mut stored = txn.open_table(FILTERS)?;
        let mut bytes = stored
            .get(1)?
            .map(|v| v.value().to_vec())
            .ok_or("filter 1")?;
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        stored.insert(1, bytes.as_slice())?;
        stored.remove(2)?;
    }
    txn.commit()?;
    let fresh = filters();
    let ((), changes) = with_catalog(&db, &fresh, 2_000, |_, _, _| Ok(()))?;
    let rebuilt: Vec<u64> = changes
        .iter()
        .filter_map(|c| match c {
            CatalogChange::Filter(p, Some(_)) => Some(*p),
            _ => None,
        })
        .collect();
    assert_eq!(rebuilt, [1, 2]);
    let txn = db.begin_read()?;
    let records = txn.open_table(RECORDS)?;
    let probes = Probes::read(&txn.open_table(PARTITIONS)?, &fresh)?;
    for i in 0..160 {
        assert!(
            find(&probes, fresh.hasher(), &records, i)?.0.is_some(),
            "key {i}"
        );
    }
    Ok(())
}

#[test]
fn probes_without_kept_filters_read_every_partition() -> TestResult {
    let db = db()?;
    three_partitions(&db, &filters())?;
    let empty = filters();
    let txn = db.begin_read()?;
    let records = txn.open_table(RECORDS)?;
    let probes = Probes::read(&txn.open_table(PARTITIONS)?, &empty)?;
    assert!(probes.iter().all(|p| p.filter.is_none()));
    assert_eq!(find(&probes, empty.hasher(), &records, 5)?, (Some(1), 3));
    assert_eq!(find(&probes, empty.hasher(), &records, 99_999)?, (None, 3));
    Ok(())
}

#[test]
fn a_range_without_a_row_is_adopted_and_two_hot_rows_refused() -> TestResult {
    let db = db()?;
    three_partitions(&db, &filters())?;
    let txn = db.begin_write()?;
    txn.open_table(PARTITIONS)?.remove(1)?;
    txn.commit()?;
    let fresh = filters();
    let (probes, _) = with_catalog(&db, &fresh, 2_000, |c, _, _| Ok(c.probes().clone()))?;
    assert_eq!(probes.len(), 3);
    let txn = db.begin_write()?;
    txn.open_table(PARTITIONS)?
        .insert(7, PartitionRow::hot(1, 1).encode(7).as_slice())?;
    txn.commit()?;
    let err = with_catalog(&db, &filters(), 2_000, |_, _, _| Ok(()))
        .err()
        .ok_or("two hot partitions")?;
    assert!(err.to_string().contains("second hot partition"), "{err}");
    Ok(())
}

#[test]
fn partitions_in_lists_each_range_once() -> TestResult {
    let db = db()?;
    let txn = db.begin_write()?;
    {
        let mut records = txn.open_table(RECORDS)?;
        for p in [1u64, 2, 300, BUILT_PARTITIONS, u64::MAX] {
            for i in 0..3 {
                records.insert(slot::slot_key(p, &rkey(i)).as_slice(), b"r".as_slice())?;
            }
        }
        assert_eq!(
            partitions_in(&records)?,
            [1, 2, 300, BUILT_PARTITIONS, u64::MAX]
        );
        assert_eq!(count_keys(&records, 300)?, 3);
        assert_eq!(count_keys(&records, u64::MAX)?, 3);
    }
    Ok(())
}

#[test]
fn partitions_sealed_by_their_key_count_share_one_group_of_filters() -> TestResult {
    let db = db()?;
    let shared = filters();
    // Ten partitions sealed by count, one past the limit (the writer seals
    // before a group's jobs), and one sealed by time with few keys.
    let (writer, _) = with_catalog(&db, &shared, 0, |c, o, changes| {
        let mut from = 0;
        for n in 0..10 {
            let keys = if n == 3 { 101 } else { 100 };
            claim(c, &mut o.records, from..from + keys, 10)?;
            from += keys;
            c.seal(&mut o.tables(), 20, changes)?;
        }
        claim(c, &mut o.records, from..from + 5, 30)?;
        c.seal(&mut o.tables(), 5_000, changes)?;
        Ok(c.probes().clone())
    })?;
    let fresh = filters();
    let (reopened, _) = with_catalog(&db, &fresh, 6_000, |c, _, _| Ok(c.probes().clone()))?;
    for (what, probes) in [("the writer's", &writer), ("a reopen's", &reopened)] {
        let sealed: Vec<&Arc<PartitionFilter>> =
            probes.iter().filter_map(|p| p.filter.as_ref()).collect();
        assert_eq!(sealed.len(), 11, "{what}");
        let by_count: Vec<_> = sealed.iter().filter(|f| f.len() >= 100).collect();
        assert_eq!(by_count.len(), 10);
        let group = by_count[0].group_slot().ok_or("grouped")?.0.clone();
        for f in &by_count {
            let (g, _) = f.group_slot().ok_or("grouped")?;
            assert!(
                Arc::ptr_eq(g, &group),
                "{what}: one group, each probe holds its view"
            );
            assert_eq!(f.block_count(), group.blocks());
        }
        assert_eq!(group.width(), 10, "{what}");
        // Held by the probes' views and the kept ones, nothing older.
        let small = sealed
            .iter()
            .find(|f| f.len() == 5)
            .ok_or("the small one")?;
        assert!(small.block_count() < group.blocks(), "sized for its keys");
    }
    Ok(())
}
