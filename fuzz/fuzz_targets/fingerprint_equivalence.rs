//! A structured JSON value rendered two ways must fingerprint equal; the
//! same value changed in any way must fingerprint different.
//!
//! The second rendering shuffles object members, adds whitespace, writes
//! numbers in another exact form (`1.0`, `10e-1`, `0.1E+1`, `-0.0`) and
//! escapes string characters differently (`\u00e9` vs raw, surrogate pairs,
//! `\/`). Pointer selection over the top-level members must agree too.
//!
//! The change is one of every kind a canonicalizer could lose: a digit
//! anywhere in a mantissa of up to 40 digits (a canonicalizer that keeps 17
//! significant digits), the sign, the exponent by one, one character of a
//! string or member name, array order and length, object members, the
//! type. Rendering and mutations are shared with `tests/prop_canonical.rs`
//! (`tests/json_gen/mod.rs`).
#![no_main]

#[path = "../../tests/json_gen/mod.rs"]
mod json_gen;

use arbitrary::Arbitrary;
use idempotency::canonical;
use idempotency::Fingerprint;
use json_gen::{mutate, normalize, places, plain, pointers_of, respelled, same, Num, Rng, Value};
use libfuzzer_sys::fuzz_target;

/// Deeper values are cut to `null`: the parser's depth limit is tested by
/// the `canonicalize` target.
const MAX_RENDER_DEPTH: usize = 24;

/// Longest mantissa generated, in digits.
const MAX_DIGITS: usize = 40;

#[derive(Arbitrary, Debug, Clone)]
enum ArbValue {
    Null,
    Bool(bool),
    /// `±digits × 10^exponent`, digits taken mod 10.
    Number {
        negative: bool,
        digits: Vec<u8>,
        exponent: i16,
    },
    String(String),
    Array(Vec<ArbValue>),
    Object(Vec<(String, ArbValue)>),
}

impl From<ArbValue> for Value {
    fn from(value: ArbValue) -> Value {
        match value {
            ArbValue::Null => Value::Null,
            ArbValue::Bool(b) => Value::Bool(b),
            ArbValue::Number {
                negative,
                digits,
                exponent,
            } => Value::Number(Num::new(negative, &digits, i64::from(exponent), MAX_DIGITS)),
            ArbValue::String(s) => Value::String(s),
            ArbValue::Array(items) => Value::Array(items.into_iter().map(Value::from).collect()),
            ArbValue::Object(members) => Value::Object(
                members
                    .into_iter()
                    .map(|(name, v)| (name, Value::from(v)))
                    .collect(),
            ),
        }
    }
}

#[derive(Arbitrary, Debug)]
struct Input {
    value: ArbValue,
    /// Drives every choice of the second rendering.
    seed: u64,
    /// Which value or member name the change hits.
    change_at: u16,
    /// Drives how it is changed.
    change_how: u64,
}

fuzz_target!(|input: Input| {
    let value = normalize(Value::from(input.value), MAX_RENDER_DEPTH);
    let plain_text = plain(&value);
    let respelled_text = respelled(&value, input.seed);

    let fp = |text: &[u8], pointers: &[&str]| {
        Fingerprint::of_json(text, pointers).unwrap_or_else(|e| {
            panic!(
                "valid JSON rejected: {e}\n{}",
                String::from_utf8_lossy(text)
            )
        })
    };
    let a = fp(&plain_text, &[]);
    assert_eq!(
        a,
        fp(&respelled_text, &[]),
        "renderings fingerprint differently:\n{}\n{}",
        String::from_utf8_lossy(&plain_text),
        String::from_utf8_lossy(&respelled_text)
    );
    assert_eq!(
        canonical::canonicalize(&plain_text).ok(),
        canonical::canonicalize(&respelled_text).ok()
    );
    let pointers = pointers_of(&value);
    let pointers: Vec<&str> = pointers.iter().map(String::as_str).collect();
    assert_eq!(fp(&plain_text, &pointers), fp(&respelled_text, &pointers));

    let mut changed = value.clone();
    let at = usize::from(input.change_at) % places(&value);
    let mutation =
        mutate(&mut changed, at, &mut Rng::new(input.change_how)).expect("the place is in range");
    assert!(
        !same(&value, &changed),
        "the generator's {mutation:?} kept the value"
    );
    let text = respelled(&changed, input.seed.rotate_left(17));
    assert_ne!(
        a,
        fp(&text, &[]),
        "{mutation:?} kept the fingerprint:\n{}\n{}",
        String::from_utf8_lossy(&plain_text),
        String::from_utf8_lossy(&text)
    );
});
