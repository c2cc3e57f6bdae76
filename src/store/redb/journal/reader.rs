//! Reading frames out of a journal's bytes: the header check, the chain of
//! frames after the checkpoint, and telling a torn end from damage in the
//! middle.

use super::frame::{checksum, frame_len, Frame, FRAME_HEADER, MAX_PAYLOAD, MIN_FRAME_BYTES};
use super::{JournalError, HEADER_LEN, MAGIC, OLDEST_VERSION, VERSION};

/// Reads frames out of a journal's bytes.
pub(super) struct Reader<'a> {
    pub(super) name: &'a str,
    pub(super) id: [u8; 16],
    pub(super) checkpointed_lsn: u64,
}

impl Reader<'_> {
    pub(super) fn check_header(&self, bytes: &[u8]) -> Result<(), JournalError> {
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
    pub(super) fn read_frames(&self, bytes: &[u8]) -> Result<Scanned, JournalError> {
        let mut out = Vec::new();
        let mut anchored = false;
        let mut pos = HEADER_LEN;
        let mut prev: Option<u64> = None;
        while let Some(FrameAt {
            lsn, payload, next, ..
        }) = self.frame_at(bytes, pos)
        {
            // No frame follows LSN u64::MAX: a chain ends there.
            if prev.is_some_and(|p| p.checked_add(1) != Some(lsn)) {
                break;
            }
            anchored |= lsn == self.checkpointed_lsn;
            if lsn > self.checkpointed_lsn {
                let expected = out
                    .last()
                    .map_or(self.checkpointed_lsn, |(l, _): &(u64, Frame)| *l)
                    .saturating_add(1);
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
        let torn = self.torn_at(bytes, pos, prev);
        // Valid frames beyond the end that do not vouch for the missing
        // one: written while it was still being synced.
        let dropped_after = self.probe_past_end(bytes, pos, needed_after)?;
        // Later frames dropped with a missing one are named even when
        // nothing of the missing one's header is left.
        let expected = prev.unwrap_or(self.checkpointed_lsn).saturating_add(1);
        let torn = match torn {
            Some((offset, lsn)) => Some(TornFrame {
                offset,
                lsn,
                dropped_after,
            }),
            None if !dropped_after.is_empty() => Some(TornFrame {
                offset: pos,
                lsn: expected,
                dropped_after,
            }),
            None => None,
        };
        if let Some(t) = torn.as_ref().filter(|t| t.lsn > self.checkpointed_lsn) {
            tracing::warn!(
                journal = %self.name,
                offset = t.offset,
                lsn = t.lsn,
                later_frames_dropped = ?t.dropped_after,
                "dropped the journal's last frame as a torn write: it fails its checksum, and \
                 no later frame shows it was durable (a frame is acknowledged only after its \
                 sync; damage to a synced last frame cannot be told from this)"
            );
        }
        Ok(Scanned {
            frames: out,
            anchored,
            torn,
        })
    }

    /// Probes every 8-byte offset past `pos`, where the chain ends, for a
    /// valid frame with an LSN above `needed_after`. One written after
    /// frame `needed_after + 1` was durable vouches that the bytes at
    /// `pos` are damage, not a torn end: an error naming `pos`. Returns
    /// the LSNs of the others (written while it was still being synced).
    fn probe_past_end(
        &self,
        bytes: &[u8],
        pos: u64,
        needed_after: u64,
    ) -> Result<Vec<u64>, JournalError> {
        let mut dropped_after = Vec::new();
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
            let found = plausible
                .then(|| Header::at(bytes, probe))
                .flatten()
                // Too early in the file for its LSN: not a frame of this
                // cycle, and no other frame vouches (see `can_lie_at`).
                .filter(|head| can_lie_at(head.lsn, probe, needed_after))
                .and_then(|head| {
                    #[cfg(test)]
                    PROBE_CHECKSUMS.with(|n| n.set(n.get() + 1));
                    self.check(&head)
                });
            if let Some(found) = found {
                if found.lsn > needed_after && found.durable_before <= needed_after {
                    dropped_after.push(found.lsn);
                }
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
        Ok(dropped_after)
    }

    /// Whether the bytes at `pos`, where the chain of frames ends, are the
    /// header of the frame that would come next (its LSN field reads the
    /// LSN expected there) whose frame does not check or is cut short by
    /// the file's end: a torn write, or damage to a frame no later frame
    /// vouches for. `(offset, LSN)`. Zeros (a journal not written that far)
    /// and a frame or the middle of one from an earlier cycle are the plain
    /// end of the log. A damaged LSN field looks like the latter.
    fn torn_at(&self, bytes: &[u8], pos: u64, prev: Option<u64>) -> Option<(u64, u64)> {
        let at = usize::try_from(pos).ok()?;
        let lsn = u64::from_le_bytes(bytes.get(at + 8..at + 16)?.try_into().ok()?);
        // After the last frame, the next LSN; in an empty chain, the
        // checkpoint's anchor or the frame after it.
        let expected = match prev {
            Some(p) => p.checked_add(1) == Some(lsn),
            None => {
                lsn == self.checkpointed_lsn || self.checkpointed_lsn.checked_add(1) == Some(lsn)
            }
        };
        (expected && lsn != 0).then_some((pos, lsn))
    }

    /// The valid frame at `pos`.
    fn frame_at<'b>(&self, bytes: &'b [u8], pos: u64) -> Option<FrameAt<'b>> {
        self.check(&Header::at(bytes, pos)?)
    }

    /// `head`'s frame, if its checksum matches (the cost of a read: BLAKE3
    /// over the payload it claims).
    fn check<'b>(&self, head: &Header<'b>) -> Option<FrameAt<'b>> {
        if checksum(&self.id, head.lsn, head.unsynced, head.payload) != head.sum {
            return None;
        }
        Some(FrameAt {
            lsn: head.lsn,
            durable_before: head
                .lsn
                .saturating_sub(u64::from(head.unsynced).saturating_add(1)),
            payload: head.payload,
            next: head.pos + frame_len(head.len),
        })
    }
}

/// Whether a frame of the current cycle with LSN `lsn`, above
/// `needed_after`, can start at offset `pos`. The probe past the chain's
/// end checksums nothing else: before this bound it checksummed every
/// 8-byte window whose LSN field merely looked plausible, each over the
/// payload it claimed, and a recovery with an earlier cycle's 32 MiB past
/// the chain took minutes.
///
/// The invariant (the writer's layout): a cycle starts at `HEADER_LEN`
/// with its anchor, LSN `A`, and every later frame of it, `A + 1`,
/// `A + 2`, ..., follows the one before back to back (`write_at`), each
/// at least [`MIN_FRAME_BYTES`] long. So frame `L` of the cycle starts at
/// or after `HEADER_LEN + MIN_FRAME_BYTES * (L - A)`, and one frame
/// earlier, `L - A - 1`, holds too for a cycle without an anchor (journals
/// written before anchors were, whose first frame `A + 1` is at
/// `HEADER_LEN`). And `A` is at most `needed_after`: the anchor is written
/// only after redb durably holds `journal_lsn = A` (a checkpoint, or an
/// open's recovery), that value never goes down, and `needed_after` is at
/// least the one read from it. Putting `needed_after` for `A` only moves
/// the earliest offset down, so no frame of the current cycle is skipped,
/// whether it vouches or is dropped with a torn one.
///
/// Frames of earlier cycles with an LSN above `needed_after` can only be
/// what an earlier recovery dropped past its chain's end (the next cycle
/// reuses their LSNs), and skipping them is safe: that recovery found
/// none that vouched (or it refused the journal), so each has
/// `durable_before` at most that recovery's `needed_after`, which became
/// the next anchor, at most today's `needed_after`. None vouches now.
fn can_lie_at(lsn: u64, pos: u64, needed_after: u64) -> bool {
    lsn.checked_sub(needed_after)
        .and_then(|after| after.checked_sub(1))
        .and_then(|frames| frames.checked_mul(MIN_FRAME_BYTES))
        .and_then(|bytes| bytes.checked_add(HEADER_LEN))
        .is_some_and(|earliest| pos >= earliest)
}

#[cfg(test)]
thread_local! {
    /// Checksums the probe past the chain's end computed on this thread
    /// (a test hook: the probe's cost, counted instead of timed).
    pub(super) static PROBE_CHECKSUMS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// A frame's header as found at an offset, with the payload it claims,
/// before its checksum is checked.
struct Header<'b> {
    pos: u64,
    /// The payload's length.
    len: u64,
    unsynced: u32,
    lsn: u64,
    /// The checksum it carries.
    sum: &'b [u8],
    payload: &'b [u8],
}

impl<'b> Header<'b> {
    /// The header at `pos` and the payload it claims, when both lie in
    /// `bytes`; its checksum is not checked yet.
    fn at(bytes: &'b [u8], pos: u64) -> Option<Header<'b>> {
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
        Some(Self {
            pos,
            len,
            unsynced,
            lsn,
            sum: &head[16..32],
            payload,
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

/// What a scan of the log found.
pub(in crate::store::redb) struct Scanned {
    pub(in crate::store::redb) frames: Vec<(u64, Frame)>,
    pub(in crate::store::redb) anchored: bool,
    /// The frame dropped at the end of the log as a torn write, if any.
    pub(in crate::store::redb) torn: Option<TornFrame>,
}

/// A frame at the end of the log that fails its checksum (or is cut short)
/// and that no later frame vouches for: dropped as a torn write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::store::redb) struct TornFrame {
    /// Its byte offset in the journal.
    pub(in crate::store::redb) offset: u64,
    /// The LSN its header reads (the one expected there).
    pub(in crate::store::redb) lsn: u64,
    /// Valid frames further on, written while it was still being synced
    /// (a power cut tore that sync): dropped with it, by LSN.
    pub(in crate::store::redb) dropped_after: Vec<u64>,
}
