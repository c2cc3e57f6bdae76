//! A simulated payment provider, as a payments API would call over the
//! network: it dedupes charges by the caller's reference (as real providers
//! do with their own idempotency keys) and answers status queries.
//!
//! Its ledger is its own JSON-lines file, one charge per line, fsynced
//! before a charge is acknowledged, so it survives a crash of the API
//! server: the demo checks it afterwards for double and lost charges. The
//! file's rules (a torn tail cut on open, a failed append rolled back, a
//! corrupt line an error) are `ledger.rs`'s.

use std::io;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::ledger::{Entry, Ledger, LedgerContents, LedgerError};

/// What the card provider's ledger is called in messages.
const WHAT: &str = "provider ledger";

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

impl Entry for Charge {
    fn reference(&self) -> &str {
        &self.reference
    }
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
    ledger: Mutex<Ledger<Charge>>,
}

impl Provider {
    /// Opens (or creates) the ledger at `path`, truncating a torn last line
    /// (an append that was never acknowledged).
    ///
    /// # Errors
    /// I/O errors, and a [`LedgerError::Corrupt`] line (as an
    /// `io::ErrorKind::InvalidData` error naming the file and line).
    pub fn open(path: &Path) -> io::Result<Provider> {
        Ok(Provider {
            ledger: Mutex::new(Ledger::open(path, WHAT)?),
        })
    }

    /// The ledger file.
    pub fn path(&self) -> std::path::PathBuf {
        self.ledger.lock().path().to_path_buf()
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
            if let Some(existing) = ledger.get(reference)? {
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
                ledger.insert(charge.clone())?;
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
        Ok(self.ledger.lock().get(reference)?.cloned())
    }

    /// The charge with provider id `id`, if any.
    pub fn by_id(&self, id: &str) -> Option<Charge> {
        let ledger = self.ledger.lock();
        let found = ledger.entries().find(|c| c.id == id).cloned();
        found
    }

    /// The charges made for the client's `Idempotency-Key` `client_key`,
    /// oldest first: how many times requests with that key were executed
    /// (the conformance kit counts executions from outside with it).
    pub fn by_client_key(&self, client_key: &str) -> Vec<Charge> {
        let ledger = self.ledger.lock();
        let mut charges: Vec<Charge> = ledger
            .entries()
            .filter(|c| c.client_key == client_key)
            .cloned()
            .collect();
        charges.sort_by(|a, b| (a.created_ms, &a.id).cmp(&(b.created_ms, &b.id)));
        charges
    }
}

impl From<io::Error> for ChargeError {
    fn from(e: io::Error) -> ChargeError {
        ChargeError::Io(e)
    }
}

/// Reads the card provider's ledger at `path` without changing it (empty
/// if the file does not exist): `ledger::read_ledger` for charges.
///
/// # Errors
/// [`LedgerError::Io`], or [`LedgerError::Corrupt`] for the first whole
/// line that is not a charge.
pub fn read_ledger(path: &Path) -> Result<LedgerContents<Charge>, LedgerError> {
    crate::ledger::read_ledger(path, WHAT)
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::OpenOptions;
    use std::io::Write;

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
        assert_eq!(read.entries, vec![first.clone()]);
        assert_eq!(read.torn_tail_bytes, torn.len() as u64);

        let provider = Provider::open(&path)?;
        assert_eq!(std::fs::metadata(&path)?.len(), whole);
        assert_eq!(provider.status("ref-2")?, None);
        let second = charge(&provider, "ref-2")?;
        drop(provider);
        let read = read_ledger(&path)?;
        assert_eq!(read.entries, vec![first, second]);
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
        assert_eq!(read.entries, vec![first.clone(), second.clone()]);
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
