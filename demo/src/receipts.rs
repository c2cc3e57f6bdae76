//! A second simulated provider: it sends the customer's receipt after the
//! charge, as an e-mail service would be called over the network. Like a
//! real one it dedupes by the caller's reference (here the "receipt" effect
//! step's reference) and answers status queries, so the resolver can ask
//! it whether a receipt went out.
//!
//! Its ledger is its own JSON-lines file (`payments.receipts.jsonl` beside
//! `payments.provider.jsonl`), one receipt per line, synced before a send
//! is acknowledged, with the same rules as the card provider's (see
//! `ledger.rs`): the demo audits it afterwards for double and lost
//! receipts.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::ledger::{Entry, Ledger, LedgerContents, LedgerError};
use crate::provider::now_ms;

/// What the receipt provider's ledger is called in messages.
const WHAT: &str = "receipt ledger";

/// How long the provider takes to send (a network round trip).
const LATENCY: Duration = Duration::from_millis(50);

/// One receipt as the provider records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receipt {
    /// The provider's message id.
    pub id: String,
    /// The caller's reference (the "receipt" step's reference): the
    /// provider's dedupe key.
    pub reference: String,
    /// The charge the receipt is for (the card provider's id).
    pub charge_id: String,
    /// Who it went to.
    pub customer: String,
    /// The client's `Idempotency-Key`, kept as metadata, so receipts can be
    /// audited per client request.
    pub client_key: String,
    /// When it was sent, ms since the Unix epoch.
    pub created_ms: u64,
}

impl Entry for Receipt {
    fn reference(&self) -> &str {
        &self.reference
    }
}

/// The receipt provider: sends once per reference, in memory and in its
/// ledger file.
pub struct Receipts {
    ledger: Mutex<Ledger<Receipt>>,
}

impl Receipts {
    /// Opens (or creates) the ledger at `path`, truncating a torn last line
    /// (a send that was never acknowledged).
    ///
    /// # Errors
    /// I/O errors, and a corrupt line (as an `io::ErrorKind::InvalidData`
    /// error naming the file and line).
    pub fn open(path: &Path) -> io::Result<Receipts> {
        Ok(Receipts {
            ledger: Mutex::new(Ledger::open(path, WHAT)?),
        })
    }

    /// The ledger file.
    pub fn path(&self) -> PathBuf {
        self.ledger.lock().path().to_path_buf()
    }

    /// Sends the receipt for `charge_id` to `customer` once per
    /// `reference`: a repeated reference returns the first receipt and
    /// sends nothing. Blocks (latency and fsync).
    ///
    /// # Errors
    /// When the ledger append failed: the send was rolled back and did not
    /// happen, unless the provider reports itself broken.
    pub fn send(
        &self,
        reference: &str,
        charge_id: &str,
        customer: &str,
        client_key: &str,
    ) -> io::Result<Receipt> {
        std::thread::sleep(LATENCY);
        let mut ledger = self.ledger.lock();
        if let Some(existing) = ledger.get(reference)? {
            return Ok(existing.clone());
        }
        let receipt = Receipt {
            id: format!("msg_{}", uuid::Uuid::new_v4().simple()),
            reference: reference.to_owned(),
            charge_id: charge_id.to_owned(),
            customer: customer.to_owned(),
            client_key: client_key.to_owned(),
            created_ms: now_ms(),
        };
        ledger.insert(receipt.clone())?;
        Ok(receipt)
    }

    /// The receipt sent for `reference`, if any (a status query).
    ///
    /// # Errors
    /// When the ledger is broken: "not sent" could then be wrong.
    pub fn status(&self, reference: &str) -> io::Result<Option<Receipt>> {
        Ok(self.ledger.lock().get(reference)?.cloned())
    }
}

/// The receipt ledger for a card provider's ledger file:
/// `payments.provider.jsonl` → `payments.receipts.jsonl`.
pub fn receipts_path(provider_ledger: &Path) -> PathBuf {
    let name = provider_ledger
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_suffix(".provider.jsonl"))
        .map_or_else(
            || {
                let mut name = provider_ledger.file_name().unwrap_or_default().to_owned();
                name.push(".receipts.jsonl");
                name
            },
            |stem| format!("{stem}.receipts.jsonl").into(),
        );
    provider_ledger.with_file_name(name)
}

/// Reads the receipt ledger at `path` without changing it (empty if the
/// file does not exist).
///
/// # Errors
/// [`LedgerError::Io`], or [`LedgerError::Corrupt`] for the first whole
/// line that is not a receipt.
pub fn read_receipts(path: &Path) -> Result<LedgerContents<Receipt>, LedgerError> {
    crate::ledger::read_ledger(path, WHAT)
}

#[cfg(test)]
mod tests {
    use super::*;

    type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

    #[test]
    fn a_repeated_reference_sends_nothing_and_survives_a_reopen() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("payments.receipts.jsonl");
        let receipts = Receipts::open(&path)?;
        assert_eq!(receipts.status("op-1/receipt")?, None);
        let first = receipts.send("op-1/receipt", "ch_1", "cus_1", "key-1")?;
        let again = receipts.send("op-1/receipt", "ch_1", "cus_1", "key-1")?;
        assert_eq!(first, again);
        drop(receipts);
        let read = read_receipts(&path)?;
        assert_eq!(read.entries, vec![first.clone()]);
        let receipts = Receipts::open(&path)?;
        assert_eq!(receipts.status("op-1/receipt")?, Some(first));
        Ok(())
    }

    #[test]
    fn a_failed_append_is_rolled_back_and_reads_as_not_sent() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("payments.receipts.jsonl");
        let receipts = Receipts::open(&path)?;
        receipts.ledger.lock().tear_next_append_at = Some(20);
        assert!(receipts.send("op-2/receipt", "ch_2", "cus", "k").is_err());
        assert_eq!(receipts.status("op-2/receipt")?, None);
        assert_eq!(read_receipts(&path)?.torn_tail_bytes, 0);
        Ok(())
    }

    #[test]
    fn the_receipt_ledger_sits_beside_the_card_ledger() {
        assert_eq!(
            receipts_path(Path::new("/d/payments.provider.jsonl")),
            PathBuf::from("/d/payments.receipts.jsonl")
        );
        assert_eq!(
            receipts_path(Path::new("/d/ledger")),
            PathBuf::from("/d/ledger.receipts.jsonl")
        );
    }
}
