//! The audit: both providers' ledgers against what the client was told.
//! Every payment the client saw succeed has exactly one charge (the one it
//! was told) and exactly one receipt (for that charge); nothing is charged
//! or receipted that the client never learned of; a refused payment has
//! neither.

use std::collections::BTreeMap;
use std::path::Path;

use super::{plural, Audit, DemoResult};
use crate::provider::{read_ledger, Charge};
use crate::receipts::{read_receipts, receipts_path, Receipt};

/// One ledger's entries for the keys under one prefix, against what the
/// client was told.
pub(super) struct Tally {
    /// Keys the client saw succeed.
    pub(super) succeeded: usize,
    /// Entries (charges or receipts) under the prefix.
    pub(super) entries: usize,
    /// Keys with more than one entry.
    pub(super) twice: usize,
    /// Keys the client saw succeed without a (matching) entry, or with an
    /// entry the client never learned of.
    pub(super) lost: usize,
    /// Each problem, naming its key.
    pub(super) problems: Vec<String>,
}

/// One ledger entry as the audit sees it.
struct Seen<'a> {
    client_key: &'a str,
    /// The charge it is, or is for.
    charge_id: &'a str,
    /// Its own id.
    id: &'a str,
}

impl Tally {
    /// The card ledger's tally.
    pub(super) fn charges(charges: &[Charge], prefix: &str, audit: &Audit) -> Tally {
        let seen = charges.iter().map(|c| Seen {
            client_key: &c.client_key,
            charge_id: &c.id,
            id: &c.id,
        });
        Tally::of(seen, "charged", prefix, audit)
    }

    /// The receipt ledger's tally: a receipt must be for the charge the
    /// client was told.
    pub(super) fn receipts(receipts: &[Receipt], prefix: &str, audit: &Audit) -> Tally {
        let seen = receipts.iter().map(|r| Seen {
            client_key: &r.client_key,
            charge_id: &r.charge_id,
            id: &r.id,
        });
        Tally::of(seen, "receipted", prefix, audit)
    }

    fn of<'a>(
        entries: impl Iterator<Item = Seen<'a>>,
        done: &str,
        prefix: &str,
        audit: &Audit,
    ) -> Tally {
        let mut by_key: BTreeMap<&str, Vec<Seen<'a>>> = BTreeMap::new();
        for e in entries.filter(|e| e.client_key.starts_with(prefix)) {
            by_key.entry(e.client_key).or_default().push(e);
        }
        let told: BTreeMap<&str, &str> = audit
            .succeeded
            .iter()
            .filter(|(key, _)| key.starts_with(prefix))
            .map(|(key, id)| (key.as_str(), id.as_str()))
            .collect();
        let mut tally = Tally {
            succeeded: told.len(),
            entries: by_key.values().map(Vec::len).sum(),
            twice: 0,
            lost: 0,
            problems: Vec::new(),
        };
        for (key, seen) in &by_key {
            if seen.len() > 1 {
                tally.twice += 1;
                let ids: Vec<&str> = seen.iter().map(|e| e.id).collect();
                tally
                    .problems
                    .push(format!("{key}: {done} {} times: {ids:?}", seen.len()));
            }
        }
        for (key, told) in &told {
            match by_key.get(key).map(Vec::as_slice) {
                Some([one]) if one.charge_id == *told => {}
                Some(seen) => {
                    let ids: Vec<&str> = seen.iter().map(|e| e.charge_id).collect();
                    tally
                        .problems
                        .push(format!("{key}: client was told {told}, {done} for {ids:?}"));
                }
                None => {
                    tally.lost += 1;
                    tally
                        .problems
                        .push(format!("{key}: client was told {told}, never {done}"));
                }
            }
        }
        for key in by_key.keys() {
            if !told.contains_key(key) {
                tally.lost += 1;
                tally
                    .problems
                    .push(format!("{key}: {done}, but the client never learned of it"));
            }
        }
        for key in audit.refused.iter().filter(|k| k.starts_with(prefix)) {
            if by_key.contains_key(key.as_str()) {
                tally
                    .problems
                    .push(format!("{key}: refused to the client, yet {done}"));
            }
        }
        tally
    }

    /// `N payments succeeded for the client, N charges, 0 charged twice, 0
    /// lost; N receipts, 0 receipted twice, 0 lost`.
    pub(super) fn line(charges: &Tally, receipts: &Tally) -> String {
        format!(
            "{} succeeded for the client, {}, {} charged twice, {} lost; {}, {} receipted \
             twice, {} lost",
            plural(charges.succeeded, "payment"),
            plural(charges.entries, "charge"),
            charges.twice,
            charges.lost,
            plural(receipts.entries, "receipt"),
            receipts.twice,
            receipts.lost
        )
    }

    /// A phase's own audit line (the final audit repeats every check).
    pub(super) fn print_phase(ledger: &Path, prefix: &str, audit: &Audit) -> DemoResult<()> {
        let charges = Tally::charges(&read_ledger(ledger)?.entries, prefix, audit);
        let receipts = Tally::receipts(
            &read_receipts(&receipts_path(ledger))?.entries,
            prefix,
            audit,
        );
        println!("    audit: {}", Tally::line(&charges, &receipts));
        Ok(())
    }
}

/// The rows' charges come from the provider's own ledger. The server may
/// be appending while this reads, so a partial last line is not counted;
/// a corrupt line is an error.
pub(super) fn ledger_count(ledger: &Path, run: &str) -> DemoResult<usize> {
    Ok(read_ledger(ledger)?
        .entries
        .iter()
        .filter(|c| c.client_key.starts_with(run))
        .count())
}

/// The receipts under `run` in the receipt ledger beside `ledger`.
pub(super) fn receipt_count(ledger: &Path, run: &str) -> DemoResult<usize> {
    Ok(read_receipts(&receipts_path(ledger))?
        .entries
        .iter()
        .filter(|r| r.client_key.starts_with(run))
        .count())
}
