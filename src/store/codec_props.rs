//! Property tests of the record decoder, on arbitrary bytes and on
//! mutations of valid records in every state: it never panics,
//! refuses garbage, and accepts exactly the valid records (not their
//! truncations, extensions or other format versions), and never accepts a
//! format-2 value with a damaged byte. They mirror the `record_decode` fuzz
//! target in `fuzz/`.

use std::path::Path;

use proptest::prelude::*;

use super::codec::{
    decode, decode_all, decode_all_framed, encode, encode_v1, fuzz_decode, FORMAT_VERSION,
    FORMAT_VERSION_1, FUZZ_KEY,
};
use super::record::{reference, Completion, Record, StoredResponse};
use crate::envelope::Envelope;
use crate::fingerprint::Fingerprint;

type TestResult = Result<(), Box<dyn std::error::Error>>;

proptest! {
    #[test]
    fn record_decoder_never_panics_on_arbitrary_bytes(input in proptest::collection::vec(any::<u8>(), 0..256)) {
        let accepted = decode_all(&input);
        // Random bytes never carry a matching checksum: only a format-1
        // value can pass.
        if input.first() != Some(&FORMAT_VERSION_1) {
            prop_assert!(!accepted, "accepted a value of another format version");
        }
    }

    #[test]
    fn field_decoders_never_panic_on_framed_arbitrary_payloads(payload in proptest::collection::vec(any::<u8>(), 0..256)) {
        // The fuzz target's framed mode: past the checksum, into the fields.
        let accepted = decode_all_framed(&payload);
        let mut input = vec![1];
        input.extend_from_slice(&payload);
        prop_assert_eq!(fuzz_decode(&input), accepted);
    }

    #[test]
    fn record_decoder_never_panics_on_mutated_records(
        which in any::<prop::sample::Index>(),
        format_1 in any::<bool>(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..4), 1..5),
    ) {
        let records = if format_1 { valid_v1_records() } else { valid_records() };
        let original = which.get(records).clone();
        let mut bytes = original.clone();
        for (at, byte, kind) in edits {
            let i = at.index(bytes.len() + 1);
            match kind {
                0 if i < bytes.len() => bytes[i] = byte,
                1 if i < bytes.len() => { bytes.remove(i); }
                2 => bytes.truncate(i),
                _ => bytes.insert(i, byte),
            }
        }
        let accepted = decode_all(&bytes);
        // A damaged format-2 value never decodes (a checksum collision,
        // 2^-64, aside).
        if bytes != original && bytes.first() == Some(&FORMAT_VERSION) {
            prop_assert!(!accepted, "accepted a damaged format-2 value");
        }
    }
}

// ---------------------------------------------------------------------------
// Valid records in every state, made by the same state changes the store
// applies.

/// Records in every state: PROCESSING, COMPLETED (headers, resource),
/// FINAL_FAILURE, UNKNOWN (with a reason), TOMBSTONE, and COMPLETED with an
/// empty response; in the order of their names in `SEED_NAMES`.
fn make_records() -> Vec<Record> {
    let t0 = 1_700_000_000_000;
    let ttl_ms = 60_000;
    let fp = Fingerprint::from_bytes([7; 32]);
    let claim =
        |key: &[u8], token| Record::processing(fp, token, reference(key, token), t0, t0 + 1_000);
    let completed = claim(b"completed", 2).completed(
        Completion::Success,
        StoredResponse::new(
            Envelope::new(3, 201, br#"{"id":"pay_1"}"#.to_vec())
                .with_header("content-type", "application/json")
                .with_header("x-bin", vec![0u8, 255, 7]),
            Some("pay_1".into()),
        ),
        t0 + 5,
        ttl_ms,
    );
    let empty = claim(b"empty", 5).completed(
        Completion::Success,
        StoredResponse::new(Envelope::new(0, 204, Vec::new()), None),
        t0 + 5,
        ttl_ms,
    );
    let failed = claim(b"failed", 3).completed(
        Completion::FinalFailure,
        StoredResponse::new(Envelope::new(1, 402, "insufficient funds"), None),
        t0 + 5,
        ttl_ms,
    );
    let processing = claim(b"processing", 1);
    let tombstone = claim(b"tombstone", 0)
        .completed(
            Completion::Success,
            StoredResponse::new(Envelope::new(1, 200, "old"), None),
            t0,
            ttl_ms,
        )
        .tombstone(t0 + ttl_ms + 600_000, t0 + ttl_ms + 1);
    let unknown = claim(b"unknown", 4).in_doubt("provider timed out".into(), t0 + 5, t0 + 5);
    vec![completed, empty, failed, processing, tombstone, unknown]
}

/// The records above in format 2, stored under `FUZZ_KEY`'s record key.
fn valid_records() -> &'static Vec<Vec<u8>> {
    static RECORDS: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
    RECORDS.get_or_init(|| {
        make_records()
            .iter()
            .map(|r| encode(FUZZ_KEY.0, r))
            .collect()
    })
}

/// The records above in format 1 (no checksum).
fn valid_v1_records() -> &'static Vec<Vec<u8>> {
    static RECORDS: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
    RECORDS.get_or_init(|| make_records().iter().map(encode_v1).collect())
}

#[test]
fn valid_records_decode_and_their_truncations_do_not() -> TestResult {
    let records = valid_records();
    assert_eq!(records.len(), 6);
    for record in records {
        assert!(decode_all(record));
        let decoded = decode(FUZZ_KEY.0, record).map_err(|e| e.to_string())?;
        assert_eq!(
            &encode(FUZZ_KEY.0, &decoded),
            record,
            "re-encoding changes the bytes"
        );
        // Its format-1 form decodes to the same record.
        let v1 = encode_v1(&decoded);
        assert!(decode_all(&v1));
        assert_eq!(decode(FUZZ_KEY.0, &v1).map_err(|e| e.to_string())?, decoded);
        for cut in 0..record.len() {
            assert!(!decode_all(&record[..cut]), "prefix {cut}");
        }
        let mut longer = record.clone();
        longer.push(0);
        assert!(!decode_all(&longer));
        for version in [0, FORMAT_VERSION_1, FORMAT_VERSION + 1, u8::MAX] {
            let mut other_version = record.clone();
            other_version[0] = version;
            assert!(!decode_all(&other_version), "as version {version}");
        }
    }
    Ok(())
}

/// The names of the records above, in their order.
const SEED_NAMES: [&str; 6] = [
    "completed",
    "empty",
    "failed",
    "processing",
    "tombstone",
    "unknown",
];

/// The `record_decode` fuzz target's seeds (see `codec::fuzz_decode`):
/// each record above in format 2 as stored (`raw-<state>.bin`: mode byte 0,
/// then the value under `FUZZ_KEY`), in format 1 (`raw-<state>.v1.bin`),
/// and as the payload the target frames itself (`framed-<state>.bin`: mode
/// byte 1, then the postcard bytes), whose mutations reach the field
/// decoders past the checksum.
fn fuzz_seeds() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for ((name, v2), v1) in SEED_NAMES
        .iter()
        .zip(valid_records())
        .zip(valid_v1_records())
    {
        let with_mode = |mode: u8, bytes: &[u8]| [&[mode][..], bytes].concat();
        out.push((format!("raw-{name}.bin"), with_mode(0, v2)));
        out.push((format!("raw-{name}.v1.bin"), with_mode(0, v1)));
        out.push((format!("framed-{name}.bin"), with_mode(1, &v1[1..])));
    }
    out
}

fn seed_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/record_decode")
}

/// Every committed seed of the `record_decode` fuzz target is there and
/// decodes as a record (a seed that no longer does, as after the checksum
/// changed, never leads the fuzzer past the check), with the bytes the
/// records above have now; any other file there (a kept crash input) at
/// least decodes without a panic.
#[test]
fn every_committed_fuzz_seed_decodes() -> TestResult {
    let seeds = fuzz_seeds();
    assert_eq!(seeds.len(), 3 * SEED_NAMES.len());
    let mut found = 0;
    for entry in std::fs::read_dir(seed_dir())? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let bytes = std::fs::read(&path)?;
        let decoded = fuzz_decode(&bytes);
        if let Some((_, expected)) = seeds.iter().find(|(n, _)| n == name) {
            assert!(decoded, "seed {name} does not decode");
            assert!(
                &bytes == expected,
                "seed {name} is stale: regenerate the seeds (fuzz/README.md)"
            );
            found += 1;
        }
    }
    assert_eq!(found, seeds.len(), "seeds are missing: regenerate them");
    Ok(())
}

/// Writes the seeds above to `fuzz/corpus/record_decode`: `cargo test
/// --release --lib -- --ignored write_record_seeds`.
#[test]
#[ignore = "writes fuzz/corpus/record_decode; run by hand"]
fn write_record_seeds() -> TestResult {
    let dir = seed_dir();
    std::fs::create_dir_all(&dir)?;
    for (name, bytes) in fuzz_seeds() {
        std::fs::write(dir.join(name), bytes)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Effect steps and log entries: the same framing, the same guarantees.

mod steps {
    use proptest::prelude::*;

    use crate::store::codec::{decode_history, decode_step, encode_history, encode_step};
    use crate::store::step::{Actor, HistoryRecord, StepRecord, StepStatus};

    const RKEY: &[u8] = b"\x04shoppay-1";

    fn step(status: u8, evidence: Vec<u8>, attempts: u32) -> StepRecord {
        let status = match status % 5 {
            0 => StepStatus::Reserved,
            1 => StepStatus::Confirmed,
            2 => StepStatus::Failed,
            3 => StepStatus::Unknown,
            _ => StepStatus::NotExecuted,
        };
        StepRecord {
            name: "charge".into(),
            reference: "idem_1_ref/charge".into(),
            status,
            token: 42,
            evidence,
            reserved_at_ms: 1_700_000_000_000,
            settled_at_ms: (attempts % 2 == 0).then_some(1_700_000_000_001),
            attempts,
            last_asked_ms: None,
        }
    }

    fn entry(seq: u32, actor: u8, evidence: Vec<u8>) -> HistoryRecord {
        let actor = match actor % 4 {
            0 => Actor::Claim { token: 7 },
            1 => Actor::Resolver,
            2 => Actor::Operator {
                reason: "checked the ledger".into(),
            },
            _ => Actor::Sweeper,
        };
        HistoryRecord {
            seq,
            at_ms: 1_700_000_000_002,
            actor,
            step: (seq % 2 == 0).then(|| "charge".to_string()),
            from: "reserved".into(),
            to: "confirmed".into(),
            evidence,
        }
    }

    proptest! {
        #[test]
        fn step_and_history_decoders_never_panic_and_refuse_arbitrary_bytes(
            input in proptest::collection::vec(any::<u8>(), 0..256),
            seq in any::<u32>(),
        ) {
            prop_assert!(decode_step(RKEY, "charge", &input).is_err());
            prop_assert!(decode_history(RKEY, seq, &input).is_err());
        }

        #[test]
        fn steps_and_entries_round_trip_and_refuse_any_damage(
            status in any::<u8>(),
            actor in any::<u8>(),
            seq in any::<u32>(),
            attempts in any::<u32>(),
            evidence in proptest::collection::vec(any::<u8>(), 0..64),
            at in any::<prop::sample::Index>(),
            flip in 1u8..=255,
        ) {
            let s = step(status, evidence.clone(), attempts);
            let bytes = encode_step(RKEY, &s);
            prop_assert_eq!(decode_step(RKEY, "charge", &bytes), Ok(s));
            let mut damaged = bytes.clone();
            damaged[at.index(bytes.len())] ^= flip;
            prop_assert!(decode_step(RKEY, "charge", &damaged).is_err());
            // Under another name or key, it does not verify.
            prop_assert!(decode_step(RKEY, "receipt", &bytes).is_err());
            prop_assert!(decode_step(b"\x04shoppay-2", "charge", &bytes).is_err());

            let e = entry(seq, actor, evidence);
            let bytes = encode_history(RKEY, &e);
            prop_assert_eq!(decode_history(RKEY, seq, &bytes), Ok(e));
            let mut damaged = bytes.clone();
            damaged[at.index(bytes.len())] ^= flip;
            prop_assert!(decode_history(RKEY, seq, &damaged).is_err());
            prop_assert!(decode_history(RKEY, seq.wrapping_add(1), &bytes).is_err());
            // Truncated or extended, never.
            prop_assert!(decode_history(RKEY, seq, &bytes[..bytes.len() - 1]).is_err());
            let mut longer = bytes.clone();
            longer.push(0);
            prop_assert!(decode_history(RKEY, seq, &longer).is_err());
        }
    }
}
