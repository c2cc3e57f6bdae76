//! The journal's unit tests: recovery order, torn ends, damage in the
//! middle, version 1 headers, checkpoints.

use std::io;

use redb::StorageBackend;

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

/// Issue 28, point 5: a dropped last frame is named (offset and LSN), and
/// logged, never dropped without a word.
#[test]
fn a_torn_last_frame_is_dropped_and_named() {
    let (shared, offsets) = written(4);
    shared.write(offsets[3] + 40, &[0xAB; 16]).unwrap();
    let r = Journal::recover(storage(&shared), ID, 0).unwrap();
    assert_eq!(lsns(&r), vec![1, 2, 3]);
    let torn = r.torn.expect("the dropped frame is not reported");
    assert_eq!((torn.offset, torn.lsn), (offsets[3], 4));
    assert!(torn.dropped_after.is_empty());
    // Cut short by the file's end: the same.
    let (shared, offsets) = written(2);
    shared.set_len(offsets[1] + 40).unwrap();
    let r = Journal::recover(storage(&shared), ID, 0).unwrap();
    assert_eq!(lsns(&r), vec![1]);
    assert_eq!(r.torn.map(|t| (t.offset, t.lsn)), Some((offsets[1], 2)));
}

/// The plain end of the log (zeros, or frames of an earlier cycle after
/// a checkpoint) is no torn frame.
#[test]
fn the_plain_end_of_the_log_drops_nothing() {
    let (shared, _) = written(4);
    let r = Journal::recover(storage(&shared), ID, 0).unwrap();
    assert_eq!((lsns(&r), r.torn), (vec![1, 2, 3, 4], None));
    let (shared, _) = written(6);
    let mut r = Journal::recover(storage(&shared), ID, 6).unwrap();
    r.journal.checkpointed().unwrap();
    r.journal.append(&frame(7)).unwrap();
    let r = Journal::recover(storage(&shared), ID, 6).unwrap();
    assert_eq!((lsns(&r), r.torn), (vec![7], None));
}

/// Damage to a frame in the middle of the log, with valid frames after it
/// that were written once it was synced, is damage: the open refuses,
/// naming the offset and the frame's LSN, and drops nothing silently.
#[test]
fn a_damaged_middle_frame_followed_by_valid_frames_is_damage() {
    let (shared, offsets) = written(6);
    let mut byte = [0_u8; 1];
    shared.read(offsets[1] + 60, &mut byte).unwrap();
    shared.write(offsets[1] + 60, &[byte[0] ^ 0x04]).unwrap();
    match Journal::recover(storage(&shared), ID, 0) {
        Err(e @ JournalError::Corrupt { .. }) => {
            let text = e.to_string();
            assert!(text.contains(&format!("offset {}", offsets[1])), "{text}");
            assert!(text.contains("frame 2 was durable"), "{text}");
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(r) => panic!("damage read as a torn end: {:?}", lsns(&r)),
    }
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
        Ok(r) => {
            assert_eq!(lsns(&r), vec![1, 2]);
            // Named, with the frames dropped with it.
            let torn = r.torn.expect("the dropped frames are not reported");
            assert_eq!((torn.offset, torn.lsn), (third, 3));
            assert_eq!(torn.dropped_after, vec![4, 5]);
        }
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
    0x10, 0x21, 0x32, 0x43, 0x54, 0x65, 0x76, 0x87, 0x98, 0xa9, 0xba, 0xcb, 0xdc, 0xed, 0xfe, 0x0f,
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

/// Frames of the smallest size (40 bytes) sit at the earliest offset
/// their LSN allows: frame `C + k` of the cycle anchored at `C` is `k`
/// such frames past the header, `k - 1` in a cycle without an anchor (a
/// journal written before anchors were). With the first frame damaged,
/// the probe past the chain's end still finds the later ones: dropped
/// with it when written while it was still being synced, vouching for it
/// (damage) when written once it was durable. A probe that skips offsets
/// too early for an LSN must not skip these.
#[test]
fn frames_of_the_smallest_size_at_the_bound_are_still_found() -> TestResult {
    let empty = Frame {
        next_token: 0,
        next_outbox: 0,
        changes: Vec::new(),
    };
    for anchor in [true, false] {
        for vouching in [false, true] {
            let shared = Shared(Arc::new(InMemoryBackend::new()));
            let mut j = Journal::recover(storage(&shared), ID, 10)?.journal;
            // The first frame: the anchor (10, which the database holds),
            // or frame 11. Frame 11 is written once 10 was durable.
            let first = if anchor {
                j.checkpointed()?;
                10
            } else {
                11
            };
            j.append(&empty)?;
            let twelve = j.write_at;
            if vouching {
                j.append(&empty)?;
            } else if !anchor {
                j.append_unsynced(&empty, 10)?;
            }
            // The first frame's checksum.
            shared.write(HEADER_LEN + 16, &[0xAB])?;
            match Journal::recover(storage(&shared), ID, 10) {
                Ok(r) if !vouching => {
                    assert!(r.frames.is_empty());
                    let torn = r.torn.map(|t| (t.offset, t.lsn, t.dropped_after));
                    assert_eq!(torn, Some((HEADER_LEN, first, vec![first + 1])));
                }
                Err(JournalError::Corrupt { detail, .. }) if vouching => {
                    let at = format!("frame 12 at offset {twelve}");
                    assert!(detail.contains(&at), "{detail}");
                }
                Err(e) => panic!("wrong error: {e}"),
                Ok(r) => panic!("damage read as a torn end: {:?}", lsns(&r)),
            }
            // Without an anchor, right at the bound.
            let earliest = if anchor { 80 } else { 40 };
            assert_eq!(twelve, HEADER_LEN + earliest);
        }
    }
    Ok(())
}

/// A frame of an earlier cycle: one record whose value ends in zeros, as
/// many values do, so the 8 bytes before the next frame's header read as
/// the header of an empty frame that fits in the file.
fn old_frame(n: u64) -> Frame {
    let mut value = vec![n as u8 | 1; 56];
    value.extend_from_slice(&[0; 8]);
    Frame {
        next_token: n,
        next_outbox: 1,
        changes: vec![Change::PutRecord {
            key: n.to_le_bytes().to_vec(),
            value,
        }],
    }
}

/// Frames `1..=old` of a cycle written as the pipelined writer writes
/// them (each while the one before was still being synced: `unsynced`
/// 1), then a checkpoint at `old` and its anchor: the new cycle's frames
/// overwrite the old one's from the start, and the rest of it stays in
/// the file past them.
fn after_a_long_cycle(old: u64) -> Result<(Shared, Journal), JournalError> {
    let shared = Shared(Arc::new(InMemoryBackend::new()));
    let mut j = Journal::recover(storage(&shared), ID, 0)?.journal;
    for n in 1..=old {
        j.append_unsynced(&old_frame(n), n.saturating_sub(2))?;
    }
    drop(j);
    let mut j = Journal::recover(storage(&shared), ID, old)?.journal;
    j.checkpointed()?;
    Ok((shared, j))
}

/// Checksums the probe past the chain's end computes while `shared` is
/// recovered at `checkpointed`, and what the recovery says.
fn probe_checksums(shared: &Shared, checkpointed: u64) -> (u64, Result<Recovered, JournalError>) {
    use super::reader::PROBE_CHECKSUMS;
    PROBE_CHECKSUMS.with(|n| n.set(0));
    let r = Journal::recover(storage(shared), ID, checkpointed);
    (PROBE_CHECKSUMS.with(std::cell::Cell::get), r)
}

/// Recovery took minutes on a 33 MB journal: past the chain's end, the
/// probe for a later frame that vouches for the missing one checksummed
/// every 8-byte window whose LSN field merely looked plausible, each over
/// the payload it claimed. An earlier cycle's frame headers are such
/// windows: `len` and `unsynced` 1 read as the LSN 2^32 + len (and here
/// the 8 bytes before each header as an empty frame that fits). Frame
/// `C + k` of the cycle anchored at `C` starts at least `k - 1` smallest
/// frames past the header, so no frame with such an LSN lies in any
/// journal. Now only the frame really written past the end is
/// checksummed (before the bound, 1,942 windows of the old cycle were),
/// and what the probe is for still works: that frame is named as dropped
/// with a torn one, or vouches for a damaged one.
#[test]
fn the_probe_past_the_end_checksums_only_frames_that_can_lie_there() -> TestResult {
    const OLD: u64 = 2_000;
    // A power cut during the sync of OLD + 2 and OLD + 3: the first never
    // reached the disk.
    let (shared, mut j) = after_a_long_cycle(OLD)?;
    j.append(&frame(OLD + 1))?;
    let torn = j.write_at;
    j.append_unsynced(&frame(OLD + 2), OLD + 1)?;
    let after = j.write_at;
    j.append_unsynced(&frame(OLD + 3), OLD + 1)?;
    shared.write(torn, &vec![0; usize::try_from(after - torn)?])?;
    assert!(shared.len()? > 200_000, "the old cycle is not in the file");
    let (hashed, r) = probe_checksums(&shared, OLD);
    let r = r?;
    assert_eq!(lsns(&r), vec![OLD + 1]);
    let dropped = r.torn.map(|t| (t.offset, t.lsn, t.dropped_after));
    assert_eq!(dropped, Some((torn, OLD + 2, vec![OLD + 3])));
    // What the bound lets through: frames written past the end with an LSN
    // above the needed one (OLD + 3), and windows whose LSN field reads at
    // most (offset - 4096) / 40 + 1 above it. This tail has none: old
    // LSNs are at most OLD, old headers read 2^32 + len, and nothing else
    // in it reads a number that close.
    assert_eq!(hashed, 1, "checksums computed past the end of the chain");

    // OLD + 3 written once OLD + 2 was durable: damage, not a torn end.
    let (shared, mut j) = after_a_long_cycle(OLD)?;
    j.append(&frame(OLD + 1))?;
    let damaged = j.write_at;
    j.append(&frame(OLD + 2))?;
    j.append(&frame(OLD + 3))?;
    shared.write(damaged + 40, &[0xAB])?;
    let (hashed, r) = probe_checksums(&shared, OLD);
    match r {
        Err(JournalError::Corrupt { offset, detail, .. }) => {
            assert_eq!(offset, damaged);
            assert!(detail.contains(&format!("frame {}", OLD + 3)), "{detail}");
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(r) => panic!("damage read as a torn end: {:?}", lsns(&r)),
    }
    assert_eq!(hashed, 1, "checksums computed past the end of the chain");
    Ok(())
}

/// The probe's bound counts on every frame taking at least
/// `MIN_FRAME_BYTES`: the smallest `Frame` encodes to `MIN_PAYLOAD` bytes,
/// and the anchor, an empty frame, takes exactly that much room.
#[test]
fn the_smallest_frame_takes_min_frame_bytes() -> TestResult {
    use super::frame::{frame_len, MIN_FRAME_BYTES, MIN_PAYLOAD};
    let empty = Frame {
        next_token: 0,
        next_outbox: 0,
        changes: Vec::new(),
    };
    assert_eq!(postcard::to_allocvec(&empty)?.len() as u64, MIN_PAYLOAD);
    assert_eq!(frame_len(MIN_PAYLOAD), MIN_FRAME_BYTES);
    assert_eq!(MIN_FRAME_BYTES, 40);
    let shared = Shared(Arc::new(InMemoryBackend::new()));
    let mut j = Journal::recover(storage(&shared), ID, 0)?.journal;
    j.checkpointed()?;
    assert_eq!(j.write_at, HEADER_LEN + MIN_FRAME_BYTES);
    Ok(())
}

/// The merge's two changes keep their variant indexes and shapes (format
/// 3's journal: appended after `DelFilter`), and their bytes are pinned.
#[test]
fn merge_changes_have_their_golden_bytes() -> TestResult {
    let copy = Change::MergeCopy {
        target: 1 << 63,
        after: Some(b"\x04shoppay-1".to_vec()),
        copied: 512,
    };
    let drop = Change::MergeDrop {
        partition: 7,
        limit: 512,
        records: 3,
    };
    let hex = |c: &Change| -> Result<String, postcard::Error> {
        Ok(crate::store::record::hex(&postcard::to_allocvec(c)?))
    };
    assert_eq!(
        hex(&copy)?,
        "1180808080808080808001010a0473686f707061792d318004"
    );
    assert_eq!(hex(&drop)?, "1207800403");
    Ok(())
}

/// Work a frame stands for beyond its bytes counts toward the next
/// checkpoint until it is taken, as the frames' bytes do.
#[test]
fn charged_work_counts_until_the_checkpoint() -> TestResult {
    let (shared, _) = written(2);
    let mut j = Journal::recover(storage(&shared), ID, 2)?.journal;
    j.checkpointed()?;
    // The anchor frame a checkpoint writes.
    let anchor = j.since_checkpoint();
    j.append(&frame(3))?;
    let framed = j.since_checkpoint();
    assert!(framed > anchor);
    j.charge(1 << 20);
    assert_eq!(j.since_checkpoint(), framed + (1 << 20));
    j.checkpointed()?;
    assert_eq!(j.since_checkpoint(), anchor);
    Ok(())
}

/// Every write a backend is asked for: (offset, length).
#[derive(Debug, Clone)]
struct Recording {
    inner: Shared,
    writes: Arc<std::sync::Mutex<Vec<(u64, usize)>>>,
}

impl StorageBackend for Recording {
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        self.inner.read(offset, out)
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        if let Ok(mut w) = self.writes.lock() {
            w.push((offset, data.len()));
        }
        self.inner.write(offset, data)
    }
}

/// Appends are written as whole pages (so the kernel never reads a page
/// to merge a partial write into it), and what they wrote reads back:
/// frames of many sizes, across a checkpoint that starts the log again
/// over the old frames.
#[test]
fn appends_write_whole_pages_and_read_back() -> Result<(), Box<dyn std::error::Error>> {
    let shared = Shared(Arc::new(InMemoryBackend::new()));
    let rec = Recording {
        inner: shared.clone(),
        writes: Arc::default(),
    };
    let storage = JournalStorage {
        backend: Arc::new(rec.clone()),
        name: "test.journal".into(),
    };
    let mut j = Journal::recover(storage, ID, 0)?.journal;
    j.checkpointed()?;
    rec.writes.lock().map_err(|e| e.to_string())?.clear();
    // 1..=40 spans pages and ends mid-page; the checkpoint at 25 starts
    // the log again at its head, over frames 1..=24.
    for i in 1..=40_u64 {
        let big = Frame {
            changes: vec![Change::PutRecord {
                key: i.to_le_bytes().to_vec(),
                value: vec![i as u8; (i as usize * 397) % 9000],
            }],
            ..frame(i)
        };
        assert_eq!(j.append(&big)?, i);
        if i == 25 {
            j.checkpointed()?;
        }
    }
    let writes = rec.writes.lock().map_err(|e| e.to_string())?.clone();
    let grows = writes.iter().filter(|(o, _)| *o >= 4 << 20).count();
    assert!(writes.len() > 40, "{writes:?}");
    for (offset, len) in &writes {
        assert_eq!(offset % PAGE_BYTES, 0, "write at {offset}, {len} bytes");
        assert_eq!(
            *len as u64 % PAGE_BYTES,
            0,
            "write at {offset}, {len} bytes"
        );
    }
    assert_eq!(grows, 0, "the test stays within the first growth step");
    let r = Journal::recover(self::storage(&shared), ID, 25)?;
    assert_eq!(lsns(&r), (26..=40).collect::<Vec<_>>());
    assert_eq!(r.frames[14].1.changes.len(), 1);
    Ok(())
}

const PAGE_BYTES: u64 = 4096;

/// Format 3's derived record changes (`derived.rs`) keep their variant
/// indexes and shapes (appended after `MergeDrop`), and their bytes are
/// pinned: a new record, a completion's delta of its claim (with the
/// base's checksum; the live value beside it is not written), a delete.
#[test]
fn derived_record_changes_have_their_golden_bytes() -> TestResult {
    use crate::envelope::Envelope;
    use crate::fingerprint::Fingerprint;
    use crate::store::record::{Completion, Record, StoredResponse};
    let claim = Record::processing(
        Fingerprint::from_bytes([7; 32]),
        41,
        "ref-41".into(),
        1_790_000_000_000,
        1_790_000_030_000,
    );
    let response = StoredResponse::new(Envelope::new(1, 201, b"paid".to_vec()), None);
    let done = claim.completed(Completion::Success, response, 1_790_000_000_500, 86_400_000);
    let slot = b"\x00\x00\x00\x00\x00\x00\x00\x01\x04shoppay-1".to_vec();
    let new = Change::PutNewRecord {
        key: slot.clone(),
        value: vec![2, 1, 0, 255],
    };
    let delta = Change::PutRecordDelta {
        key: slot.clone(),
        base: [1, 2, 3, 4, 5, 6, 7, 8],
        delta: RecordDelta::between(&claim, &done),
        live: Unlogged(vec![9; 40]),
    };
    let delete = Change::DelIndexedRecord { key: slot };
    let hex = |c: &Change| -> Result<String, postcard::Error> {
        Ok(crate::store::record::hex(&postcard::to_allocvec(c)?))
    };
    assert_eq!(
        hex(&new)?,
        "131200000000000000010473686f707061792d3104020100ff"
    );
    // Variant 20, the slot key, the base's 8 bytes, then 4 fields: state
    // COMPLETED, updated at, expires at, the response (schema 1, status
    // 201, no headers, body "paid", no resource).
    assert_eq!(
        hex(&delta)?,
        concat!(
            "141200000000000000010473686f707061792d310102030405060708",
            "04000106f4dbc1a28c3408f493dbcb8c340d0101c90100047061696400"
        )
    );
    assert_eq!(hex(&delete)?, "151200000000000000010473686f707061792d31");
    for change in [new, delta, delete] {
        let read: Change = postcard::from_bytes(&postcard::to_allocvec(&change)?)?;
        assert_eq!(read, change);
    }
    Ok(())
}
