//! Fingerprinting a JSON body (strict parse, RFC 8785-style canonical form,
//! blake3) vs `serde_json::from_slice::<serde_json::Value>` of the same bytes,
//! for a 300-byte and a 10 KiB body. Throughput is in body bytes. The ratio
//! is measured again interleaved (`PAIRED …` lines).

mod common;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use idempotency::Fingerprint;

/// A payment-like JSON object of about `size` bytes: a few fixed members,
/// then line items until the size is reached.
fn body(size: usize) -> Vec<u8> {
    let mut s = String::from(
        r#"{"amount":1999.5,"currency":"EUR","customer":"cus_9f1c2b","description":"order 42","metadata":{"channel":"web","retry":false},"items":["#,
    );
    let mut i = 0;
    while s.len() + 80 < size {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&format!(
            r#"{{"sku":"sku-{i:05}","qty":{},"price":{}.25,"gift":{}}}"#,
            i % 7 + 1,
            i * 13 % 1000,
            i % 2 == 0
        ));
        i += 1;
    }
    s.push_str("]}");
    while s.len() < size {
        s.insert(s.len() - 1, ' ');
    }
    s.into_bytes()
}

fn fingerprint(c: &mut Criterion) {
    for (name, size) in [("300B", 300), ("10KiB", 10 * 1024)] {
        let body = body(size);
        assert_eq!(body.len(), size);
        serde_json::from_slice::<serde_json::Value>(&body).expect("valid json");
        let mut g = c.benchmark_group(format!("fingerprint, {name} JSON body"));
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_function("Fingerprint::of_json (canonicalize + blake3)", |b| {
            b.iter(|| Fingerprint::of_json(std::hint::black_box(&body), &[]).expect("fingerprint"));
        });
        g.bench_function("serde_json::from_slice::<Value>", |b| {
            b.iter(|| {
                serde_json::from_slice::<serde_json::Value>(std::hint::black_box(&body))
                    .expect("parse")
            });
        });
        g.finish();

        // The target ratio again, interleaved in 0.3 s slices.
        if common::paired_selected() {
            let r = common::rounds();
            let slice = r.slice / 5;
            let (mut ours, mut theirs) = (vec![], vec![]);
            for _ in 0..r.rounds {
                ours.push(common::rate_for(1, slice, |_| {
                    Fingerprint::of_json(std::hint::black_box(&body), &[]).expect("fingerprint");
                }));
                theirs.push(common::rate_for(1, slice, |_| {
                    serde_json::from_slice::<serde_json::Value>(std::hint::black_box(&body))
                        .expect("parse");
                }));
            }
            common::report_paired(
                &format!("fingerprint {name} bodies/s: of_json vs serde_json Value"),
                "/s",
                &ours,
                &theirs,
            );
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(30)
        .warm_up_time(std::time::Duration::from_millis(300))
        .measurement_time(std::time::Duration::from_secs(1))
        .without_plots()
        .configure_from_args();
    targets = fingerprint
}
criterion_main!(benches);
