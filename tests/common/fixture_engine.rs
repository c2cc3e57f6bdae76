//! The engine settings, key and fingerprints the committed fixtures
//! (`tests/fixtures/format*.redb`) were written with, shared by the tests
//! that open them: a fixture answers as written only under the same TTL,
//! tombstone policy and scope.

#![allow(dead_code)] // each test file uses what it needs

use std::path::{Path, PathBuf};
use std::time::Duration;

use idempotency::{Engine, EngineBuilder, ExpiryPolicy, Fingerprint, IdempotencyKey, ManualClock};

/// One day.
pub const DAY: Duration = Duration::from_secs(24 * 60 * 60);

/// An engine builder as the fixtures' writers had it: `clock`, no
/// sweeper, a 30-day TTL, a 30 s lease, tombstones kept 10 days.
pub fn builder(clock: &ManualClock) -> EngineBuilder {
    Engine::builder()
        .clock(clock.clone())
        .sweep_interval(None)
        .ttl(30 * DAY)
        .lease(Duration::from_secs(30))
        .expiry_policy(ExpiryPolicy::Tombstone { keep: 10 * DAY })
}

/// The key `k` in the fixtures' scope, `shop:pay`.
pub fn key(k: &str) -> Result<IdempotencyKey, idempotency::Error> {
    IdempotencyKey::new("shop:pay", k)
}

/// The fingerprint of a payment of `amount` EUR.
pub fn fp(amount: u32) -> Result<Fingerprint, idempotency::FingerprintError> {
    Fingerprint::of_json(
        format!(r#"{{"amount":{amount},"currency":"EUR"}}"#).as_bytes(),
        &[],
    )
}

/// The journal's header length and the bytes of a frame before its
/// payload (`src/store/redb/journal.rs`).
pub const JOURNAL_HEADER: usize = 4096;
/// See [`JOURNAL_HEADER`].
pub const FRAME_HEADER: usize = 32;

/// The journal's bytes up to the end of its frame chain from the first
/// frame (`journal.rs`: each frame `len u32 · unsynced u32 · LSN u64 ·
/// checksum 16 · payload`, padded to 8; LSNs consecutive): the zeros the
/// writer preallocates, and older cycles' frames beyond the chain, carry
/// nothing a reader needs.
pub fn journal_chain(journal: &[u8]) -> Result<&[u8], Box<dyn std::error::Error>> {
    let mut pos = JOURNAL_HEADER;
    let mut prev: Option<u64> = None;
    while let Some(head) = journal.get(pos..pos + FRAME_HEADER) {
        let len = u32::from_le_bytes(head[0..4].try_into()?) as usize;
        let lsn = u64::from_le_bytes(head[8..16].try_into()?);
        if head.iter().all(|&b| b == 0) || prev.is_some_and(|p| lsn != p + 1) {
            break;
        }
        let end = pos + (FRAME_HEADER + len).div_ceil(8) * 8;
        if end > journal.len() {
            break;
        }
        prev = Some(lsn);
        pos = end;
    }
    if prev.is_none() {
        return Err("the journal holds no frame".into());
    }
    Ok(&journal[..pos])
}

/// The committed fixture file `name` in `tests/fixtures/`.
pub fn fixture_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A fresh copy in `dir` of fixture `name` and its journal
/// (`name.journal`); returns the copy's path.
pub fn copy_with_journal(name: &str, dir: &Path) -> Result<PathBuf, Box<dyn std::error::Error>> {
    let path = dir.join(name);
    std::fs::copy(fixture_file(name), &path)?;
    let journal = format!("{name}.journal");
    std::fs::copy(fixture_file(&journal), dir.join(journal))?;
    Ok(path)
}
