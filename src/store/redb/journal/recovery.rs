//! Opening a journal: the frames the database does not hold yet, read at
//! open (and by read-only views, without writing).

use std::io;

use super::frame::Frame;
use super::reader::{Reader, Scanned};
use super::{Journal, JournalError, JournalStorage, HEADER_LEN};

/// A journal file larger than this is damage, not a journal: the writer
/// starts over after every checkpoint (32 MiB), and one frame holds at
/// most one batch.
const MAX_FILE: u64 = 16 << 30;

/// A journal read at open: the frames the database does not hold yet.
pub(in crate::store::redb) struct Recovered {
    pub(in crate::store::redb) journal: Journal,
    pub(in crate::store::redb) frames: Vec<(u64, Frame)>,
    /// Whether the log holds the frame of the database's checkpoint (the
    /// anchor written after every checkpoint): without it, frames after
    /// the checkpoint may have been lost (a journal deleted, emptied or
    /// replaced by an older copy).
    pub(in crate::store::redb) anchored: bool,
    /// The frame dropped at the end of the log as a torn write, if any
    /// (logged as a warning when the database did not hold it yet).
    pub(in crate::store::redb) torn: Option<super::reader::TornFrame>,
}

impl Journal {
    /// Reads the journal in `storage`, which must carry `id` (an empty or
    /// too short file gets a fresh header). Returns the frames with an LSN
    /// above `checkpointed_lsn`, in order. The returned journal appends after
    /// them only once [`Journal::checkpointed`] has been called.
    pub(in crate::store::redb) fn recover(
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
            grow_bytes: super::writer::GROW_BYTES,
            charged: 0,
            buf: Vec::new(),
            tail: Vec::new(),
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
                torn: None,
            });
        }
        let Scanned {
            frames,
            anchored,
            torn,
        } = journal.read_all()?;
        if let Some((lsn, _)) = frames.last() {
            journal.last_lsn = *lsn;
        }
        Ok(Recovered {
            journal,
            frames,
            anchored,
            torn,
        })
    }

    /// The frames above `checkpointed_lsn` in `storage`, without writing
    /// anything (for read-only views).
    pub(in crate::store::redb) fn scan(
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
                torn: None,
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

    pub(super) fn read_all(&self) -> Result<Scanned, JournalError> {
        Journal::scan(&self.storage, self.id, self.checkpointed_lsn)
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
