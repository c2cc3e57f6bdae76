//! The error of the canonical JSON parser and where in the input it was
//! found.

use std::fmt;

use super::number::MAX_DECIMAL_EXPONENT;

/// Deepest nesting of arrays and objects accepted: a top-level array is
/// depth 1. Deeper input is a [`CanonicalError::TooDeep`], never a stack
/// overflow. (Kept with the error that reports it.)
pub(crate) const MAX_DEPTH: usize = 128;

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
    pub(crate) fn locate(input: &[u8], offset: usize) -> Position {
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

/// Why JSON text could not be canonicalized, or a JSON Pointer not used.
///
/// Every variant about the input says where: a [`Position`] with byte
/// offset, line and column (see [`CanonicalError::position`]).
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
    /// Arrays and objects are nested deeper than 128 levels (a top-level
    /// array is level 1).
    #[error("JSON nested deeper than {limit} levels at {position}")]
    TooDeep {
        /// The limit: 128.
        limit: usize,
        /// Where the first array or object beyond the limit starts.
        position: Position,
    },
    /// A non-zero number's decimal exponent in scientific notation (the `e`
    /// in `d.ddd × 10^e`) is beyond ±1,000,000.
    #[error("number at {position} is out of range: its decimal exponent exceeds ±{limit}")]
    NumberOutOfRange {
        /// The limit: 1,000,000.
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
    #[must_use]
    pub fn position(&self) -> Option<Position> {
        match self {
            CanonicalError::Syntax { position, .. }
            | CanonicalError::DuplicateMember { position, .. }
            | CanonicalError::TooDeep { position, .. }
            | CanonicalError::NumberOutOfRange { position, .. } => Some(*position),
            CanonicalError::InvalidPointer { .. } => None,
        }
    }

    pub(crate) fn too_deep(input: &[u8], offset: usize) -> CanonicalError {
        CanonicalError::TooDeep {
            limit: MAX_DEPTH,
            position: Position::locate(input, offset),
        }
    }

    pub(crate) fn number_out_of_range(input: &[u8], offset: usize) -> CanonicalError {
        CanonicalError::NumberOutOfRange {
            limit: MAX_DECIMAL_EXPONENT,
            position: Position::locate(input, offset),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_count_lines_and_characters() {
        let input = "ab\n\u{e9}\u{1F600}x".as_bytes();
        let at = |offset| {
            let p = Position::locate(input, offset);
            (p.line, p.column)
        };
        assert_eq!(at(0), (1, 1));
        assert_eq!(at(2), (1, 3));
        assert_eq!(at(3), (2, 1));
        // é is 2 bytes and 😀 4: x is the third character of line 2.
        assert_eq!(at(9), (2, 3));
        assert_eq!(
            Position::locate(input, 9).to_string(),
            "byte 9 (line 2, column 3)"
        );
    }

    #[test]
    fn limits_are_the_documented_ones() {
        // The public docs state these numbers; keep them in step.
        assert_eq!(MAX_DEPTH, 128);
        assert_eq!(MAX_DECIMAL_EXPONENT, 1_000_000);
        assert!(matches!(
            CanonicalError::too_deep(b"[", 0),
            CanonicalError::TooDeep { limit: 128, .. }
        ));
    }

    #[test]
    fn object_names_cannot_break_a_log_line() {
        let err = CanonicalError::DuplicateMember {
            object: "/a\nb".to_owned(),
            name: "x\ny".to_owned(),
            position: Position {
                offset: 1,
                line: 1,
                column: 2,
            },
        };
        assert_eq!(
            err.to_string(),
            "duplicate member \"x\\ny\" in object at /a\\nb (byte 1, line 1, column 2)"
        );
        assert_eq!(err.position().map(|p| p.column), Some(2));
    }
}
