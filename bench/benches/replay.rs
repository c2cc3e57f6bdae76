//! Replay: `begin` on a completed key (a read transaction, decode, classify,
//! envelope copy) vs a raw redb point lookup and a SQLite point lookup of a
//! value of the same size, each over 10k completed records, 1 thread. The
//! ratios are measured again interleaved (`PAIRED …` lines).
//!
//! Then the same replay over 1M records (`IDEMPOTENCY_BENCH_RECORDS`
//! overrides it; criterion's test mode uses 2,000) against the raw redb
//! lookup (a read transaction and the table opened per lookup) and against
//! a raw lookup in a read transaction and table kept open (issue 26,
//! "Kept-open read snapshot"). The engine's file is a fixture: made once
//! through the engine (completed records under a fixed clock, so none
//! expires) and kept under the bench base dir (`fixtures/replay-N`); each
//! run opens a copy. The raw file is loaded in one write transaction.

mod common;

use std::path::{Path, PathBuf};

use common::{redb_plain, sqlite, Picker};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use idempotency::{Begin, Engine, IdempotencyKey, ManualClock};

const RECORDS: usize = 10_000;
/// The fixture's clock reading (ms): preload and replays both run at it.
const T0: u64 = 1_800_000_000_000;

fn replay(c: &mut Criterion) {
    let mut g =
        c.benchmark_group("replay of a completed key, 300B response, 10k records, 1 thread");
    g.throughput(Throughput::Elements(1));
    let dir = common::bench_dir();

    let engine = Engine::builder()
        .open(dir.path().join("engine.redb"))
        .expect("open engine");
    let keys = common::preload_engine(&engine, RECORDS);
    let fp = common::fingerprint();
    let mut pick = Picker::new(1);
    g.bench_function("engine begin (replay)", |b| {
        b.iter(|| match engine.begin(&keys[pick.next(RECORDS)], fp) {
            Ok(Begin::Replay(r)) => r,
            other => panic!("expected a replay, got {other:?}"),
        });
    });

    // The same keys and a value as large as the engine's encoded record
    // (state, fingerprint, reference, instants, 300-byte response: 404 bytes).
    let raw_keys: Vec<Vec<u8>> = keys
        .iter()
        .map(|k| redb_plain::record_key(k.scope(), k.key()))
        .collect();
    let value = vec![1u8; 404];
    let redb = redb_plain::PlainRedb::create(&dir.path().join("plain.redb"));
    redb.load(&raw_keys, &value);
    let mut pick = Picker::new(1);
    g.bench_function("raw redb point lookup", |b| {
        b.iter(|| redb.get(&raw_keys[pick.next(RECORDS)]).expect("present"));
    });
    let kept = redb.kept();
    let mut pick = Picker::new(1);
    g.bench_function("raw redb point lookup, table kept open", |b| {
        b.iter(|| kept.get(&raw_keys[pick.next(RECORDS)]).expect("present"));
    });

    let sql_keys: Vec<String> = keys.iter().map(ToString::to_string).collect();
    let sql = sqlite::PerOp::create(&dir.path().join("lookup.sqlite"));
    sql.load(
        &sql_keys,
        fp.as_bytes(),
        &vec![b'x'; common::RESPONSE_BYTES],
    );
    let mut pick = Picker::new(1);
    g.bench_function("sqlite point lookup", |b| {
        b.iter(|| sql.get(&sql_keys[pick.next(RECORDS)]).expect("present"));
    });
    g.finish();

    // The target ratios again, interleaved (see `common::Rounds`).
    if common::paired_selected() {
        let r = common::rounds();
        let slice = r.slice / 3;
        let pick = std::sync::atomic::AtomicUsize::new(0);
        let next = || pick.fetch_add(7919, std::sync::atomic::Ordering::Relaxed) % RECORDS;
        let (mut ours, mut raw, mut lite, mut held) = (vec![], vec![], vec![], vec![]);
        for _ in 0..r.rounds {
            ours.push(common::rate_for(1, slice, |_| {
                assert!(matches!(
                    engine.begin(&keys[next()], fp),
                    Ok(Begin::Replay(_))
                ));
            }));
            raw.push(common::rate_for(1, slice, |_| {
                redb.get(&raw_keys[next()]).expect("present");
            }));
            lite.push(common::rate_for(1, slice, |_| {
                sql.get(&sql_keys[next()]).expect("present");
            }));
            held.push(common::rate_for(1, slice, |_| {
                kept.get(&raw_keys[next()]).expect("present");
            }));
        }
        let name = "replay lookups/s, 1 thread, 10k records";
        common::report_paired(&format!("{name}: engine vs raw redb"), "/s", &ours, &raw);
        common::report_paired(&format!("{name}: engine vs sqlite"), "/s", &ours, &lite);
        common::report_paired(
            &format!("{name}: raw redb kept open vs raw redb"),
            "/s",
            &held,
            &raw,
        );
    }
}

fn large() -> usize {
    let default = if common::measuring() {
        1_000_000
    } else {
        2_000
    };
    std::env::var("IDEMPOTENCY_BENCH_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The `i`th fixture key: a UUID-shaped key derived from `i`, so the
/// fixture needs no key list.
fn fixture_key(i: usize) -> IdempotencyKey {
    let hash = blake3::hash(&(i as u64).to_le_bytes());
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&hash.as_bytes()[..16]);
    IdempotencyKey::new(common::SCOPE, uuid::Uuid::from_bytes(bytes).to_string())
        .expect("valid key")
}

/// An engine at `T0` with no sweeper, on `path`.
fn open_engine(path: &Path) -> Engine {
    Engine::builder()
        .clock(ManualClock::new(T0))
        .sweep_interval(None)
        .open(path)
        .expect("open engine")
}

/// The directory of the engine fixture with `records` completed records
/// (keys [`fixture_key`]), made on first use.
fn fixture(records: usize) -> PathBuf {
    let base = std::env::var_os("IDEMPOTENCY_BENCH_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")), PathBuf::from)
        .join("fixtures");
    let dir = base.join(format!("replay-{records}"));
    if dir.join("engine.redb").exists() {
        return dir;
    }
    std::fs::create_dir_all(&base).expect("create the fixtures dir");
    let making = tempfile::tempdir_in(&base).expect("a temp dir for the fixture");
    let start = std::time::Instant::now();
    let engine = open_engine(&making.path().join("engine.redb"));
    let keys: Vec<IdempotencyKey> = (0..records).map(fixture_key).collect();
    let threads = 256.min(records.max(1));
    common::run_clients(threads, records as u64, |t, i| {
        common::engine_request(&engine, &keys[i as usize * threads + t]);
    });
    drop(engine);
    println!(
        "PRELOAD fixture of {records} records through the engine in {:.1}s",
        start.elapsed().as_secs_f64()
    );
    std::fs::rename(making.keep(), &dir).expect("move the fixture into place");
    dir
}

/// Replays over `large()` records: the engine (its file a copy of the
/// fixture) against the raw lookup, per lookup and kept open.
fn replay_large(c: &mut Criterion) {
    let records = large();
    let label = if records.is_multiple_of(1_000_000) {
        format!("{}M", records / 1_000_000)
    } else {
        format!("{}k", records as f64 / 1_000.0)
    };
    let dir = common::bench_dir();
    let fixture = fixture(records);
    for entry in std::fs::read_dir(&fixture).expect("read the fixture dir") {
        let entry = entry.expect("fixture entry");
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).expect("copy the fixture");
    }
    let engine = open_engine(&dir.path().join("engine.redb"));
    let keys: Vec<IdempotencyKey> = (0..records).map(fixture_key).collect();
    let raw_keys: Vec<Vec<u8>> = keys
        .iter()
        .map(|k| redb_plain::record_key(k.scope(), k.key()))
        .collect();
    let start = std::time::Instant::now();
    let redb = redb_plain::PlainRedb::create(&dir.path().join("plain.redb"));
    redb.load(&raw_keys, &vec![1u8; 404]);
    println!(
        "PRELOAD raw redb, {records} records in one write transaction, in {:.1}s",
        start.elapsed().as_secs_f64()
    );
    let kept = redb.kept();
    let fp = common::fingerprint();
    let replay = |i: usize| match engine.begin(&keys[i], fp) {
        Ok(Begin::Replay(r)) => r,
        other => panic!("expected a replay, got {other:?}"),
    };
    // Both files through their caches once, so no series starts cold.
    for (i, raw) in raw_keys.iter().enumerate() {
        replay(i);
        redb.get(raw).expect("present");
    }

    let mut g = c.benchmark_group(format!(
        "replay of a completed key, 300B response, {label} records, 1 thread"
    ));
    g.throughput(Throughput::Elements(1));
    let mut pick = Picker::new(1);
    g.bench_function("engine begin (replay)", |b| {
        b.iter(|| replay(pick.next(records)));
    });
    let mut pick = Picker::new(1);
    g.bench_function("raw redb point lookup", |b| {
        b.iter(|| redb.get(&raw_keys[pick.next(records)]).expect("present"));
    });
    let mut pick = Picker::new(1);
    g.bench_function("raw redb point lookup, table kept open", |b| {
        b.iter(|| kept.get(&raw_keys[pick.next(records)]).expect("present"));
    });
    g.finish();

    if common::paired_selected() {
        let r = common::rounds();
        let slice = r.slice / 3;
        let pick = std::sync::atomic::AtomicUsize::new(0);
        let next = || pick.fetch_add(7919, std::sync::atomic::Ordering::Relaxed) % records;
        let (mut ours, mut raw, mut held) = (vec![], vec![], vec![]);
        for _ in 0..r.rounds {
            ours.push(common::rate_for(1, slice, |_| {
                replay(next());
            }));
            raw.push(common::rate_for(1, slice, |_| {
                redb.get(&raw_keys[next()]).expect("present");
            }));
            held.push(common::rate_for(1, slice, |_| {
                kept.get(&raw_keys[next()]).expect("present");
            }));
        }
        let name = format!("replay lookups/s, 1 thread, {label} records");
        common::report_paired(&format!("{name}: engine vs raw redb"), "/s", &ours, &raw);
        common::report_paired(
            &format!("{name}: engine vs raw redb kept open"),
            "/s",
            &ours,
            &held,
        );
        common::report_paired(
            &format!("{name}: raw redb kept open vs raw redb"),
            "/s",
            &held,
            &raw,
        );
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(30)
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(2))
        .without_plots()
        .configure_from_args();
    targets = replay, replay_large
}
criterion_main!(benches);
