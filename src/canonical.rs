//! Strict JSON parsing and canonical serialization, the input side of request
//! fingerprints.
//!
//! [`parse`] accepts exactly the JSON text of RFC 8259 (UTF-8, no byte order
//! mark, nothing after the value) and additionally rejects objects with
//! duplicate member names, nesting deeper than [`MAX_DEPTH`] and numbers whose
//! magnitude is beyond 10^±[`MAX_DECIMAL_EXPONENT`]. [`canonicalize`] writes
//! the parsed value in the canonical form of RFC 8785 (JSON Canonicalization
//! Scheme): no insignificant whitespace, object members sorted by their names
//! as UTF-16 code unit sequences, minimal string escapes.
//!
//! # Numbers: a deliberate deviation from RFC 8785
//!
//! RFC 8785 rounds every number through an IEEE 754 double. Here numbers keep
//! their exact decimal value instead: `9007199254740993` and
//! `9007199254740992` stay different, and `1e400` is a valid number. Numbers
//! that denote the same value are equal (`1`, `1.0`, `1e0`, `10e-1`; `-0` and
//! `0`), and they are written in the ECMAScript `Number::toString` layout that
//! RFC 8785 uses, so a number written with the shortest digits that
//! round-trip a double is canonicalized exactly as RFC 8785 would.
//!
//! Input size is not limited here; callers bound it.

use std::cmp::Ordering;
use std::fmt;

/// Deepest nesting of arrays and objects that [`parse`] accepts: a top-level
/// array is depth 1. Deeper input is a [`CanonicalError::TooDeep`], never a
/// stack overflow.
pub const MAX_DEPTH: usize = 128;

/// Largest magnitude of a number's decimal exponent in scientific notation
/// (the `e` in `d.ddd × 10^e`) that [`parse`] accepts for a non-zero number.
///
/// Beyond it a number is a [`CanonicalError::NumberOutOfRange`]. This keeps
/// exponent arithmetic bounded; zero is accepted with any exponent.
pub const MAX_DECIMAL_EXPONENT: i64 = 1_000_000;

/// Where in the input an error was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Position {
    /// Byte offset from the start of the input, 0-based.
    pub offset: usize,
    /// Line number, 1-based; lines end at `\n`.
    pub line: usize,
    /// Column, 1-based, counted in characters (UTF-8 sequences) since the
    /// start of the line.
    pub column: usize,
}

impl Position {
    /// Computes line and column of `offset` in `input`. Only called on the
    /// error path, so the scan costs nothing on success.
    fn locate(input: &[u8], offset: usize) -> Position {
        let before = input.get(..offset).unwrap_or(input);
        let line_start = before
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |i| i + 1);
        let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
        let column = before
            .get(line_start..)
            .unwrap_or_default()
            .iter()
            .filter(|&&b| !is_utf8_continuation(b))
            .count()
            + 1;
        Position {
            offset,
            line,
            column,
        }
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "byte {} (line {}, column {})",
            self.offset, self.line, self.column
        )
    }
}

fn is_utf8_continuation(b: u8) -> bool {
    b & 0xC0 == 0x80
}

/// Why JSON text could not be parsed, or a JSON Pointer not used.
///
/// Every variant about the input says where: a [`Position`] with byte
/// offset, line and column.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CanonicalError {
    /// The input is not JSON text as RFC 8259 defines it (including invalid
    /// UTF-8, a leading byte order mark, lone surrogate escapes, empty input
    /// and data after the value).
    #[error("invalid JSON at {position}: {reason}")]
    Syntax {
        /// Where the problem was found.
        position: Position,
        /// What was wrong, e.g. "expected ':' after object member name".
        reason: &'static str,
    },
    /// An object has two members with the same name (compared after
    /// unescaping). Which member wins is ambiguous across JSON parsers, so a
    /// fingerprint over such input would not describe what a handler sees.
    #[error(
        "duplicate member {name:?} in {} (byte {}, line {}, column {})",
        describe_object(.object),
        .position.offset,
        .position.line,
        .position.column
    )]
    DuplicateMember {
        /// RFC 6901 JSON Pointer of the object; empty for the top level.
        object: String,
        /// The repeated member name, unescaped.
        name: String,
        /// Where the second occurrence of the name starts.
        position: Position,
    },
    /// Arrays and objects are nested deeper than [`MAX_DEPTH`].
    #[error("JSON nested deeper than {limit} levels at {position}")]
    TooDeep {
        /// The limit, [`MAX_DEPTH`].
        limit: usize,
        /// Where the first array or object beyond the limit starts.
        position: Position,
    },
    /// A non-zero number's decimal exponent is beyond
    /// [`MAX_DECIMAL_EXPONENT`] in magnitude.
    #[error("number at {position} is out of range: its decimal exponent exceeds ±{limit}")]
    NumberOutOfRange {
        /// The limit, [`MAX_DECIMAL_EXPONENT`].
        limit: i64,
        /// Where the number starts.
        position: Position,
    },
    /// A JSON Pointer (RFC 6901) is malformed.
    #[error("invalid JSON Pointer {pointer:?}: {reason}")]
    InvalidPointer {
        /// The pointer as given.
        pointer: String,
        /// What was wrong with it.
        reason: &'static str,
    },
}

impl CanonicalError {
    /// Where in the input the error was found; `None` for
    /// [`CanonicalError::InvalidPointer`], which is not about the input.
    pub fn position(&self) -> Option<Position> {
        match self {
            CanonicalError::Syntax { position, .. }
            | CanonicalError::DuplicateMember { position, .. }
            | CanonicalError::TooDeep { position, .. }
            | CanonicalError::NumberOutOfRange { position, .. } => Some(*position),
            CanonicalError::InvalidPointer { .. } => None,
        }
    }
}

/// Names the object of a duplicate-member error. Control characters are
/// escaped so that a hostile member name cannot break a log line.
fn describe_object(pointer: &str) -> String {
    if pointer.is_empty() {
        "the top-level object".to_owned()
    } else {
        format!("object at {}", pointer.escape_debug())
    }
}

/// A JSON number, kept as its exact decimal value.
///
/// Normalized on construction: the value is `digits × 10^exponent` with no
/// leading or trailing zeros in `digits`, and zero has a single
/// representation. Structural equality is therefore equality of values:
/// `1`, `1.0`, `1e0` and `10e-1` are equal, `-0` equals `0`.
///
/// `Display` writes the canonical form (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Number {
    negative: bool,
    /// ASCII digits without leading or trailing zeros; empty for zero.
    digits: String,
    /// Power of ten applied to `digits`; 0 for zero.
    exponent: i64,
}

impl Number {
    /// Whether the number is below zero (zero is never negative).
    pub fn is_negative(&self) -> bool {
        self.negative
    }

    /// Whether the number is zero.
    pub fn is_zero(&self) -> bool {
        self.digits.is_empty()
    }

    /// The significant decimal digits, without leading or trailing zeros;
    /// empty for zero.
    pub fn digits(&self) -> &str {
        &self.digits
    }

    /// The power of ten the digits are scaled by: the absolute value is
    /// `digits × 10^exponent`. 0 for zero.
    pub fn exponent(&self) -> i64 {
        self.exponent
    }

    /// Writes the number in the ECMAScript `Number::toString` layout used by
    /// RFC 8785 §3.2.2.3, with the exact digits.
    fn write_canonical(&self, out: &mut Vec<u8>) {
        let digits = self.digits.as_bytes();
        if digits.is_empty() {
            out.push(b'0');
            return;
        }
        if self.negative {
            out.push(b'-');
        }
        // k digits, value = digits × 10^(n − k). Parsing bounds |n − 1| by
        // MAX_DECIMAL_EXPONENT, and k by the input length, so no overflow.
        let k = i64::try_from(digits.len()).unwrap_or(i64::MAX);
        let n = k.saturating_add(self.exponent);
        if k <= n && n <= 21 {
            out.extend_from_slice(digits);
            out.extend(std::iter::repeat_n(
                b'0',
                usize::try_from(n - k).unwrap_or(0),
            ));
        } else if 0 < n && n <= 21 {
            let (int, frac) = digits.split_at(usize::try_from(n).unwrap_or(0));
            out.extend_from_slice(int);
            out.push(b'.');
            out.extend_from_slice(frac);
        } else if -6 < n && n <= 0 {
            out.extend_from_slice(b"0.");
            out.extend(std::iter::repeat_n(b'0', usize::try_from(-n).unwrap_or(0)));
            out.extend_from_slice(digits);
        } else {
            let (first, rest) = digits.split_at(1);
            out.extend_from_slice(first);
            if !rest.is_empty() {
                out.push(b'.');
                out.extend_from_slice(rest);
            }
            let e = n.saturating_sub(1);
            out.push(b'e');
            out.push(if e < 0 { b'-' } else { b'+' });
            out.extend_from_slice(e.unsigned_abs().to_string().as_bytes());
        }
    }
}

impl fmt::Display for Number {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = Vec::new();
        self.write_canonical(&mut out);
        // Only ASCII was written; lossy conversion cannot lose anything.
        f.write_str(&String::from_utf8_lossy(&out))
    }
}

/// A parsed JSON value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonValue {
    /// `null`.
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// A number, as an exact decimal.
    Number(Number),
    /// A string, unescaped.
    String(String),
    /// An array.
    Array(Vec<JsonValue>),
    /// An object. After [`parse`], members are in canonical order (names
    /// compared as UTF-16 code unit sequences, RFC 8785 §3.2.3) and names are
    /// unique.
    Object(Vec<(String, JsonValue)>),
}

impl JsonValue {
    /// Appends the RFC 8785 canonical form of the value (with exact numbers,
    /// see the module docs) to `out`.
    ///
    /// Members of an object built by hand are written in canonical order
    /// even if the vector is not sorted; duplicate names in such an object
    /// are written as they are.
    pub fn write_canonical(&self, out: &mut Vec<u8>) {
        match self {
            JsonValue::Null => out.extend_from_slice(b"null"),
            JsonValue::Bool(true) => out.extend_from_slice(b"true"),
            JsonValue::Bool(false) => out.extend_from_slice(b"false"),
            JsonValue::Number(number) => number.write_canonical(out),
            JsonValue::String(s) => write_string(s, out),
            JsonValue::Array(items) => {
                out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    item.write_canonical(out);
                }
                out.push(b']');
            }
            JsonValue::Object(members) => {
                let mut sorted: Vec<&(String, JsonValue)> = members.iter().collect();
                // Already sorted after `parse`; the stable sort then only checks.
                sorted.sort_by(|a, b| cmp_utf16(&a.0, &b.0));
                out.push(b'{');
                for (i, (name, value)) in sorted.into_iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    write_string(name, out);
                    out.push(b':');
                    value.write_canonical(out);
                }
                out.push(b'}');
            }
        }
    }

    /// Resolves an RFC 6901 JSON Pointer against this value.
    ///
    /// `""` is the whole value; `"/a/b"` is member `b` of member `a`, with
    /// `~1` standing for `/` and `~0` for `~` in names. An array index is a
    /// decimal number without leading zeros. A name missing from an object,
    /// an index that is out of range, `-` or not a number, and any step into
    /// a scalar all yield `Ok(None)`.
    ///
    /// # Errors
    ///
    /// [`CanonicalError::InvalidPointer`] if the pointer is neither empty nor
    /// starts with `/`, or has a `~` not followed by `0` or `1`. The whole
    /// pointer is checked before it is resolved.
    pub fn pointer(&self, pointer: &str) -> Result<Option<&JsonValue>, CanonicalError> {
        let tokens = pointer_tokens(pointer)?;
        let mut current = self;
        for token in &tokens {
            let next = match current {
                JsonValue::Object(members) => members
                    .iter()
                    .find(|(name, _)| name == token)
                    .map(|(_, value)| value),
                JsonValue::Array(items) => array_index(token).and_then(|i| items.get(i)),
                _ => None,
            };
            match next {
                Some(value) => current = value,
                None => return Ok(None),
            }
        }
        Ok(Some(current))
    }
}

/// Checks that `pointer` is a well-formed RFC 6901 JSON Pointer.
///
/// # Errors
///
/// [`CanonicalError::InvalidPointer`] as for [`JsonValue::pointer`].
pub fn validate_pointer(pointer: &str) -> Result<(), CanonicalError> {
    pointer_tokens(pointer).map(drop)
}

/// Splits and unescapes a JSON Pointer (RFC 6901 §3, §4).
fn pointer_tokens(pointer: &str) -> Result<Vec<String>, CanonicalError> {
    let invalid = |reason| CanonicalError::InvalidPointer {
        pointer: pointer.to_owned(),
        reason,
    };
    let Some(rest) = pointer.strip_prefix('/') else {
        return if pointer.is_empty() {
            Ok(Vec::new())
        } else {
            Err(invalid("must be empty or start with '/'"))
        };
    };
    rest.split('/')
        .map(|raw| {
            let mut token = String::with_capacity(raw.len());
            let mut chars = raw.chars();
            while let Some(c) = chars.next() {
                if c == '~' {
                    match chars.next() {
                        Some('0') => token.push('~'),
                        Some('1') => token.push('/'),
                        _ => return Err(invalid("'~' must be followed by '0' or '1'")),
                    }
                } else {
                    token.push(c);
                }
            }
            Ok(token)
        })
        .collect()
}

/// An array index token: `0` or a decimal without leading zeros.
fn array_index(token: &str) -> Option<usize> {
    let valid = !token.is_empty()
        && token.bytes().all(|b| b.is_ascii_digit())
        && (token == "0" || !token.starts_with('0'));
    if valid {
        token.parse().ok()
    } else {
        None
    }
}

/// Compares strings as sequences of UTF-16 code units (RFC 8785 §3.2.3).
fn cmp_utf16(a: &str, b: &str) -> Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

/// Writes a string per RFC 8785 §3.2.2.2: `\"`, `\\`, the five short control
/// escapes, `\u00xx` (lowercase) for other control characters, everything
/// else as raw UTF-8.
fn write_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    for &b in s.as_bytes() {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x0C => out.extend_from_slice(b"\\f"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0x00..=0x1F => {
                out.extend_from_slice(b"\\u00");
                out.push(hex_digit(b >> 4));
                out.push(hex_digit(b));
            }
            _ => out.push(b),
        }
    }
    out.push(b'"');
}

/// The lowercase hex digit for the low four bits of `nibble`.
fn hex_digit(nibble: u8) -> u8 {
    let n = nibble & 0x0F;
    if n < 10 {
        b'0' + n
    } else {
        b'a' + (n - 10)
    }
}

/// Parses JSON text strictly (see the module docs).
///
/// # Errors
///
/// [`CanonicalError::Syntax`] for anything RFC 8259 does not allow,
/// [`CanonicalError::DuplicateMember`], [`CanonicalError::TooDeep`] and
/// [`CanonicalError::NumberOutOfRange`]; each says where. When an object has
/// a duplicate name and also a syntax error inside a later member, the
/// syntax error is reported: duplicates are detected once an object is
/// complete.
pub fn parse(bytes: &[u8]) -> Result<JsonValue, CanonicalError> {
    Parser {
        input: bytes,
        pos: 0,
    }
    .parse_document()
}

/// Parses JSON text strictly and returns its canonical form.
///
/// Equivalent to [`parse`] followed by [`JsonValue::write_canonical`].
/// Canonicalizing the output again returns it unchanged.
///
/// # Errors
///
/// As for [`parse`].
pub fn canonicalize(bytes: &[u8]) -> Result<Vec<u8>, CanonicalError> {
    let value = parse(bytes)?;
    let mut out = Vec::with_capacity(bytes.len());
    value.write_canonical(&mut out);
    Ok(out)
}

/// One step of the path from the document root to the value being parsed,
/// kept only to name the object in a duplicate-member error.
enum PathSegment {
    Member(String),
    Index(usize),
}

fn path_to_pointer(path: &[PathSegment]) -> String {
    let mut pointer = String::new();
    for segment in path {
        pointer.push('/');
        match segment {
            PathSegment::Member(name) => {
                pointer.push_str(&name.replace('~', "~0").replace('/', "~1"));
            }
            PathSegment::Index(i) => pointer.push_str(&i.to_string()),
        }
    }
    pointer
}

struct Parser<'a> {
    input: &'a [u8],
    /// Next byte to read; never beyond `input.len()`.
    pos: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    fn syntax(&self, offset: usize, reason: &'static str) -> CanonicalError {
        CanonicalError::Syntax {
            position: Position::locate(self.input, offset),
            reason,
        }
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    fn parse_document(mut self) -> Result<JsonValue, CanonicalError> {
        if self.input.starts_with(b"\xEF\xBB\xBF") {
            return Err(self.syntax(0, "a byte order mark is not allowed"));
        }
        self.skip_whitespace();
        let mut path = Vec::new();
        let value = self.parse_value(&mut path, 0)?;
        self.skip_whitespace();
        if self.pos < self.input.len() {
            return Err(self.syntax(self.pos, "unexpected data after the JSON value"));
        }
        Ok(value)
    }

    /// Parses the value starting at `pos` (whitespace already skipped);
    /// `depth` counts the arrays and objects around it.
    fn parse_value(
        &mut self,
        path: &mut Vec<PathSegment>,
        depth: usize,
    ) -> Result<JsonValue, CanonicalError> {
        match self.peek() {
            None => Err(self.syntax(self.pos, "expected a JSON value, found end of input")),
            Some(b'{') => self.parse_object(path, depth + 1),
            Some(b'[') => self.parse_array(path, depth + 1),
            Some(b'"') => self.parse_string().map(JsonValue::String),
            Some(b't') => self.parse_literal(b"true", JsonValue::Bool(true)),
            Some(b'f') => self.parse_literal(b"false", JsonValue::Bool(false)),
            Some(b'n') => self.parse_literal(b"null", JsonValue::Null),
            Some(b'-' | b'0'..=b'9') => self.parse_number().map(JsonValue::Number),
            Some(_) => Err(self.syntax(self.pos, "expected a JSON value")),
        }
    }

    fn parse_literal(
        &mut self,
        literal: &'static [u8],
        value: JsonValue,
    ) -> Result<JsonValue, CanonicalError> {
        let end = self.pos + literal.len();
        if self.input.get(self.pos..end) == Some(literal) {
            self.pos = end;
            Ok(value)
        } else {
            Err(self.syntax(self.pos, "invalid literal (expected true, false or null)"))
        }
    }

    fn check_depth(&self, depth: usize) -> Result<(), CanonicalError> {
        if depth > MAX_DEPTH {
            Err(CanonicalError::TooDeep {
                limit: MAX_DEPTH,
                position: Position::locate(self.input, self.pos),
            })
        } else {
            Ok(())
        }
    }

    fn parse_array(
        &mut self,
        path: &mut Vec<PathSegment>,
        depth: usize,
    ) -> Result<JsonValue, CanonicalError> {
        self.check_depth(depth)?;
        self.pos += 1; // '['
        self.skip_whitespace();
        let mut items = Vec::new();
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok(JsonValue::Array(items));
        }
        loop {
            path.push(PathSegment::Index(items.len()));
            let item = self.parse_value(path, depth);
            path.pop();
            items.push(item?);
            self.skip_whitespace();
            match self.peek() {
                Some(b',') => {
                    self.pos += 1;
                    self.skip_whitespace();
                }
                Some(b']') => {
                    self.pos += 1;
                    return Ok(JsonValue::Array(items));
                }
                None => {
                    return Err(self.syntax(
                        self.pos,
                        "unterminated array: expected ',' or ']', found end of input",
                    ))
                }
                Some(_) => {
                    return Err(self.syntax(self.pos, "expected ',' or ']' after array element"))
                }
            }
        }
    }

    fn parse_object(
        &mut self,
        path: &mut Vec<PathSegment>,
        depth: usize,
    ) -> Result<JsonValue, CanonicalError> {
        self.check_depth(depth)?;
        self.pos += 1; // '{'
        self.skip_whitespace();
        // (name, value, byte offset of the name)
        let mut members: Vec<(String, JsonValue, usize)> = Vec::new();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(JsonValue::Object(Vec::new()));
        }
        loop {
            match self.peek() {
                Some(b'"') => {}
                None => {
                    return Err(self.syntax(
                        self.pos,
                        "unterminated object: expected a member name, found end of input",
                    ))
                }
                Some(_) => {
                    return Err(self.syntax(self.pos, "expected '\"' to begin object member name"))
                }
            }
            let name_offset = self.pos;
            let name = self.parse_string()?;
            self.skip_whitespace();
            if self.peek() != Some(b':') {
                return Err(self.syntax(self.pos, "expected ':' after object member name"));
            }
            self.pos += 1;
            self.skip_whitespace();
            // The name travels on the path while its value is parsed, then
            // comes back: no copy per member.
            path.push(PathSegment::Member(name));
            let value = self.parse_value(path, depth);
            let name = match path.pop() {
                Some(PathSegment::Member(name)) => name,
                // Unreachable: the member pushed above is on top.
                _ => String::new(),
            };
            members.push((name, value?, name_offset));
            self.skip_whitespace();
            match self.peek() {
                Some(b',') => {
                    self.pos += 1;
                    self.skip_whitespace();
                }
                Some(b'}') => {
                    self.pos += 1;
                    break;
                }
                None => {
                    return Err(self.syntax(
                        self.pos,
                        "unterminated object: expected ',' or '}', found end of input",
                    ))
                }
                Some(_) => {
                    return Err(self.syntax(self.pos, "expected ',' or '}' after object member"))
                }
            }
        }
        // Stable: equal names keep document order, so in each run of equal
        // names every element after the first is a repeat.
        members.sort_by(|a, b| cmp_utf16(&a.0, &b.0));
        let first_repeat = members
            .windows(2)
            .filter_map(|pair| match pair {
                [a, b] if a.0 == b.0 => Some(b),
                _ => None,
            })
            .min_by_key(|member| member.2);
        if let Some((name, _, offset)) = first_repeat {
            return Err(CanonicalError::DuplicateMember {
                object: path_to_pointer(path),
                name: name.clone(),
                position: Position::locate(self.input, *offset),
            });
        }
        Ok(JsonValue::Object(
            members
                .into_iter()
                .map(|(name, value, _)| (name, value))
                .collect(),
        ))
    }

    /// Parses a string starting at the opening quote.
    fn parse_string(&mut self) -> Result<String, CanonicalError> {
        self.pos += 1; // '"'
        let mut out = String::new();
        loop {
            let run_start = self.pos;
            while let Some(b) = self.peek() {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.pos += 1;
            }
            // The run stops only at ASCII bytes, which never split a valid
            // UTF-8 sequence; a split one is invalid and reported here.
            let run = self.input.get(run_start..self.pos).unwrap_or_default();
            match std::str::from_utf8(run) {
                Ok(s) => out.push_str(s),
                Err(e) => {
                    return Err(self.syntax(run_start + e.valid_up_to(), "invalid UTF-8 in string"))
                }
            }
            match self.peek() {
                None => {
                    return Err(self.syntax(
                        self.pos,
                        "unterminated string: expected '\"', found end of input",
                    ))
                }
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(out);
                }
                Some(b'\\') => out.push(self.parse_escape()?),
                Some(_) => {
                    return Err(
                        self.syntax(self.pos, "control characters in strings must be escaped")
                    )
                }
            }
        }
    }

    /// Parses an escape sequence starting at the backslash.
    fn parse_escape(&mut self) -> Result<char, CanonicalError> {
        let start = self.pos;
        self.pos += 1; // '\\'
        let c = match self.peek() {
            Some(b'"') => '"',
            Some(b'\\') => '\\',
            Some(b'/') => '/',
            Some(b'b') => '\u{8}',
            Some(b'f') => '\u{c}',
            Some(b'n') => '\n',
            Some(b'r') => '\r',
            Some(b't') => '\t',
            Some(b'u') => {
                self.pos += 1;
                return self.parse_unicode_escape(start);
            }
            None => {
                return Err(self.syntax(
                    self.pos,
                    "unterminated string: expected an escape, found end of input",
                ))
            }
            Some(_) => return Err(self.syntax(start, "invalid escape sequence")),
        };
        self.pos += 1;
        Ok(c)
    }

    /// Parses the hex digits of `\uXXXX` (and of a following low surrogate
    /// escape); `start` is the offset of the backslash.
    fn parse_unicode_escape(&mut self, start: usize) -> Result<char, CanonicalError> {
        let unit = self.parse_hex4()?;
        let code_point = match unit {
            0xD800..=0xDBFF => {
                if self.input.get(self.pos..self.pos + 2) != Some(b"\\u") {
                    return Err(self.syntax(
                        start,
                        "lone high surrogate in \\u escape (expected a low surrogate escape next)",
                    ));
                }
                self.pos += 2;
                let low = self.parse_hex4()?;
                if !(0xDC00..=0xDFFF).contains(&low) {
                    return Err(self.syntax(
                        start,
                        "lone high surrogate in \\u escape (the next escape is not a low surrogate)",
                    ));
                }
                0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)
            }
            0xDC00..=0xDFFF => {
                return Err(self.syntax(start, "lone low surrogate in \\u escape"));
            }
            _ => unit,
        };
        char::from_u32(code_point)
            .ok_or_else(|| self.syntax(start, "\\u escape is not a Unicode scalar value"))
    }

    fn parse_hex4(&mut self) -> Result<u32, CanonicalError> {
        let mut value = 0u32;
        for _ in 0..4 {
            let digit = match self.peek() {
                Some(b) => char::from(b).to_digit(16),
                None => None,
            };
            match digit {
                Some(d) => value = value << 4 | d,
                None => return Err(self.syntax(self.pos, "expected four hex digits in \\u escape")),
            }
            self.pos += 1;
        }
        Ok(value)
    }

    /// Skips ASCII digits and returns them.
    fn digits(&mut self) -> &[u8] {
        let start = self.pos;
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
        self.input.get(start..self.pos).unwrap_or_default()
    }

    fn parse_number(&mut self) -> Result<Number, CanonicalError> {
        let start = self.pos;
        let negative = self.peek() == Some(b'-');
        if negative {
            self.pos += 1;
        }
        let int_start = self.pos;
        match self.peek() {
            Some(b'0') => {
                self.pos += 1;
                if let Some(b'0'..=b'9') = self.peek() {
                    return Err(self.syntax(self.pos, "leading zeros are not allowed in numbers"));
                }
            }
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return Err(self.syntax(self.pos, "expected a digit after '-'")),
        }
        let int_end = self.pos;
        let (mut frac_start, mut frac_end) = (int_end, int_end);
        if self.peek() == Some(b'.') {
            self.pos += 1;
            frac_start = self.pos;
            if self.digits().is_empty() {
                return Err(self.syntax(self.pos, "expected a digit after the decimal point"));
            }
            frac_end = self.pos;
        }
        // Saturating: any exponent this large is out of range (or applies
        // to zero) either way.
        let mut exponent: i64 = 0;
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            let exponent_negative = match self.peek() {
                Some(b'-') => {
                    self.pos += 1;
                    true
                }
                Some(b'+') => {
                    self.pos += 1;
                    false
                }
                _ => false,
            };
            let digits = self.digits();
            if digits.is_empty() {
                return Err(self.syntax(self.pos, "expected a digit in the exponent"));
            }
            for &d in digits {
                exponent = exponent
                    .saturating_mul(10)
                    .saturating_add(i64::from(d - b'0'));
            }
            if exponent_negative {
                exponent = -exponent;
            }
        }

        let int = self.input.get(int_start..int_end).unwrap_or_default();
        let frac = self.input.get(frac_start..frac_end).unwrap_or_default();
        // value = (int ++ frac) × 10^(exponent − frac.len())
        let all = || int.iter().chain(frac.iter());
        let Some(leading) = all().position(|&b| b != b'0') else {
            return Ok(Number {
                negative: false,
                digits: String::new(),
                exponent: 0,
            });
        };
        let trailing = all().rev().position(|&b| b != b'0').unwrap_or(0);
        let total = int.len() + frac.len();
        let k = total - leading - trailing;
        let digits: String = all()
            .skip(leading)
            .take(k)
            .map(|&b| char::from(b))
            .collect();
        // i128 cannot overflow here: every term is an i64 or a usize.
        let scale = i128::from(exponent) - frac.len() as i128 + trailing as i128;
        let scientific = scale + k as i128 - 1;
        let out_of_range = || CanonicalError::NumberOutOfRange {
            limit: MAX_DECIMAL_EXPONENT,
            position: Position::locate(self.input, start),
        };
        if scientific.unsigned_abs() > u128::from(MAX_DECIMAL_EXPONENT.unsigned_abs()) {
            return Err(out_of_range());
        }
        Ok(Number {
            negative,
            digits,
            exponent: i64::try_from(scale).map_err(|_| out_of_range())?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    fn canon(input: &str) -> Result<String, Box<dyn std::error::Error>> {
        Ok(String::from_utf8(canonicalize(input.as_bytes())?)?)
    }

    fn syntax_at(input: &[u8]) -> Option<(usize, usize, usize, &'static str)> {
        match parse(input) {
            Err(CanonicalError::Syntax { position, reason }) => {
                Some((position.offset, position.line, position.column, reason))
            }
            _ => None,
        }
    }

    /// RFC 8785 §3.2.2 example, except for the first number (see below).
    #[test]
    fn rfc8785_structure_example() -> TestResult {
        let input = r#"{
  "numbers": [333333333.33333329, 1E30, 4.50,
              2e-3, 0.000000000000000000000000001],
  "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
  "literals": [null, true, false]
}"#;
        // RFC 8785 writes the first number as 333333333.3333333 after rounding
        // it to a double; we keep the exact decimal by design.
        let expected = r#"{"literals":[null,true,false],"numbers":[333333333.33333329,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#;
        assert_eq!(canon(input)?, expected);
        Ok(())
    }

    /// RFC 8785 §3.2.2.2 string example.
    #[test]
    fn rfc8785_string_example() -> TestResult {
        let input = r#""\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/""#;
        assert_eq!(canon(input)?, r#""€$\u000f\nA'B\"\\\\\"/""#);
        Ok(())
    }

    #[test]
    fn string_escapes_are_minimal() -> TestResult {
        assert_eq!(
            canon(r#""\u0000\u0001\b\f\n\r\t\u001f\u0020\u007f\u0080\u00e9\ud83d\ude00""#)?,
            "\"\\u0000\\u0001\\b\\f\\n\\r\\t\\u001f \u{7f}\u{80}é😀\""
        );
        Ok(())
    }

    /// RFC 8785 §3.2.3 sorting example: UTF-16 order puts the emoji (a
    /// surrogate pair, 0xD83D...) before U+FB33, unlike code point order.
    #[test]
    fn rfc8785_sorting_example() -> TestResult {
        let input = r#"{
  "\u20ac": "Euro Sign",
  "\r": "Carriage Return",
  "\ufb33": "Hebrew Letter Dalet With Dagesh",
  "1": "One",
  "\ud83d\ude00": "Emoji: Grinning Face",
  "\u0080": "Control",
  "\u00f6": "Latin Small Letter O With Diaeresis"
}"#;
        let JsonValue::Object(members) = parse(input.as_bytes())? else {
            return Err("not an object".into());
        };
        let values: Vec<&JsonValue> = members.iter().map(|(_, v)| v).collect();
        let expected = [
            "Carriage Return",
            "One",
            "Control",
            "Latin Small Letter O With Diaeresis",
            "Euro Sign",
            "Emoji: Grinning Face",
            "Hebrew Letter Dalet With Dagesh",
        ];
        let expected: Vec<JsonValue> = expected
            .iter()
            .map(|s| JsonValue::String((*s).to_owned()))
            .collect();
        assert_eq!(values, expected.iter().collect::<Vec<_>>());
        assert_eq!(
            canon(input)?,
            "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\u{80}\":\"Control\",\
             \"ö\":\"Latin Small Letter O With Diaeresis\",\"€\":\"Euro Sign\",\
             \"😀\":\"Emoji: Grinning Face\",\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}"
        );
        Ok(())
    }

    /// RFC 8785 Appendix B: each expected output, used as input, is kept as
    /// is (it is written with the shortest round-trip digits), and other
    /// spellings of the same decimal give the same output.
    ///
    /// Differ by design: an input that is not the shortest round-trip form
    /// keeps its exact value, where RFC 8785 rounds it through a double:
    /// `295147905179352825856` (2^68 written exactly) stays as is where RFC
    /// 8785 gives `295147905179352830000`, `9007199254740993` stays where RFC
    /// 8785 gives `9007199254740992`, `333333333.33333329` stays where RFC
    /// 8785 gives `333333333.3333333`, and `1e400` is `1e+400` where RFC 8785
    /// rejects it as infinite.
    #[test]
    fn rfc8785_appendix_b_numbers() -> TestResult {
        let same = [
            "0",
            "5e-324",
            "-5e-324",
            "1.7976931348623157e+308",
            "-1.7976931348623157e+308",
            "9007199254740992",
            "-9007199254740992",
            "295147905179352830000",
            "9.999999999999997e+22",
            "1e+23",
            "1.0000000000000001e+23",
            "999999999999999700000",
            "999999999999999900000",
            "1e+21",
            "9.999999999999997e-7",
            "0.000001",
            "333333333.3333332",
            "333333333.33333325",
            "333333333.3333333",
            "333333333.3333334",
            "333333333.33333343",
            "-0.0000033333333333333333",
            "1424953923781206.2",
        ];
        for n in same {
            assert_eq!(canon(n)?, n, "{n}");
        }
        let respelled = [
            ("-0", "0"),
            ("2.95147905179352830000e20", "295147905179352830000"),
            ("1e23", "1e+23"),
            ("1E21", "1e+21"),
            ("1e21", "1e+21"),
            ("1e20", "100000000000000000000"),
            ("9.999999999999997E-7", "9.999999999999997e-7"),
            ("1e-6", "0.000001"),
            ("1e-7", "1e-7"),
            ("0.0000001", "1e-7"),
            ("1e30", "1e+30"),
            ("1E30", "1e+30"),
            ("4.50", "4.5"),
            ("2e-3", "0.002"),
            ("0.002", "0.002"),
            ("0.000000000000000000000000001", "1e-27"),
            ("14249539237812062e-1", "1424953923781206.2"),
        ];
        for (input, expected) in respelled {
            assert_eq!(canon(input)?, expected, "{input}");
        }
        Ok(())
    }

    #[test]
    fn exact_numbers_deviate_from_rfc8785_by_design() -> TestResult {
        assert_eq!(canon("295147905179352825856")?, "295147905179352825856");
        assert_eq!(canon("9007199254740993")?, "9007199254740993");
        assert_ne!(parse(b"9007199254740993")?, parse(b"9007199254740992")?);
        assert_eq!(canon("333333333.33333329")?, "333333333.33333329");
        assert_eq!(canon("1e400")?, "1e+400");
        assert_eq!(canon("-1.5e-400")?, "-1.5e-400");
        Ok(())
    }

    #[test]
    fn equal_values_are_equal_numbers() -> TestResult {
        for n in ["1", "1.0", "1e0", "10e-1", "0.1e1", "1.000E+0", "100e-2"] {
            assert_eq!(canon(n)?, "1", "{n}");
            assert_eq!(parse(n.as_bytes())?, parse(b"1")?, "{n}");
        }
        for n in [
            "0",
            "-0",
            "0.0",
            "-0.0e-5",
            "0.0e5",
            "0e999999999999999999999",
        ] {
            assert_eq!(canon(n)?, "0", "{n}");
            assert_eq!(parse(n.as_bytes())?, parse(b"0")?, "{n}");
        }
        assert_eq!(canon("-1.0")?, "-1");
        assert_eq!(canon("120")?, "120");
        assert_eq!(canon("12.50")?, "12.5");
        assert_eq!(canon("0.5")?, "0.5");
        let JsonValue::Number(n) = parse(b"-12.500e3")? else {
            return Err("not a number".into());
        };
        assert!(n.is_negative() && !n.is_zero());
        assert_eq!(
            (n.digits(), n.exponent(), n.to_string()),
            ("125", 2, "-12500".to_owned())
        );
        Ok(())
    }

    #[test]
    fn exponent_limits() -> TestResult {
        assert_eq!(canon("1e1000000")?, "1e+1000000");
        assert_eq!(canon("1e-1000000")?, "1e-1000000");
        // 10 × 10^999999 = 1e+1000000: the limit is on the normalized exponent.
        assert_eq!(canon("10e999999")?, "1e+1000000");
        for input in [
            "1e1000001",
            "1e-1000001",
            "[0, 1e999999999999999999]",
            "-1E-99999999999999999999999",
        ] {
            let err = parse(input.as_bytes()).err();
            assert!(
                matches!(err, Some(CanonicalError::NumberOutOfRange { .. })),
                "{input}: {err:?}"
            );
        }
        let err = parse(b"[0, 1e999999999999999999]")
            .err()
            .ok_or("accepted")?;
        assert_eq!(err.position().map(|p| p.offset), Some(4));
        assert_eq!(
            err.to_string(),
            "number at byte 4 (line 1, column 5) is out of range: its decimal exponent exceeds ±1000000"
        );
        // Output stays proportional to the input.
        assert_eq!(canon("1e400")?, "1e+400");
        assert_eq!(canon("123e-400")?, "1.23e-398");
        Ok(())
    }

    #[test]
    fn whitespace_and_member_order_do_not_matter() -> TestResult {
        let a = canon(" {\"b\" : [1, 2, {\"y\":null, \"x\":true}],\n\t\"a\":\"s\"}\r\n")?;
        let b = canon(r#"{"a":"s","b":[1,2.0,{"x":true,"y":null}]}"#)?;
        assert_eq!(a, b);
        assert_eq!(a, r#"{"a":"s","b":[1,2,{"x":true,"y":null}]}"#);
        // Array order does matter.
        assert_ne!(canon("[1,2]")?, canon("[2,1]")?);
        Ok(())
    }

    #[test]
    fn scalars_at_top_level() -> TestResult {
        assert_eq!(canon(" true ")?, "true");
        assert_eq!(canon("false")?, "false");
        assert_eq!(canon("null")?, "null");
        assert_eq!(canon(r#""x""#)?, r#""x""#);
        assert_eq!(canon("[]")?, "[]");
        assert_eq!(canon("{ }")?, "{}");
        Ok(())
    }

    #[test]
    fn duplicate_members_are_rejected_with_their_location() -> TestResult {
        let input = br#"{"payment": {"amount": 1, "currency": "EUR", "amount": 2}}"#;
        let err = parse(input).err().ok_or("accepted")?;
        assert_eq!(
            err,
            CanonicalError::DuplicateMember {
                object: "/payment".to_owned(),
                name: "amount".to_owned(),
                position: Position {
                    offset: 45,
                    line: 1,
                    column: 46
                },
            }
        );
        assert_eq!(
            err.to_string(),
            "duplicate member \"amount\" in object at /payment (byte 45, line 1, column 46)"
        );

        // Compared after unescaping; the pointer escapes '/' and '~'.
        let input = br#"[0, {"a/b~": {"x": 1, "\u0078": 2}}]"#;
        let err = parse(input).err().ok_or("accepted")?;
        assert!(
            matches!(&err, CanonicalError::DuplicateMember { object, name, .. }
                if object == "/1/a~1b~0" && name == "x"),
            "{err:?}"
        );

        // The first repeat in document order is reported.
        let err = parse(b"{\"b\":1,\"a\":1,\n\"a\":2,\"b\":3}")
            .err()
            .ok_or("accepted")?;
        assert_eq!(
            err.to_string(),
            "duplicate member \"a\" in the top-level object (byte 14, line 2, column 1)"
        );
        Ok(())
    }

    #[test]
    fn nesting_is_limited() -> TestResult {
        let ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert_eq!(canon(&ok)?, ok);
        let too_deep = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
        let err = parse(too_deep.as_bytes()).err().ok_or("accepted")?;
        assert!(matches!(
            err,
            CanonicalError::TooDeep {
                limit: MAX_DEPTH,
                ..
            }
        ));
        assert_eq!(err.position().map(|p| p.offset), Some(MAX_DEPTH));
        // Far deeper input is an error too, not a stack overflow.
        let huge = "{\"a\":".repeat(100_000);
        assert!(matches!(
            parse(huge.as_bytes()),
            Err(CanonicalError::TooDeep { .. })
        ));
        Ok(())
    }

    #[test]
    fn surrogates() -> TestResult {
        assert_eq!(canon(r#""\uD83D\uDE00""#)?, "\"😀\"");
        let cases: [(&[u8], usize); 5] = [
            (br#""\ud83d""#, 1),
            (br#""ab\ud83dx""#, 3),
            (br#""\ud83d\u0041""#, 1),
            (br#""\ude00""#, 1),
            (br#"{"k": "\udc00\ud800"}"#, 7),
        ];
        for (input, offset) in cases {
            let (at, _, _, reason) = syntax_at(input).ok_or("accepted")?;
            assert_eq!(at, offset, "{reason}");
            assert!(reason.contains("surrogate"), "{reason}");
        }
        Ok(())
    }

    #[test]
    fn invalid_utf8_is_rejected() -> TestResult {
        let cases: [(&[u8], usize); 5] = [
            (b"\"ab\xFF\"", 3),
            (b"\"\xC3\"", 1),
            (b"\"\xED\xA0\x80\"", 1), // UTF-8-encoded surrogate
            (b"[\"\xC0\xAF\"]", 2),   // overlong
            (b"\xC3\xA9", 0),         // outside a string
        ];
        for (input, offset) in cases {
            let (at, ..) = syntax_at(input).ok_or("accepted")?;
            assert_eq!(at, offset, "{input:?}");
        }
        assert_eq!(
            syntax_at(b"\"\xFF\"").map(|e| e.3),
            Some("invalid UTF-8 in string")
        );
        Ok(())
    }

    #[test]
    fn syntax_errors_say_where() -> TestResult {
        /// (offset, line, column)
        type Expected = (usize, usize, usize);
        let cases: [(&[u8], Expected); 24] = [
            (b"", (0, 1, 1)),
            (b"   ", (3, 1, 4)),
            (b"\xEF\xBB\xBF{}", (0, 1, 1)),
            (b"{} x", (3, 1, 4)),
            (b"1 2", (2, 1, 3)),
            (b"[1,]", (3, 1, 4)),
            (b"{\"a\":1,}", (7, 1, 8)),
            (b"{\"a\"\n  1}", (7, 2, 3)),
            (b"{a:1}", (1, 1, 2)),
            (b"[1 2]", (3, 1, 4)),
            (b"[1", (2, 1, 3)),
            (b"{\"a\":1", (6, 1, 7)),
            (b"\"abc", (4, 1, 5)),
            (b"\"a\tb\"", (2, 1, 3)),
            (b"\"\\x\"", (1, 1, 2)),
            (b"\"\\u12g4\"", (5, 1, 6)),
            (b"01", (1, 1, 2)),
            (b"-", (1, 1, 2)),
            (b"1.", (2, 1, 3)),
            (b"1e+", (3, 1, 4)),
            (b".5", (0, 1, 1)),
            (b"tru", (0, 1, 1)),
            (b"NaN", (0, 1, 1)),
            (b"[\"\xC3\xA9\xC3\xA9\", nul]", (9, 1, 8)),
        ];
        for (input, expected) in cases {
            let (offset, line, column, _) = syntax_at(input).ok_or("accepted")?;
            assert_eq!(
                (offset, line, column),
                expected,
                "{}",
                String::from_utf8_lossy(input)
            );
        }
        let err = parse(b"{\n  \"amount\" 5}").err().ok_or("accepted")?;
        assert_eq!(
            err.to_string(),
            "invalid JSON at byte 13 (line 2, column 12): expected ':' after object member name"
        );
        Ok(())
    }

    #[test]
    fn pointers() -> TestResult {
        let doc = parse(br#"{"a": {"b": [10, 20, {"c": null}]}, "x/y": 1, "m~n": 2, "": 3}"#)?;
        let number = |s: &str| parse(s.as_bytes());
        assert_eq!(doc.pointer("")?, Some(&doc));
        assert_eq!(doc.pointer("/a/b/1")?, Some(&number("20")?));
        assert_eq!(doc.pointer("/a/b/2/c")?, Some(&JsonValue::Null));
        assert_eq!(doc.pointer("/x~1y")?, Some(&number("1")?));
        assert_eq!(doc.pointer("/m~0n")?, Some(&number("2")?));
        assert_eq!(doc.pointer("/")?, Some(&number("3")?));
        for absent in [
            "/missing",
            "/a/b/3",
            "/a/b/-",
            "/a/b/01",
            "/a/b/x",
            "/a/b/0/z",
            "/a/b/99999999999999999999999",
        ] {
            assert_eq!(doc.pointer(absent)?, None, "{absent}");
        }
        let err = doc.pointer("a/b").err().ok_or("accepted")?;
        assert_eq!(
            err.to_string(),
            "invalid JSON Pointer \"a/b\": must be empty or start with '/'"
        );
        for bad in ["/a~2", "/a~", "/missing/~x"] {
            assert!(
                matches!(doc.pointer(bad), Err(CanonicalError::InvalidPointer { .. })),
                "{bad}"
            );
            assert!(validate_pointer(bad).is_err());
        }
        assert!(validate_pointer("/a/~0~1").is_ok());
        Ok(())
    }

    #[test]
    fn hand_built_objects_are_written_sorted() {
        let value = JsonValue::Object(vec![
            ("b".to_owned(), JsonValue::Bool(true)),
            ("a".to_owned(), JsonValue::Array(vec![JsonValue::Null])),
        ]);
        let mut out = Vec::new();
        value.write_canonical(&mut out);
        assert_eq!(out, br#"{"a":[null],"b":true}"#);
    }

    /// Deterministic mutation test: no input panics, and every accepted
    /// input canonicalizes to a fixed point that `serde_json` also accepts.
    #[test]
    fn mutations_never_panic_and_canonical_form_is_a_fixed_point() -> TestResult {
        let seeds: [&[u8]; 6] = [
            br#"{"a": [1, -2.5e3, true, null, "x\u00e9\ud83d\ude00"], "b": {"c": 0.000001}}"#,
            br#"[1e30, 4.50, 2e-3, 333333333.33333329, "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/"]"#,
            br#"{"\u20ac":1,"\r":2,"\ufb33":3,"1":4,"\ud83d\ude00":5,"\u0080":6,"\u00f6":7}"#,
            b"[[[[{\"k\":[]}]]]]",
            b"  -0.0E-0 ",
            "\"caf\u{e9} \u{1F600}\"".as_bytes(),
        ];
        let alphabet = b"{}[],:\"\\/-+.0123456789eEtrufalsn \t\n\xC3\xA9\xED\xFFu";
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut accepted = 0;
        for round in 0..20_000 {
            let mut input = seeds[round % seeds.len()].to_vec();
            for _ in 0..(next() % 4 + 1) {
                let at = (next() as usize) % (input.len() + 1);
                let byte = alphabet[(next() as usize) % alphabet.len()];
                match next() % 3 {
                    0 if at < input.len() => input[at] = byte,
                    1 if at < input.len() => {
                        input.remove(at);
                    }
                    _ => input.insert(at, byte),
                }
            }
            if let Ok(once) = canonicalize(&input) {
                accepted += 1;
                assert_eq!(canonicalize(&once)?, once);
                assert!(
                    serde_json::from_slice::<serde::de::IgnoredAny>(&input).is_ok(),
                    "{}",
                    String::from_utf8_lossy(&input)
                );
                assert!(
                    serde_json::from_slice::<serde_json::Value>(&once).is_ok()
                        || once.contains(&b'e')
                );
            }
        }
        assert!(accepted > 1000, "only {accepted} mutated inputs were valid");
        Ok(())
    }

    #[test]
    fn canonicalize_is_idempotent() -> TestResult {
        for input in [
            r#"{"z": [1.50, {"b": "\u0001", "a": -0}], "a": 1e-7, "é": "\/"}"#,
            "[1e21, 1e20, 123456789012345678901234567890, 0.0000012, 1.5e-7]",
        ] {
            let once = canonicalize(input.as_bytes())?;
            assert_eq!(canonicalize(&once)?, once);
        }
        Ok(())
    }
}
