//! Property tests of the record decoder, on arbitrary bytes and on
//! mutations of valid records in every state: it never panics,
//! refuses garbage, and accepts exactly the valid records (not their
//! truncations, extensions or other format versions), and never accepts a
//! format-2 value with a damaged byte. They mirror the `record_decode` fuzz
//! target in `fuzz/`.

use std::path::Path;

use proptest::prelude::*;

use super::codec::{
    decode, decode_all, encode, encode_v1, FORMAT_VERSION, FORMAT_VERSION_1, FUZZ_KEY,
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
/// empty response; in the order of their names in `write_record_seeds`.
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

/// Writes the records above as seeds for the `record_decode` fuzz target,
/// in format 2 (`<state>.bin`, under `FUZZ_KEY`) and format 1
/// (`<state>.v1.bin`): `cargo test --release --lib -- --ignored
/// write_record_seeds`.
#[test]
#[ignore = "writes fuzz/corpus/record_decode; run by hand"]
fn write_record_seeds() -> TestResult {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/record_decode");
    std::fs::create_dir_all(&dir)?;
    let names = [
        "completed",
        "empty",
        "failed",
        "processing",
        "tombstone",
        "unknown",
    ];
    let (v2, v1) = (valid_records(), valid_v1_records());
    assert_eq!(v2.len(), names.len());
    for ((name, v2), v1) in names.iter().zip(v2).zip(v1) {
        std::fs::write(dir.join(format!("{name}.bin")), v2)?;
        std::fs::write(dir.join(format!("{name}.v1.bin")), v1)?;
    }
    Ok(())
}
