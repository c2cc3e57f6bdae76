//! Appending frames (the writer thread), syncing them (the syncer thread),
//! and starting the log again after a checkpoint.

use std::io;

use redb::StorageBackend;

use super::frame::{checksum, frame_len, Frame, FRAME_HEADER};
use super::{Journal, JournalError, HEADER_LEN, MAGIC, VERSION};

/// The file grows by at most this much (zeros) when a frame needs room
/// (see [`Journal::set_grow_bytes`]).
pub(in crate::store::redb) const GROW_BYTES: u64 = 4 << 20;
/// Growth is rounded up to this.
const GROW_BLOCK: u64 = PAGE;
/// The page size appends are written in (see `Journal::write_at_end`):
/// the kernel's page on every platform we build for, and the journal
/// header's length, so frames start on a page boundary.
const PAGE: u64 = HEADER_LEN;
#[allow(clippy::cast_possible_truncation)] // 4096
const PAGE_USIZE: usize = PAGE as usize;

/// The syncing side of a journal: `fdatasync` on its file, from the
/// syncer thread, while the writer appends the next frames.
#[derive(Clone)]
pub(in crate::store::redb) struct JournalSync {
    backend: std::sync::Arc<dyn StorageBackend>,
    name: String,
}

impl JournalSync {
    /// Makes every frame appended before the call durable.
    pub(in crate::store::redb) fn sync(&self) -> Result<(), JournalError> {
        self.backend.sync_data().map_err(|source| JournalError::Io {
            file: self.name.clone(),
            source,
        })
    }
}

impl Journal {
    /// The LSN of the last frame appended.
    pub(in crate::store::redb) fn last_lsn(&self) -> u64 {
        self.last_lsn
    }

    /// Whether frames were appended since the last checkpoint.
    pub(in crate::store::redb) fn dirty(&self) -> bool {
        self.last_lsn != self.checkpointed_lsn
    }

    /// Bytes of frames since the last checkpoint, and the work they stand
    /// for beyond their own bytes ([`Self::charge`]): what a recovery
    /// would replay, which the writer bounds by checkpointing.
    pub(in crate::store::redb) fn since_checkpoint(&self) -> u64 {
        (self.write_at - HEADER_LEN).saturating_add(self.charged)
    }

    /// Counts `bytes` of work the frames appended since the last
    /// checkpoint stand for beyond their own bytes: a merge's copy step
    /// (`Change::MergeCopy`) is a small frame, but the records it copies
    /// are written to redb, replayed by a recovery, and free the pages of
    /// their sources only once a checkpoint has made the copy durable.
    pub(in crate::store::redb) fn charge(&mut self, bytes: u64) {
        self.charged = self.charged.saturating_add(bytes);
    }

    /// Appends `frame` and syncs it; returns its LSN. After an error the
    /// journal refuses every later append (the file's state is unknown).
    #[cfg(test)]
    pub(in crate::store::redb) fn append(&mut self, frame: &Frame) -> Result<u64, JournalError> {
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
    pub(in crate::store::redb) fn append_unsynced(
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
    pub(in crate::store::redb) fn sync_handle(&self) -> JournalSync {
        JournalSync {
            backend: self.storage.backend.clone(),
            name: self.storage.name.clone(),
        }
    }

    #[cfg(test)]
    pub(super) fn sync(&self) -> io::Result<()> {
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
        super::frame::write_header(&mut self.buf[..FRAME_HEADER], len32, unsynced, lsn, &sum);
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

    /// Writes the frame in `buf` at the write position, as whole pages:
    /// the start of the page it begins in (`tail`, the bytes already
    /// there), the frame, and zeros to the end of its last page (past the
    /// log's end: never read as a frame). A write of part of a page that
    /// is not in the page cache makes the kernel read the page from the
    /// disk first; this way no append does, even after the cache was
    /// dropped or the pages ahead of the log were evicted. The bytes the
    /// device writes are the same: it writes whole pages either way.
    fn write_at_end(&mut self, total: u64, sync: bool) -> io::Result<()> {
        let end = self.write_at + total;
        if end > self.len {
            self.grow(end)?;
        }
        let page_start = self.write_at - self.tail.len() as u64;
        let mut pages = std::mem::take(&mut self.tail);
        pages.extend_from_slice(&self.buf);
        // Bytes of the frame's last page that it fills (0: it ends on a
        // page boundary): the next append's tail.
        let last_page = usize::try_from(end % PAGE).unwrap_or(0);
        let next_tail = pages[pages.len().saturating_sub(last_page)..].to_vec();
        // Zeros to the page's end, within the file (`grow` rounds its
        // length up to whole pages; an older file may end mid-page).
        let room = usize::try_from(self.len.saturating_sub(page_start)).unwrap_or(usize::MAX);
        let padded = pages.len().next_multiple_of(PAGE_USIZE).min(room);
        pages.resize(padded.max(pages.len()), 0);
        self.storage.backend.write(page_start, &pages)?;
        self.tail = next_tail;
        if sync {
            self.storage.backend.sync_data()?;
        }
        Ok(())
    }

    /// Grows the file to hold `end` bytes, with zeros written now, so later
    /// appends overwrite allocated blocks and their syncs rarely touch
    /// metadata: by the grow step when the disk has room, else by less,
    /// down to just what the frame needs. A step the disk refused is undone
    /// (no sparse tail is left to fail a later write).
    fn grow(&mut self, end: u64) -> io::Result<()> {
        let needed = end.div_ceil(GROW_BLOCK) * GROW_BLOCK;
        let mut step = self.grow_bytes.max(GROW_BLOCK);
        loop {
            let new_len = needed.max(self.len + step);
            let zeros = vec![0_u8; usize::try_from(new_len - self.len).unwrap_or(usize::MAX)];
            let grown = self
                .storage
                .backend
                .set_len(new_len)
                .and_then(|()| self.storage.backend.write(self.len, &zeros));
            match grown {
                Ok(()) => {
                    self.len = new_len;
                    return Ok(());
                }
                Err(e) if is_full(&e) && new_len > needed => {
                    // Give back what the refused step took; try less.
                    self.storage.backend.set_len(self.len)?;
                    step /= 4;
                }
                Err(e) => {
                    let _ = self.storage.backend.set_len(self.len);
                    return Err(e);
                }
            }
        }
    }

    /// The most the file grows by at a time (at least 4 KiB): the engine
    /// sets it to its checkpoint interval when that is smaller than
    /// [`GROW_BYTES`], so a small file system is not asked for 4 MiB.
    pub(in crate::store::redb) fn set_grow_bytes(&mut self, bytes: u64) {
        self.grow_bytes = bytes.clamp(GROW_BLOCK, GROW_BYTES);
    }

    /// The database now durably holds everything up to [`Self::last_lsn`]:
    /// the log starts again with an anchor, an empty frame carrying that
    /// LSN, so a later open can tell this journal from one that lost frames
    /// (see [`super::Recovered::anchored`]).
    pub(in crate::store::redb) fn checkpointed(&mut self) -> Result<(), JournalError> {
        self.checkpointed_lsn = self.last_lsn;
        self.write_at = HEADER_LEN;
        self.tail.clear();
        self.charged = 0;
        let anchor = Frame {
            next_token: 0,
            next_outbox: 0,
            changes: Vec::new(),
        };
        self.write_frame(self.checkpointed_lsn, &anchor, 0, true)
    }

    pub(super) fn write_header(&mut self) -> io::Result<()> {
        let head = file_header(&self.id);
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

/// Whether `e` says the disk (or a quota) is full.
/// The journal file's header (`HEADER_LEN` bytes) for journal `id`:
/// magic, version, id and the header's checksum (module docs).
pub(super) fn file_header(id: &[u8; 16]) -> Vec<u8> {
    let mut head = vec![0_u8; usize::try_from(HEADER_LEN).unwrap_or(4096)];
    head[..16].copy_from_slice(MAGIC);
    head[16..20].copy_from_slice(&VERSION.to_le_bytes());
    head[24..40].copy_from_slice(id);
    let sum = blake3::hash(&head[..40]);
    head[40..48].copy_from_slice(&sum.as_bytes()[..8]);
    head
}

fn is_full(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded
    )
}

#[cfg(test)]
mod grow_tests {
    use std::io;
    use std::sync::Arc;

    use redb::backends::InMemoryBackend;
    use redb::StorageBackend;

    use super::super::{Change, Frame, Journal, JournalStorage};

    /// A disk of `cap` bytes: a write past it fails as a full disk does
    /// (growing the length alone is a sparse file, and works).
    #[derive(Debug, Clone)]
    struct Small {
        bytes: Arc<InMemoryBackend>,
        cap: u64,
    }

    impl StorageBackend for Small {
        fn len(&self) -> io::Result<u64> {
            self.bytes.len()
        }
        fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
            self.bytes.read(offset, out)
        }
        fn set_len(&self, len: u64) -> io::Result<()> {
            self.bytes.set_len(len)
        }
        fn sync_data(&self) -> io::Result<()> {
            Ok(())
        }
        fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
            if offset + data.len() as u64 > self.cap {
                return Err(io::Error::from(io::ErrorKind::StorageFull));
            }
            self.bytes.write(offset, data)
        }
    }

    #[test]
    fn a_disk_short_of_a_grow_step_still_takes_frames() -> Result<(), Box<dyn std::error::Error>> {
        let disk = Small {
            bytes: Arc::new(InMemoryBackend::new()),
            cap: 96 << 10,
        };
        let storage = JournalStorage {
            backend: Arc::new(disk.clone()),
            name: "small.journal".into(),
        };
        let mut journal = Journal::recover(storage, [3; 16], 0)?.journal;
        for n in 1..=20_u64 {
            let frame = Frame {
                next_token: n,
                next_outbox: 1,
                changes: vec![Change::PutRecord {
                    key: n.to_le_bytes().to_vec(),
                    value: vec![1; 2_000],
                }],
            };
            journal.append(&frame)?;
        }
        // Every refused step was undone: no sparse tail past the disk.
        let len = disk.len()?;
        assert!(
            len <= disk.cap,
            "the journal is {len} bytes on a {} byte disk",
            disk.cap
        );
        let storage = JournalStorage {
            backend: Arc::new(disk),
            name: "small.journal".into(),
        };
        let recovered = Journal::recover(storage, [3; 16], 0)?;
        assert_eq!(recovered.frames.len(), 20);
        Ok(())
    }
}
