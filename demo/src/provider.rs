//! A simulated payment provider, as a payments API would call over the
//! network: it dedupes charges by the caller's reference (as real providers
//! do with their own idempotency keys) and answers status queries.
//!
//! Its ledger is its own JSON-lines file, one charge per line, fsynced
//! before a charge is acknowledged, so it survives a crash of the API
//! server: the demo checks it afterwards for double and lost charges.
//!
//! The ledger never forgets an acknowledged charge. A charge is
//! acknowledged only once its whole line, newline included, is synced, so:
//! - a last line without its newline is a torn append that was never
//!   acknowledged: opening the provider truncates it;
//! - a failed append is rolled back (the file is cut back to its length
//!   before the append and synced) before the error is returned, so the
//!   next charge never lands on a half line; if even that fails, the
//!   provider refuses further charges and status queries;
//! - any complete line that does not parse is corruption: an error naming
//!   the file and line, never skipped.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// Amounts above this (in minor units) are declined: 10,000.00.
pub const DECLINE_ABOVE: u64 = 1_000_000;

/// How long the provider takes to charge (a network round trip).
const LATENCY: Duration = Duration::from_millis(150);

/// One charge as the provider records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Charge {
    /// The provider's charge id.
    pub id: String,
    /// The caller's reference (the claim's `Claim::reference`): the
    /// provider's dedupe key.
    pub reference: String,
    /// Amount in minor units.
    pub amount: u64,
    /// ISO 4217 code.
    pub currency: String,
    /// The client's `Idempotency-Key`, kept as metadata (like Stripe's
    /// `metadata`), so charges can be audited per client request.
    pub client_key: String,
    /// When it was charged, ms since the Unix epoch.
    pub created_ms: u64,
}

/// Why a charge did not go through.
#[derive(Debug)]
pub enum ChargeError {
    /// The card was declined; nothing was charged.
    Declined,
    /// The call timed out. The provider may or may not have charged (in
    /// this simulation it did): only a status query can tell.
    Timeout,
    /// The provider's ledger failed.
    Io(io::Error),
}

/// What the fault injection asks of one charge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Charge normally.
    None,
    /// Charge, then let the caller's request time out.
    TimeoutAfterCharge,
}

/// The provider: charges by reference, in memory and in its ledger file.
pub struct Provider {
    path: PathBuf,
    ledger: Mutex<Ledger>,
}

struct Ledger {
    file: File,
    /// The file's length: every byte before it is whole, synced lines.
    len: u64,
    by_reference: HashMap<String, Charge>,
    /// Set when a failed append could not be rolled back: the file's tail
    /// is unknown, so neither charges nor status answers can be trusted.
    broken: Option<String>,
    /// Fault injection for tests: the next append writes only this many
    /// bytes of its line, then fails as a full disk would.
    #[cfg(test)]
    tear_next_append_at: Option<usize>,
    /// Fault injection for tests: rolling back a failed append fails too.
    #[cfg(test)]
    fail_rollback: bool,
}

impl Provider {
    /// Opens (or creates) the ledger at `path`, truncating a torn last line
    /// (an append that was never acknowledged).
    ///
    /// # Errors
    /// I/O errors, and a [`LedgerError::Corrupt`] line (as an
    /// `io::ErrorKind::InvalidData` error naming the file and line).
    pub fn open(path: &Path) -> io::Result<Provider> {
        let contents = read_ledger(path).map_err(LedgerError::into_io)?;
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        if contents.torn_tail_bytes > 0 {
            eprintln!(
                "provider: {}: dropping a torn last line ({} bytes, never acknowledged)",
                path.display(),
                contents.torn_tail_bytes
            );
            file.set_len(contents.complete_bytes)?;
            file.sync_data()?;
        }
        let by_reference = contents
            .charges
            .into_iter()
            .map(|c| (c.reference.clone(), c))
            .collect();
        Ok(Provider {
            path: path.to_path_buf(),
            ledger: Mutex::new(Ledger {
                file,
                len: contents.complete_bytes,
                by_reference,
                broken: None,
                #[cfg(test)]
                tear_next_append_at: None,
                #[cfg(test)]
                fail_rollback: false,
            }),
        })
    }

    /// The ledger file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Charges `amount` once per `reference`: a repeated reference returns
    /// the first charge and charges nothing. Blocks (latency and fsync).
    ///
    /// # Errors
    /// [`ChargeError::Io`] when the ledger append failed: the charge was
    /// rolled back and did not happen, unless the provider reports itself
    /// broken, in which case nobody can tell until it is reopened.
    pub fn charge(
        &self,
        reference: &str,
        amount: u64,
        currency: &str,
        client_key: &str,
        fault: Fault,
    ) -> Result<Charge, ChargeError> {
        std::thread::sleep(LATENCY);
        if amount > DECLINE_ABOVE {
            return Err(ChargeError::Declined);
        }
        let charge = {
            let mut ledger = self.ledger.lock();
            ledger.check(&self.path)?;
            if let Some(existing) = ledger.by_reference.get(reference) {
                existing.clone()
            } else {
                let charge = Charge {
                    id: format!("ch_{}", uuid::Uuid::new_v4().simple()),
                    reference: reference.to_owned(),
                    amount,
                    currency: currency.to_owned(),
                    client_key: client_key.to_owned(),
                    created_ms: now_ms(),
                };
                let mut line = serde_json::to_vec(&charge).map_err(io::Error::other)?;
                line.push(b'\n');
                ledger.append(&self.path, &line)?;
                ledger
                    .by_reference
                    .insert(charge.reference.clone(), charge.clone());
                charge
            }
        };
        match fault {
            Fault::None => Ok(charge),
            Fault::TimeoutAfterCharge => {
                std::thread::sleep(LATENCY);
                Err(ChargeError::Timeout)
            }
        }
    }

    /// The charge made for `reference`, if any (a status query).
    ///
    /// # Errors
    /// When the ledger is broken (a failed append could not be rolled
    /// back): "no charge" could then be wrong.
    pub fn status(&self, reference: &str) -> io::Result<Option<Charge>> {
        let ledger = self.ledger.lock();
        ledger.check(&self.path)?;
        Ok(ledger.by_reference.get(reference).cloned())
    }

    /// The charge with provider id `id`, if any.
    pub fn by_id(&self, id: &str) -> Option<Charge> {
        let ledger = self.ledger.lock();
        ledger.by_reference.values().find(|c| c.id == id).cloned()
    }

    /// The charges made for the client's `Idempotency-Key` `client_key`,
    /// oldest first: how many times requests with that key were executed
    /// (the conformance kit counts executions from outside with it).
    pub fn by_client_key(&self, client_key: &str) -> Vec<Charge> {
        let ledger = self.ledger.lock();
        let mut charges: Vec<Charge> = ledger
            .by_reference
            .values()
            .filter(|c| c.client_key == client_key)
            .cloned()
            .collect();
        charges.sort_by(|a, b| (a.created_ms, &a.id).cmp(&(b.created_ms, &b.id)));
        charges
    }
}

impl Ledger {
    fn check(&self, path: &Path) -> io::Result<()> {
        match &self.broken {
            None => Ok(()),
            Some(why) => Err(io::Error::other(format!(
                "provider ledger {} is broken ({why}); reopen it",
                path.display()
            ))),
        }
    }

    /// Appends one whole line and syncs it; on failure, cuts the file back
    /// to where it was, so no half line stays for the next append to glue
    /// onto.
    fn append(&mut self, path: &Path, line: &[u8]) -> io::Result<()> {
        let written = self.write_and_sync(line);
        if let Err(e) = written {
            if let Err(rollback) = self.rollback() {
                self.broken = Some(format!(
                    "an append failed ({e}) and cutting it back failed too ({rollback})"
                ));
            }
            return Err(io::Error::new(
                e.kind(),
                format!("appending to {}: {e}", path.display()),
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

impl From<io::Error> for ChargeError {
    fn from(e: io::Error) -> ChargeError {
        ChargeError::Io(e)
    }
}

/// What a ledger file holds.
#[derive(Debug, Default)]
pub struct LedgerContents {
    /// Every acknowledged charge, in the order charged.
    pub charges: Vec<Charge>,
    /// Bytes of whole lines: where a torn tail starts.
    pub complete_bytes: u64,
    /// Bytes after the last newline: an append that never completed (a
    /// crash or a full disk mid-write). 0 for a healthy ledger.
    pub torn_tail_bytes: u64,
}

/// Why a ledger could not be read.
#[derive(Debug)]
pub enum LedgerError {
    /// The file could not be read.
    Io {
        /// The ledger file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// A whole line that is not a charge: the ledger is corrupt, and
    /// skipping the line could forget an acknowledged charge.
    Corrupt {
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
            LedgerError::Io { path, source } => {
                write!(f, "reading provider ledger {}: {source}", path.display())
            }
            LedgerError::Corrupt { path, line, reason } => write!(
                f,
                "provider ledger {} is corrupt at line {line}: {reason}",
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
    fn into_io(self) -> io::Error {
        match self {
            LedgerError::Io { source, .. } => source,
            corrupt @ LedgerError::Corrupt { .. } => {
                io::Error::new(io::ErrorKind::InvalidData, corrupt.to_string())
            }
        }
    }
}

/// Reads the ledger at `path` without changing it (empty if the file does
/// not exist). A torn tail is reported, not returned as a charge.
///
/// # Errors
/// [`LedgerError::Io`], or [`LedgerError::Corrupt`] for the first whole
/// line that is not a charge (blank lines included: the provider never
/// writes one).
pub fn read_ledger(path: &Path) -> Result<LedgerContents, LedgerError> {
    let io_err = |source| LedgerError::Io {
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
    let mut charges = Vec::new();
    if complete > 0 {
        for (i, line) in whole.split(|&b| b == b'\n').enumerate() {
            let charge =
                serde_json::from_slice::<Charge>(line).map_err(|e| LedgerError::Corrupt {
                    path: path.to_path_buf(),
                    line: i + 1,
                    reason: e.to_string(),
                })?;
            charges.push(charge);
        }
    }
    Ok(LedgerContents {
        charges,
        complete_bytes: complete as u64,
        torn_tail_bytes: (bytes.len() - complete) as u64,
    })
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

    fn charge(provider: &Provider, reference: &str) -> Result<Charge> {
        provider
            .charge(reference, 100, "EUR", reference, Fault::None)
            .map_err(|e| format!("{e:?}").into())
    }

    #[test]
    fn a_torn_tail_is_truncated_on_open_and_the_next_charge_starts_a_new_line() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("ledger.jsonl");
        let provider = Provider::open(&path)?;
        let first = charge(&provider, "ref-1")?;
        drop(provider);
        let whole = std::fs::metadata(&path)?.len();
        // A crash mid-append: half a line, no newline.
        let mut file = OpenOptions::new().append(true).open(&path)?;
        let torn = br#"{"id":"ch_torn","reference":"ref-2","amo"#;
        file.write_all(torn)?;
        drop(file);
        let read = read_ledger(&path)?;
        assert_eq!(read.charges, vec![first.clone()]);
        assert_eq!(read.torn_tail_bytes, torn.len() as u64);

        let provider = Provider::open(&path)?;
        assert_eq!(std::fs::metadata(&path)?.len(), whole);
        assert_eq!(provider.status("ref-2")?, None);
        let second = charge(&provider, "ref-2")?;
        drop(provider);
        let read = read_ledger(&path)?;
        assert_eq!(read.charges, vec![first, second]);
        assert_eq!(read.torn_tail_bytes, 0);
        Ok(())
    }

    #[test]
    fn a_corrupt_middle_line_is_an_error_naming_file_and_line() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("ledger.jsonl");
        let provider = Provider::open(&path)?;
        charge(&provider, "ref-1")?;
        charge(&provider, "ref-2")?;
        charge(&provider, "ref-3")?;
        drop(provider);
        // Two appends glued together: line 2 is no longer a charge.
        let text = std::fs::read_to_string(&path)?;
        let mut lines: Vec<&str> = text.lines().collect();
        let glued = format!("{}{}", &lines[1][..20], lines[2]);
        lines[1] = &glued;
        lines.remove(2);
        std::fs::write(&path, lines.join("\n") + "\n")?;

        let err = read_ledger(&path)
            .err()
            .ok_or("a corrupt ledger was read")?;
        assert!(
            matches!(err, LedgerError::Corrupt { line: 2, .. }),
            "{err:?}"
        );
        let message = err.to_string();
        assert!(message.contains(&path.display().to_string()), "{message}");
        assert!(message.contains("line 2"), "{message}");
        // Opening refuses too, rather than forgetting the charge.
        let open = Provider::open(&path)
            .err()
            .ok_or("a corrupt ledger opened")?;
        assert_eq!(open.kind(), io::ErrorKind::InvalidData);
        assert!(open.to_string().contains("line 2"), "{open}");
        Ok(())
    }

    #[test]
    fn a_failed_append_is_rolled_back_and_the_next_one_is_whole() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("ledger.jsonl");
        let provider = Provider::open(&path)?;
        let first = charge(&provider, "ref-1")?;
        // The disk fills after 30 bytes of the next line.
        provider.ledger.lock().tear_next_append_at = Some(30);
        let failed = provider.charge("ref-2", 200, "EUR", "ref-2", Fault::None);
        assert!(matches!(failed, Err(ChargeError::Io(_))), "{failed:?}");
        // Not charged, and the provider says so.
        assert_eq!(provider.status("ref-2")?, None);
        assert_eq!(read_ledger(&path)?.torn_tail_bytes, 0);
        // The retry is appended whole, not onto a half line.
        let second = charge(&provider, "ref-2")?;
        drop(provider);
        let read = read_ledger(&path)?;
        assert_eq!(read.charges, vec![first.clone(), second.clone()]);
        assert_eq!(read.torn_tail_bytes, 0);
        // And it is remembered across a restart.
        let provider = Provider::open(&path)?;
        assert_eq!(provider.status("ref-2")?, Some(second));
        Ok(())
    }

    #[test]
    fn a_failed_rollback_breaks_the_provider_instead_of_answering_not_charged() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("ledger.jsonl");
        let provider = Provider::open(&path)?;
        charge(&provider, "ref-1")?;
        {
            let mut ledger = provider.ledger.lock();
            ledger.tear_next_append_at = Some(30);
            ledger.fail_rollback = true;
        }
        let failed = provider.charge("ref-2", 200, "EUR", "ref-2", Fault::None);
        assert!(matches!(failed, Err(ChargeError::Io(_))), "{failed:?}");
        // "Not charged" could be wrong now: the status query fails, so the
        // resolver answers "still unknown", and no charge is accepted.
        assert!(provider.status("ref-2").is_err());
        let refused = provider.charge("ref-3", 300, "EUR", "ref-3", Fault::None);
        assert!(matches!(refused, Err(ChargeError::Io(_))), "{refused:?}");
        drop(provider);
        // Reopening truncates the half line and keeps the acknowledged charge.
        let provider = Provider::open(&path)?;
        assert!(provider.status("ref-1")?.is_some());
        assert_eq!(provider.status("ref-2")?, None);
        Ok(())
    }
}
