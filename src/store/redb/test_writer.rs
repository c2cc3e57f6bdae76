//! The format-3 writer the store's table-level tests drive
//! (`partitioned_tables_tests.rs`, `merge_tests.rs`): one in-memory file,
//! its catalog, counters and clock, each group run as the writer runs
//! it, and every frame kept so a test can replay them.

use std::sync::Arc;

use redb::backends::InMemoryBackend;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use crate::key::IdempotencyKey;
use crate::policy::ExpiryPolicy;
use crate::report::SweepCounts;
use crate::store::config::StoreConfig;

use super::journal::{Change, Frame};
use super::partition::catalog::{Catalog, Filters, SealRule};
use super::partition::filter::FilterHasher;
use super::partition::row::{PartitionRow, FILTERS, PARTITIONS};
use super::tables::{Sequences, Tables};

pub(super) type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

pub(super) const T0: u64 = 1_796_000_000_000;
pub(super) const SEED: &[u8; 16] = b"sixteen byte key";

pub(super) fn cfg() -> StoreConfig {
    StoreConfig {
        ttl_ms: 86_400_000,
        expiry: ExpiryPolicy::Forget,
        max_response_bytes: 1 << 20,
    }
}

pub(super) fn key(i: u32) -> R<IdempotencyKey> {
    Ok(IdempotencyKey::new("shop:pay", format!("order-{i}"))?)
}

pub(super) fn mem() -> R<Database> {
    Ok(Database::builder().create_with_backend(InMemoryBackend::new())?)
}

/// A format-3 writer over one in-memory file: its catalog, counters and
/// clock, and every frame its groups wrote.
pub(super) struct Writer {
    pub(super) db: Database,
    pub(super) catalog: Catalog,
    pub(super) seq: Sequences,
    pub(super) now: u64,
    pub(super) frames: Vec<Frame>,
    /// The settings its groups run with ([`cfg`] unless a test changes
    /// them).
    pub(super) cfg: StoreConfig,
}

impl Writer {
    pub(super) fn new(rule: SealRule) -> R<Writer> {
        Writer::on(mem()?, rule)
    }

    /// A format-3 writer over `db` (an empty file, e.g. on disk).
    pub(super) fn on(db: Database, rule: SealRule) -> R<Writer> {
        let txn = db.begin_write()?;
        {
            let mut meta = txn.open_table(super::tables::META)?;
            super::meta::create_format_3(&mut meta, SEED)?;
        }
        let mut changes = Vec::new();
        let catalog = Catalog::load_in(
            &txn,
            Arc::new(Filters::new(FilterHasher::new(SEED))),
            rule,
            T0,
            &mut changes,
        )?;
        txn.commit()?;
        let first = Frame {
            next_token: 1,
            next_outbox: 1,
            changes: changes.into_iter().map(Change::from).collect(),
        };
        Ok(Writer {
            db,
            catalog,
            seq: Sequences {
                token: 1,
                outbox: 1,
            },
            now: T0,
            frames: vec![first],
            cfg: cfg(),
        })
    }

    /// The writer's frames applied, in order, to an empty format-3 file
    /// (what a recovery replays).
    pub(super) fn replayed(&self) -> R<Database> {
        let replayed = mem()?;
        let txn = replayed.begin_write()?;
        {
            let mut meta = txn.open_table(super::tables::META)?;
            super::meta::create_format_3(&mut meta, SEED)?;
        }
        for frame in &self.frames {
            super::recover::apply(&txn, frame, true).map_err(|e| format!("{e:?}"))?;
        }
        txn.commit()?;
        Ok(replayed)
    }

    /// One group as the writer runs it: seal if due, then `ops`,
    /// committed, the partitions it dropped forgotten, its frame kept.
    pub(super) fn group<T>(&mut self, ops: impl FnOnce(&mut Tables<'_>) -> R<T>) -> R<T> {
        let txn = self.db.begin_write()?;
        let (out, seq, changes, dropped) = {
            let mut t =
                Tables::open_partitioned(&txn, self.seq, self.now, self.cfg, &mut self.catalog)?;
            t.keep_changes();
            t.seal_if_due()?;
            let out = ops(&mut t)?;
            let dropped = t.take_dropped();
            (out, t.seq, t.changes.take().unwrap_or_default(), dropped)
        };
        txn.commit()?;
        for p in dropped {
            self.catalog.dropped(p);
        }
        self.seq = seq;
        self.frames.push(Frame {
            next_token: seq.token,
            next_outbox: seq.outbox,
            changes,
        });
        Ok(out)
    }
}

/// Every (key, value) of a table, as bytes.
pub(super) fn dump<K: redb::Key + 'static>(
    db: &Database,
    def: TableDefinition<K, &'static [u8]>,
) -> R<Vec<(Vec<u8>, Vec<u8>)>>
where
    for<'a> K::SelfType<'a>: std::fmt::Debug,
{
    let txn = db.begin_read()?;
    let Some(table) = opened(&txn, def)? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for entry in table.iter()? {
        let (k, v) = entry?;
        out.push((format!("{:?}", k.value()).into_bytes(), v.value().to_vec()));
    }
    Ok(out)
}

/// Table `def` of `txn`, `None` if the file has none.
fn opened<K: redb::Key + 'static, V: redb::Value + 'static>(
    txn: &redb::ReadTransaction,
    def: TableDefinition<K, V>,
) -> R<Option<redb::ReadOnlyTable<K, V>>> {
    match txn.open_table(def) {
        Ok(table) => Ok(Some(table)),
        Err(redb::TableError::TableDoesNotExist(_)) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Every entry of an index table.
pub(super) fn dump_index(
    db: &Database,
    def: TableDefinition<(u64, &'static [u8]), ()>,
) -> R<Vec<(u64, Vec<u8>)>> {
    let txn = db.begin_read()?;
    let Some(table) = opened(&txn, def)? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for entry in table.iter()? {
        let (k, _) = entry?;
        let (at, key) = k.value();
        out.push((at, key.to_vec()));
    }
    Ok(out)
}

/// (slot key, step name, value) of every effect step.
pub(super) type StepRows = Vec<(Vec<u8>, String, Vec<u8>)>;
/// (slot key, seq, value) of every log entry.
pub(super) type LogRows = Vec<(Vec<u8>, u32, Vec<u8>)>;

/// Every effect step of `db`.
pub(super) fn dump_steps(db: &Database) -> R<StepRows> {
    let txn = db.begin_read()?;
    let mut out = Vec::new();
    if let Ok(t) = txn.open_table(super::partition::catalog::STEPS) {
        for e in t.iter()? {
            let (k, v) = e?;
            let (a, b) = k.value();
            out.push((a.to_vec(), b.to_owned(), v.value().to_vec()));
        }
    }
    Ok(out)
}

/// Every log entry of `db`.
pub(super) fn dump_history(db: &Database) -> R<LogRows> {
    let txn = db.begin_read()?;
    let mut out = Vec::new();
    if let Ok(t) = txn.open_table(super::partition::catalog::HISTORY) {
        for e in t.iter()? {
            let (k, v) = e?;
            let (a, b) = k.value();
            out.push((a.to_vec(), b, v.value().to_vec()));
        }
    }
    Ok(out)
}

/// Every partition row of `db` that decodes (one that does not fails).
pub(super) fn rows(db: &Database) -> R<std::collections::BTreeMap<u64, PartitionRow>> {
    let txn = db.begin_read()?;
    let mut out = std::collections::BTreeMap::new();
    for entry in txn.open_table(PARTITIONS)?.iter()? {
        let (k, v) = entry?;
        out.insert(k.value(), PartitionRow::decode(k.value(), v.value())?);
    }
    Ok(out)
}

impl Writer {
    /// One merge step of at most `records` records, in a group of its own.
    pub(super) fn merge_step(&mut self, records: usize) -> R<SweepCounts> {
        let mut counts = SweepCounts::default();
        self.group(|t| {
            t.merge_step(records, &mut counts)
                .map_err(|e| format!("{e:?}"))?;
            Ok(())
        })?;
        Ok(counts)
    }

    /// Fails (naming `what` and the table) unless the writer's records,
    /// rows, filters, index entries, outbox, steps and log entries are
    /// those its frames replay to, byte for byte.
    pub(super) fn assert_replays(&self, what: &str) -> R<()> {
        use super::partition::catalog::RECORDS;
        let replayed = self.replayed()?;
        for (name, a, b) in [
            (
                "records",
                dump(&replayed, RECORDS)?,
                dump(&self.db, RECORDS)?,
            ),
            (
                "rows",
                dump(&replayed, PARTITIONS)?,
                dump(&self.db, PARTITIONS)?,
            ),
            (
                "filters",
                dump(&replayed, FILTERS)?,
                dump(&self.db, FILTERS)?,
            ),
        ] {
            if a != b {
                return Err(format!("{what}: replayed {name} differ").into());
            }
        }
        for (name, def) in [
            ("leases", super::tables::LEASES),
            ("recovery", super::tables::RECOVERY),
            ("expiry", super::tables::EXPIRY),
        ] {
            if dump_index(&replayed, def)? != dump_index(&self.db, def)? {
                return Err(format!("{what}: replayed {name} index differs").into());
            }
        }
        if dump(&replayed, super::tables::OUTBOX)? != dump(&self.db, super::tables::OUTBOX)? {
            return Err(format!("{what}: replayed outbox differs").into());
        }
        if dump_steps(&replayed)? != dump_steps(&self.db)? {
            return Err(format!("{what}: replayed steps differ").into());
        }
        if dump_history(&replayed)? != dump_history(&self.db)? {
            return Err(format!("{what}: replayed history differs").into());
        }
        Ok(())
    }
}

impl Writer {
    /// The catalog an open loads from the file now (with `rule`); an
    /// error if loading it would change anything.
    pub(super) fn loaded_catalog(&self, rule: SealRule) -> R<Catalog> {
        let txn = self.db.begin_write()?;
        let mut changes = Vec::new();
        let catalog = Catalog::load_in(
            &txn,
            Arc::new(Filters::new(FilterHasher::new(SEED))),
            rule,
            self.now,
            &mut changes,
        )?;
        txn.commit()?;
        if !changes.is_empty() {
            return Err(format!("a reload changed the file: {changes:?}").into());
        }
        Ok(catalog)
    }

    /// Keys `key(0..count)`, four a group, each group a second after the
    /// one before: claimed with a lease of `lease_ms` and completed; the
    /// keys at `with_step` get a confirmed effect step "charge" (and so
    /// log entries) before their completion.
    pub(super) fn completed(
        &mut self,
        count: u32,
        lease_ms: u64,
        with_step: &[usize],
    ) -> R<Vec<IdempotencyKey>> {
        use super::test_requests::{claim_in, complete_in, finish_charge};
        let keys: Vec<IdempotencyKey> = (0..count).map(key).collect::<R<_>>()?;
        for group in keys.chunks(4).enumerate().map(|(g, _)| g) {
            self.now += 1_000;
            self.group(|t| {
                for (i, k) in keys.iter().enumerate().skip(group * 4).take(4) {
                    let token = claim_in(t, k, lease_ms)?;
                    if with_step.contains(&i) {
                        finish_charge(t, k, token)?;
                    }
                    complete_in(t, k, token)?;
                }
                Ok(())
            })?;
        }
        Ok(keys)
    }
}

impl Writer {
    /// Two merge spans later, the merge run in steps of 7 records up to
    /// its switch: the sources dropping, none dropped yet. An error if it
    /// does not begin, switch within 40 steps, or leave a source dropping.
    pub(super) fn merge_to_switch(&mut self) -> R<()> {
        use super::partition::merge::MERGE_SPAN_MS;
        use super::partition::row::PartitionState;
        self.now += 2 * MERGE_SPAN_MS;
        if !self.merge_step(7)?.more {
            return Err("the merge did not begin".into());
        }
        let mut steps = 0;
        while self.catalog.merging().is_some() {
            self.merge_step(7)?;
            steps += 1;
            if steps >= 40 {
                return Err("the merge did not switch in 40 steps".into());
            }
        }
        let r = rows(&self.db)?;
        if !r.values().any(|row| row.state == PartitionState::Dropping) {
            return Err(format!("no source dropping after the switch: {r:?}").into());
        }
        Ok(())
    }
}
