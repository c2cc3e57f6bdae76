//! Writing what was gathered into the new database file, through a
//! temporary file renamed into place once committed.
//!
//! The new file has the damaged one's format. In format 3 the records,
//! steps and log go, in record-key order, into one partition numbered
//! `BUILT_PARTITIONS`, sealed as a migration from format 2 seals its
//! partition (`migrate3::seal_built_partition`: its filter built from its
//! keys, its row written), under a fresh `filter_seed`: nothing of the
//! damaged file's rows and filters is carried over.

use std::path::{Path, PathBuf};

use redb::{Durability, WriteTransaction};

use crate::error::{OpenError, Result};
use crate::policy::ExpiryPolicy;
use crate::store::config::StoreConfig;

use super::super::meta::{self, Counter, OpenContext};
use super::super::open::migrate3::seal_built_partition;
use super::super::open::{open_path, prepare_new_as, NewFormat};
use super::super::partition::catalog;
use super::super::partition::slot::{slot_key, BUILT_PARTITIONS};
use super::super::tables::{
    ENTITIES, EXPIRY, HISTORY, LEASES, META, OUTBOX, RECORDS, RECOVERY, STEPS,
};
use super::gathered::Gathered;

/// The temporary file the new file `new` is written through.
pub(super) fn temporary(new: &Path) -> PathBuf {
    let mut name = new.as_os_str().to_owned();
    name.push(".salvaging");
    PathBuf::from(name)
}

/// Writes `g` into a new database file at `new`, through a temporary file
/// beside it.
pub(super) fn write_new(g: &Gathered, new: &Path) -> Result<(), OpenError> {
    let tmp = temporary(new);
    let io = |context: &'static str| {
        move |source: std::io::Error| OpenError::Storage {
            context,
            source: Box::new(source),
        }
    };
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("removing an earlier salvage's temporary file")(e)),
    }
    let written = write_tables(g, &tmp);
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, new).map_err(io("moving the salvaged file into place"))?;
    if let Some(dir) = new.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io("syncing the salvaged file's directory"))?;
    }
    Ok(())
}

pub(super) fn write_tables(g: &Gathered, path: &Path) -> Result<(), OpenError> {
    let db = open_path(path, None)?;
    // Settings are not taken from `cfg` (nothing is stored from it when
    // they are read from the database, and a new file has none).
    let cfg = StoreConfig {
        ttl_ms: 0,
        expiry: ExpiryPolicy::Forget,
        max_response_bytes: 0,
    };
    let new_format = if g.partitioned {
        NewFormat::Format3
    } else {
        NewFormat::Format2
    };
    prepare_new_as(&db, path, cfg, true, new_format)?;
    let what = "writing the salvaged database";
    let mut txn = db.begin_write().open_context(what)?;
    txn.set_durability(Durability::Immediate)
        .open_context(what)?;
    if g.partitioned {
        write_partitioned(&txn, g).open_context(what)?;
    } else {
        write_unpartitioned(&txn, g).open_context(what)?;
    }
    {
        let mut leases = txn.open_table(LEASES).open_context(what)?;
        let mut recovery = txn.open_table(RECOVERY).open_context(what)?;
        let mut expiry = txn.open_table(EXPIRY).open_context(what)?;
        for (name, at, key) in &g.index {
            let table = match *name {
                "leases" => &mut leases,
                "recovery" => &mut recovery,
                _ => &mut expiry,
            };
            table.insert((*at, key.as_slice()), ()).open_context(what)?;
        }
        let mut outbox = txn.open_table(OUTBOX).open_context(what)?;
        for (seq, value) in &g.outbox {
            outbox.insert(*seq, value.as_slice()).open_context(what)?;
        }
        let mut entities = txn.open_table(ENTITIES).open_context(what)?;
        for (id, value) in &g.entities {
            entities
                .insert(id.as_str(), value.as_slice())
                .open_context(what)?;
        }
        let mut meta_table = txn.open_table(META).open_context(what)?;
        meta::write_counter(&mut meta_table, Counter::NextToken, g.next_token)
            .open_context(what)?;
        meta::write_counter(&mut meta_table, Counter::NextOutboxSeq, g.next_outbox)
            .open_context(what)?;
        if let Some((ttl_ms, policy)) = g.expiry {
            meta::write_expiry(&mut meta_table, ttl_ms, policy).open_context(what)?;
        }
    }
    if g.partitioned {
        let seed = meta::read_filter_seed(&txn.open_table(META).open_context(what)?)
            .map_err(|e| e.open_error(path, what))?;
        seal_built_partition(&txn, &seed, now_ms()).map_err(|e| e.open_error(path, what))?;
    }
    txn.commit().open_context(what)?;
    drop(db);
    Ok(())
}

/// Format 2's records, steps and log, keyed by record key.
fn write_unpartitioned(txn: &WriteTransaction, g: &Gathered) -> Result<(), redb::Error> {
    let mut records = txn.open_table(RECORDS)?;
    for (key, value) in &g.records {
        records.insert(key.as_slice(), value.as_slice())?;
    }
    // Tables created on first use.
    if !g.steps.is_empty() || !g.history.is_empty() {
        let mut steps = txn.open_table(STEPS)?;
        for ((rkey, name), value) in &g.steps {
            steps.insert((rkey.as_slice(), name.as_str()), value.as_slice())?;
        }
        let mut history = txn.open_table(HISTORY)?;
        for ((rkey, seq), value) in &g.history {
            history.insert((rkey.as_slice(), *seq), value.as_slice())?;
        }
    }
    Ok(())
}

/// Format 3's records, steps and log, under their slot keys in partition
/// [`BUILT_PARTITIONS`], in key order (the partition is sealed after).
fn write_partitioned(txn: &WriteTransaction, g: &Gathered) -> Result<(), redb::Error> {
    let p = BUILT_PARTITIONS;
    let mut records = txn.open_table(catalog::RECORDS)?;
    for (key, value) in &g.records {
        records.insert(slot_key(p, key).as_slice(), value.as_slice())?;
    }
    if !g.steps.is_empty() || !g.history.is_empty() {
        let mut steps = txn.open_table(catalog::STEPS)?;
        for ((rkey, name), value) in &g.steps {
            steps.insert(
                (slot_key(p, rkey).as_slice(), name.as_str()),
                value.as_slice(),
            )?;
        }
        let mut history = txn.open_table(catalog::HISTORY)?;
        for ((rkey, seq), value) in &g.history {
            history.insert((slot_key(p, rkey).as_slice(), *seq), value.as_slice())?;
        }
    }
    Ok(())
}

/// The built partition's claim time in its row: the salvage's wall-clock
/// time (the records' own expiry index entries expire them meanwhile; the
/// partition is drained no sooner than a TTL after the salvage).
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
