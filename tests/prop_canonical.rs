//! Property tests for the JSON canonicalizer behind request fingerprints
//! (the record decoder's are in `src/store/codec_props.rs`).
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
//! - the two paths of `canonicalize` (straight into canonical bytes, and
//!   through the tree parser that reports errors) agree on every input: the
//!   fast path accepts only what the tree path accepts, with the same
//!   output, and gives up on valid JSON only for member names that RFC 8785
//!   escapes.

mod json_gen;

use idempotency::canonical;
use idempotency::Fingerprint;
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

/// The fast path of `canonicalize` agrees with the tree path: same output
/// where it accepts, nothing accepted that the tree path rejects, and valid
/// JSON left to the tree path only for names with escaped characters.
fn check_paths_agree(input: &[u8]) -> Result<(), TestCaseError> {
    let both = canonical::fuzz_hook::differential(input);
    match (&both.fast, &both.tree) {
        (Ok(fast), tree) => prop_assert_eq!(Some(fast), tree.as_ref().ok(), "{}", shown(input)),
        (Err(escaped_name), Ok(_)) => prop_assert!(
            *escaped_name,
            "fast path gave up on valid JSON: {}",
            shown(input)
        ),
        (Err(_), Err(_)) => {}
    }
    prop_assert_eq!(
        canonical::canonicalize(input),
        both.tree,
        "{}",
        shown(input)
    );
    Ok(())
}

#[test]
fn paths_agree_on_edge_cases() -> TestResult {
    let cases: [&[u8]; 22] = [
        br#"{"b":1,"a":{"d":[1,{"z":0,"y":-0.0}],"c":"\u00e9"}}"#,
        "{\"\u{e000}\":1,\"\u{1F600}\":2,\"\u{ffff}\":3,\"\u{10000}\":4}".as_bytes(),
        br#"{"\ud83d\ude00":1,"\ue000":2}"#,
        br#"{"a":1,"b":2,"a":3}"#,
        br#"{"a":1,"\u0061":2}"#,
        br#"{"\n":1,"a":2}"#,
        br#"{"\"":1}"#,
        br#"[1e1000000,1e1000001]"#,
        br#"[0e99999999999999999999,-0,0.000,100,1.50e+2,123e-400]"#,
        br#"[01]"#,
        br#"-"#,
        br#""\ud800""#,
        br#""\udc00""#,
        br#""\ud800\u0041""#,
        b"\"\xff\"",
        b"\xEF\xBB\xBF{}",
        b"[1,]",
        b"{\"a\":1,}",
        b" \t\r\n[ true , false , null ] \n",
        b"\"\x7f\\u007f\\u001f\\/\"",
        b"",
        b"{}x",
    ];
    for case in cases {
        check_paths_agree(case).map_err(|e| e.to_string())?;
    }
    let deep = |n| format!("{}{}", "[".repeat(n), "]".repeat(n));
    check_paths_agree(deep(128).as_bytes()).map_err(|e| e.to_string())?;
    check_paths_agree(deep(129).as_bytes()).map_err(|e| e.to_string())?;
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

    /// Both paths of `canonicalize`, on generated JSON rendered two ways
    /// and on a changed copy.
    #[test]
    fn fast_and_tree_paths_agree(
        value in value_strategy(),
        seed in any::<u64>(),
        at in any::<usize>(),
        how in any::<u64>(),
    ) {
        check_paths_agree(&plain(&value))?;
        check_paths_agree(&respelled(&value, seed))?;
        let mut changed = value.clone();
        mutate(&mut changed, at % places(&value), &mut Rng::new(how));
        check_paths_agree(&respelled(&changed, seed))?;
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
        check_paths_agree(&input)?;
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
        check_paths_agree(&input)?;
    }
}
