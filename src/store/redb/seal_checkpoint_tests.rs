//! The writer checkpoints at a seal of the hot partition once a quarter of
//! its checkpoint interval has passed (`writer.rs`,
//! `SEAL_CHECKPOINT_SHARE`), so a sealed partition's pages reach the file
//! once; and not at a seal that comes sooner.
//!
//! A checkpoint is seen in the journal: it starts the log again with an
//! anchor frame carrying the checkpoint's LSN, so the first frame of the
//! file names the last checkpoint.

use std::path::Path;
use std::sync::Arc;

use crate::clock::ManualClock;
use crate::envelope::Envelope;
use crate::key::IdempotencyKey;
use crate::policy::ExpiryPolicy;
use crate::store::config::StoreConfig;
use crate::store::record::StoredResponse;
use crate::store::Backend;

use super::journal::JournalStorage;
use super::partition::catalog::SealRule;
use super::test_requests::{claim, paid, R};
use super::{prepare_new_as, NewFormat, Opened, RedbStore, Sizes};

const T0: u64 = 1_796_000_000_000;
/// Keys a partition holds before it is sealed.
const KEYS: u64 = 8;
/// Response bytes of each completion: with its claim, about 3.5 KB of
/// journal a key, so `KEYS` keys take more than a quarter of the 64 KiB
/// interval a store with a [`RESERVE`] checkpoints at, and less than all
/// of it.
const BODY: usize = 3 << 10;
/// The recovery reserve: the writer checkpoints every half reserve
/// (`reserve::checkpoint_bytes`), 64 KiB here.
const RESERVE: u64 = 128 << 10;

/// A format-3 store on `path` with its journal, a 64 KiB checkpoint
/// interval, partitions of [`KEYS`] keys.
fn store(path: &Path) -> R<RedbStore> {
    let cfg = StoreConfig {
        ttl_ms: 24 * 60 * 60 * 1000,
        expiry: ExpiryPolicy::Forget,
        max_response_bytes: 1 << 20,
    };
    let opened = Opened::path(path, None)?;
    let cfg = prepare_new_as(&opened.db, path, cfg, true, NewFormat::Format3)?;
    Ok(RedbStore::start(
        opened,
        cfg,
        Arc::new(ManualClock::new(T0)),
        Sizes {
            max_batch: 16,
            max_group_bytes: 1 << 20,
            queue_capacity: 64,
            recovery_reserve: RESERVE,
            seal_rule: SealRule {
                interval_ms: 3_600_000,
                max_keys: KEYS,
            },
            migration: None,
        },
        None,
    )?)
}

/// Claims and completes `key` with a [`BODY`]-byte response.
fn done(store: &RedbStore, key: &IdempotencyKey, body: usize) -> R<()> {
    let claimed = claim(store, key)?;
    let mut request = paid(key, claimed.token);
    request.response = StoredResponse::new(Envelope::new(1, 200, vec![b'r'; body]), None);
    store.complete(request)?;
    Ok(())
}

/// The LSN of the journal's first frame: the anchor the last checkpoint
/// (or the open) wrote at the head of the log, over what was there
/// (`journal/mod.rs`: a frame header is its payload length, u32, its
/// unsynced count, u32, and its LSN, u64, little-endian).
fn last_checkpoint(path: &Path) -> R<u64> {
    let bytes = std::fs::read(JournalStorage::path_of(path))?;
    let head = bytes.get(4096..4112).ok_or("a journal without a frame")?;
    Ok(u64::from_le_bytes(head[8..16].try_into()?))
}

fn key(i: u64) -> R<IdempotencyKey> {
    Ok(IdempotencyKey::new("shop:pay", format!("order-{i}"))?)
}

#[test]
fn a_seal_after_a_quarter_interval_checkpoints() -> R<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("seal.redb");
    let store = store(&path)?;
    let opened_at = last_checkpoint(&path)?;
    for i in 0..KEYS {
        done(&store, &key(i)?, BODY)?;
    }
    assert_eq!(
        last_checkpoint(&path)?,
        opened_at,
        "no checkpoint before the seal (the keys took less than the interval)"
    );
    // The next claim seals the full partition: a checkpoint follows it.
    done(&store, &key(KEYS)?, BODY)?;
    let sealed_at = last_checkpoint(&path)?;
    assert!(
        sealed_at > opened_at,
        "the seal brought a checkpoint: {sealed_at} vs {opened_at}"
    );
    for i in 0..=KEYS {
        assert!(store.record(&key(i)?)?.is_some(), "key {i} kept");
    }
    Ok(())
}

#[test]
fn a_seal_soon_after_a_checkpoint_does_not() -> R<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("soon.redb");
    let store = store(&path)?;
    let opened_at = last_checkpoint(&path)?;
    // Small responses: the partition fills with far less than a quarter
    // of the interval, and its seal brings no checkpoint.
    for i in 0..=KEYS {
        done(&store, &key(i)?, 16)?;
    }
    assert_eq!(last_checkpoint(&path)?, opened_at);
    Ok(())
}
