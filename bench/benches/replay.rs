//! Replay: `begin` on a completed key (a read transaction, decode, classify,
//! envelope copy) vs a raw redb point lookup and a SQLite point lookup of a
//! value of the same size, each over 10k completed records, 1 thread. The
//! ratios are measured again interleaved (`PAIRED …` lines).

mod common;

use common::{redb_plain, sqlite, Picker};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use idempotency::{Begin, Engine};

const RECORDS: usize = 10_000;

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
        let (mut ours, mut raw, mut lite) = (vec![], vec![], vec![]);
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
        }
        let name = "replay lookups/s, 1 thread, 10k records";
        common::report_paired(&format!("{name}: engine vs raw redb"), "/s", &ours, &raw);
        common::report_paired(&format!("{name}: engine vs sqlite"), "/s", &ours, &lite);
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
    targets = replay
}
criterion_main!(benches);
