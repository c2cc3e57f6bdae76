//! Storage layout: the engine's table shapes on plain redb, with three
//! record-key layouts, to choose the format by measurement.
//!
//! - `scope-prefixed` (current format 1): record key
//!   `[scope len][scope][key]`, 57 bytes for a 20-byte scope and a UUID key;
//!   index entries `(u64, record key)`.
//! - `blake3-16`: record key = 16-byte blake3 hash of (scope, key); scope
//!   and key move into the value (+57 bytes) so records can still be listed;
//!   index entries `(u64, [u8; 16])`.
//! - `sequential-u64`: record key = an increasing u64 (8 bytes). Not usable
//!   as is (lookups are by the client's random key, which would need its own
//!   index), it bounds what append-only inserts could gain.
//! - `key->id + sequential records`: a `keys` table maps the scope-prefixed
//!   key to a u64 id (assigned in claim order, e.g. the fencing token) and
//!   records are keyed by that id; indexes hold `(u64, id)`. A begin inserts
//!   into both tables; a complete reads the id and rewrites a record near the
//!   right edge of the records tree; a lookup is two gets.
//!
//! Each iteration is one durable write transaction shaped like a group
//! commit of 32 requests' `begin`s and the previous batch's `complete`s:
//! per begin a get (miss), an 80-byte PROCESSING value and a lease-index
//! entry; per complete a get, the 404-byte COMPLETED value, a lease-index
//! removal and an expiry-index entry. Databases are preloaded with 10k or
//! 1M completed records in one transaction. Point lookups (read txn + get)
//! are measured too. File size per record is printed as `LAYOUT …` lines.

mod common;

use std::time::Instant;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};

const RECORDS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("records");
const KEYS: TableDefinition<&[u8], u64> = TableDefinition::new("keys");
const LEASES: TableDefinition<(u64, &[u8]), ()> = TableDefinition::new("leases");
const EXPIRY: TableDefinition<(u64, &[u8]), ()> = TableDefinition::new("expiry");
const BATCH: usize = 32;
const NOW: u64 = 1_800_000_000_000;

#[derive(Clone, Copy)]
enum Layout {
    ScopePrefixed,
    Blake3,
    Sequential,
    IdIndexed,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Layout::ScopePrefixed => "scope-prefixed",
            Layout::Blake3 => "blake3-16",
            Layout::Sequential => "sequential-u64",
            Layout::IdIndexed => "key->id + sequential records",
        }
    }

    /// The record key of request number `n` with client key `uuid`.
    fn key(self, n: u64, uuid: &str) -> Vec<u8> {
        match self {
            Layout::ScopePrefixed | Layout::IdIndexed => {
                common::redb_plain::record_key(common::SCOPE, uuid)
            }
            Layout::Blake3 => {
                let mut h = blake3::Hasher::new();
                h.update(&[common::SCOPE.len() as u8]);
                h.update(common::SCOPE.as_bytes());
                h.update(uuid.as_bytes());
                h.finalize().as_bytes()[..16].to_vec()
            }
            Layout::Sequential => n.to_be_bytes().to_vec(),
        }
    }

    /// Value sizes (processing, completed): the hashed layout also stores
    /// the 57-byte scope and key.
    fn values(self) -> (Vec<u8>, Vec<u8>) {
        let extra = if matches!(self, Layout::Blake3) {
            57
        } else {
            0
        };
        (vec![0u8; 80 + extra], vec![1u8; 404 + extra])
    }
}

struct Store {
    layout: Layout,
    db: Database,
    next: u64,
    pending: Vec<Vec<u8>>,
    keys: Vec<Vec<u8>>,
}

impl Store {
    fn create(layout: Layout, path: &std::path::Path, preload: usize) -> Store {
        let db = Database::create(path).expect("create");
        let mut s = Store {
            layout,
            db,
            next: 0,
            pending: Vec::new(),
            keys: Vec::with_capacity(preload),
        };
        let (_, done) = layout.values();
        let txn = s.db.begin_write().expect("txn");
        {
            let mut rec = txn.open_table(RECORDS).expect("t");
            let mut exp = txn.open_table(EXPIRY).expect("t");
            txn.open_table(LEASES).expect("t");
            let mut ids = txn.open_table(KEYS).expect("t");
            for _ in 0..preload {
                let k = s.new_key();
                let rk = s.record_key(&k, &mut ids);
                rec.insert(rk.as_slice(), done.as_slice()).expect("insert");
                exp.insert((NOW, rk.as_slice()), ()).expect("insert");
                s.keys.push(k);
            }
        }
        txn.commit().expect("commit");
        s
    }

    fn new_key(&mut self) -> Vec<u8> {
        self.next += 1;
        self.layout
            .key(self.next, &uuid::Uuid::new_v4().to_string())
    }

    /// The record key for client key `k`: itself, or (IdIndexed) the id
    /// `keys` maps it to, assigned here if absent.
    fn record_key(&self, k: &[u8], ids: &mut redb::Table<&[u8], u64>) -> Vec<u8> {
        if !matches!(self.layout, Layout::IdIndexed) {
            return k.to_vec();
        }
        if let Some(id) = ids.get(k).expect("get") {
            return id.value().to_be_bytes().to_vec();
        }
        let id = self.next;
        ids.insert(k, id).expect("insert");
        id.to_be_bytes().to_vec()
    }

    /// One group commit: BATCH begins and the previous BATCH completes.
    fn group_commit(&mut self) {
        let (proc_v, done_v) = self.layout.values();
        let begins: Vec<Vec<u8>> = (0..BATCH).map(|_| self.new_key()).collect();
        let mut txn = self.db.begin_write().expect("txn");
        txn.set_durability(Durability::Immediate)
            .expect("durability");
        {
            let mut rec = txn.open_table(RECORDS).expect("t");
            let mut leases = txn.open_table(LEASES).expect("t");
            let mut exp = txn.open_table(EXPIRY).expect("t");
            let mut ids = txn.open_table(KEYS).expect("t");
            for (i, k) in begins.iter().enumerate() {
                let k = if matches!(self.layout, Layout::IdIndexed) {
                    assert!(ids.get(k.as_slice()).expect("get").is_none());
                    let id = self.next - (BATCH - 1 - i) as u64;
                    ids.insert(k.as_slice(), id).expect("i");
                    id.to_be_bytes().to_vec()
                } else {
                    assert!(rec.get(k.as_slice()).expect("get").is_none());
                    k.clone()
                };
                leases.insert((NOW + 30_000, k.as_slice()), ()).expect("i");
                rec.insert(k.as_slice(), proc_v.as_slice()).expect("i");
            }
            for k in &self.pending {
                let k = self.record_key(k, &mut ids);
                assert!(rec.get(k.as_slice()).expect("get").is_some());
                leases.remove((NOW + 30_000, k.as_slice())).expect("r");
                exp.insert((NOW + 86_400_000, k.as_slice()), ()).expect("i");
                rec.insert(k.as_slice(), done_v.as_slice()).expect("i");
            }
        }
        txn.commit().expect("commit");
        self.pending = begins;
    }

    fn lookup(&self, k: &[u8]) -> Vec<u8> {
        let txn = self.db.begin_read().expect("txn");
        let t = txn.open_table(RECORDS).expect("t");
        let id;
        let k = if matches!(self.layout, Layout::IdIndexed) {
            let ids = txn.open_table(KEYS).expect("t");
            id = ids
                .get(k)
                .expect("get")
                .expect("present")
                .value()
                .to_be_bytes();
            &id[..]
        } else {
            k
        };
        let v = t.get(k).expect("get").expect("present");
        v.value().to_vec()
    }
}

fn layout(c: &mut Criterion) {
    let layouts = [
        Layout::ScopePrefixed,
        Layout::Blake3,
        Layout::Sequential,
        Layout::IdIndexed,
    ];
    let big = if common::measuring() {
        1_000_000
    } else {
        2_000
    };
    for preload in [10_000usize, big] {
        let label = match preload {
            1_000_000 => "1M".to_string(),
            10_000 => "10k".to_string(),
            n => n.to_string(),
        };
        let mut commit = c.benchmark_group(format!(
            "layout: group commit of {BATCH} begins + {BATCH} completes, {label} records"
        ));
        commit.throughput(Throughput::Elements(BATCH as u64));
        commit.sample_size(10);
        let mut stores = Vec::new();
        for l in layouts {
            let dir = common::bench_dir();
            let path = dir.path().join("layout.redb");
            let mut store: Option<Store> = None;
            commit.bench_function(BenchmarkId::from_parameter(l.name()), |b| {
                let s = store.get_or_insert_with(|| {
                    let start = Instant::now();
                    let s = Store::create(l, &path, preload);
                    eprintln!("preloaded {preload} {} in {:?}", l.name(), start.elapsed());
                    s
                });
                b.iter(|| s.group_commit());
            });
            if let Some(s) = store {
                let size = std::fs::metadata(&path).map_or(0, |m| m.len());
                println!(
                    "LAYOUT {} {label}: file {:.0} MiB, {:.0} bytes per record",
                    l.name(),
                    size as f64 / (1 << 20) as f64,
                    size as f64 / (s.next as f64)
                );
                stores.push((l, s, dir));
            }
        }
        commit.finish();

        let mut get = c.benchmark_group(format!("layout: point lookup, {label} records"));
        get.throughput(Throughput::Elements(1));
        for (l, s, _dir) in &stores {
            let mut pick = common::Picker::new(3);
            get.bench_function(BenchmarkId::from_parameter(l.name()), |b| {
                b.iter(|| s.lookup(&s.keys[pick.next(s.keys.len())]));
            });
        }
        get.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(std::time::Duration::from_millis(300))
        .measurement_time(std::time::Duration::from_secs(2))
        .without_plots()
        .configure_from_args();
    targets = layout
}
criterion_main!(benches);
