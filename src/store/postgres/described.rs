//! PostgreSQL client errors shown with what the server or the socket said.

/// `e` with what the server or the socket said (tokio-postgres's own text
/// is only its kind, e.g. "db error").
pub(super) fn describe(e: &tokio_postgres::Error) -> String {
    match (e.as_db_error(), std::error::Error::source(e)) {
        // The server's own text ("FATAL: ...", as its error displays)
        // comes first, so a reader that prints the error's sources after
        // it can tell the source says nothing new.
        (Some(db), _) => format!(
            "{e}: {}: {} (SQLSTATE {})",
            db.severity(),
            db.message(),
            db.code().code()
        ),
        (None, Some(cause)) => format!("{e}: {cause}"),
        (None, None) => e.to_string(),
    }
}
