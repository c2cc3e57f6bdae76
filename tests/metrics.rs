//! Guards against the engine's counters and commit latencies not reaching
//! the `metrics` facade: an app that installs an exporter (Prometheus or
//! another) must see claims, replays, mismatches, processing and unknown
//! answers, and the group-commit batch sizes and latencies, under the
//! names `docs/metrics.md` documents.

use std::collections::HashMap;
use std::error::Error;

use idempotency::{Begin, Engine, Envelope, Fingerprint, IdempotencyKey};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

type TestResult = Result<(), Box<dyn Error>>;

#[test]
fn counters_and_commit_latencies_reach_the_metrics_facade() -> TestResult {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install()?;

    let engine = Engine::builder().sweep_interval(None).in_memory()?;
    let key = IdempotencyKey::new("shop:pay", "m-1")?;
    let fp = Fingerprint::of_json(br#"{"amount":1}"#, &[])?;
    let Begin::Claimed(claim) = engine.begin(&key, fp)? else {
        return Err("a new key is claimed".into());
    };
    assert!(matches!(engine.begin(&key, fp)?, Begin::Processing { .. }));
    engine.complete(claim, Envelope::new(1, 201, "ok"))?;
    assert!(matches!(engine.begin(&key, fp)?, Begin::Replay(_)));
    let other = Fingerprint::of_json(br#"{"amount":2}"#, &[])?;
    assert!(matches!(engine.begin(&key, other)?, Begin::Mismatch));

    let mut counters = HashMap::new();
    let mut histograms = HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let name = key.key().name().to_string();
        match value {
            DebugValue::Counter(n) => {
                counters.insert(name, n);
            }
            DebugValue::Histogram(samples) => {
                histograms.insert(name, samples.len());
            }
            DebugValue::Gauge(_) => {}
        }
    }
    for (name, want) in [
        ("idempotency_claims_total", 1),
        ("idempotency_processing_answers_total", 1),
        ("idempotency_replays_total", 1),
        ("idempotency_mismatches_total", 1),
    ] {
        assert_eq!(
            counters.get(name).copied(),
            Some(want),
            "{name}: {counters:?}"
        );
    }
    // One commit for the claim, one for the completion.
    for name in [
        "idempotency_group_commit_ops",
        "idempotency_group_commit_seconds",
    ] {
        assert!(
            histograms.get(name).is_some_and(|&n| n >= 2),
            "{name}: {histograms:?}"
        );
    }
    Ok(())
}
