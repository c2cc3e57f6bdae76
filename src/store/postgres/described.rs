//! PostgreSQL client errors shown with what the server or the socket said.

/// `e` with what the server or the socket said (tokio-postgres's own text
/// is only its kind, e.g. "db error").
pub(super) fn describe(e: &tokio_postgres::Error) -> String {
    match (e.as_db_error(), std::error::Error::source(e)) {
        (Some(db), _) => format!(
            "{e}: {} {}: {}",
            db.severity(),
            db.code().code(),
            db.message()
        ),
        (None, Some(cause)) => format!("{e}: {cause}"),
        (None, None) => e.to_string(),
    }
}
