//! The fast path of [`super::canonicalize`]: JSON text parsed straight into
//! its canonical bytes, with no tree, no allocation per value, strings and
//! numbers copied from the input where they need no change.
//!
//! It gives up ([`Fallback`]) on anything unusual, invalid input included;
//! the caller then runs the tree parser ([`super::parse`]), which reports
//! errors with their positions. So the fast path only has to be right about
//! what it accepts: for every input it accepts, its output is the tree
//! path's (the `canonicalize` fuzz target and `tests/prop_canonical.rs`
//! check this differentially).
//!
//! Object members are written in document order, each one's span recorded;
//! when the object closes, the spans are sorted by name and, unless already
//! in order, rewritten through a scratch buffer. A name is compared through
//! its canonical bytes, which are its UTF-8 unless it holds a character that
//! RFC 8785 escapes (`"`, `\`, a control character): such names are left to
//! the tree path.

use std::cmp::Ordering;
use std::ops::Range;

use super::error::MAX_DEPTH;
use super::number::{normalize, write_normalized};
use super::string::{cmp_utf16_bytes, write_char};

/// Why the fast path gave up; the tree path decides instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fallback {
    /// The input is invalid, or a case the fast path does not handle
    /// (duplicate names are found here too).
    Rejected,
    /// A member name holds a character that RFC 8785 escapes.
    EscapedName,
}

/// One member of the object being written: spans of `out`.
struct Member {
    /// The name's canonical bytes, without quotes.
    name: Range<usize>,
    /// The whole member: name, `:` and value.
    span: Range<usize>,
}

/// Bytes that end a run of string content copied as is.
static STRING_STOP: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 0x20 {
        table[b] = true;
        b += 1;
    }
    table[b'"' as usize] = true;
    table[b'\\' as usize] = true;
    table
};

/// Appends the canonical form of `input` to `out` (see the module docs).
///
/// # Errors
///
/// [`Fallback`] if the tree path must decide; `out` then holds partial
/// output beyond its original length.
pub(crate) fn write_canonical(input: &[u8], out: &mut Vec<u8>) -> Result<(), Fallback> {
    let mut writer = Writer {
        input,
        pos: 0,
        out,
        // Enough for typical request bodies without growing.
        members: Vec::with_capacity(16),
        scratch: Vec::with_capacity(input.len().min(4096)),
    };
    writer.skip_whitespace();
    writer.value(0)?;
    writer.skip_whitespace();
    if writer.pos == input.len() {
        Ok(())
    } else {
        Err(Fallback::Rejected)
    }
}

struct Writer<'a, 'o> {
    input: &'a [u8],
    /// Next byte to read.
    pos: usize,
    out: &'o mut Vec<u8>,
    /// Members of the objects being written, innermost last.
    members: Vec<Member>,
    /// Where an object's members are copied while they are put in order.
    scratch: Vec<u8>,
}

impl Writer<'_, '_> {
    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    /// Expects `byte`, copies it to the output and skips whitespace after it.
    fn punctuation(&mut self, byte: u8) -> Result<(), Fallback> {
        if self.peek() != Some(byte) {
            return Err(Fallback::Rejected);
        }
        self.pos += 1;
        self.out.push(byte);
        self.skip_whitespace();
        Ok(())
    }

    /// The value at `pos` (whitespace skipped), inside `depth` arrays and
    /// objects.
    fn value(&mut self, depth: usize) -> Result<(), Fallback> {
        match self.peek() {
            Some(b'{') => self.object(depth + 1),
            Some(b'[') => self.array(depth + 1),
            Some(b'"') => self.string().map(drop),
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'n') => self.literal(b"null"),
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ => Err(Fallback::Rejected),
        }
    }

    fn literal(&mut self, literal: &'static [u8]) -> Result<(), Fallback> {
        let end = self.pos + literal.len();
        if self.input.get(self.pos..end) != Some(literal) {
            return Err(Fallback::Rejected);
        }
        self.pos = end;
        self.out.extend_from_slice(literal);
        Ok(())
    }

    fn array(&mut self, depth: usize) -> Result<(), Fallback> {
        if depth > MAX_DEPTH {
            return Err(Fallback::Rejected);
        }
        self.punctuation(b'[')?;
        if self.peek() == Some(b']') {
            self.pos += 1;
            self.out.push(b']');
            return Ok(());
        }
        loop {
            self.value(depth)?;
            self.skip_whitespace();
            match self.peek() {
                Some(b',') => self.punctuation(b',')?,
                Some(b']') => {
                    self.pos += 1;
                    self.out.push(b']');
                    return Ok(());
                }
                _ => return Err(Fallback::Rejected),
            }
        }
    }

    fn object(&mut self, depth: usize) -> Result<(), Fallback> {
        if depth > MAX_DEPTH {
            return Err(Fallback::Rejected);
        }
        self.punctuation(b'{')?;
        if self.peek() == Some(b'}') {
            self.pos += 1;
            self.out.push(b'}');
            return Ok(());
        }
        let first = self.members.len();
        loop {
            if self.peek() != Some(b'"') {
                return Err(Fallback::Rejected);
            }
            let start = self.out.len();
            if self.string()? {
                return Err(Fallback::EscapedName);
            }
            let name = start + 1..self.out.len() - 1;
            self.skip_whitespace();
            self.punctuation(b':')?;
            self.value(depth)?;
            self.members.push(Member {
                name,
                span: start..self.out.len(),
            });
            self.skip_whitespace();
            match self.peek() {
                Some(b',') => self.punctuation(b',')?,
                Some(b'}') => {
                    self.pos += 1;
                    break;
                }
                _ => return Err(Fallback::Rejected),
            }
        }
        self.put_in_order(first)?;
        self.members.truncate(first);
        self.out.push(b'}');
        Ok(())
    }

    /// Rewrites the members from `members[first..]` in canonical order
    /// (RFC 8785 §3.2.3).
    ///
    /// # Errors
    ///
    /// [`Fallback::Rejected`] on a duplicate name: the tree path reports it.
    fn put_in_order(&mut self, first: usize) -> Result<(), Fallback> {
        let out = &mut *self.out;
        let members = self.members.get_mut(first..).unwrap_or_default();
        let cmp = |a: &Member, b: &Member| {
            cmp_utf16_bytes(
                out.get(a.name.clone()).unwrap_or_default(),
                out.get(b.name.clone()).unwrap_or_default(),
            )
        };
        let in_order = |members: &[Member]| {
            members
                .windows(2)
                .map(|pair| match pair {
                    [a, b] => cmp(a, b),
                    _ => Ordering::Less,
                })
                .try_fold(true, |sorted, order| match order {
                    Ordering::Less => Some(sorted),
                    Ordering::Greater => Some(false),
                    Ordering::Equal => None,
                })
        };
        match in_order(members) {
            None => return Err(Fallback::Rejected),
            Some(true) => return Ok(()),
            Some(false) => {}
        }
        // Where the first member in document order starts.
        let start = members.first().map_or(out.len(), |m| m.span.start);
        members.sort_unstable_by(cmp);
        if in_order(members) != Some(true) {
            return Err(Fallback::Rejected);
        }
        self.scratch.clear();
        self.scratch
            .extend_from_slice(out.get(start..).unwrap_or_default());
        out.truncate(start);
        for (i, member) in members.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            let span = member.span.start - start..member.span.end - start;
            out.extend_from_slice(self.scratch.get(span).unwrap_or_default());
        }
        Ok(())
    }

    /// Writes the string starting at the opening quote in canonical form;
    /// returns whether any character of it was escaped in the output.
    fn string(&mut self) -> Result<bool, Fallback> {
        self.pos += 1;
        self.out.push(b'"');
        let mut escaped = false;
        loop {
            let run_start = self.pos;
            let mut high = 0u8;
            while let Some(&b) = self.input.get(self.pos) {
                if STRING_STOP[usize::from(b)] {
                    break;
                }
                high |= b;
                self.pos += 1;
            }
            // The run stops only at ASCII bytes, which never split a valid
            // UTF-8 sequence; ASCII needs no check.
            let run = self.input.get(run_start..self.pos).unwrap_or_default();
            if high >= 0x80 && std::str::from_utf8(run).is_err() {
                return Err(Fallback::Rejected);
            }
            self.out.extend_from_slice(run);
            match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    self.out.push(b'"');
                    return Ok(escaped);
                }
                Some(b'\\') => {
                    let c = self.escape()?;
                    escaped |= write_char(c, self.out);
                }
                _ => return Err(Fallback::Rejected),
            }
        }
    }

    /// Decodes the escape sequence starting at the backslash.
    fn escape(&mut self) -> Result<char, Fallback> {
        self.pos += 1;
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
                let unit = self.hex4()?;
                let code_point = match unit {
                    0xD800..=0xDBFF => {
                        if self.input.get(self.pos..self.pos + 2) != Some(b"\\u") {
                            return Err(Fallback::Rejected);
                        }
                        self.pos += 2;
                        let low = self.hex4()?;
                        if !(0xDC00..=0xDFFF).contains(&low) {
                            return Err(Fallback::Rejected);
                        }
                        0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)
                    }
                    _ => unit,
                };
                // Lone low surrogates are not scalar values.
                return char::from_u32(code_point).ok_or(Fallback::Rejected);
            }
            _ => return Err(Fallback::Rejected),
        };
        self.pos += 1;
        Ok(c)
    }

    fn hex4(&mut self) -> Result<u32, Fallback> {
        let hex = self
            .input
            .get(self.pos..self.pos + 4)
            .ok_or(Fallback::Rejected)?;
        let mut value = 0;
        for &b in hex {
            let digit = char::from(b).to_digit(16).ok_or(Fallback::Rejected)?;
            value = value << 4 | digit;
        }
        self.pos += 4;
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

    fn number(&mut self) -> Result<(), Fallback> {
        let negative = self.peek() == Some(b'-');
        if negative {
            self.pos += 1;
        }
        let int_start = self.pos;
        match self.peek() {
            Some(b'0') => self.pos += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return Err(Fallback::Rejected),
        }
        let int_end = self.pos;
        let mut frac = int_end..int_end;
        if self.peek() == Some(b'.') {
            self.pos += 1;
            let start = self.pos;
            if self.digits().is_empty() {
                return Err(Fallback::Rejected);
            }
            frac = start..self.pos;
        }
        let mut exponent: i64 = 0;
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            let negative_exponent = match self.peek() {
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
                return Err(Fallback::Rejected);
            }
            // Saturating, as in the tree parser.
            for &d in digits {
                exponent = exponent
                    .saturating_mul(10)
                    .saturating_add(i64::from(d - b'0'));
            }
            if negative_exponent {
                exponent = -exponent;
            }
        }
        // A leading zero followed by a digit is a syntax error.
        if let Some(b'0'..=b'9') = self.peek() {
            return Err(Fallback::Rejected);
        }
        let int = self.input.get(int_start..int_end).unwrap_or_default();
        let frac = self.input.get(frac).unwrap_or_default();
        match normalize(int, frac, exponent).map_err(|_| Fallback::Rejected)? {
            None => self.out.push(b'0'),
            Some((digits, scale)) => write_normalized(negative, digits, scale, self.out),
        }
        Ok(())
    }
}
