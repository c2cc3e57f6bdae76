//! Reading what can be read of a damaged journal, for salvage: every frame
//! beyond the checkpoint that still checks, wherever it lies, and the LSNs
//! that are missing between them.

use super::frame::{checksum, Frame, FRAME_HEADER, MAX_PAYLOAD};
use super::reader::Reader;
use super::{JournalError, HEADER_LEN};

/// What a tolerant read of a journal found.
pub(in crate::store::redb) struct Salvaged {
    /// Frames above the checkpoint that check and decode, in LSN order.
    pub(in crate::store::redb) frames: Vec<(u64, Frame)>,
    /// LSNs missing below the last frame found: (first, last) of each run.
    pub(in crate::store::redb) missing: Vec<(u64, u64)>,
    /// Whether the frame of the checkpoint itself was found.
    pub(in crate::store::redb) anchored: bool,
}

/// Reads `bytes` (a whole journal file named `name`, of the database whose
/// journal id is `id` and whose state includes frame `checkpointed_lsn`),
/// trying every 8-byte offset past the header for a frame that checks.
///
/// # Errors
///
/// [`JournalError`] when the header is not this database's journal's.
pub(in crate::store::redb) fn salvage_frames(
    name: &str,
    bytes: &[u8],
    id: [u8; 16],
    checkpointed_lsn: u64,
) -> Result<Salvaged, JournalError> {
    let reader = Reader {
        name,
        id,
        checkpointed_lsn,
    };
    reader.check_header(bytes)?;
    let mut found = std::collections::BTreeMap::new();
    let mut anchored = false;
    let mut pos = usize::try_from(HEADER_LEN).unwrap_or(usize::MAX);
    while pos + FRAME_HEADER <= bytes.len() {
        let head = &bytes[pos..pos + FRAME_HEADER];
        let field =
            |at: usize| u32::from_le_bytes([head[at], head[at + 1], head[at + 2], head[at + 3]]);
        let (len, unsynced) = (u64::from(field(0)), field(4));
        let mut lsn_bytes = [0_u8; 8];
        lsn_bytes.copy_from_slice(&head[8..16]);
        let lsn = u64::from_le_bytes(lsn_bytes);
        let plausible = lsn >= checkpointed_lsn && lsn - checkpointed_lsn < (1 << 32);
        let body = pos + FRAME_HEADER;
        let end = usize::try_from(len).ok().and_then(|l| body.checked_add(l));
        if let (true, true, Some(end)) = (plausible, len <= MAX_PAYLOAD, end) {
            if let Some(payload) = bytes.get(body..end) {
                if checksum(&id, lsn, unsynced, payload) == head[16..32] {
                    anchored |= lsn == checkpointed_lsn;
                    if lsn > checkpointed_lsn {
                        if let Ok(frame) = postcard::from_bytes::<Frame>(payload) {
                            found.insert(lsn, frame);
                        }
                    }
                }
            }
        }
        pos += 8;
    }
    let mut missing = Vec::new();
    let mut expected = checkpointed_lsn + 1;
    for &lsn in found.keys() {
        if lsn > expected {
            missing.push((expected, lsn - 1));
        }
        expected = lsn + 1;
    }
    Ok(Salvaged {
        frames: found.into_iter().collect(),
        missing,
        anchored,
    })
}
