//! Arbitrary bytes into the redb backend's other stored structures: a
//! journal's frames (what an open after a crash replays), and format 3's
//! partition rows and key filters (what every open reads).
//!
//! Byte 0 picks the structure and mode, byte 1 a partition number or the
//! LSN the journal's database is checkpointed at (see
//! `store::redb::fuzz_stored`):
//!
//! - 0: the bytes after a valid journal header, as is: the frame chain,
//!   the torn-end and damage rules over whatever is there;
//! - 1: a list of frames the hook writes with correct checksums (a control
//!   byte for the LSN step, `unsynced` and a broken checksum; a length; the
//!   payload), so mutations reach the postcard frame decoder;
//! - 2: a partition row, as stored (bit 2 clear) or a 65-byte payload the
//!   hook frames with a correct checksum (bit 2 set);
//! - 3: a stored filter, its row's checksum computed over it.
//!
//! Never panics. The hooks also assert what a decoder promises: frames
//! read are consecutive from the checkpoint; a row or filter that decodes
//! encodes back to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = idempotency::__fuzz_decode_stored(data);
});
