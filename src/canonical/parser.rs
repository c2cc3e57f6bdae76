//! The strict JSON parser (RFC 8259, plus the rules of [`crate::canonical`]:
//! no duplicate member names, bounded depth and number range).
//!
//! Errors carry a [`Position`]; line and column are computed only on the
//! error path.

use super::error::{CanonicalError, Position};
use super::number::{Number, OutOfRange};
use super::pointer::push_token;
use super::string::cmp_utf16;
use super::value::JsonValue;

pub(crate) use super::error::MAX_DEPTH;

/// Parses JSON text strictly (see the [`crate::canonical`] docs).
///
/// # Errors
///
/// [`CanonicalError::Syntax`] for anything RFC 8259 does not allow,
/// [`CanonicalError::DuplicateMember`], [`CanonicalError::TooDeep`] and
/// [`CanonicalError::NumberOutOfRange`]; each says where. When an object has
/// a duplicate name and also a syntax error inside a later member, the
/// syntax error is reported: duplicates are detected once an object is
/// complete.
pub(crate) fn parse(bytes: &[u8]) -> Result<JsonValue, CanonicalError> {
    Parser {
        input: bytes,
        pos: 0,
    }
    .parse_document()
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
        match segment {
            PathSegment::Member(name) => push_token(&mut pointer, name),
            PathSegment::Index(i) => push_token(&mut pointer, &i.to_string()),
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
            Err(CanonicalError::too_deep(self.input, self.pos))
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
        Number::from_parts(negative, int, frac, exponent)
            .map_err(|OutOfRange| CanonicalError::number_out_of_range(self.input, start))
    }
}

#[cfg(test)]
mod tests {
    use super::super::canonicalize;
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
}
