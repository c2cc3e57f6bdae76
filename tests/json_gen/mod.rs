//! Generated JSON values, rendered in several exact spellings, and mutated
//! so that their value changes. Shared by `tests/prop_canonical.rs` and the
//! `fingerprint_equivalence` fuzz target (which includes this file by path),
//! so it uses only `std`; each side builds [`Value`]s its own way (proptest
//! strategies, `arbitrary`).
//!
//! A fingerprint must not see the spelling (member order, whitespace,
//! `1.0` vs `10e-1`, escapes) and must see every change of value. The
//! mutations therefore change values in every way a canonicalizer could
//! lose: a digit anywhere in a long mantissa (a canonicalizer that keeps
//! only 17 significant digits), the sign, the exponent by one, one character
//! of a string or member name, array order and length, object members, and
//! the type. [`same`] is the model of value equality that decides whether a
//! mutation changed anything.

#![allow(dead_code)] // each includer uses a part

use std::collections::HashSet;

/// A JSON value as generated.
#[derive(Debug, Clone)]
pub enum Value {
    Null,
    Bool(bool),
    Number(Num),
    String(String),
    Array(Vec<Value>),
    /// Member names are unique (the parser rejects duplicates by design).
    Object(Vec<(String, Value)>),
}

/// `±digits × 10^exponent`: `digits` are 0..=9 without a leading zero
/// (trailing zeros allowed); empty is zero, whatever the sign and exponent.
#[derive(Debug, Clone)]
pub struct Num {
    pub negative: bool,
    pub digits: Vec<u8>,
    pub exponent: i64,
}

impl Num {
    /// A number from raw parts: digits are taken mod 10, at most
    /// `max_digits`, and leading zeros dropped.
    pub fn new(negative: bool, digits: &[u8], exponent: i64, max_digits: usize) -> Num {
        let digits: Vec<u8> = digits
            .iter()
            .take(max_digits)
            .map(|d| d % 10)
            .skip_while(|&d| d == 0)
            .collect();
        Num {
            negative,
            digits,
            exponent,
        }
    }

    fn is_zero(&self) -> bool {
        self.digits.is_empty()
    }

    /// Sign, digits without trailing zeros, and exponent; one form per value.
    fn normalized(&self) -> (bool, &[u8], i64) {
        let zeros = self.digits.iter().rev().take_while(|&&d| d == 0).count();
        if zeros == self.digits.len() {
            return (false, &[], 0);
        }
        let digits = &self.digits[..self.digits.len() - zeros];
        (self.negative, digits, self.exponent + zeros as i64)
    }
}

/// Cuts values nested deeper than `max_depth` to `null` and drops repeated
/// member names.
pub fn normalize(value: Value, max_depth: usize) -> Value {
    fn walk(value: Value, depth: usize, max_depth: usize) -> Value {
        match value {
            Value::Array(_) | Value::Object(_) if depth >= max_depth => Value::Null,
            Value::Array(items) => Value::Array(
                items
                    .into_iter()
                    .map(|v| walk(v, depth + 1, max_depth))
                    .collect(),
            ),
            Value::Object(members) => {
                let mut seen = HashSet::new();
                Value::Object(
                    members
                        .into_iter()
                        .filter(|(name, _)| seen.insert(name.clone()))
                        .map(|(name, v)| (name, walk(v, depth + 1, max_depth)))
                        .collect(),
                )
            }
            other => other,
        }
    }
    walk(value, 0, max_depth)
}

/// Whether two values are equal as JSON values: numbers by exact decimal
/// value (`-0` is `0`), objects regardless of member order.
pub fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Null, Value::Null) => true,
        (Value::Bool(x), Value::Bool(y)) => x == y,
        (Value::Number(x), Value::Number(y)) => x.normalized() == y.normalized(),
        (Value::String(x), Value::String(y)) => x == y,
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter().all(|(name, v)| {
                    y.iter()
                        .find(|(other, _)| other == name)
                        .is_some_and(|(_, w)| same(v, w))
                })
        }
        _ => false,
    }
}

// ---------------------------------------------------------------------------
// Rendering.

/// The choices a rendering makes; `None` is the plain choice.
pub trait Style {
    fn pick(&mut self, n: u64) -> Option<u64>;
}

/// The plain rendering: document order, no whitespace, minimal escapes,
/// numbers as `digits` and `e<exponent>` when the exponent is not zero.
pub struct Plain;

impl Style for Plain {
    fn pick(&mut self, _: u64) -> Option<u64> {
        None
    }
}

/// A xorshift generator: drives a respelled rendering, and mutations.
pub struct Rng(pub u64);

impl Rng {
    /// A generator from any seed (zero is not a valid xorshift state).
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number below `n` (0 if `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % (n.max(1) as u64)) as usize
    }
}

impl Style for Rng {
    fn pick(&mut self, n: u64) -> Option<u64> {
        Some(self.next() % n.max(1))
    }
}

fn chance(style: &mut dyn Style, one_in: u64) -> bool {
    style.pick(one_in) == Some(0)
}

fn space(style: &mut dyn Style, out: &mut Vec<u8>) {
    for _ in 0..style.pick(3).unwrap_or(0) {
        let i = style.pick(4).unwrap_or(0) as usize;
        out.push(b" \t\n\r"[i]);
    }
}

/// The value rendered plainly.
pub fn plain(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    render(value, &mut Plain, &mut out);
    out
}

/// The value rendered with members shuffled, whitespace, numbers in another
/// exact form and characters escaped at random, driven by `seed`.
pub fn respelled(value: &Value, seed: u64) -> Vec<u8> {
    let mut out = Vec::new();
    render(value, &mut Rng::new(seed), &mut out);
    out
}

pub fn render(value: &Value, style: &mut dyn Style, out: &mut Vec<u8>) {
    space(style, out);
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        Value::Number(n) => render_number(n, style, out),
        Value::String(s) => render_string(s, style, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                render(item, style, out);
            }
            space(style, out);
            out.push(b']');
        }
        Value::Object(members) => {
            let mut order: Vec<usize> = (0..members.len()).collect();
            for i in (1..order.len()).rev() {
                if let Some(j) = style.pick(i as u64 + 1) {
                    order.swap(i, j as usize);
                }
            }
            out.push(b'{');
            for (i, &m) in order.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                let (name, member) = &members[m];
                space(style, out);
                render_string(name, style, out);
                space(style, out);
                out.push(b':');
                render(member, style, out);
            }
            space(style, out);
            out.push(b'}');
        }
    }
    space(style, out);
}

/// Writes `±digits × 10^exponent` in one of several exact forms.
fn render_number(n: &Num, style: &mut dyn Style, out: &mut Vec<u8>) {
    if n.is_zero() {
        // Zero, with or without a sign, fraction and exponent.
        let zeros = [
            "0", "-0", "0.0", "-0.000", "0e5", "0E-7", "-0.0e+0", "0.00E12",
        ];
        let i = style.pick(zeros.len() as u64).unwrap_or(0) as usize;
        out.extend_from_slice(zeros[i].as_bytes());
        return;
    }
    if n.negative {
        out.push(b'-');
    }
    // value = d × 10^e, where d is the digits plus `pad` trailing zeros.
    let pad = style.pick(3).unwrap_or(0) as usize;
    let mut d: Vec<u8> = n.digits.iter().map(|x| b'0' + x).collect();
    d.extend(std::iter::repeat_n(b'0', pad));
    let e = n.exponent - pad as i64;
    let len = d.len() as i64;
    let shown = match style.pick(3) {
        // d.ddd × 10^(e + len − 1)
        Some(0) => {
            out.push(d[0]);
            if d.len() > 1 {
                out.push(b'.');
                out.extend_from_slice(&d[1..]);
            }
            e + len - 1
        }
        // 0.000ddd × 10^(e + zeros + len)
        Some(1) => {
            let zeros = style.pick(3).unwrap_or(0);
            out.extend_from_slice(b"0.");
            out.extend(std::iter::repeat_n(b'0', zeros as usize));
            out.extend_from_slice(&d);
            e + zeros as i64 + len
        }
        // ddd × 10^e
        _ => {
            out.extend_from_slice(&d);
            e
        }
    };
    if shown != 0 || chance(style, 4) {
        out.push(if chance(style, 2) { b'E' } else { b'e' });
        if shown >= 0 && chance(style, 2) {
            out.push(b'+');
        }
        out.extend_from_slice(shown.to_string().as_bytes());
    }
}

/// Writes a string with minimal escapes, or with characters escaped at
/// random (`\uXXXX` in either case, surrogate pairs, short escapes, `\/`).
fn render_string(s: &str, style: &mut dyn Style, out: &mut Vec<u8>) {
    out.push(b'"');
    for c in s.chars() {
        let short = match c {
            '"' => Some(b'"'),
            '\\' => Some(b'\\'),
            '/' => Some(b'/'),
            '\u{8}' => Some(b'b'),
            '\u{c}' => Some(b'f'),
            '\n' => Some(b'n'),
            '\r' => Some(b'r'),
            '\t' => Some(b't'),
            _ => None,
        };
        let must_escape = c < ' ' || c == '"' || c == '\\';
        match (style.pick(3), short) {
            (Some(0), _) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let hex = if chance(style, 2) {
                        format!("\\u{unit:04X}")
                    } else {
                        format!("\\u{unit:04x}")
                    };
                    out.extend_from_slice(hex.as_bytes());
                }
            }
            (Some(1), Some(b)) => out.extend_from_slice(&[b'\\', b]),
            (_, Some(b)) if must_escape => out.extend_from_slice(&[b'\\', b]),
            _ if must_escape => {
                out.extend_from_slice(format!("\\u{:04x}", u32::from(c)).as_bytes());
            }
            _ => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out.push(b'"');
}

/// JSON Pointers to try against `value`: the whole, an absent member, and
/// its top-level members or first elements.
pub fn pointers_of(value: &Value) -> Vec<String> {
    let mut out = vec![String::new(), "/missing~1x".to_owned()];
    match value {
        Value::Object(members) => out.extend(
            members
                .iter()
                .map(|(name, _)| format!("/{}", name.replace('~', "~0").replace('/', "~1"))),
        ),
        Value::Array(items) => out.extend((0..items.len().min(4)).map(|i| format!("/{i}"))),
        _ => {}
    }
    out
}

// ---------------------------------------------------------------------------
// Mutations.

/// What a mutation changed; in the failure message when a changed value
/// fingerprints like the original.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// A value replaced by one of another type.
    Type,
    BoolFlipped,
    /// One digit of the mantissa replaced, at this index from the left.
    Digit(usize),
    DigitAppended,
    LastDigitDropped,
    SignFlipped,
    ExponentUp,
    ExponentDown,
    /// Zero became a non-zero number.
    NonZero,
    /// One character of a string replaced, inserted or removed.
    StringChar,
    /// One character of a member name replaced, inserted or removed.
    MemberName,
    /// Two unequal elements of an array swapped.
    ArraySwap,
    ArrayLastDropped,
    ArrayElementRemoved,
    ArrayElementAdded,
    MemberRemoved,
    MemberAdded,
}

/// How many places [`mutate`] can hit: every value and every member name.
pub fn places(value: &Value) -> usize {
    1 + match value {
        Value::Array(items) => items.iter().map(places).sum(),
        Value::Object(members) => members.iter().map(|(_, v)| 1 + places(v)).sum(),
        _ => 0,
    }
}

/// Changes the value at place `at` (in document order, see [`places`]) so
/// that the whole is a different JSON value, choosing how with `rng`.
/// Returns what it did, or `None` if `at` is out of range.
pub fn mutate(value: &mut Value, mut at: usize, rng: &mut Rng) -> Option<Mutation> {
    mutate_at(value, &mut at, rng)
}

fn mutate_at(value: &mut Value, at: &mut usize, rng: &mut Rng) -> Option<Mutation> {
    if *at == 0 {
        return Some(mutate_here(value, rng));
    }
    *at -= 1;
    match value {
        Value::Array(items) => items.iter_mut().find_map(|item| mutate_at(item, at, rng)),
        Value::Object(members) => {
            for i in 0..members.len() {
                if *at == 0 {
                    rename_member(members, i, rng);
                    return Some(Mutation::MemberName);
                }
                *at -= 1;
                if let Some(m) = mutate_at(&mut members[i].1, at, rng) {
                    return Some(m);
                }
            }
            None
        }
        _ => None,
    }
}

fn mutate_here(value: &mut Value, rng: &mut Rng) -> Mutation {
    // One in eight: another type altogether.
    if rng.below(8) == 0 {
        *value = other_type(value, rng);
        return Mutation::Type;
    }
    match value {
        Value::Null => {
            *value = other_type(value, rng);
            Mutation::Type
        }
        Value::Bool(b) => {
            *b = !*b;
            Mutation::BoolFlipped
        }
        Value::Number(n) => mutate_number(n, rng),
        Value::String(s) => {
            *s = change_char(s, rng);
            Mutation::StringChar
        }
        Value::Array(items) => mutate_array(items, rng),
        Value::Object(members) => {
            if !members.is_empty() && rng.below(2) == 0 {
                members.remove(rng.below(members.len()));
                Mutation::MemberRemoved
            } else {
                let name = unique_name(members, String::new(), rng);
                let member = small_value(rng);
                let at = rng.below(members.len() + 1);
                members.insert(at, (name, member));
                Mutation::MemberAdded
            }
        }
    }
}

fn mutate_number(n: &mut Num, rng: &mut Rng) -> Mutation {
    if n.is_zero() {
        n.digits = vec![1 + rng.below(9) as u8];
        n.negative = rng.below(2) == 0;
        return Mutation::NonZero;
    }
    // Half of the time a digit of the mantissa: anywhere in it, so mostly
    // deep in a long one.
    match rng.below(10) {
        0..=4 => {
            let i = rng.below(n.digits.len());
            let old = n.digits[i];
            // The first digit stays non-zero (no leading zero).
            let lowest = u8::from(i == 0);
            let choices: Vec<u8> = (lowest..10).filter(|&d| d != old).collect();
            n.digits[i] = choices[rng.below(choices.len())];
            Mutation::Digit(i)
        }
        5 => {
            n.negative = !n.negative;
            Mutation::SignFlipped
        }
        6 => {
            n.exponent += 1;
            Mutation::ExponentUp
        }
        7 => {
            n.exponent -= 1;
            Mutation::ExponentDown
        }
        // d·10 + x ≠ d and ⌊d / 10⌋ ≠ d for every non-zero d.
        8 => {
            n.digits.push(rng.below(10) as u8);
            Mutation::DigitAppended
        }
        _ => {
            n.digits.pop();
            Mutation::LastDigitDropped
        }
    }
}

fn mutate_array(items: &mut Vec<Value>, rng: &mut Rng) -> Mutation {
    if items.is_empty() {
        items.push(small_value(rng));
        return Mutation::ArrayElementAdded;
    }
    match rng.below(4) {
        0 => {
            let i = rng.below(items.len());
            let unequal: Vec<usize> = (0..items.len())
                .filter(|&j| !same(&items[i], &items[j]))
                .collect();
            if unequal.is_empty() {
                // All elements equal: order cannot change, length can.
                items.pop();
                return Mutation::ArrayLastDropped;
            }
            let j = unequal[rng.below(unequal.len())];
            items.swap(i, j);
            Mutation::ArraySwap
        }
        1 => {
            items.pop();
            Mutation::ArrayLastDropped
        }
        2 => {
            items.remove(rng.below(items.len()));
            Mutation::ArrayElementRemoved
        }
        _ => {
            let element = if rng.below(2) == 0 {
                items[rng.below(items.len())].clone()
            } else {
                small_value(rng)
            };
            let at = rng.below(items.len() + 1);
            items.insert(at, element);
            Mutation::ArrayElementAdded
        }
    }
}

/// Characters worth swapping in: escapes, controls, boundaries of UTF-8
/// and UTF-16 encodings, pointer escapes.
const SPECIAL: [char; 22] = [
    '"',
    '\\',
    '/',
    '\0',
    '\u{8}',
    '\u{c}',
    '\n',
    '\r',
    '\t',
    '\u{1f}',
    ' ',
    '~',
    'a',
    'A',
    '\u{7f}',
    '\u{80}',
    '\u{e9}',
    '\u{20ac}',
    '\u{fb33}',
    '\u{ffff}',
    '\u{1F600}',
    '\u{10FFFF}',
];

/// A character other than `c`: a neighbour, one bit flipped, or a special
/// one.
fn other_char(c: char, rng: &mut Rng) -> char {
    let code = u32::from(c);
    let candidate = match rng.below(3) {
        0 => {
            if rng.below(2) == 0 {
                code.wrapping_add(1)
            } else {
                code.wrapping_sub(1)
            }
        }
        1 => code ^ (1 << rng.below(if code < 0x80 { 7 } else { 21 })),
        _ => u32::from(SPECIAL[rng.below(SPECIAL.len())]),
    };
    match char::from_u32(candidate) {
        Some(new) if new != c => new,
        _ if c == 'x' => 'y',
        _ => 'x',
    }
}

/// `s` with one character replaced, inserted or removed.
fn change_char(s: &str, rng: &mut Rng) -> String {
    let mut chars: Vec<char> = s.chars().collect();
    let how = if chars.is_empty() { 1 } else { rng.below(3) };
    match how {
        0 => {
            let i = rng.below(chars.len());
            chars[i] = other_char(chars[i], rng);
        }
        1 => {
            let base = chars.get(rng.below(chars.len())).copied().unwrap_or('a');
            let c = other_char(base, rng);
            chars.insert(rng.below(chars.len() + 1), c);
        }
        _ => {
            chars.remove(rng.below(chars.len()));
        }
    }
    chars.into_iter().collect()
}

/// Changes one character of member `i`'s name, keeping names unique.
fn rename_member(members: &mut [(String, Value)], i: usize, rng: &mut Rng) {
    let changed = change_char(&members[i].0, rng);
    members[i].0 = unique_name(members, changed, rng);
}

/// `name`, or a variant of it, that no member has.
fn unique_name(members: &[(String, Value)], mut name: String, rng: &mut Rng) -> String {
    while members.iter().any(|(other, _)| *other == name) {
        let c = other_char('a', rng);
        name.push(c);
    }
    name
}

/// A scalar or empty container.
fn small_value(rng: &mut Rng) -> Value {
    match rng.below(6) {
        0 => Value::Null,
        1 => Value::Bool(rng.below(2) == 0),
        2 => Value::Number(Num {
            negative: rng.below(2) == 0,
            digits: vec![1 + rng.below(9) as u8],
            exponent: rng.below(5) as i64 - 2,
        }),
        3 => Value::String(other_char('a', rng).to_string()),
        4 => Value::Array(Vec::new()),
        _ => Value::Object(Vec::new()),
    }
}

/// A value of another type than `value`.
fn other_type(value: &Value, rng: &mut Rng) -> Value {
    loop {
        let new = small_value(rng);
        if std::mem::discriminant(&new) != std::mem::discriminant(value) {
            return new;
        }
    }
}
