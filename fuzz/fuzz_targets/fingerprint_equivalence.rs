//! A structured JSON value rendered two ways must fingerprint equal; the
//! same value with one change must fingerprint different.
//!
//! The second rendering shuffles object members, adds whitespace, writes
//! numbers in another exact form (`1.0`, `10e-1`, `0.1E+1`, `-0.0`) and
//! escapes string characters differently (`\u00e9` vs raw, surrogate pairs,
//! `\/`). Pointer selection over the top-level members must agree too.
#![no_main]

use arbitrary::Arbitrary;
use idempotency::canonical;
use idempotency::Fingerprint;
use libfuzzer_sys::fuzz_target;

/// Deeper values are cut to `null`: the parser's depth limit is tested by
/// the `canonicalize` target.
const MAX_RENDER_DEPTH: usize = 24;

#[derive(Arbitrary, Debug, Clone)]
enum Value {
    Null,
    Bool(bool),
    Number(Num),
    String(String),
    Array(Vec<Value>),
    Object(Vec<(String, Value)>),
}

/// `±digits × 10^exponent`, `digits` taken mod 10 and without leading zeros.
#[derive(Arbitrary, Debug, Clone)]
struct Num {
    negative: bool,
    digits: Vec<u8>,
    exponent: i16,
}

#[derive(Arbitrary, Debug)]
struct Input {
    value: Value,
    /// Drives every choice of the second rendering.
    seed: u64,
    /// Which leaf the one-value change hits.
    change_at: u16,
}

fuzz_target!(|input: Input| {
    let value = normalize(input.value, 0);
    let mut plain = Vec::new();
    render(&value, &mut Plain, &mut plain);
    let mut rng = Rng(input.seed | 1);
    let mut respelled = Vec::new();
    render(&value, &mut rng, &mut respelled);

    let fp = |text: &[u8], pointers: &[&str]| {
        Fingerprint::of_json(text, pointers).unwrap_or_else(|e| {
            panic!(
                "valid JSON rejected: {e}\n{}",
                String::from_utf8_lossy(text)
            )
        })
    };
    let a = fp(&plain, &[]);
    assert_eq!(
        a,
        fp(&respelled, &[]),
        "renderings fingerprint differently:\n{}\n{}",
        String::from_utf8_lossy(&plain),
        String::from_utf8_lossy(&respelled)
    );
    assert_eq!(
        canonical::canonicalize(&plain).ok(),
        canonical::canonicalize(&respelled).ok()
    );
    let pointers = top_level_pointers(&value);
    let pointers: Vec<&str> = pointers.iter().map(String::as_str).collect();
    assert_eq!(fp(&plain, &pointers), fp(&respelled, &pointers));

    let mut changed = value.clone();
    let mut at = usize::from(input.change_at) % targets(&value);
    assert!(change_one(&mut changed, &mut at));
    let mut text = Vec::new();
    render(&changed, &mut rng, &mut text);
    assert_ne!(
        a,
        fp(&text, &[]),
        "a one-value change kept the fingerprint:\n{}\n{}",
        String::from_utf8_lossy(&plain),
        String::from_utf8_lossy(&text)
    );
});

/// Cuts deep values, keeps digits decimal and drops repeated member names
/// (the parser rejects duplicates by design).
fn normalize(value: Value, depth: usize) -> Value {
    match value {
        Value::Array(_) | Value::Object(_) if depth >= MAX_RENDER_DEPTH => Value::Null,
        Value::Array(items) => {
            Value::Array(items.into_iter().map(|v| normalize(v, depth + 1)).collect())
        }
        Value::Object(members) => {
            let mut seen = std::collections::HashSet::new();
            Value::Object(
                members
                    .into_iter()
                    .filter(|(name, _)| seen.insert(name.clone()))
                    .map(|(name, v)| (name, normalize(v, depth + 1)))
                    .collect(),
            )
        }
        Value::Number(n) => {
            let mut digits: Vec<u8> = n.digits.iter().take(40).map(|d| d % 10).collect();
            while digits.first() == Some(&0) {
                digits.remove(0);
            }
            Value::Number(Num {
                negative: n.negative,
                digits,
                exponent: n.exponent,
            })
        }
        other => other,
    }
}

fn top_level_pointers(value: &Value) -> Vec<String> {
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

/// How many places [`change_one`] can hit: scalars, empty containers and
/// member names.
fn targets(value: &Value) -> usize {
    match value {
        Value::Array(items) if !items.is_empty() => items.iter().map(targets).sum(),
        Value::Object(members) if !members.is_empty() => {
            members.iter().map(|(_, v)| 1 + targets(v)).sum()
        }
        _ => 1,
    }
}

/// Changes exactly one value (a scalar, an empty container or a member
/// name), the `at`-th in document order, so that the result is a different
/// JSON value. Returns whether it did.
fn change_one(value: &mut Value, at: &mut usize) -> bool {
    match value {
        Value::Array(items) if !items.is_empty() => {
            items.iter_mut().any(|item| change_one(item, at))
        }
        Value::Object(members) if !members.is_empty() => {
            let names: Vec<String> = members.iter().map(|(n, _)| n.clone()).collect();
            for (name, member) in members.iter_mut() {
                if *at == 0 {
                    let mut new = format!("{name}~");
                    while names.contains(&new) {
                        new.push('~');
                    }
                    *name = new;
                    return true;
                }
                *at -= 1;
                if change_one(member, at) {
                    return true;
                }
            }
            false
        }
        leaf => {
            if *at > 0 {
                *at -= 1;
                return false;
            }
            *leaf = match std::mem::replace(leaf, Value::Null) {
                Value::Null => Value::Bool(false),
                Value::Bool(b) => Value::Bool(!b),
                // 10·d + 1 ≠ d for every d, zero included.
                Value::Number(mut n) => {
                    n.digits.push(1);
                    Value::Number(n)
                }
                Value::String(mut s) => {
                    s.push('x');
                    Value::String(s)
                }
                Value::Array(_) => Value::Array(vec![Value::Null]),
                Value::Object(_) => Value::Object(vec![(String::new(), Value::Null)]),
            };
            true
        }
    }
}

/// The choices a rendering makes.
trait Style {
    fn pick(&mut self, n: u64) -> u64;
    fn chance(&mut self, one_in: u64) -> bool {
        self.pick(one_in) == 0
    }
    fn space(&mut self, out: &mut Vec<u8>);
    fn shuffle(&mut self, order: &mut [usize]);
}

/// The plain rendering: document order, no whitespace, minimal escapes,
/// numbers as `digits` + `e<exp>`.
struct Plain;

impl Style for Plain {
    fn pick(&mut self, _: u64) -> u64 {
        u64::MAX
    }
    fn space(&mut self, _: &mut Vec<u8>) {}
    fn shuffle(&mut self, _: &mut [usize]) {}
}

/// A xorshift generator driving the respelled rendering.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

impl Style for Rng {
    fn pick(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn space(&mut self, out: &mut Vec<u8>) {
        for _ in 0..self.pick(3) {
            out.push(b" \t\n\r"[self.pick(4) as usize]);
        }
    }
    fn shuffle(&mut self, order: &mut [usize]) {
        for i in (1..order.len()).rev() {
            let j = self.pick(i as u64 + 1) as usize;
            order.swap(i, j);
        }
    }
}

fn render(value: &Value, style: &mut dyn Style, out: &mut Vec<u8>) {
    style.space(out);
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
            style.space(out);
            out.push(b']');
        }
        Value::Object(members) => {
            let mut order: Vec<usize> = (0..members.len()).collect();
            style.shuffle(&mut order);
            out.push(b'{');
            for (i, &m) in order.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                let (name, member) = &members[m];
                style.space(out);
                render_string(name, style, out);
                style.space(out);
                out.push(b':');
                render(member, style, out);
            }
            style.space(out);
            out.push(b'}');
        }
    }
    style.space(out);
}

fn render_number(n: &Num, style: &mut dyn Style, out: &mut Vec<u8>) {
    if n.digits.is_empty() {
        // Zero, with or without a sign, fraction and exponent.
        let zeros = [
            "0", "-0", "0.0", "-0.000", "0e5", "0E-7", "-0.0e+0", "0.00E12",
        ];
        let i = style.pick(zeros.len() as u64);
        out.extend_from_slice(zeros.get(i as usize).unwrap_or(&"0").as_bytes());
        return;
    }
    if n.negative {
        out.push(b'-');
    }
    // value = D × 10^e with D the digits plus `pad` trailing zeros.
    let pad = style.pick(3) as usize;
    let mut d: Vec<u8> = n.digits.iter().map(|x| b'0' + x).collect();
    d.extend(std::iter::repeat_n(
        b'0',
        if pad == usize::MAX { 0 } else { pad },
    ));
    let e = i64::from(n.exponent) - if pad == usize::MAX { 0 } else { pad as i64 };
    let len = d.len() as i64;
    let shown_exponent = match style.pick(3) {
        // d.ddd × 10^(e + len − 1)
        0 => {
            out.push(d[0]);
            if d.len() > 1 {
                out.push(b'.');
                out.extend_from_slice(&d[1..]);
            }
            e + len - 1
        }
        // 0.000ddd × 10^(e + zeros + len)
        1 => {
            let zeros = style.pick(3) as i64;
            out.extend_from_slice(b"0.");
            out.extend(std::iter::repeat_n(b'0', zeros as usize));
            out.extend_from_slice(&d);
            e + zeros + len
        }
        // ddd × 10^e
        _ => {
            out.extend_from_slice(&d);
            e
        }
    };
    if shown_exponent != 0 || style.chance(4) {
        out.push(if style.chance(2) { b'E' } else { b'e' });
        if shown_exponent >= 0 && style.chance(2) {
            out.push(b'+');
        }
        out.extend_from_slice(shown_exponent.to_string().as_bytes());
    }
}

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
        match style.pick(3) {
            0 => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let hex = if style.chance(2) {
                        format!("\\u{unit:04X}")
                    } else {
                        format!("\\u{unit:04x}")
                    };
                    out.extend_from_slice(hex.as_bytes());
                }
            }
            1 if short.is_some() => {
                out.push(b'\\');
                out.extend(short);
            }
            _ if must_escape => match short {
                Some(b) if c != '/' => out.extend_from_slice(&[b'\\', b]),
                _ => out.extend_from_slice(format!("\\u{:04x}", u32::from(c)).as_bytes()),
            },
            _ => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out.push(b'"');
}
