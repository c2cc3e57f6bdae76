//! A simulated payment provider, as a payments API would call over the
//! network: it dedupes charges by the caller's reference (as real providers
//! do with their own idempotency keys) and answers status queries.
//!
//! Its ledger is its own JSON-lines file, one charge per line, fsynced
//! before a charge is acknowledged, so it survives a crash of the API
//! server: the demo checks it afterwards for double and lost charges.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
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
    by_reference: HashMap<String, Charge>,
}

impl Provider {
    /// Opens (or creates) the ledger at `path`.
    pub fn open(path: &Path) -> io::Result<Provider> {
        let by_reference = read_ledger(path)?
            .into_iter()
            .map(|c| (c.reference.clone(), c))
            .collect();
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Provider {
            path: path.to_path_buf(),
            ledger: Mutex::new(Ledger { file, by_reference }),
        })
    }

    /// The ledger file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Charges `amount` once per `reference`: a repeated reference returns
    /// the first charge and charges nothing. Blocks (latency and fsync).
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
                ledger.file.write_all(&line).map_err(ChargeError::Io)?;
                ledger.file.sync_data().map_err(ChargeError::Io)?;
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
    pub fn status(&self, reference: &str) -> Option<Charge> {
        self.ledger.lock().by_reference.get(reference).cloned()
    }

    /// The charge with provider id `id`, if any.
    pub fn by_id(&self, id: &str) -> Option<Charge> {
        let ledger = self.ledger.lock();
        ledger.by_reference.values().find(|c| c.id == id).cloned()
    }
}

impl From<io::Error> for ChargeError {
    fn from(e: io::Error) -> ChargeError {
        ChargeError::Io(e)
    }
}

/// Every charge in the ledger at `path`, in the order charged (none if the
/// file does not exist). A torn last line (a crash mid-append, before the
/// fsync acknowledged the charge) is skipped.
pub fn read_ledger(path: &Path) -> io::Result<Vec<Charge>> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut charges = Vec::new();
    for line in BufReader::new(file).lines() {
        let line = line?;
        if let Ok(charge) = serde_json::from_str::<Charge>(&line) {
            charges.push(charge);
        }
    }
    Ok(charges)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
