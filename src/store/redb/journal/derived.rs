//! The changes a format-3 journal logs without their index entries
//! (`Change::PutNewRecord`, `PutRecordDelta`, `DelIndexedRecord`), turned
//! back into the plain changes the live path made.
//!
//! A record sits in exactly one index, chosen by its state
//! (`Record::index`), so every index change of a record write is a
//! function of the value stored before it and the value after it: the
//! write removes the old value's entry and adds the new one's. The writer
//! logs such a write as one change only when it has checked that the
//! stored value is the one it changed (`Tables::derivable`); replay applies
//! a frame to the state it was written from, finds the same stored value,
//! and derives the same entries. Index changes that are no such function
//! (the sweep dropping an entry that does not match its record, an
//! operator's purge of a record that does not decode) stay logged as
//! `PutIndex` / `DelIndex`.

use crate::store::codec;
use crate::store::record::Record;

use super::super::partition::slot;
use super::frame::{Change, IndexTable};

/// Why a derived change does not fit the record stored under its key:
/// the journal does not fit the file (damage), reported with the slot key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::store::redb) struct Misfit(pub(in crate::store::redb) String);

impl std::fmt::Display for Misfit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Misfit {}

impl IndexTable {
    /// The index `rec` sits in, and at which instant (ms): the one rule,
    /// [`Record::index`].
    pub(in crate::store::redb) fn of(rec: &Record) -> (IndexTable, u64) {
        let (name, at) = rec.index();
        let which = match name {
            "leases" => IndexTable::Leases,
            "recovery" => IndexTable::Recovery,
            _ => IndexTable::Expiry,
        };
        (which, at)
    }
}

impl Change {
    /// The slot key a record change writes, and whether it puts a value
    /// (`false`: it deletes one); `None` for other changes.
    pub(in crate::store::redb) fn record_write(&self) -> Option<(&Vec<u8>, bool)> {
        match self {
            Change::PutRecord { key, .. }
            | Change::PutNewRecord { key, .. }
            | Change::PutRecordDelta { key, .. } => Some((key, true)),
            Change::DelRecord { key } | Change::DelIndexedRecord { key } => Some((key, false)),
            _ => None,
        }
    }

    /// The slot key whose stored value a derived change needs to be
    /// expanded ([`expand`]); `None` for a plain change.
    pub(in crate::store::redb) fn derived_key(&self) -> Option<&Vec<u8>> {
        match self {
            Change::PutNewRecord { key, .. }
            | Change::PutRecordDelta { key, .. }
            | Change::DelIndexedRecord { key } => Some(key),
            _ => None,
        }
    }
}

/// The plain changes derived change `change` stands for, given the value
/// stored under its slot key before it (`base`); a plain change as it is.
///
/// # Errors
///
/// [`Misfit`] when the change does not fit `base`: a new record where one
/// is stored, a delta or delete where none is or where it does not decode,
/// a key that is no slot key, a value or delta that does not decode.
pub(in crate::store::redb) fn expand(
    change: &Change,
    base: Option<&[u8]>,
) -> Result<Vec<Change>, Misfit> {
    let Some(key) = change.derived_key() else {
        return Ok(vec![change.clone()]);
    };
    let Some((_, rkey)) = slot::split(key) else {
        return Err(misfit(key, "its key is no slot key"));
    };
    let decoded = |what: &str, bytes: &[u8]| {
        codec::decode(rkey, bytes)
            .map_err(|e| misfit(key, &format!("{what} does not decode ({e})")))
    };
    let old = match (change, base) {
        (Change::PutNewRecord { .. }, None) => None,
        (Change::PutNewRecord { .. }, Some(_)) => {
            return Err(misfit(key, "a new record is logged where one is stored"))
        }
        (_, Some(base)) => Some(decoded("the stored record it changes", base)?),
        (_, None) => return Err(misfit(key, "it changes a record that is not stored")),
    };
    let index = |rec: &Record, put: bool| {
        let (index, at) = IndexTable::of(rec);
        let key = rkey.to_vec();
        if put {
            Change::PutIndex { index, at, key }
        } else {
            Change::DelIndex { index, at, key }
        }
    };
    let mut plain: Vec<Change> = old.iter().map(|old| index(old, false)).collect();
    match change {
        Change::PutNewRecord { value, .. } => {
            plain.push(index(&decoded("its record", value)?, true));
            plain.push(Change::PutRecord {
                key: key.clone(),
                value: value.clone(),
            });
        }
        Change::PutRecordDelta {
            base: sum, delta, ..
        } => {
            let (Some(old), Some(base)) = (old, base) else {
                return Err(misfit(key, "it changes a record that is not stored"));
            };
            if base_sum(base) != *sum {
                return Err(misfit(
                    key,
                    "the stored record is not the one its delta was taken from",
                ));
            }
            let new = delta.apply(old).map_err(|e| misfit(key, &e.to_string()))?;
            plain.push(index(&new, true));
            plain.push(Change::PutRecord {
                key: key.clone(),
                value: codec::encode(rkey, &new),
            });
        }
        _ => plain.push(Change::DelRecord { key: key.clone() }),
    }
    Ok(plain)
}

/// The last 8 bytes of stored value `base` (a format-2 value's checksum;
/// zeros before a shorter value's bytes): what a delta names its base by.
pub(in crate::store::redb) fn base_sum(base: &[u8]) -> [u8; 8] {
    let mut sum = [0_u8; 8];
    let tail = &base[base.len().saturating_sub(8)..];
    sum[8 - tail.len()..].copy_from_slice(tail);
    sum
}

fn misfit(key: &[u8], why: &str) -> Misfit {
    Misfit(format!(
        "the journal's change of record slot {}: {why}",
        crate::store::record::hex(key)
    ))
}
