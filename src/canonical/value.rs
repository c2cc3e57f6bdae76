//! A parsed JSON value and its canonical serialization (RFC 8785 §3.2).

use super::number::Number;
use super::string::{cmp_utf16, write_string};

/// A parsed JSON value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum JsonValue {
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
    /// An object. After parsing, members are in canonical order (names
    /// compared as UTF-16 code unit sequences, RFC 8785 §3.2.3) and names
    /// are unique.
    Object(Vec<(String, JsonValue)>),
}

impl JsonValue {
    /// Appends the RFC 8785 canonical form of the value (with exact numbers)
    /// to `out`.
    ///
    /// Members of an object built by hand are written in canonical order
    /// even if the vector is not sorted; duplicate names in such an object
    /// are written as they are.
    pub(crate) fn write_canonical(&self, out: &mut Vec<u8>) {
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
                // Already sorted after parsing; the stable sort then only checks.
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
