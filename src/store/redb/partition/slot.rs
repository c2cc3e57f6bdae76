//! Where a record lives in format 3: its *slot key*, the record key
//! prefixed by the number of the partition that holds it.
//!
//! Format 3 keeps every partition's records in one table,
//! `idempotency.partitioned.records`, keyed
//!
//! ```text
//! bytes 0..8   the partition number, u64 big-endian
//! bytes 8..    the record key (`key::record_key`: scope length, scope, key)
//! ```
//!
//! Big-endian, so redb's byte order sorts a table by partition first: each
//! partition is one contiguous key range ([`range_of`]), a new key lands in
//! the hot partition's range only (a checkpoint writes that range's leaves
//! and the path to them, never an older range's), and expiry deletes a
//! range in key order. The steps and evidence-log tables of format 3 are
//! keyed by the same slot key, so a record's steps sit beside it in the
//! same partition.
//!
//! Partition numbers: partitions that took claims count up from
//! [`FIRST_PARTITION`]; numbers from [`BUILT_PARTITIONS`] up are kept for
//! partitions written in key order by the engine itself (a migration from
//! format 2, a merge), which need a range above every other to be packed
//! (redb packs leaves only for inserts past the last key of a table).
//!
//! Store layer (layer 2).

/// The first partition number of a file: the hot partition of a new file.
pub(crate) const FIRST_PARTITION: u64 = 1;
/// The first number of a partition the engine builds in key order
/// (module docs).
pub(crate) const BUILT_PARTITIONS: u64 = 1 << 63;
/// Bytes of the partition prefix.
pub(crate) const PREFIX_BYTES: usize = 8;

/// The slot key of record key `rkey` in partition `partition`.
pub(crate) fn slot_key(partition: u64, rkey: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(PREFIX_BYTES + rkey.len());
    out.extend_from_slice(&partition.to_be_bytes());
    out.extend_from_slice(rkey);
    out
}

/// The partition number and record key of a slot key; `None` for bytes
/// shorter than the prefix (damage: no slot key this build writes is).
pub(crate) fn split(slot: &[u8]) -> Option<(u64, &[u8])> {
    let (prefix, rkey) = slot.split_first_chunk::<PREFIX_BYTES>()?;
    Some((u64::from_be_bytes(*prefix), rkey))
}

/// The bounds of partition `partition`'s key range: every slot key `k`
/// of the partition has `lo <= k` and, with `Some(hi)`, `k < hi` (`None`:
/// the partition is the last number, its range runs to the end).
pub(crate) fn range_of(partition: u64) -> ([u8; PREFIX_BYTES], Option<[u8; PREFIX_BYTES]>) {
    (
        partition.to_be_bytes(),
        partition.checked_add(1).map(u64::to_be_bytes),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_key_splits_back_into_its_parts() {
        let rkey = b"\x03abcKEY";
        for p in [0, FIRST_PARTITION, 255, 256, BUILT_PARTITIONS, u64::MAX] {
            let slot = slot_key(p, rkey);
            assert_eq!(slot.len(), PREFIX_BYTES + rkey.len());
            assert_eq!(split(&slot), Some((p, &rkey[..])));
        }
        assert_eq!(split(&[0; 7]), None, "shorter than the prefix");
        assert_eq!(split(&[0; 8]), Some((0, &[][..])));
    }

    #[test]
    fn slot_keys_sort_by_partition_then_record_key() {
        // Byte order is redb's order for `&[u8]` keys.
        let a = slot_key(1, b"\xffzzz");
        let b = slot_key(2, b"\x00");
        let c = slot_key(256, b"\x00");
        let d = slot_key(BUILT_PARTITIONS, b"\x00");
        assert!(a < b && b < c && c < d);
        assert!(slot_key(7, b"\x01a") < slot_key(7, b"\x01b"));
    }

    #[test]
    fn a_range_holds_exactly_its_partitions_keys() {
        for p in [0, 1, 255, 256, BUILT_PARTITIONS - 1, u64::MAX - 1] {
            let (lo, hi) = range_of(p);
            let hi = hi.map(|h| h.to_vec());
            let inside = |k: &[u8]| k >= &lo[..] && hi.as_ref().is_none_or(|h| k < h.as_slice());
            assert!(inside(&slot_key(p, b"")));
            assert!(inside(&slot_key(p, &[0xff; 300])));
            assert!(!inside(&slot_key(p + 1, b"")));
            if p > 0 {
                assert!(!inside(&slot_key(p - 1, &[0xff; 300])));
            }
        }
        assert_eq!(range_of(u64::MAX).1, None);
    }
}
