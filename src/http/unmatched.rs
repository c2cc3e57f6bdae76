//! Warnings for requests the layer applies to that match no configured
//! [`Route`](super::Route): a pattern with a typo, or a `nest` prefix on
//! the wrong side of the layer, silently falls back to the layer's
//! defaults (a key that was meant to be required becomes optional).

use std::collections::HashSet;

use parking_lot::Mutex;

/// Distinct paths warned about before the layer stops warning.
pub(crate) const MAX_PATHS: usize = 64;
/// Longest path kept (and logged), in bytes; longer ones are cut.
const MAX_PATH_BYTES: usize = 200;

/// The paths already warned about: at most [`MAX_PATHS`] of at most
/// [`MAX_PATH_BYTES`] each, so clients sending endless distinct paths cost
/// a bounded amount of memory and log lines.
#[derive(Debug, Default)]
pub(crate) struct Unmatched {
    seen: Mutex<HashSet<String>>,
}

/// What to log for one unmatched request.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Warn {
    /// The first time for this path (as cut to [`MAX_PATH_BYTES`]).
    First(String),
    /// The path that filled the table: warn, and say no more will come.
    Last(String),
    /// Already warned, or the table is full.
    Quiet,
}

impl Unmatched {
    /// Records `path` and says whether to warn.
    pub(crate) fn note(&self, path: &str) -> Warn {
        let mut seen = self.seen.lock();
        if seen.len() >= MAX_PATHS {
            return Warn::Quiet;
        }
        let path = cut(path);
        if seen.contains(path) {
            return Warn::Quiet;
        }
        seen.insert(path.to_owned());
        if seen.len() == MAX_PATHS {
            Warn::Last(path.to_owned())
        } else {
            Warn::First(path.to_owned())
        }
    }

    /// Logs a warning for a `method` request on `path` that matched no
    /// route, once per path.
    pub(crate) fn warn(&self, method: &http::Method, path: &str, key_required: bool) {
        let (path, last) = match self.note(path) {
            Warn::Quiet => return,
            Warn::First(path) => (path, false),
            Warn::Last(path) => (path, true),
        };
        tracing::warn!(
            %method,
            %path,
            key_required,
            "this request matched no Route of the idempotency layer, so the layer's defaults \
             apply to it (Idempotency-Key {}, body fingerprinted by content type). If a Route \
             was meant to cover it, check its pattern against the path the layer sees (a \
             layer outside axum's nest() sees the prefix, one inside does not); for a path the \
             layer should simply pass, add Route::new(pattern).optional_key(). Logged once per \
             path{}",
            if key_required { "required" } else { "optional" },
            if last {
                "; this is the last such warning (too many distinct paths)"
            } else {
                ""
            }
        );
    }
}

/// `path` cut to at most [`MAX_PATH_BYTES`], at a character boundary.
fn cut(path: &str) -> &str {
    if path.len() <= MAX_PATH_BYTES {
        return path;
    }
    let mut end = MAX_PATH_BYTES;
    while !path.is_char_boundary(end) {
        end -= 1;
    }
    path.get(..end).unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn once_per_path_and_bounded() {
        let u = Unmatched::default();
        assert_eq!(u.note("/paymnets"), Warn::First("/paymnets".into()));
        assert_eq!(u.note("/paymnets"), Warn::Quiet);
        for i in 1..MAX_PATHS - 1 {
            assert!(matches!(u.note(&format!("/p/{i}")), Warn::First(_)));
        }
        assert!(matches!(u.note("/the-last"), Warn::Last(_)));
        assert_eq!(u.note("/one-more"), Warn::Quiet);
        assert_eq!(u.seen.lock().len(), MAX_PATHS);
        let long = "/".repeat(MAX_PATH_BYTES * 10);
        let fresh = Unmatched::default();
        assert!(matches!(fresh.note(&long), Warn::First(p) if p.len() == MAX_PATH_BYTES));
    }
}
