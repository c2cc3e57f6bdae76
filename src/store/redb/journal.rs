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
//! error naming the file and the offset. A power cut during a sync may
//! leave any of the frames that sync covered on disk and others not; none
//! of them was acknowledged (callers hear nothing before the sync
//! returns), and the first one missing is the end of the log. Damage to
//! one of the last frames before a crash, which no later frame vouches
//! for, cannot be told from that and is taken for a torn end too.
//!
//! Why not a crate: `okaywal`, the one maintained-looking Rust WAL, says in
//! its README that it must not be used in production and that its format is
//! unstable, and its checkpointer runs on its own thread, which would have
//! to wait for our writer's redb lock while our writer waits for its log.
//! This file is small, and its format is documented here.

use std::fmt;
use std::io;

use redb::StorageBackend;
use serde::{Deserialize, Serialize};

/// Bytes before the first frame.
pub(super) const HEADER_LEN: u64 = 4096;
const MAGIC: &[u8; 16] = b"idempotency-jrnl";
const VERSION: u32 = 2;
/// The oldest journal version this build reads (version 1 frames always
/// have `unsynced` 0).
const OLDEST_VERSION: u32 = 1;
/// Bytes of a frame before its payload.
const FRAME_HEADER: usize = 32;
/// The file grows by at least this much (zeros) when a frame needs room.
const GROW_BYTES: u64 = 4 << 20;
/// Largest payload a frame may claim (its length field is a u32); the
/// writer refuses a larger frame, so the reader never meets a valid one.
const MAX_PAYLOAD: u64 = u32::MAX as u64;
/// A journal file larger than this is damage, not a journal: the writer
/// starts over after every checkpoint (32 MiB), and one frame holds at
/// most one batch.
const MAX_FILE: u64 = 16 << 30;

/// One change to an engine table, as a frame records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum Change {
    /// `idempotency.records`: record key → encoded record.
    PutRecord {
        #[serde(with = "crate::store::wire::byte_buf")]
        key: Vec<u8>,
        #[serde(with = "crate::store::wire::byte_buf")]
        value: Vec<u8>,
    },
    DelRecord {
        #[serde(with = "crate::store::wire::byte_buf")]
        key: Vec<u8>,
    },
    /// An index table (see [`IndexTable`]): `(instant ms, record key)`.
    PutIndex {
        index: IndexTable,
        at: u64,
        #[serde(with = "crate::store::wire::byte_buf")]
        key: Vec<u8>,
    },
    DelIndex {
        index: IndexTable,
        at: u64,
        #[serde(with = "crate::store::wire::byte_buf")]
        key: Vec<u8>,
    },
    /// `idempotency.outbox`: sequence number → encoded message.
    PutOutbox {
        seq: u64,
        #[serde(with = "crate::store::wire::byte_buf")]
        value: Vec<u8>,
    },
    DelOutbox {
        seq: u64,
    },
    /// `idempotency.entities`: entity id → encoded state.
    PutEntity {
        id: String,
        #[serde(with = "crate::store::wire::byte_buf")]
        value: Vec<u8>,
    },
}

impl Change {
    /// Bytes of the keys and values it carries (what makes a frame large).
    pub(super) fn size_bytes(&self) -> usize {
        match self {
            Change::PutRecord { key, value } => key.len().saturating_add(value.len()),
            Change::DelRecord { key }
            | Change::PutIndex { key, .. }
            | Change::DelIndex { key, .. } => key.len(),
            Change::PutOutbox { value, .. } => value.len(),
            Change::DelOutbox { .. } => 0,
            Change::PutEntity { id, value } => id.len().saturating_add(value.len()),
        }
    }
}

/// The three index tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum IndexTable {
    Leases,
    Recovery,
    Expiry,
}

/// What one group commit changed: its changes in order, and the counters
/// after it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Frame {
    pub(super) next_token: u64,
    pub(super) next_outbox: u64,
    pub(super) changes: Vec<Change>,
}

/// Why a journal cannot be used. Every variant names the file.
#[derive(Debug)]
pub(crate) enum JournalError {
    Io {
        file: String,
        source: io::Error,
    },
    /// Not a journal (wrong magic), or a version this build cannot read.
    NotAJournal {
        file: String,
        detail: String,
    },
    /// The journal belongs to another database file.
    OtherDatabase {
        file: String,
    },
    /// Damage before the end of the log.
    Corrupt {
        file: String,
        offset: u64,
        detail: String,
    },
}

impl fmt::Display for JournalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JournalError::Io { file, source } => write!(f, "journal {file}: {source}"),
            JournalError::NotAJournal { file, detail } => {
                write!(f, "{file} is not a journal this build reads: {detail}")
            }
            JournalError::OtherDatabase { file } => write!(
                f,
                "journal {file} belongs to another database file (its journal id differs)"
            ),
            JournalError::Corrupt {
                file,
                offset,
                detail,
            } => write!(
                f,
                "journal {file} is damaged at byte offset {offset}: {detail}"
            ),
        }
    }
}

impl std::error::Error for JournalError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            JournalError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Where the journal's bytes live, and its name for messages.
pub(crate) struct JournalStorage {
    pub(crate) backend: std::sync::Arc<dyn StorageBackend>,
    pub(crate) name: String,
}

impl fmt::Debug for JournalStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JournalStorage")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl JournalStorage {
    /// The journal file at `path` (see [`JournalStorage::path_of`]),
    /// created if missing.
    pub(crate) fn beside_path(path: &std::path::Path) -> io::Result<JournalStorage> {
        let existed = path.exists();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        if !existed {
            // The new name must survive a power loss too.
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::File::open(dir)?.sync_all()?;
            }
        }
        Ok(JournalStorage {
            backend: std::sync::Arc::new(PlainFile(file)),
            name: path.display().to_string(),
        })
    }

    /// A journal file opened for reading only.
    pub(crate) fn read_only(file: std::fs::File, path: &std::path::Path) -> JournalStorage {
        JournalStorage {
            backend: std::sync::Arc::new(PlainFile(file)),
            name: path.display().to_string(),
        }
    }

    /// The journal path of the database file `db`: beside the file itself
    /// (links resolved), so every name of one file finds one journal.
    pub(crate) fn path_of(db: &std::path::Path) -> std::path::PathBuf {
        let real = std::fs::canonicalize(db).unwrap_or_else(|_| db.to_path_buf());
        let mut name = real.into_os_string();
        name.push(".journal");
        std::path::PathBuf::from(name)
    }
}

/// A plain file as a storage backend (positioned reads and writes).
#[derive(Debug)]
struct PlainFile(std::fs::File);

impl StorageBackend for PlainFile {
    fn len(&self) -> io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&self.0, out, offset)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(&self.0, data, offset)
    }
}

/// The journal, owned by the writer thread.
pub(super) struct Journal {
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
    buf: Vec<u8>,
}

/// The syncing side of a journal: `fdatasync` on its file, from the
/// syncer thread, while the writer appends the next frames.
#[derive(Clone)]
pub(super) struct JournalSync {
    backend: std::sync::Arc<dyn StorageBackend>,
    name: String,
}

impl JournalSync {
    /// Makes every frame appended before the call durable.
    pub(super) fn sync(&self) -> Result<(), JournalError> {
        self.backend.sync_data().map_err(|source| JournalError::Io {
            file: self.name.clone(),
            source,
        })
    }
}

/// Reads frames out of a journal's bytes.
struct Reader<'a> {
    name: &'a str,
    id: [u8; 16],
    checkpointed_lsn: u64,
}

impl Reader<'_> {
    fn check_header(&self, bytes: &[u8]) -> Result<(), JournalError> {
        let file = || self.name.to_string();
        let not = |detail: &str| JournalError::NotAJournal {
            file: file(),
            detail: detail.to_string(),
        };
        if bytes.get(..16) != Some(MAGIC.as_slice()) {
            return Err(not("its first bytes are not the journal magic"));
        }
        let head = bytes.get(..48).ok_or_else(|| not("short header"))?;
        if blake3::hash(&head[..40]).as_bytes()[..8] != head[40..48] {
            return Err(JournalError::Corrupt {
                file: file(),
                offset: 0,
                detail: "the header's checksum does not match".into(),
            });
        }
        let version = u32::from_le_bytes([head[16], head[17], head[18], head[19]]);
        if !(OLDEST_VERSION..=VERSION).contains(&version) {
            return Err(not(&format!(
                "journal version {version} (this build reads {VERSION})"
            )));
        }
        if head[24..40] != self.id {
            return Err(JournalError::OtherDatabase { file: file() });
        }
        Ok(())
    }

    /// The chain of frames from the first one; those above the checkpoint.
    fn read_frames(&self, bytes: &[u8]) -> Result<Scanned, JournalError> {
        let mut out = Vec::new();
        let mut anchored = false;
        let mut pos = HEADER_LEN;
        let mut prev: Option<u64> = None;
        while let Some(FrameAt {
            lsn, payload, next, ..
        }) = self.frame_at(bytes, pos)
        {
            if prev.is_some_and(|p| lsn != p + 1) {
                break;
            }
            anchored |= lsn == self.checkpointed_lsn;
            if lsn > self.checkpointed_lsn {
                let expected = out
                    .last()
                    .map_or(self.checkpointed_lsn + 1, |(l, _): &(u64, Frame)| l + 1);
                if lsn != expected {
                    return Err(JournalError::Corrupt {
                        file: self.name.to_string(),
                        offset: pos,
                        detail: format!(
                            "frame {lsn} follows frame {} the database holds: frames are missing",
                            expected - 1
                        ),
                    });
                }
                let frame: Frame =
                    postcard::from_bytes(payload).map_err(|e| JournalError::Corrupt {
                        file: self.name.to_string(),
                        offset: pos,
                        detail: format!("frame {lsn} checks but does not decode: {e}"),
                    })?;
                out.push((lsn, frame));
            }
            prev = Some(lsn);
            pos = next;
        }
        // The end of the log, or damage in its middle: a valid, still
        // needed frame further on that was written after the missing one
        // was durable means the latter. One written while the missing one
        // was still being synced means a power cut tore that sync: none
        // of them was acknowledged.
        let needed_after = prev.map_or(self.checkpointed_lsn, |p| p.max(self.checkpointed_lsn));
        let mut probe = pos.saturating_add(8);
        while probe + FRAME_HEADER as u64 <= bytes.len() as u64 {
            // Only a frame whose LSN could be a needed one is worth its
            // checksum (most offsets are zeros or inside other frames).
            let at = usize::try_from(probe).unwrap_or(usize::MAX);
            let lsn = bytes
                .get(at + 8..at + 16)
                .and_then(|b| <[u8; 8]>::try_from(b).ok())
                .map_or(0, u64::from_le_bytes);
            let plausible = lsn > needed_after && lsn - needed_after < (1 << 32);
            if let Some(found) = plausible.then(|| self.frame_at(bytes, probe)).flatten() {
                if found.lsn > needed_after && found.durable_before > needed_after {
                    let lsn = found.lsn;
                    return Err(JournalError::Corrupt {
                        file: self.name.to_string(),
                        offset: pos,
                        detail: format!(
                            "the frame here does not check, but frame {lsn} at offset {probe} does, \
                             and was written after frame {} was durable: the journal is damaged, \
                             not just cut short",
                            needed_after + 1
                        ),
                    });
                }
            }
            probe += 8;
        }
        Ok(Scanned {
            frames: out,
            anchored,
        })
    }

    /// The valid frame at `pos`.
    fn frame_at<'b>(&self, bytes: &'b [u8], pos: u64) -> Option<FrameAt<'b>> {
        let start = usize::try_from(pos).ok()?;
        let head = bytes.get(start..start.checked_add(FRAME_HEADER)?)?;
        let len = u64::from(u32::from_le_bytes([head[0], head[1], head[2], head[3]]));
        let unsynced = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        let lsn = u64::from_le_bytes(head[8..16].try_into().ok()?);
        if len > MAX_PAYLOAD {
            return None;
        }
        let body_start = start + FRAME_HEADER;
        let payload = bytes.get(body_start..body_start.checked_add(usize::try_from(len).ok()?)?)?;
        if checksum(&self.id, lsn, unsynced, payload) != head[16..32] {
            return None;
        }
        Some(FrameAt {
            lsn,
            durable_before: lsn.saturating_sub(u64::from(unsynced).saturating_add(1)),
            payload,
            next: pos + frame_len(len),
        })
    }
}

/// A frame that checks, as found in the file.
struct FrameAt<'b> {
    lsn: u64,
    /// Every frame up to this LSN was durable when this one was written.
    durable_before: u64,
    payload: &'b [u8],
    /// The offset of the next frame.
    next: u64,
}

/// A journal read at open: the frames the database does not hold yet.
pub(super) struct Recovered {
    pub(super) journal: Journal,
    pub(super) frames: Vec<(u64, Frame)>,
    /// Whether the log holds the frame of the database's checkpoint (the
    /// anchor written after every checkpoint): without it, frames after
    /// the checkpoint may have been lost (a journal deleted, emptied or
    /// replaced by an older copy).
    pub(super) anchored: bool,
}

/// What a scan of the log found.
pub(super) struct Scanned {
    pub(super) frames: Vec<(u64, Frame)>,
    pub(super) anchored: bool,
}

impl Journal {
    /// Reads the journal in `storage`, which must carry `id` (an empty or
    /// too short file gets a fresh header). Returns the frames with an LSN
    /// above `checkpointed_lsn`, in order. The returned journal appends after
    /// them only once [`Journal::checkpointed`] has been called.
    pub(super) fn recover(
        storage: JournalStorage,
        id: [u8; 16],
        checkpointed_lsn: u64,
    ) -> Result<Recovered, JournalError> {
        let io_err = |source| JournalError::Io {
            file: storage.name.clone(),
            source,
        };
        let len = storage.backend.len().map_err(io_err)?;
        let mut journal = Journal {
            id,
            write_at: HEADER_LEN,
            len,
            last_lsn: checkpointed_lsn,
            checkpointed_lsn,
            broken: false,
            buf: Vec::new(),
            storage,
        };
        if unwritten(&journal.storage, len).map_err(|source| JournalError::Io {
            file: journal.storage.name.clone(),
            source,
        })? {
            // A header is synced before any frame is written: a shorter
            // file, or one whose header was never written, never held a
            // frame.
            journal.write_header().map_err(|source| JournalError::Io {
                file: journal.storage.name.clone(),
                source,
            })?;
            return Ok(Recovered {
                journal,
                frames: Vec::new(),
                anchored: false,
            });
        }
        let Scanned { frames, anchored } = journal.read_all()?;
        if let Some((lsn, _)) = frames.last() {
            journal.last_lsn = *lsn;
        }
        Ok(Recovered {
            journal,
            frames,
            anchored,
        })
    }

    /// The frames above `checkpointed_lsn` in `storage`, without writing
    /// anything (for read-only views).
    pub(super) fn scan(
        storage: &JournalStorage,
        id: [u8; 16],
        checkpointed_lsn: u64,
    ) -> Result<Scanned, JournalError> {
        let io_err = |source| JournalError::Io {
            file: storage.name.clone(),
            source,
        };
        let len = storage.backend.len().map_err(io_err)?;
        if unwritten(storage, len).map_err(io_err)? {
            return Ok(Scanned {
                frames: Vec::new(),
                anchored: false,
            });
        }
        if len > MAX_FILE {
            return Err(JournalError::Corrupt {
                file: storage.name.clone(),
                offset: len,
                detail: format!("{len} bytes is larger than any journal this engine writes"),
            });
        }
        // A view over the same storage, borrowed: reuse the reader.
        let reader = Reader {
            name: &storage.name,
            id,
            checkpointed_lsn,
        };
        let mut bytes = Vec::new();
        let size = usize::try_from(len).unwrap_or(usize::MAX);
        bytes.try_reserve_exact(size).map_err(|_| {
            io_err(io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("no memory to read {len} bytes of journal"),
            ))
        })?;
        bytes.resize(size, 0);
        storage.backend.read(0, &mut bytes).map_err(io_err)?;
        reader.check_header(&bytes)?;
        reader.read_frames(&bytes)
    }

    fn read_all(&self) -> Result<Scanned, JournalError> {
        Journal::scan(&self.storage, self.id, self.checkpointed_lsn)
    }

    /// The LSN of the last frame appended.
    pub(super) fn last_lsn(&self) -> u64 {
        self.last_lsn
    }

    /// Whether frames were appended since the last checkpoint.
    pub(super) fn dirty(&self) -> bool {
        self.last_lsn != self.checkpointed_lsn
    }

    /// Bytes of frames since the last checkpoint.
    pub(super) fn since_checkpoint(&self) -> u64 {
        self.write_at - HEADER_LEN
    }

    /// Appends `frame` and syncs it; returns its LSN. After an error the
    /// journal refuses every later append (the file's state is unknown).
    #[cfg(test)]
    pub(super) fn append(&mut self, frame: &Frame) -> Result<u64, JournalError> {
        let synced = self.last_lsn;
        let lsn = self.append_unsynced(frame, synced)?;
        self.sync().map_err(|e| self.io_error(e))?;
        Ok(lsn)
    }

    /// Appends `frame` without syncing it; returns its LSN. `synced`: every
    /// frame up to this LSN is known to be durable (the frame records it,
    /// see the module docs). The frame is durable once a later
    /// [`JournalSync::sync`] returns. After an error the journal refuses
    /// every later append (the file's state is unknown).
    pub(super) fn append_unsynced(
        &mut self,
        frame: &Frame,
        synced: u64,
    ) -> Result<u64, JournalError> {
        let lsn = self.last_lsn + 1;
        let unsynced =
            u32::try_from(lsn.saturating_sub(synced.saturating_add(1))).unwrap_or(u32::MAX);
        self.write_frame(lsn, frame, unsynced, false)?;
        self.last_lsn = lsn;
        Ok(lsn)
    }

    /// What the syncer thread calls to make appended frames durable.
    pub(super) fn sync_handle(&self) -> JournalSync {
        JournalSync {
            backend: self.storage.backend.clone(),
            name: self.storage.name.clone(),
        }
    }

    #[cfg(test)]
    fn sync(&self) -> io::Result<()> {
        self.storage.backend.sync_data()
    }

    /// Writes `frame` as `lsn` at the write position, and syncs it if
    /// `sync`.
    fn write_frame(
        &mut self,
        lsn: u64,
        frame: &Frame,
        unsynced: u32,
        sync: bool,
    ) -> Result<(), JournalError> {
        if self.broken {
            return Err(self.io_error(io::Error::other(
                "an earlier write failed; the journal must be reopened",
            )));
        }
        self.buf.clear();
        self.buf.resize(FRAME_HEADER, 0);
        let encoded = postcard::to_extend(frame, std::mem::take(&mut self.buf));
        self.buf = match encoded {
            Ok(buf) => buf,
            Err(e) => return Err(self.io_error(io::Error::other(e.to_string()))),
        };
        let len = (self.buf.len() - FRAME_HEADER) as u64;
        let sum = checksum(&self.id, lsn, unsynced, &self.buf[FRAME_HEADER..]);
        let Ok(len32) = u32::try_from(len) else {
            // Refused before anything is written: the batch fails, the
            // journal stays usable.
            return Err(self.io_error(io::Error::other(format!(
                "a batch of {len} bytes is larger than a journal frame holds (4 GiB)"
            ))));
        };
        self.buf[0..4].copy_from_slice(&len32.to_le_bytes());
        self.buf[4..8].copy_from_slice(&unsynced.to_le_bytes());
        self.buf[8..16].copy_from_slice(&lsn.to_le_bytes());
        self.buf[16..32].copy_from_slice(&sum);
        let total = frame_len(len);
        self.buf
            .resize(usize::try_from(total).unwrap_or(usize::MAX), 0);
        let result = self.write_at_end(total, sync);
        if let Err(e) = result {
            self.broken = true;
            return Err(self.io_error(e));
        }
        self.write_at += total;
        Ok(())
    }

    fn write_at_end(&mut self, total: u64, sync: bool) -> io::Result<()> {
        let end = self.write_at + total;
        if end > self.len {
            // Grow with zeros written now, so later appends overwrite
            // allocated blocks and their syncs rarely touch metadata.
            let new_len = end.max(self.len + GROW_BYTES);
            let zeros = vec![0_u8; usize::try_from(new_len - self.len).unwrap_or(usize::MAX)];
            self.storage.backend.set_len(new_len)?;
            self.storage.backend.write(self.len, &zeros)?;
            self.len = new_len;
        }
        self.storage.backend.write(self.write_at, &self.buf)?;
        if sync {
            self.storage.backend.sync_data()?;
        }
        Ok(())
    }

    /// The database now durably holds everything up to [`Self::last_lsn`]:
    /// the log starts again with an anchor, an empty frame carrying that
    /// LSN, so a later open can tell this journal from one that lost frames
    /// (see [`Recovered::anchored`]).
    pub(super) fn checkpointed(&mut self) -> Result<(), JournalError> {
        self.checkpointed_lsn = self.last_lsn;
        self.write_at = HEADER_LEN;
        let anchor = Frame {
            next_token: 0,
            next_outbox: 0,
            changes: Vec::new(),
        };
        self.write_frame(self.checkpointed_lsn, &anchor, 0, true)
    }

    fn write_header(&mut self) -> io::Result<()> {
        let mut head = vec![0_u8; usize::try_from(HEADER_LEN).unwrap_or(4096)];
        head[..16].copy_from_slice(MAGIC);
        head[16..20].copy_from_slice(&VERSION.to_le_bytes());
        head[24..40].copy_from_slice(&self.id);
        let sum = blake3::hash(&head[..40]);
        head[40..48].copy_from_slice(&sum.as_bytes()[..8]);
        if self.len < HEADER_LEN {
            self.storage.backend.set_len(HEADER_LEN)?;
        }
        self.storage.backend.write(0, &head)?;
        self.storage.backend.sync_data()?;
        self.len = self.len.max(HEADER_LEN);
        Ok(())
    }

    fn io_error(&self, source: io::Error) -> JournalError {
        JournalError::Io {
            file: self.storage.name.clone(),
            source,
        }
    }
}

/// Whether the journal in `storage` (`len` bytes) never had its header
/// written: shorter than a header, or exactly a header's length and all
/// zeros. `write_header` sizes the file before it writes the header, so a
/// full disk (or a crash) in between leaves the latter; a frame always
/// lies beyond the header, so such a file never held one. (Whether the
/// database may do without frames is `recover.rs`'s to decide, as for a
/// missing journal.)
fn unwritten(storage: &JournalStorage, len: u64) -> io::Result<bool> {
    if len != HEADER_LEN {
        return Ok(len < HEADER_LEN);
    }
    let mut head = vec![0_u8; usize::try_from(HEADER_LEN).unwrap_or(4096)];
    storage.backend.read(0, &mut head)?;
    Ok(head.iter().all(|&b| b == 0))
}

/// A frame's size on disk: header, payload, padding to 8 bytes.
fn frame_len(payload: u64) -> u64 {
    (FRAME_HEADER as u64 + payload).div_ceil(8) * 8
}

fn checksum(id: &[u8; 16], lsn: u64, unsynced: u32, payload: &[u8]) -> [u8; 16] {
    let mut h = blake3::Hasher::new();
    h.update(id);
    h.update(&lsn.to_le_bytes());
    // Hashed only when set, so version 1 frames (always 0) check the same.
    if unsynced != 0 {
        h.update(&unsynced.to_le_bytes());
    }
    h.update(&(payload.len() as u64).to_le_bytes());
    h.update(payload);
    let mut out = [0_u8; 16];
    out.copy_from_slice(&h.finalize().as_bytes()[..16]);
    out
}

/// A fresh journal id: unique enough to tell one database's journal from
/// another's (time, process, address).
pub(super) fn new_id(seed: &[u8]) -> [u8; 16] {
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

#[cfg(test)]
mod tests {
    use super::*;
    use redb::backends::InMemoryBackend;
    use std::sync::Arc;

    /// Shared bytes, so a test can reopen what a journal wrote.
    #[derive(Debug, Clone)]
    struct Shared(Arc<InMemoryBackend>);

    impl StorageBackend for Shared {
        fn len(&self) -> io::Result<u64> {
            self.0.len()
        }
        fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
            self.0.read(offset, out)
        }
        fn set_len(&self, len: u64) -> io::Result<()> {
            self.0.set_len(len)
        }
        fn sync_data(&self) -> io::Result<()> {
            self.0.sync_data()
        }
        fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
            self.0.write(offset, data)
        }
    }

    const ID: [u8; 16] = [7; 16];

    fn storage(shared: &Shared) -> JournalStorage {
        JournalStorage {
            backend: std::sync::Arc::new(shared.clone()),
            name: "test.journal".into(),
        }
    }

    fn frame(n: u64) -> Frame {
        Frame {
            next_token: n,
            next_outbox: 1,
            changes: vec![Change::PutRecord {
                key: n.to_le_bytes().to_vec(),
                value: vec![n as u8; 100 + n as usize],
            }],
        }
    }

    /// Writes frames 1..=n to a fresh journal; returns the shared bytes and
    /// each frame's offset.
    fn written(n: u64) -> (Shared, Vec<u64>) {
        let shared = Shared(Arc::new(InMemoryBackend::new()));
        let mut j = Journal::recover(storage(&shared), ID, 0).unwrap().journal;
        let mut offsets = Vec::new();
        for i in 1..=n {
            offsets.push(j.write_at);
            assert_eq!(j.append(&frame(i)).unwrap(), i);
        }
        (shared, offsets)
    }

    fn lsns(r: &Recovered) -> Vec<u64> {
        r.frames.iter().map(|(l, _)| *l).collect()
    }

    #[test]
    fn frames_after_the_checkpoint_come_back_in_order() {
        let (shared, _) = written(5);
        let r = Journal::recover(storage(&shared), ID, 2).unwrap();
        assert_eq!(lsns(&r), vec![3, 4, 5]);
        assert_eq!(r.frames[0].1, frame(3));
        assert_eq!(r.journal.last_lsn(), 5);
    }

    #[test]
    fn a_torn_last_frame_is_the_end_of_the_log() {
        let (shared, offsets) = written(4);
        // Tear frame 4: its last bytes never made it.
        let end = offsets[3] + 40;
        shared.write(end, &[0xAB; 16]).unwrap();
        let r = Journal::recover(storage(&shared), ID, 0).unwrap();
        assert_eq!(lsns(&r), vec![1, 2, 3]);
    }

    #[test]
    fn a_damaged_middle_frame_is_an_error_naming_file_and_offset() {
        let (shared, offsets) = written(4);
        shared.write(offsets[1] + 40, &[0xAB]).unwrap();
        match Journal::recover(storage(&shared), ID, 0) {
            Err(JournalError::Corrupt { file, offset, .. }) => {
                assert_eq!(file, "test.journal");
                assert_eq!(offset, offsets[1]);
            }
            Err(e) => panic!("wrong error: {e}"),
            Ok(r) => panic!("damage skipped: {:?}", lsns(&r)),
        }
        // Damage before the checkpoint is harmless: those frames are not
        // needed any more.
        let (shared, offsets) = written(4);
        shared.write(offsets[3] + 40, &[0xAB]).unwrap();
        let r = Journal::recover(storage(&shared), ID, 4).unwrap();
        assert!(r.frames.is_empty());
    }

    /// The pipelined writer appends up to 16 frames (`append_unsynced`)
    /// before the syncer's one `fdatasync` covers them all, and none of
    /// them is acknowledged before that sync returns. A power cut during
    /// it may leave any subset of their pages on disk: here frame 3 never
    /// made it, frames 4 and 5 did. Nothing after frame 2 was ever
    /// acknowledged, so this is the torn end of the log, not damage: the
    /// open must apply frames 1 and 2 instead of refusing the database.
    #[test]
    fn a_power_cut_during_a_pipelined_sync_is_the_end_of_the_log() {
        let shared = Shared(Arc::new(InMemoryBackend::new()));
        let mut j = Journal::recover(storage(&shared), ID, 0).unwrap().journal;
        j.append(&frame(1)).unwrap();
        j.append(&frame(2)).unwrap();
        let third = j.write_at;
        j.append_unsynced(&frame(3), 2).unwrap();
        let fourth = j.write_at;
        j.append_unsynced(&frame(4), 2).unwrap();
        j.append_unsynced(&frame(5), 2).unwrap();
        // The power cut: frame 3's bytes are what the disk held before.
        shared
            .write(third, &vec![0; usize::try_from(fourth - third).unwrap()])
            .unwrap();
        match Journal::recover(storage(&shared), ID, 0) {
            Ok(r) => assert_eq!(lsns(&r), vec![1, 2]),
            Err(e) => panic!("a power cut during a sync left a database that cannot open: {e}"),
        }
    }

    /// A later frame that was written after the bad one was durable
    /// proves the damage: frame 5 was appended once frame 3 was synced.
    #[test]
    fn damage_to_a_frame_a_later_frame_vouches_for_is_an_error() {
        let shared = Shared(Arc::new(InMemoryBackend::new()));
        let mut j = Journal::recover(storage(&shared), ID, 0).unwrap().journal;
        j.append(&frame(1)).unwrap();
        j.append(&frame(2)).unwrap();
        let third = j.write_at;
        j.append_unsynced(&frame(3), 2).unwrap();
        j.append_unsynced(&frame(4), 2).unwrap();
        j.append_unsynced(&frame(5), 3).unwrap();
        j.sync().unwrap();
        let mut byte = [0_u8; 1];
        shared.read(third + 40, &mut byte).unwrap();
        shared.write(third + 40, &[byte[0] ^ 0x01]).unwrap();
        match Journal::recover(storage(&shared), ID, 0) {
            Err(JournalError::Corrupt { offset, .. }) => assert_eq!(offset, third),
            Err(e) => panic!("wrong error: {e}"),
            Ok(r) => panic!("damage read as a torn end: {:?}", lsns(&r)),
        }
    }

    /// A version 1 journal (each frame synced before the next, `unsynced`
    /// always 0) reads the same.
    #[test]
    fn a_version_1_header_is_read() {
        let (shared, _) = written(3);
        let mut head = vec![0_u8; 48];
        shared.read(0, &mut head).unwrap();
        head[16..20].copy_from_slice(&1_u32.to_le_bytes());
        let sum = blake3::hash(&head[..40]);
        head[40..48].copy_from_slice(&sum.as_bytes()[..8]);
        shared.write(0, &head).unwrap();
        let r = Journal::recover(storage(&shared), ID, 0).unwrap();
        assert_eq!(lsns(&r), vec![1, 2, 3]);
    }

    #[test]
    fn after_a_checkpoint_new_frames_overwrite_old_ones() {
        let (shared, _) = written(6);
        let mut r = Journal::recover(storage(&shared), ID, 6).unwrap();
        r.journal.checkpointed().unwrap();
        r.journal.append(&frame(7)).unwrap();
        r.journal.append(&frame(8)).unwrap();
        // Frames 3..6 of the old cycle lie after 7 and 8: not followers.
        let r = Journal::recover(storage(&shared), ID, 6).unwrap();
        assert_eq!(lsns(&r), vec![7, 8]);
    }

    #[test]
    fn only_a_log_holding_the_checkpoint_is_anchored() {
        let (shared, _) = written(5);
        assert!(Journal::recover(storage(&shared), ID, 3).unwrap().anchored);
        // Frame 9 was never written here: frames after it may be lost.
        assert!(!Journal::recover(storage(&shared), ID, 9).unwrap().anchored);
        // After a checkpoint the log starts with its anchor.
        let mut r = Journal::recover(storage(&shared), ID, 5).unwrap();
        r.journal.checkpointed().unwrap();
        let r = Journal::recover(storage(&shared), ID, 5).unwrap();
        assert!(r.anchored && r.frames.is_empty());
        // An empty journal holds nothing.
        let empty = Shared(Arc::new(InMemoryBackend::new()));
        assert!(!Journal::recover(storage(&empty), ID, 5).unwrap().anchored);
    }

    #[test]
    fn a_header_that_was_never_written_is_an_empty_journal() {
        // Sized for its header, which a full disk then refused.
        let shared = Shared(Arc::new(InMemoryBackend::new()));
        shared.set_len(HEADER_LEN).unwrap();
        let scanned = Journal::scan(&storage(&shared), ID, 0).unwrap();
        assert!(scanned.frames.is_empty() && !scanned.anchored);
        let mut r = Journal::recover(storage(&shared), ID, 0).unwrap();
        assert!(r.frames.is_empty() && !r.anchored);
        r.journal.append(&frame(1)).unwrap();
        let r = Journal::recover(storage(&shared), ID, 0).unwrap();
        assert_eq!(r.frames.len(), 1);
        // A zeroed header with frames after it is damage, as before.
        let (shared, _) = written(1);
        shared.write(0, &[0; HEADER_LEN as usize]).unwrap();
        assert!(matches!(
            Journal::recover(storage(&shared), ID, 0),
            Err(JournalError::NotAJournal { .. })
        ));
    }

    #[test]
    fn another_databases_journal_is_refused() {
        let (shared, _) = written(1);
        assert!(matches!(
            Journal::recover(storage(&shared), [9; 16], 0),
            Err(JournalError::OtherDatabase { .. })
        ));
    }

    #[test]
    fn missing_frames_are_an_error() {
        let (shared, _) = written(3);
        // The database says it holds up to 0, but the log starts after a
        // gap: pretend frame 1 was overwritten by a later cycle.
        let mut r = Journal::recover(storage(&shared), ID, 3).unwrap();
        r.journal.checkpointed().unwrap();
        r.journal.append(&frame(4)).unwrap();
        assert!(matches!(
            Journal::recover(storage(&shared), ID, 1),
            Err(JournalError::Corrupt { .. })
        ));
    }

    /// A journal id whose bytes all differ.
    const GOLDEN_ID: [u8; 16] = [
        0x10, 0x21, 0x32, 0x43, 0x54, 0x65, 0x76, 0x87, 0x98, 0xa9, 0xba, 0xcb, 0xdc, 0xed, 0xfe,
        0x0f,
    ];

    /// A frame with every kind of change, every field distinct.
    fn every_change() -> Frame {
        Frame {
            next_token: 300,
            next_outbox: 12,
            changes: vec![
                Change::PutRecord {
                    key: b"\x04shoppay-1".to_vec(),
                    value: vec![2, 1, 0, 255],
                },
                Change::DelRecord {
                    key: b"\x04shoppay-2".to_vec(),
                },
                Change::PutIndex {
                    index: IndexTable::Leases,
                    at: 1_790_000_000_001,
                    key: b"k1".to_vec(),
                },
                Change::DelIndex {
                    index: IndexTable::Recovery,
                    at: 1_790_000_000_002,
                    key: b"k2".to_vec(),
                },
                Change::PutIndex {
                    index: IndexTable::Expiry,
                    at: 3,
                    key: b"k3".to_vec(),
                },
                Change::PutOutbox {
                    seq: 5,
                    value: vec![9, 8],
                },
                Change::DelOutbox { seq: 6 },
                Change::PutEntity {
                    id: "order-1".into(),
                    value: vec![7],
                },
            ],
        }
    }

    /// Golden bytes of the journal (format 2 is released: they may never
    /// change): the header, a frame with every kind of change and one
    /// written while another was unsynced, compared with committed hex;
    /// the committed hex read back as a journal gives the same frames.
    #[test]
    fn header_and_frames_have_their_golden_bytes() -> TestResult {
        let small = Frame {
            next_token: 301,
            next_outbox: 13,
            changes: vec![Change::DelOutbox { seq: 12 }],
        };
        let shared = Shared(Arc::new(InMemoryBackend::new()));
        let mut j = Journal::recover(storage(&shared), GOLDEN_ID, 0)?.journal;
        assert_eq!(j.append(&every_change())?, 1);
        assert_eq!(j.append_unsynced(&small, 0)?, 2);
        let end = usize::try_from(j.write_at)?;
        let mut bytes = vec![0_u8; end];
        shared.read(0, &mut bytes)?;
        let header = usize::try_from(HEADER_LEN)?;
        assert_eq!(crate::store::record::hex(&bytes[..48]), GOLDEN_HEADER);
        assert!(bytes[48..header].iter().all(|&b| b == 0));
        assert_eq!(crate::store::record::hex(&bytes[header..]), GOLDEN_FRAMES);

        let unhex = |s: &str| -> Vec<u8> {
            (0..s.len() / 2)
                .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap_or(0))
                .collect()
        };
        let mut golden = unhex(GOLDEN_HEADER);
        golden.resize(header, 0);
        golden.extend_from_slice(&unhex(GOLDEN_FRAMES));
        let shared = Shared(Arc::new(InMemoryBackend::new()));
        shared.set_len(golden.len() as u64)?;
        shared.write(0, &golden)?;
        let r = Journal::recover(storage(&shared), GOLDEN_ID, 0)?;
        assert_eq!(r.frames, vec![(1, every_change()), (2, small)]);
        Ok(())
    }

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    const GOLDEN_HEADER: &str = concat!(
        "6964656d706f74656e63792d6a726e6c02000000000000001021324354657687",
        "98a9bacbdcedfe0f5083e9751cc02233",
    );
    const GOLDEN_FRAMES: &str = concat!(
        "4f000000000000000100000000000000d60d3ef11d1be4089219d0788e063f0c",
        "ac020c08000a0473686f707061792d3104020100ff010a0473686f707061792d",
        "32020081d8c1a28c34026b31030182d8c1a28c34026b32020203026b33040502",
        "0908050606076f726465722d3101070006000000010000000200000000000000",
        "5b0d2edee2f2af1e81ffc19b8a4f5c89ad020d01050c0000",
    );
}
