//! The pieces together in a redb file (in memory), as format 3 will use
//! them: per-partition tables found by listing the file's tables and
//! parsing their names (oldest first), each sealed partition's row and
//! stored filter read back and checked against its table, and a damaged
//! filter refused and rebuilt from its table's keys, never taken as
//! "absent".

use redb::backends::InMemoryBackend;
use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableHandle};

use super::filter::{FilterHasher, FilterProblem, PartitionFilter};
use super::row::{
    history_definition, records_definition, steps_definition, PartitionRow, PartitionState,
    PartitionTable, TableKind, FILTERS, PARTITIONS,
};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const SEED: [u8; 16] = *b"seed-of-the-file";

fn record_key(p: u64, i: u64) -> Vec<u8> {
    format!("\x04shoppartition-{p}-request-{i}").into_bytes()
}

/// Partitions 9, 10 and 100 (so a name sorted as text would put 10 and 100
/// before 9 if unpadded) with `count(p)` records each; all sealed but 100.
fn build(db: &Database, hasher: &FilterHasher) -> TestResult {
    let txn = db.begin_write()?;
    {
        let mut rows = txn.open_table(PARTITIONS)?;
        let mut filters = txn.open_table(FILTERS)?;
        for p in [100u64, 9, 10] {
            let count = p * 3;
            let name = PartitionTable::records(p).name();
            let mut records = txn.open_table(records_definition(&name))?;
            let mut filter = PartitionFilter::with_capacity(p, count, hasher)?;
            let mut row = PartitionRow::hot(p * 1_000, p * 1_000 + 86_400_000);
            for i in 0..count {
                let key = record_key(p, i);
                records.insert(key.as_slice(), b"record".as_slice())?;
                filter.insert(&key)?;
                if i > 0 {
                    row.claimed(p * 1_000 + i, p * 1_000 + i + 86_400_000);
                }
            }
            let steps_name = PartitionTable::steps(p).name();
            let mut steps = txn.open_table(steps_definition(&steps_name))?;
            steps.insert((record_key(p, 0).as_slice(), "charge"), b"step".as_slice())?;
            let history_name = PartitionTable::history(p).name();
            let mut history = txn.open_table(history_definition(&history_name))?;
            history.insert((record_key(p, 0).as_slice(), 0u32), b"entry".as_slice())?;
            if p != 100 {
                let (bytes, sum) = filter.encode();
                filters.insert(p, bytes.as_slice())?;
                row.seal(p, sum)?;
            }
            rows.insert(p, row.encode(p).as_slice())?;
        }
    }
    txn.commit()?;
    Ok(())
}

#[test]
fn partitions_are_found_by_name_oldest_first_and_their_filters_check_out() -> TestResult {
    let db = Database::builder().create_with_backend(InMemoryBackend::new())?;
    let hasher = FilterHasher::new(&SEED);
    build(&db, &hasher)?;

    let read = db.begin_read()?;
    let mut names: Vec<String> = read.list_tables()?.map(|t| t.name().to_owned()).collect();
    names.sort();
    let mut found = Vec::new();
    for name in &names {
        match PartitionTable::parse(name) {
            Ok(t) => found.push(t),
            Err(_) => {
                let name: &str = name;
                assert!(
                    [super::row::PARTITIONS_TABLE, super::row::FILTERS_TABLE].contains(&name),
                    "{name}"
                );
            }
        }
    }
    // Sorted by name is sorted by age, for each kind.
    let records: Vec<u64> = found
        .iter()
        .filter(|t| t.kind == TableKind::Records)
        .map(|t| t.partition)
        .collect();
    assert_eq!(records, [9, 10, 100]);
    assert_eq!(found.len(), 9);

    let rows = read.open_table(PARTITIONS)?;
    let filters = read.open_table(FILTERS)?;
    for p in records {
        let row = PartitionRow::decode(p, rows.get(p)?.ok_or("no row")?.value())?;
        assert_eq!(row.keys, p * 3);
        assert_eq!(row.first_claim_ms, p * 1_000);
        let name = PartitionTable::records(p).name();
        let table = read.open_table(records_definition(&name))?;
        assert_eq!(table.len()?, row.keys);
        if row.state == PartitionState::Hot {
            assert!(filters.get(p)?.is_none());
            continue;
        }
        let sum = row.filter_checksum.ok_or("sealed without a checksum")?;
        let stored = filters.get(p)?.ok_or("no filter")?;
        let filter = PartitionFilter::decode(p, stored.value(), &sum, &hasher)?;
        filter.check_table_len(table.len()?)?;
        for i in 0..row.keys {
            assert!(filter.may_contain(&record_key(p, i)));
        }
        // A key of another partition: absent here (a false "maybe" is
        // allowed, but not for all of them).
        let absent = (0..300)
            .filter(|&i| !filter.may_contain(&record_key(p + 1_000, i)))
            .count();
        assert!(absent > 250, "{absent} of 300 other keys said absent");
    }
    Ok(())
}

#[test]
fn a_damaged_stored_filter_is_refused_and_rebuilt_from_its_table() -> TestResult {
    let db = Database::builder().create_with_backend(InMemoryBackend::new())?;
    let hasher = FilterHasher::new(&SEED);
    build(&db, &hasher)?;
    // Damage partition 10's filter: zero its blocks, so it would say
    // "absent" to every key if it were believed.
    let txn = db.begin_write()?;
    {
        let mut filters = txn.open_table(FILTERS)?;
        let mut bytes = filters.get(10)?.ok_or("no filter")?.value().to_vec();
        bytes[17..].fill(0);
        filters.insert(10, bytes.as_slice())?;
    }
    txn.commit()?;

    let read = db.begin_read()?;
    let rows = read.open_table(PARTITIONS)?;
    let row = PartitionRow::decode(10, rows.get(10)?.ok_or("no row")?.value())?;
    let sum = row.filter_checksum.ok_or("no checksum")?;
    let stored = read
        .open_table(FILTERS)?
        .get(10)?
        .ok_or("no filter")?
        .value()
        .to_vec();
    let err = PartitionFilter::decode(10, &stored, &sum, &hasher).map(|_| ());
    assert_eq!(
        err.map_err(|e| (e.partition, e.problem)),
        Err((10, FilterProblem::ChecksumMismatch))
    );
    // The rebuild: a scan of the table's keys, at the table's size.
    let name = PartitionTable::records(10).name();
    let table = read.open_table(records_definition(&name))?;
    let mut rebuilt = PartitionFilter::with_capacity(10, table.len()?, &hasher)?;
    for entry in table.iter()? {
        let (key, _) = entry?;
        rebuilt.insert(key.value())?;
    }
    rebuilt.check_table_len(row.keys)?;
    // Built at the same capacity from the same keys: the filter sealed.
    assert_eq!(rebuilt.encode().1, sum);
    Ok(())
}
