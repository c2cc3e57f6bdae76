//! The write-ahead journal in front of the redb file (part of format 2).
//!
//! Each group commit appends ONE frame holding every change it makes to the
//! engine's tables, with one `fdatasync`, and only then commits to redb
//! with `Durability::None` (visible to readers at once, made durable later).
//! Every so often a checkpoint commits to redb with
//! `Durability::Immediate`, which makes every earlier commit durable, and
//! the journal starts again from its first frame. On open, the frames after
//! the last checkpoint are applied again. So a commit costs one sequential
//! append and one sync, instead of writing every B-tree page it touched.
//!
//! # File layout (`<database file>.journal`)
//!
//! ```text
//! 0      header, 4096 bytes:
//!          magic "idempotency-jrnl" (16) · version u32 LE (= 1) · 0u32 ·
//!          journal id (16, also in the database's meta table) ·
//!          first 8 bytes of BLAKE3 of the 40 bytes before · zeros
//! 4096   frames, each 8-byte aligned:
//!          payload length u32 LE · unsynced u32 LE · LSN u64 LE ·
//!          checksum (first 16 bytes of BLAKE3 of journal id, LSN,
//!          unsynced when not 0, length, payload) ·
//!          payload (postcard of `Frame`) · zero padding to 8
//! ```
//!
//! `unsynced` is how many frames before this one were not yet known to be
//! durable when it was written (the writer appends the next frames while
//! the syncer thread syncs earlier ones): every frame up to
//! `LSN - 1 - unsynced` was. Version 1 journals (each frame synced before
//! the next was written) always hold 0 there and read the same way.
//!
//! LSNs (log sequence numbers) grow by one per frame, forever. The database
//! stores the LSN its state includes (`journal_lsn` in the meta table). A
//! checkpoint does not truncate the file: new frames overwrite old ones
//! from offset 4096, so appends rarely grow the file and a sync rarely
//! changes its metadata. Reading stops at the first frame that does not
//! check or whose LSN does not follow its predecessor's: the end of the
//! log. Frames of earlier cycles have smaller LSNs, so they are never taken
//! for new ones.
//!
//! A frame that fails its checksum is a torn write (the end of the log)
//! unless a valid frame further on, with a later, still needed LSN, says
//! that the bad frame was durable before it was written (its `unsynced`):
//! then the journal is damaged in the middle, and opening fails with an
//! error naming the file and the offset. The search for such a frame
//! checksums only offsets where a frame with the LSN it reads can lie:
//! every frame is at least 40 bytes, so frame `C + k` of the cycle that
//! starts with the anchor of `C` lies at least `k - 1` of those past the
//! header (`reader::can_lie_at`). A power cut during a sync may
//! leave any of the frames that sync covered on disk and others not; none
//! of them was acknowledged (callers hear nothing before the sync
//! returns), and the first one missing is the end of the log. Damage to
//! one of the last frames before a crash, which no later frame vouches
//! for, cannot be told from that and is taken for a torn end too. Such a
//! dropped tail is named, not dropped silently: when the bytes where the
//! chain ends carry the header of the next LSN but do not check, or valid
//! later frames are dropped with it, the scan returns it
//! ([`reader::TornFrame`]: offset, LSN, the later LSNs) and logs a
//! warning. A damaged LSN field there reads as the plain end of the log.
//!
//! Why not a crate: `okaywal`, the one maintained-looking Rust WAL, says in
//! its README that it must not be used in production and that its format is
//! unstable, and its checkpointer runs on its own thread, which would have
//! to wait for our writer's redb lock while our writer waits for its log.
//! This folder is small, and its format is documented here.
//!
//! # Files
//!
//! - `frame.rs`: what a frame holds ([`Frame`], [`Change`]) and its
//!   on-disk framing (header, checksum, padding);
//! - `delta.rs`: a record rewrite as the fields it changed (format 3's
//!   `Change::PutRecordDelta`);
//! - `derived.rs`: format 3's record changes whose index entries replay
//!   derives, turned back into the plain changes the live path made;
//! - `storage.rs`: where the bytes live ([`JournalStorage`]);
//! - `writer.rs`: appending frames, syncing them ([`JournalSync`]) and the
//!   checkpoint anchor;
//! - `reader.rs`: reading the chain of frames, a torn end told from damage;
//! - `recovery.rs`: opening a journal and scanning it for read-only views;
//! - `error.rs`: [`JournalError`].

mod delta;
mod derived;
mod error;
mod frame;
#[cfg(any(test, fuzzing))]
pub(in crate::store::redb) mod fuzz_hook;
mod reader;
mod recovery;
mod salvage;
mod storage;
mod writer;

#[cfg(test)]
mod tests;

pub(super) use self::delta::{RecordDelta, Unlogged};
pub(super) use self::derived::{base_sum, expand};
pub(crate) use self::error::JournalError;
pub(super) use self::frame::{Change, Frame, IndexTable};
pub(super) use self::reader::Scanned;
pub(super) use self::recovery::Recovered;
pub(super) use self::salvage::salvage_frames;
pub(crate) use self::storage::JournalStorage;
pub(super) use self::writer::JournalSync;

/// Bytes before the first frame.
pub(super) const HEADER_LEN: u64 = 4096;
pub(super) const MAGIC: &[u8; 16] = b"idempotency-jrnl";
pub(super) const VERSION: u32 = 2;
/// The oldest journal version this build reads (version 1 frames always
/// have `unsynced` 0).
pub(super) const OLDEST_VERSION: u32 = 1;

/// The journal, owned by the writer thread.
pub(in crate::store::redb) struct Journal {
    storage: JournalStorage,
    id: [u8; 16],
    /// Where the next frame goes.
    write_at: u64,
    /// The file's length.
    len: u64,
    /// LSN of the last frame appended (or of the state recovered).
    last_lsn: u64,
    /// LSN the database durably holds.
    checkpointed_lsn: u64,
    /// A failed append leaves the file in an unknown state: no more.
    broken: bool,
    /// The most the file grows by at a time (see `Journal::set_grow_bytes`).
    grow_bytes: u64,
    /// Bytes of work the frames since the last checkpoint stand for beyond
    /// their own bytes (a merge's copy step is one small frame that a
    /// recovery replays by copying its records again; see
    /// `Journal::charge`).
    charged: u64,
    buf: Vec<u8>,
    /// The bytes of the last page the frames reach into, from the page's
    /// start up to `write_at` (shorter than a page; empty when `write_at`
    /// is page-aligned). Each append writes whole pages from there, so the
    /// kernel never reads a page from the disk to merge a partial write
    /// into it (see `Journal::write_at_end`).
    tail: Vec<u8>,
}

/// A fresh journal id: unique enough to tell one database's journal from
/// another's (time, process, address).
pub(in crate::store::redb) fn new_id(seed: &[u8]) -> [u8; 16] {
    let mut h = blake3::Hasher::new();
    h.update(seed);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.update(&now.to_le_bytes());
    h.update(&std::process::id().to_le_bytes());
    let local = 0_u8;
    h.update(&(std::ptr::addr_of!(local) as usize).to_le_bytes());
    let mut out = [0_u8; 16];
    out.copy_from_slice(&h.finalize().as_bytes()[..16]);
    out
}
