//! Why a journal cannot be used.

use std::fmt;
use std::io;

/// Why a journal cannot be used. Every variant names the file.
#[derive(Debug)]
pub(crate) enum JournalError {
    Io {
        file: String,
        source: io::Error,
    },
    /// Not a journal (wrong magic), or a version this build cannot read.
    NotAJournal {
        file: String,
        detail: String,
    },
    /// The journal belongs to another database file.
    OtherDatabase {
        file: String,
    },
    /// Damage before the end of the log.
    Corrupt {
        file: String,
        offset: u64,
        detail: String,
    },
}

impl fmt::Display for JournalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JournalError::Io { file, source } => write!(f, "journal {file}: {source}"),
            JournalError::NotAJournal { file, detail } => {
                write!(f, "{file} is not a journal this build reads: {detail}")
            }
            JournalError::OtherDatabase { file } => write!(
                f,
                "journal {file} belongs to another database file (its journal id differs)"
            ),
            JournalError::Corrupt {
                file,
                offset,
                detail,
            } => write!(
                f,
                "journal {file} is damaged at byte offset {offset}: {detail}"
            ),
        }
    }
}

impl std::error::Error for JournalError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            JournalError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
