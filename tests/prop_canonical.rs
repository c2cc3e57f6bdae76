//! Property tests for the parsers that read outside input: the JSON
//! canonicalizer behind request fingerprints, and the on-disk record decoder.
//!
//! They guard against a retry being judged by the wrong fingerprint (two
//! spellings of one request hashing differently, or two requests hashing the
//! same) and against a parser panicking on hostile or corrupt bytes. They
//! mirror the cargo-fuzz targets in `fuzz/` (see `fuzz/README.md`), bounded
//! so that the whole file runs in a few seconds:
//!
//! - canonicalization is idempotent, and its output parses to a value equal
//!   to the input's (generated JSON, and arbitrary or JSON-like bytes, which
//!   never panic);
//! - a value rendered two ways (members shuffled, whitespace, numbers in
//!   another exact form, escapes instead of raw characters) fingerprints
//!   equal, with and without JSON Pointers; a value changed in any way a
//!   canonicalizer could lose (a digit deep in a long mantissa, the sign,
//!   the exponent, one character of a string or name, array order and
//!   length, members, the type) fingerprints different;
//! - the record decoder never panics on arbitrary bytes nor on mutations of
//!   valid records written by a real engine, and refuses garbage.

mod json_gen;

use std::path::Path;
use std::time::Duration;

use idempotency::canonical;
use idempotency::{
    Begin, Engine, Envelope, ExpiryPolicy, Failure, Fingerprint, IdempotencyKey, ManualClock,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use json_gen::{mutate, normalize, places, plain, pointers_of, respelled, same, Num, Rng, Value};

type TestResult = Result<(), Box<dyn std::error::Error>>;

// ---------------------------------------------------------------------------
// Generated JSON values; rendering and mutation are in `json_gen`, shared
// with the fuzz targets.

fn name_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z]{0,3}",
        // Escapes, control characters, `~` and `/` (pointer escapes),
        // non-ASCII and astral characters (UTF-16 ordering).
        "[a-c~/\"\\\\\u{0}-\u{1f}\u{7f}\u{80}\u{e9}\u{20ac}\u{fb33}\u{1F600}]{0,4}",
    ]
}

fn number_strategy() -> impl Strategy<Value = Value> {
    (
        any::<bool>(),
        prop_oneof![
            proptest::collection::vec(0u8..10, 0..4),
            // Past u64 and f64 precision.
            proptest::collection::vec(0u8..10, 15..40),
        ],
        prop_oneof![-30i64..30, -400i64..400, -1_000i64..1_000],
    )
        .prop_map(|(negative, digits, exponent)| {
            Value::Number(Num::new(negative, &digits, exponent, usize::MAX))
        })
}

fn value_strategy() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number_strategy(),
        number_strategy(),
        name_strategy().prop_map(Value::String),
        any::<String>().prop_map(Value::String),
    ];
    leaf.prop_recursive(5, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::vec((name_strategy(), inner), 0..6)
                .prop_map(|members| normalize(Value::Object(members), usize::MAX)),
        ]
    })
}

fn shown(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Canonicalization is a fixed point and keeps the value; checked for any
/// input `canonicalize` accepts. The value is compared through serde_json
/// (numbers as doubles), where serde_json accepts both texts.
fn check_canonical_fixed_point(input: &[u8]) -> Result<(), TestCaseError> {
    let Ok(once) = canonical::canonicalize(input) else {
        return Ok(());
    };
    let twice = canonical::canonicalize(&once);
    prop_assert_eq!(twice.as_ref().ok(), Some(&once), "{}", shown(input));
    let before = serde_json::from_slice::<serde_json::Value>(input);
    let after = serde_json::from_slice::<serde_json::Value>(&once);
    prop_assert_eq!(before.is_ok(), after.is_ok(), "{}", shown(input));
    if let (Ok(before), Ok(after)) = (before, after) {
        prop_assert!(
            same_json(&before, &after),
            "{} became {}",
            shown(input),
            shown(&once)
        );
    }
    prop_assert_eq!(
        Fingerprint::of_json(input, &[]).ok(),
        Fingerprint::of_json(&once, &[]).ok()
    );
    Ok(())
}

/// Equal JSON values, numbers compared as doubles up to rounding (two
/// spellings of one decimal may round differently in serde_json's parser).
fn same_json(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    use serde_json::Value as J;
    match (a, b) {
        (J::Number(x), J::Number(y)) => match (x.as_f64(), y.as_f64()) {
            (Some(x), Some(y)) => x == y || (x - y).abs() <= x.abs().max(y.abs()) * 1e-15,
            _ => false,
        },
        (J::Array(x), J::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_json(x, y))
        }
        (J::Object(x), J::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_json(v, w)))
        }
        _ => a == b,
    }
}

/// The mutations themselves: each kind occurs, and each changes the value
/// (by the model `same`), on a value with long mantissas, strings, nested
/// arrays and objects.
#[test]
fn every_mutation_kind_occurs_and_changes_the_value() -> TestResult {
    let long = |negative, digits: &str, exponent| {
        let digits: Vec<u8> = digits.bytes().map(|b| b - b'0').collect();
        Value::Number(Num::new(negative, &digits, exponent, usize::MAX))
    };
    let value = Value::Object(vec![
        (
            "amount".to_owned(),
            long(false, "1234567890123456789012345", -3),
        ),
        ("fee".to_owned(), long(true, "25", 0)),
        ("zero".to_owned(), long(false, "", 0)),
        (
            "memo".to_owned(),
            Value::String("caf\u{e9} \u{1F600}".to_owned()),
        ),
        (
            "lines".to_owned(),
            Value::Array(vec![
                Value::Bool(true),
                Value::Null,
                Value::Array(Vec::new()),
                Value::Object(Vec::new()),
                Value::String(String::new()),
            ]),
        ),
    ]);
    let mut seen = std::collections::HashSet::new();
    let mut deep_digits = 0;
    let mut rng = Rng::new(7);
    for _ in 0..20_000 {
        let mut changed = value.clone();
        let at = rng.below(places(&value));
        let mutation = mutate(&mut changed, at, &mut rng).ok_or("place out of range")?;
        assert!(!same(&value, &changed), "{mutation:?} kept the value");
        if let json_gen::Mutation::Digit(i) = mutation {
            deep_digits += usize::from(i >= 17);
        }
        seen.insert(std::mem::discriminant(&mutation));
    }
    assert_eq!(seen.len(), 17, "mutation kinds seen");
    assert!(
        deep_digits > 100,
        "only {deep_digits} digits changed past the 17th"
    );
    assert!(mutate(&mut value.clone(), places(&value), &mut rng).is_none());
    Ok(())
}

/// `PROPTEST_CASES` overrides the bounded default, for a longer search.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(2048)))]

    #[test]
    fn canonical_form_is_idempotent_and_keeps_the_value(value in value_strategy(), seed in any::<u64>()) {
        for text in [plain(&value), respelled(&value, seed)] {
            prop_assert!(canonical::canonicalize(&text).is_ok(), "rejected {}", shown(&text));
            check_canonical_fixed_point(&text)?;
        }
    }

    #[test]
    fn equivalent_renderings_fingerprint_equal(value in value_strategy(), seed in any::<u64>()) {
        let a = plain(&value);
        let b = respelled(&value, seed);
        prop_assert_eq!(
            canonical::canonicalize(&a).ok(),
            canonical::canonicalize(&b).ok(),
            "{} vs {}", shown(&a), shown(&b)
        );
        prop_assert_eq!(
            Fingerprint::of_json(&a, &[]).ok(),
            Fingerprint::of_json(&b, &[]).ok()
        );
        prop_assert!(Fingerprint::of_json(&a, &[]).is_ok());
        let pointers = pointers_of(&value);
        let mut pointers: Vec<&str> = pointers.iter().map(String::as_str).collect();
        let fa = Fingerprint::of_json(&a, &pointers).ok();
        prop_assert!(fa.is_some());
        pointers.reverse();
        prop_assert_eq!(fa, Fingerprint::of_json(&b, &pointers).ok());
    }

    /// Every kind of value change (a digit deep in a long mantissa, the
    /// sign, the exponent, one character, array order and length, members,
    /// the type) changes the fingerprint.
    #[test]
    fn one_changed_value_fingerprints_differently(
        value in value_strategy(),
        seed in any::<u64>(),
        at in any::<usize>(),
        how in any::<u64>(),
    ) {
        let mut changed = value.clone();
        let mutation = mutate(&mut changed, at % places(&value), &mut Rng::new(how));
        prop_assert!(mutation.is_some());
        prop_assert!(!same(&value, &changed), "{:?} kept the value", mutation);
        let a = plain(&value);
        let b = respelled(&changed, seed);
        let (fa, fb) = (Fingerprint::of_json(&a, &[]), Fingerprint::of_json(&b, &[]));
        prop_assert!(fa.is_ok() && fb.is_ok());
        prop_assert_ne!(fa.ok(), fb.ok(), "{:?}: {} vs {}", mutation, shown(&a), shown(&b));
    }

    #[test]
    fn arbitrary_bytes_never_panic(input in proptest::collection::vec(any::<u8>(), 0..64)) {
        check_canonical_fixed_point(&input)?;
        let _ = Fingerprint::of_json(&input, &["/a", ""]);
    }

    /// Bytes from JSON's alphabet reach far more of the parser than uniform
    /// bytes do.
    #[test]
    fn json_like_bytes_never_panic(input in proptest::collection::vec(
        proptest::sample::select(b"{}[],:\"\\/-+.0123456789eEtrufalsnu \t\n\xC3\xA9\xED\xFFdD8".to_vec()),
        0..48,
    )) {
        check_canonical_fixed_point(&input)?;
    }

    #[test]
    fn record_decoder_never_panics_on_arbitrary_bytes(input in proptest::collection::vec(any::<u8>(), 0..256)) {
        let accepted = idempotency::__fuzz_decode_record(&input);
        if accepted {
            prop_assert_eq!(input.first(), Some(&1u8));
        }
        if input.first() != Some(&1) {
            prop_assert!(!accepted, "accepted a value of another format version");
        }
    }

    #[test]
    fn record_decoder_never_panics_on_mutated_records(
        which in any::<prop::sample::Index>(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..4), 1..5),
    ) {
        let records = valid_records();
        let mut bytes = which.get(records).clone();
        for (at, byte, kind) in edits {
            let i = at.index(bytes.len() + 1);
            match kind {
                0 if i < bytes.len() => bytes[i] = byte,
                1 if i < bytes.len() => { bytes.remove(i); }
                2 => bytes.truncate(i),
                _ => bytes.insert(i, byte),
            }
        }
        let _ = idempotency::__fuzz_decode_record(&bytes);
    }
}

// ---------------------------------------------------------------------------
// Valid records, as a real engine writes them.

/// The raw value of every record in the engine's database at `path`.
fn raw_records(path: &Path) -> Result<Vec<Vec<u8>>, Box<dyn std::error::Error>> {
    use redb::{ReadableDatabase, ReadableTable, TableDefinition};
    const RECORDS: TableDefinition<&[u8], &[u8]> = TableDefinition::new("idempotency.records");
    let db = redb::Database::open(path)?;
    let txn = db.begin_read()?;
    let table = txn.open_table(RECORDS)?;
    let mut out = Vec::new();
    for entry in table.iter()? {
        let (_, value) = entry?;
        out.push(value.value().to_vec());
    }
    Ok(out)
}

/// Records in every state: PROCESSING, COMPLETED (headers, resource),
/// FAILED_FINAL, UNKNOWN (with a reason) and TOMBSTONE.
fn make_records(dir: &Path) -> Result<Vec<Vec<u8>>, Box<dyn std::error::Error>> {
    let path = dir.join("records.redb");
    let clock = ManualClock::new(1_700_000_000_000);
    {
        let engine = Engine::builder()
            .clock(clock.clone())
            .sweep_interval(None)
            .ttl(Duration::from_secs(60))
            .expiry_policy(ExpiryPolicy::Tombstone { keep_ms: 600_000 })
            .open(&path)?;
        let fp = Fingerprint::of_json(br#"{"amount": 10, "currency": "EUR"}"#, &[])?;
        let claim = |key: &str| -> Result<idempotency::Claim, Box<dyn std::error::Error>> {
            match engine.begin(&IdempotencyKey::new("tenant:pay", key)?, fp)? {
                Begin::Claimed(claim) => Ok(claim),
                other => Err(format!("{key}: expected a claim, got {other:?}").into()),
            }
        };
        let tomb = claim("tombstone")?;
        engine.complete(tomb, Envelope::new(1, 200, "old"))?;
        clock.advance(Duration::from_secs(61));
        engine.sweep_now()?;
        let processing = claim("processing")?;
        let done = claim("completed")?;
        engine.complete_with_resource(
            done,
            Envelope::new(3, 201, br#"{"id":"pay_1"}"#.to_vec())
                .with_header("content-type", "application/json")
                .with_header("x-bin", vec![0u8, 255, 7]),
            "pay_1",
        )?;
        let failed = claim("failed")?;
        engine.fail(
            failed,
            Failure::Final(Envelope::new(1, 402, "insufficient funds")),
        )?;
        let unknown = claim("unknown")?;
        engine.fail(
            unknown,
            Failure::Unknown {
                reason: "provider timed out".into(),
            },
        )?;
        let empty = claim("empty")?;
        engine.complete(empty, Envelope::new(0, 204, Vec::new()))?;
        // Neither completed nor dropped: the record stays PROCESSING.
        std::mem::forget(processing);
    }
    raw_records(&path)
}

fn valid_records() -> &'static Vec<Vec<u8>> {
    static RECORDS: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
    RECORDS.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temporary directory");
        make_records(dir.path()).expect("records written by a real engine")
    })
}

#[test]
fn valid_records_decode_and_their_truncations_do_not() -> TestResult {
    let records = valid_records();
    assert_eq!(records.len(), 6);
    for record in records {
        assert!(idempotency::__fuzz_decode_record(record));
        for cut in 0..record.len() {
            assert!(
                !idempotency::__fuzz_decode_record(&record[..cut]),
                "prefix {cut}"
            );
        }
        let mut longer = record.clone();
        longer.push(0);
        assert!(!idempotency::__fuzz_decode_record(&longer));
        let mut other_version = record.clone();
        other_version[0] = 2;
        assert!(!idempotency::__fuzz_decode_record(&other_version));
    }
    Ok(())
}

/// Writes the records above as seeds for the `record_decode` fuzz target:
/// `cargo test --release --test prop_canonical -- --ignored write_record_seeds`.
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
    let records = valid_records();
    assert_eq!(records.len(), names.len());
    // The records table is sorted by record key: scope, then key.
    for (name, record) in names.iter().zip(records) {
        std::fs::write(dir.join(format!("{name}.bin")), record)?;
    }
    Ok(())
}
