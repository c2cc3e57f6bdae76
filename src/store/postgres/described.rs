//! PostgreSQL client errors shown with what the server or the socket said.

/// A client error whose text says what the server or the socket said
/// (`postgres::Error` shows only its kind, e.g. "db error").
#[derive(Debug)]
pub(super) struct Described(pub(super) postgres::Error);

impl std::fmt::Display for Described {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let e = &self.0;
        match (e.as_db_error(), std::error::Error::source(e)) {
            (Some(db), _) => write!(
                f,
                "{e}: {} {}: {}",
                db.severity(),
                db.code().code(),
                db.message()
            ),
            (None, Some(cause)) => write!(f, "{e}: {cause}"),
            (None, None) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for Described {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}
