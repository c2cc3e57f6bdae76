//! The journal half of the `stored_structures` fuzz target: a journal's
//! bytes after a valid header, read as an open's recovery reads them
//! (`Reader::read_frames`: the chain of frames, torn-end detection, the
//! postcard decode of each frame). Never panics, whatever the bytes.

use super::frame::{checksum, frame_len, write_header, FRAME_HEADER};
use super::reader::Reader;
use super::writer::file_header;

/// The journal id the fuzz inputs are checked against.
const FUZZ_ID: [u8; 16] = *b"fuzz-journal-id!";

/// Reads a journal made of a valid header and `body`, with the database at
/// `checkpointed` (the LSN its state includes). With `framed`, `body` is a
/// list of frames to write with correct checksums, so mutations reach the
/// frame decoder and the chain rules: each is a control byte (bits 0–1:
/// LSN step from the previous frame, 0–3; bits 2–4: `unsynced`; bit 7: a
/// wrong checksum, as damage or a torn write leaves), a length byte, and
/// that many payload bytes (fewer at the end). Without it, `body` follows
/// the header as it is. Returns how many frames the read took, 0 when it
/// refused the journal.
pub(in crate::store::redb) fn fuzz_read(framed: bool, checkpointed: u64, body: &[u8]) -> usize {
    let mut bytes = file_header(&FUZZ_ID);
    if framed {
        append_frames(&mut bytes, checkpointed, body);
    } else {
        bytes.extend_from_slice(body);
    }
    let reader = Reader {
        name: "fuzz.journal",
        id: FUZZ_ID,
        checkpointed_lsn: checkpointed,
    };
    assert!(
        reader.check_header(&bytes).is_ok(),
        "a header written by file_header does not check"
    );
    match reader.read_frames(&bytes) {
        Ok(scanned) => {
            let mut last = checkpointed;
            for (lsn, frame) in &scanned.frames {
                assert!(
                    last.checked_add(1) == Some(*lsn),
                    "frames out of order: {lsn} after {last}"
                );
                last = *lsn;
                expand_all(frame);
            }
            scanned.frames.len()
        }
        Err(_) => 0,
    }
}

/// Expands each of `frame`'s changes as replay does (`derived.rs`), over
/// no stored record, a value that does not decode, and a record that
/// decodes under the change's key; and applies each delta to a record:
/// refused or applied, never a panic.
fn expand_all(frame: &super::frame::Frame) {
    use crate::store::codec;
    use crate::store::record::Record;
    let record = Record::processing(
        crate::fingerprint::Fingerprint::from_bytes([1; 32]),
        1,
        "fuzz".into(),
        1,
        2,
    );
    for change in &frame.changes {
        let _ = super::derived::expand(change, None);
        let _ = super::derived::expand(change, Some(&[2, 0, 0]));
        if let Some(key) = change.derived_key() {
            if let Some((_, rkey)) = crate::store::redb::partition::slot::split(key) {
                let _ = super::derived::expand(change, Some(&codec::encode(rkey, &record)));
            }
        }
        if let super::frame::Change::PutRecordDelta { delta, .. } = change {
            let _ = delta.apply(record.clone());
        }
    }
}

fn append_frames(bytes: &mut Vec<u8>, checkpointed: u64, mut body: &[u8]) {
    let mut lsn = checkpointed;
    while let [control, len, rest @ ..] = body {
        let take = usize::from(*len).min(rest.len());
        let (payload, after) = rest.split_at(take);
        body = after;
        lsn = lsn.saturating_add(u64::from(control & 3));
        let unsynced = u32::from((control >> 2) & 7);
        let mut sum = checksum(&FUZZ_ID, lsn, unsynced, payload);
        if control & 0x80 != 0 {
            sum[0] ^= 1;
        }
        let start = bytes.len();
        let total = usize::try_from(frame_len(payload.len() as u64)).unwrap_or(usize::MAX);
        bytes.resize(start + total, 0);
        // `take` is at most 255, so the length fits.
        let len32 = u32::try_from(take).unwrap_or(u32::MAX);
        write_header(
            &mut bytes[start..start + FRAME_HEADER],
            len32,
            unsynced,
            lsn,
            &sum,
        );
        bytes[start + FRAME_HEADER..start + FRAME_HEADER + take].copy_from_slice(payload);
    }
}

/// A seed for the journal modes: three frames after checkpoint LSN
/// `checkpointed`, each one record put, as `body` for [`fuzz_read`]
/// (`framed`: the hook's frame list; else the frames as a journal holds
/// them, with their checksums).
#[cfg(test)]
pub(in crate::store::redb) fn seed_frames(checkpointed: u64, framed: bool) -> Vec<u8> {
    use super::frame::{Change, Frame};
    let mut list = Vec::new();
    for i in 0..3u8 {
        let frame = Frame {
            next_token: u64::from(i) + 2,
            next_outbox: 1,
            changes: vec![Change::PutRecord {
                key: vec![b'k', i],
                value: vec![2, i, i],
            }],
        };
        let payload = postcard::to_allocvec(&frame).unwrap_or_default();
        list.push(1);
        list.push(u8::try_from(payload.len()).unwrap_or(u8::MAX));
        list.extend_from_slice(&payload);
    }
    if framed {
        return list;
    }
    let mut bytes = Vec::new();
    append_frames(&mut bytes, checkpointed, &list);
    bytes
}

#[cfg(test)]
mod tests {
    use super::super::frame::Frame;
    use super::*;

    /// One empty frame as the hook's frame list holds it, after a control
    /// byte `control`.
    fn one_frame(control: u8) -> Result<Vec<u8>, postcard::Error> {
        let frame = Frame {
            next_token: 7,
            next_outbox: 1,
            changes: Vec::new(),
        };
        let payload = postcard::to_allocvec(&frame)?;
        let mut v = vec![control, payload.len() as u8];
        v.extend_from_slice(&payload);
        Ok(v)
    }

    /// A well-formed frame list reads back in full; the same list with
    /// the last frame's checksum broken reads one frame fewer (a torn
    /// end); raw garbage after the header is refused or read as empty,
    /// never a panic.
    #[test]
    fn frames_written_by_the_hook_read_back() -> Result<(), postcard::Error> {
        let good: Vec<u8> = [one_frame(1)?, one_frame(1)?, one_frame(1)?].concat();
        assert_eq!(fuzz_read(true, 4, &good), 3);
        let torn: Vec<u8> = [one_frame(1)?, one_frame(1)?, one_frame(0x81)?].concat();
        assert_eq!(fuzz_read(true, 4, &torn), 2);
        assert_eq!(fuzz_read(false, 0, &[0xff; 100]), 0);
        Ok(())
    }

    /// LSNs at the end of the u64 range (a damaged meta table's
    /// checkpoint): frames that check are read or refused, never an
    /// arithmetic overflow in the reader or the hook.
    #[test]
    fn lsns_near_u64_max_never_overflow() -> Result<(), postcard::Error> {
        let three: Vec<u8> = [one_frame(1)?, one_frame(1)?, one_frame(1)?].concat();
        for checkpointed in [u64::MAX - 2, u64::MAX - 1, u64::MAX] {
            let read = fuzz_read(true, checkpointed, &three);
            assert!(read <= 2, "{read} frames after {checkpointed}");
        }
        let raw = seed_frames(u64::MAX - 1, false);
        assert!(fuzz_read(false, u64::MAX - 1, &raw) <= 1);
        Ok(())
    }
}
