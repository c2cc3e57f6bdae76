//! JSON Pointers (RFC 6901): checking, resolving against a parsed value,
//! and escaping member names.

use super::error::CanonicalError;
use super::value::JsonValue;

/// Checks that `pointer` is a well-formed RFC 6901 JSON Pointer.
///
/// # Errors
///
/// [`CanonicalError::InvalidPointer`] as for [`resolve`].
pub(crate) fn validate_pointer(pointer: &str) -> Result<(), CanonicalError> {
    tokens(pointer).map(drop)
}

/// Resolves an RFC 6901 JSON Pointer against `value`.
///
/// `""` is the whole value; `"/a/b"` is member `b` of member `a`, with `~1`
/// standing for `/` and `~0` for `~` in names. An array index is a decimal
/// number without leading zeros. A name missing from an object, an index
/// that is out of range, `-` or not a number, and any step into a scalar all
/// yield `Ok(None)`.
///
/// # Errors
///
/// [`CanonicalError::InvalidPointer`] if the pointer is neither empty nor
/// starts with `/`, or has a `~` not followed by `0` or `1`. The whole
/// pointer is checked before it is resolved.
pub(crate) fn resolve<'v>(
    value: &'v JsonValue,
    pointer: &str,
) -> Result<Option<&'v JsonValue>, CanonicalError> {
    let tokens = tokens(pointer)?;
    let mut current = value;
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

/// Appends `/` and `name` escaped as a pointer token (RFC 6901 §3).
pub(crate) fn push_token(pointer: &mut String, name: &str) {
    pointer.push('/');
    pointer.push_str(&name.replace('~', "~0").replace('/', "~1"));
}

/// Splits and unescapes a JSON Pointer (RFC 6901 §3, §4).
fn tokens(pointer: &str) -> Result<Vec<String>, CanonicalError> {
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

#[cfg(test)]
mod tests {
    use super::super::parser::parse;
    use super::*;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    #[test]
    fn pointers() -> TestResult {
        let doc = parse(br#"{"a": {"b": [10, 20, {"c": null}]}, "x/y": 1, "m~n": 2, "": 3}"#)?;
        let number = |s: &str| parse(s.as_bytes());
        assert_eq!(resolve(&doc, "")?, Some(&doc));
        assert_eq!(resolve(&doc, "/a/b/1")?, Some(&number("20")?));
        assert_eq!(resolve(&doc, "/a/b/2/c")?, Some(&JsonValue::Null));
        assert_eq!(resolve(&doc, "/x~1y")?, Some(&number("1")?));
        assert_eq!(resolve(&doc, "/m~0n")?, Some(&number("2")?));
        assert_eq!(resolve(&doc, "/")?, Some(&number("3")?));
        for absent in [
            "/missing",
            "/a/b/3",
            "/a/b/-",
            "/a/b/01",
            "/a/b/x",
            "/a/b/0/z",
            "/a/b/99999999999999999999999",
        ] {
            assert_eq!(resolve(&doc, absent)?, None, "{absent}");
        }
        let err = resolve(&doc, "a/b").err().ok_or("accepted")?;
        assert_eq!(
            err.to_string(),
            "invalid JSON Pointer \"a/b\": must be empty or start with '/'"
        );
        for bad in ["/a~2", "/a~", "/missing/~x"] {
            assert!(
                matches!(
                    resolve(&doc, bad),
                    Err(CanonicalError::InvalidPointer { .. })
                ),
                "{bad}"
            );
            assert!(validate_pointer(bad).is_err());
        }
        assert!(validate_pointer("/a/~0~1").is_ok());
        Ok(())
    }

    #[test]
    fn escaped_tokens_resolve_back() -> TestResult {
        let mut pointer = String::new();
        push_token(&mut pointer, "a/b~");
        push_token(&mut pointer, "");
        assert_eq!(pointer, "/a~1b~0/");
        let doc = parse(br#"{"a/b~": {"": true}}"#)?;
        assert_eq!(resolve(&doc, &pointer)?, Some(&JsonValue::Bool(true)));
        Ok(())
    }
}
