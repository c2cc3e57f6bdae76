//! A simulated provider's durable ledger: one JSON line per entry, keyed by
//! the caller's reference (the provider's idempotency key). The card
//! provider (`provider.rs`) and the receipt provider (`receipts.rs`) each
//! keep one, in a file of their own.
//!
//! The ledger never forgets an acknowledged entry. An entry is
//! acknowledged only once its whole line, newline included, is synced, so:
//! - a last line without its newline is a torn append that was never
//!   acknowledged: opening the ledger truncates it;
//! - a failed append is rolled back (the file is cut back to its length
//!   before the append and synced) before the error is returned, so the
//!   next entry never lands on a half line; if even that fails, the ledger
//!   refuses further appends and status queries;
//! - any complete line that does not parse is corruption: an error naming
//!   the file and line, never skipped.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

/// One line of a ledger: serialisable, and keyed by the caller's reference.
pub trait Entry: Serialize + DeserializeOwned + Clone {
    /// The caller's reference: the provider's dedupe key.
    fn reference(&self) -> &str;
}

/// A ledger file and the entries it holds, by reference.
pub(crate) struct Ledger<T> {
    path: PathBuf,
    /// What the ledger is, for messages ("provider ledger").
    what: &'static str,
    file: File,
    /// The file's length: every byte before it is whole, synced lines.
    len: u64,
    by_reference: HashMap<String, T>,
    /// Set when a failed append could not be rolled back: the file's tail
    /// is unknown, so neither appends nor status answers can be trusted.
    broken: Option<String>,
    /// Fault injection for tests: the next append writes only this many
    /// bytes of its line, then fails as a full disk would.
    #[cfg(test)]
    pub(crate) tear_next_append_at: Option<usize>,
    /// Fault injection for tests: rolling back a failed append fails too.
    #[cfg(test)]
    pub(crate) fail_rollback: bool,
}

impl<T: Entry> Ledger<T> {
    /// Opens (or creates) the ledger at `path`, truncating a torn last line
    /// (an append that was never acknowledged). `what` names it in
    /// messages.
    ///
    /// # Errors
    /// I/O errors, and a [`LedgerError::Corrupt`] line (as an
    /// `io::ErrorKind::InvalidData` error naming the file and line).
    pub(crate) fn open(path: &Path, what: &'static str) -> io::Result<Ledger<T>> {
        let contents = read_ledger::<T>(path, what).map_err(LedgerError::into_io)?;
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        if contents.torn_tail_bytes > 0 {
            eprintln!(
                "{what}: {}: dropping a torn last line ({} bytes, never acknowledged)",
                path.display(),
                contents.torn_tail_bytes
            );
            file.set_len(contents.complete_bytes)?;
            file.sync_data()?;
        }
        let by_reference = contents
            .entries
            .into_iter()
            .map(|e| (e.reference().to_owned(), e))
            .collect();
        Ok(Ledger {
            path: path.to_path_buf(),
            what,
            file,
            len: contents.complete_bytes,
            by_reference,
            broken: None,
            #[cfg(test)]
            tear_next_append_at: None,
            #[cfg(test)]
            fail_rollback: false,
        })
    }

    /// The ledger file.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The entry for `reference`, if any (a status query).
    ///
    /// # Errors
    /// When the ledger is broken: "no entry" could then be wrong.
    pub(crate) fn get(&self, reference: &str) -> io::Result<Option<&T>> {
        self.check()?;
        Ok(self.by_reference.get(reference))
    }

    /// Every entry, in no particular order.
    pub(crate) fn entries(&self) -> impl Iterator<Item = &T> {
        self.by_reference.values()
    }

    /// Appends `entry` (one whole, synced line) and indexes it by its
    /// reference; the caller has checked that the reference is new.
    ///
    /// # Errors
    /// The append failed: it was rolled back and did not happen, unless the
    /// ledger reports itself broken from then on.
    pub(crate) fn insert(&mut self, entry: T) -> io::Result<()> {
        self.check()?;
        let mut line = serde_json::to_vec(&entry).map_err(io::Error::other)?;
        line.push(b'\n');
        self.append(&line)?;
        self.by_reference
            .insert(entry.reference().to_owned(), entry);
        Ok(())
    }

    fn check(&self) -> io::Result<()> {
        match &self.broken {
            None => Ok(()),
            Some(why) => Err(io::Error::other(format!(
                "{} {} is broken ({why}); reopen it",
                self.what,
                self.path.display()
            ))),
        }
    }

    /// Appends one whole line and syncs it; on failure, cuts the file back
    /// to where it was, so no half line stays for the next append to glue
    /// onto.
    fn append(&mut self, line: &[u8]) -> io::Result<()> {
        let written = self.write_and_sync(line);
        if let Err(e) = written {
            if let Err(rollback) = self.rollback() {
                self.broken = Some(format!(
                    "an append failed ({e}) and cutting it back failed too ({rollback})"
                ));
            }
            return Err(io::Error::new(
                e.kind(),
                format!("appending to {}: {e}", self.path.display()),
            ));
        }
        self.len += line.len() as u64;
        Ok(())
    }

    fn write_and_sync(&mut self, line: &[u8]) -> io::Result<()> {
        #[cfg(test)]
        if let Some(at) = self.tear_next_append_at.take() {
            self.file.write_all(&line[..at.min(line.len())])?;
            return Err(io::Error::new(
                io::ErrorKind::StorageFull,
                "no space left on device (injected)",
            ));
        }
        self.file.write_all(line)?;
        self.file.sync_data()
    }

    fn rollback(&mut self) -> io::Result<()> {
        #[cfg(test)]
        if self.fail_rollback {
            return Err(io::Error::other("rollback failed (injected)"));
        }
        self.file.set_len(self.len)?;
        self.file.sync_data()
    }
}

/// What a ledger file holds.
#[derive(Debug)]
pub struct LedgerContents<T> {
    /// Every acknowledged entry, in the order written.
    pub entries: Vec<T>,
    /// Bytes of whole lines: where a torn tail starts.
    pub complete_bytes: u64,
    /// Bytes after the last newline: an append that never completed (a
    /// crash or a full disk mid-write). 0 for a healthy ledger.
    pub torn_tail_bytes: u64,
}

impl<T> Default for LedgerContents<T> {
    fn default() -> Self {
        LedgerContents {
            entries: Vec::new(),
            complete_bytes: 0,
            torn_tail_bytes: 0,
        }
    }
}

/// Why a ledger could not be read.
#[derive(Debug)]
pub enum LedgerError {
    /// The file could not be read.
    Io {
        /// What the ledger is ("provider ledger").
        what: &'static str,
        /// The ledger file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// A whole line that is not an entry: the ledger is corrupt, and
    /// skipping the line could forget an acknowledged entry.
    Corrupt {
        /// What the ledger is ("provider ledger").
        what: &'static str,
        /// The ledger file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What the parser said.
        reason: String,
    },
}

impl std::fmt::Display for LedgerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LedgerError::Io { what, path, source } => {
                write!(f, "reading {what} {}: {source}", path.display())
            }
            LedgerError::Corrupt {
                what,
                path,
                line,
                reason,
            } => write!(
                f,
                "{what} {} is corrupt at line {line}: {reason}",
                path.display()
            ),
        }
    }
}

impl std::error::Error for LedgerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LedgerError::Io { source, .. } => Some(source),
            LedgerError::Corrupt { .. } => None,
        }
    }
}

impl LedgerError {
    pub(crate) fn into_io(self) -> io::Error {
        match self {
            LedgerError::Io { source, .. } => source,
            corrupt @ LedgerError::Corrupt { .. } => {
                io::Error::new(io::ErrorKind::InvalidData, corrupt.to_string())
            }
        }
    }
}

/// Reads the ledger at `path` without changing it (empty if the file does
/// not exist). A torn tail is reported, not returned as an entry. `what`
/// names the ledger in errors.
///
/// # Errors
/// [`LedgerError::Io`], or [`LedgerError::Corrupt`] for the first whole
/// line that is not an entry (blank lines included: a provider never
/// writes one).
pub fn read_ledger<T: DeserializeOwned>(
    path: &Path,
    what: &'static str,
) -> Result<LedgerContents<T>, LedgerError> {
    let io_err = |source| LedgerError::Io {
        what,
        path: path.to_path_buf(),
        source,
    };
    let mut bytes = Vec::new();
    match File::open(path) {
        Ok(mut f) => f.read_to_end(&mut bytes).map_err(io_err)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(LedgerContents::default()),
        Err(e) => return Err(io_err(e)),
    };
    let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    // `complete` is 0 or just past a newline, so the last piece of the
    // split is the empty string after that newline: not a line.
    let whole = bytes.get(..complete.saturating_sub(1)).unwrap_or_default();
    let mut entries = Vec::new();
    if complete > 0 {
        for (i, line) in whole.split(|&b| b == b'\n').enumerate() {
            let entry = serde_json::from_slice::<T>(line).map_err(|e| LedgerError::Corrupt {
                what,
                path: path.to_path_buf(),
                line: i + 1,
                reason: e.to_string(),
            })?;
            entries.push(entry);
        }
    }
    Ok(LedgerContents {
        entries,
        complete_bytes: complete as u64,
        torn_tail_bytes: (bytes.len() - complete) as u64,
    })
}
