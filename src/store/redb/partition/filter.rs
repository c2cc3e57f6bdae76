//! A partition's key filter (format 3, docs/format3-plan.md, "Filters:
//! never trusted for present, never taken as absent when damaged"): a
//! blocked Bloom filter over the record keys of one partition table.
//!
//! It answers "absent" or "maybe", never "present": a "maybe" is followed
//! by a read of the partition's table, and an "absent" is believed only
//! from a filter built in this process or decoded with every check below
//! passed. A filter that fails a check is an error naming its partition,
//! for the caller to rebuild from the table (or refuse), never an
//! "absent".
//!
//! # Shape
//!
//! 24 bits per key at the designed load ([`BITS_PER_KEY`]), in blocks of
//! 512 bits (one 64-byte cache line), as the prototype
//! (`bench/benches/partitions.rs`). A key sets [`PROBES`] (11) bits, all
//! in one block, so a probe touches one cache line. About 3 MiB per
//! million keys; at the designed load a false "maybe" for 30 of 500,000
//! absent keys (`false_maybe_rate_at_the_designed_load_is_small`).
//!
//! # Hash (part of the format)
//!
//! A key's hash is 64 bits, `h = rapidhash_v3_seeded(key bytes, S)`
//! (`rapidhash::v3`, the C++ rapidhash V3 algorithm, whose output its
//! crate promises not to change within a major version), with the secrets
//! `S = RapidSecrets::seed(seed_lo ^ seed_hi)`, where `seed_lo` and
//! `seed_hi` are bytes 0..8 and 8..16 of the file's 16 random
//! `filter_seed` bytes (its meta row), each read as a u64 LE. Seeded, so a
//! client cannot choose keys that all fall in one block without knowing the
//! seed; portable, so the bits are the same on every platform and build
//! (never `std`'s `DefaultHasher`, whose output may change between Rust
//! releases). rapidhash is not a keyed PRF: a client that found an
//! overloaded block only makes its own lookups read a table, since a
//! filter never answers "present". From `h`:
//!
//! ```text
//! block         (h × block count) >> 64, as u128
//! probe bits    p = w0 | w1 << 64 (u128), where w0, w1 are the first two
//!               outputs of SplitMix64 started at state h:
//!               wi = fmix(h + (i + 1) × 0x9E3779B97F4A7C15) (wrapping),
//!               fmix(z) = z ^= z >> 30; z ×= 0xBF58476D1CE5E9B9;
//!                         z ^= z >> 27; z ×= 0x94D049BB133111EB;
//!                         z ^ (z >> 31)
//!               probe j (0..11) sets bit (p >> 9j) & 511 of the block;
//!               bit b is bit b % 64 of the block's word b / 64
//! ```
//!
//! The cost: a seeded rapidhash v3 of a 57-byte key took 4.3–8.1 ns in
//! the bench, against 87–100 ns for the BLAKE3 keyed hash it replaced
//! (docs/format3-plan.md, "Open questions for the format-3 session:
//! measured"). A lookup still hashes its key once ([`FilterHasher::hash`])
//! and probes every partition with [`PartitionFilter::may_contain_hash`].
//! A sealed filter kept in memory may have its blocks in a group of
//! filters of the same block count (`filter_group.rs`): the same bits,
//! read from adjacent memory; nothing stored changes.
//!
//! # Stored value (`idempotency.filters`, key: the partition number)
//!
//! ```text
//! byte 0        FILTER_VERSION (1)
//! bytes 1..9    key count, u64 LE
//! bytes 9..17   block count, u64 LE (at least 1)
//! bytes 17..    the blocks, 64 bytes each: 8 words, each u64 LE
//! ```
//!
//! Its checksum is kept apart, in the partition's `idempotency.partitions`
//! row (`row.rs`): `blake3::keyed_hash(checksum key, partition u64 LE ‖
//! value)`, with the checksum key `blake3::derive_key(CHECKSUM_KEY_CONTEXT,
//! filter_seed)`. So a value copied under another partition, or read with
//! another file's seed (whose bits would mean nothing), fails it like a
//! damaged one.
//!
//! A filter holds at most as many keys as its blocks allow at 24 bits per
//! key (`max_keys`): more, and its false "maybe" rate would grow without
//! bound. [`PartitionFilter::insert`] refuses the key past that, and a
//! decoded filter whose key count is past it is refused, so a filter
//! built here always decodes.

use std::sync::Arc;

use thiserror::Error;

/// The encoding this build writes and the only one it reads.
pub(crate) const FILTER_VERSION: u8 = 1;
/// Bits of filter per key at the designed load.
pub(crate) const BITS_PER_KEY: u64 = 24;
/// Bits a key sets, all in its block.
pub(crate) const PROBES: u32 = 11;
/// Bits per block: one 64-byte cache line.
const BLOCK_BITS: u64 = 512;
/// Bytes per block as stored.
pub(super) const BLOCK_BYTES: usize = 64;
/// Bits of the hash each probe takes (log2 of [`BLOCK_BITS`]).
const PROBE_BITS: u32 = 9;
/// Bytes of the stored header: version, key count, block count.
const HEADER_BYTES: usize = 17;

/// `blake3::derive_key` context of the checksum key: part of the format.
const CHECKSUM_KEY_CONTEXT: &str = "idempotency 2026-12-02 partition filter checksum key v1";
/// `blake3::derive_key` context of a hasher's identity (in memory only).
const IDENTITY_CONTEXT: &str = "idempotency 2026-12-02 partition filter hasher identity";

/// `SplitMix64`'s increment (the golden ratio in 64 bits): the probe bits'
/// words are its first two outputs from state `h` (module docs).
const SPLITMIX_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// One 512-bit block: 8 words, bit `b` is bit `b % 64` of word `b / 64`.
pub(super) type Block = [u64; 8];

/// The file's 16 random bytes that key every filter's hash (the
/// `filter_seed` meta row of format 3).
pub(crate) type FilterSeed = [u8; 16];

/// The BLAKE3 checksum of a stored filter, kept in its partition's
/// `idempotency.partitions` row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FilterChecksum(pub(crate) [u8; 32]);

/// The secrets and key derived from a file's `filter_seed`: every filter
/// of the file hashes with the same ones, so a key is hashed once per
/// lookup however many partitions it probes ([`FilterHasher::hash`]).
#[derive(Clone)]
pub(crate) struct FilterHasher {
    /// The rapidhash v3 secrets of the key hash (module docs, "Hash").
    secrets: rapidhash::v3::RapidSecrets,
    checksum_key: [u8; 32],
    /// Tells hashes of another seed apart (`KeyHash::hasher`).
    identity: u64,
}

impl std::fmt::Debug for FilterHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The secrets stay out of logs: they are what keeps a client from
        // aiming keys at one block.
        f.debug_struct("FilterHasher")
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl FilterHasher {
    /// The hasher of a file whose `filter_seed` is `seed`.
    pub(crate) fn new(seed: &FilterSeed) -> FilterHasher {
        let identity = blake3::derive_key(IDENTITY_CONTEXT, seed);
        let lo = u64::from_le_bytes(first_8(&seed[..]));
        let hi = u64::from_le_bytes(first_8(&seed[8..]));
        FilterHasher {
            secrets: rapidhash::v3::RapidSecrets::seed(lo ^ hi),
            checksum_key: blake3::derive_key(CHECKSUM_KEY_CONTEXT, seed),
            identity: u64::from_le_bytes(first_8(&identity[..])),
        }
    }

    /// The hash of record key `key`, for [`PartitionFilter::insert_hash`]
    /// and [`PartitionFilter::may_contain_hash`] of any filter of this
    /// file.
    pub(crate) fn hash(&self, key: &[u8]) -> KeyHash {
        let h = rapidhash::v3::rapidhash_v3_seeded(key, &self.secrets);
        let w0 = splitmix_fmix(h.wrapping_add(SPLITMIX_GAMMA));
        let w1 = splitmix_fmix(h.wrapping_add(SPLITMIX_GAMMA.wrapping_mul(2)));
        KeyHash {
            block: h,
            bits: u128::from(w0) | (u128::from(w1) << 64),
            hasher: self.identity,
        }
    }

    /// The checksum of the stored filter `value` of partition `partition`.
    fn checksum(&self, partition: u64, value: &[u8]) -> FilterChecksum {
        let mut h = blake3::Hasher::new_keyed(&self.checksum_key);
        h.update(&partition.to_le_bytes());
        h.update(value);
        FilterChecksum(*h.finalize().as_bytes())
    }
}

/// The first 8 bytes of `b`, which holds at least 8 (a seed or a hash).
fn first_8(b: &[u8]) -> [u8; 8] {
    let mut out = [0u8; 8];
    for (o, x) in out.iter_mut().zip(b) {
        *o = *x;
    }
    out
}

/// `SplitMix64`'s output function, as in Vigna's reference `splitmix64.c`
/// (Stafford's "Mix13" constants): a bijection that spreads every bit of
/// `z` over the 64.
fn splitmix_fmix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE5_E9B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A record key's hash under one file's [`FilterHasher`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyHash {
    /// `h`: picks the block.
    block: u64,
    /// The probe bits, 9 per probe (module docs).
    bits: u128,
    /// The identity of the hasher that made it: a filter of another seed
    /// answers "maybe" to it, never "absent".
    hasher: u64,
}

impl KeyHash {
    /// The block of a filter of `blocks` blocks this key falls in
    /// (multiply-shift: uniform over the blocks without a division).
    // i < blocks, which is a usize: the cast cannot truncate.
    #[allow(clippy::cast_possible_truncation)]
    pub(super) fn block_index(&self, blocks: usize) -> usize {
        let i = (u128::from(self.block) * blocks as u128) >> 64;
        i as usize
    }

    /// The key's [`PROBES`] bits as a block: a block that has every bit
    /// of it set may hold the key.
    pub(super) fn wanted(&self) -> Block {
        let mut want = [0u64; 8];
        for (word, mask) in self.probes() {
            want[word] |= mask;
        }
        want
    }

    /// The identity of the hasher that made it.
    pub(super) fn hasher_identity(&self) -> u64 {
        self.hasher
    }

    /// The key's bits in its block (0..512; a bit may repeat).
    pub(super) fn bits(&self) -> impl Iterator<Item = usize> {
        self.probes()
            .map(|(word, mask)| word * 64 + mask.trailing_zeros() as usize)
    }

    /// The (word, mask) of each of the key's [`PROBES`] bits in its block.
    fn probes(&self) -> impl Iterator<Item = (usize, u64)> {
        let bits = self.bits;
        (0..PROBES).map(move |j| {
            // The low 9 bits: 0..512, a bit of the block.
            let bit = ((bits >> (PROBE_BITS * j)) & u128::from(BLOCK_BITS - 1)) as usize;
            (bit / 64, 1u64 << (bit % 64))
        })
    }
}

/// What is wrong with a filter.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub(crate) enum FilterProblem {
    /// The stored value is shorter than its header.
    #[error("the stored value is {len} bytes, too short for its {HEADER_BYTES}-byte header")]
    Truncated {
        /// Bytes stored.
        len: usize,
    },
    /// The version byte is not [`FILTER_VERSION`].
    #[error("unknown filter version {0} (this build reads version {FILTER_VERSION})")]
    UnknownVersion(u8),
    /// The header says 0 blocks.
    #[error("the header says 0 blocks (a filter has at least one)")]
    NoBlocks,
    /// The value's length is not what its block count takes.
    #[error("the stored value is {len} bytes where its {blocks} blocks take {expected}")]
    Length {
        /// Bytes stored.
        len: usize,
        /// Block count in the header.
        blocks: u64,
        /// Bytes that block count takes, header included.
        expected: u128,
    },
    /// More keys than the blocks hold at [`BITS_PER_KEY`].
    #[error("{keys} keys in {blocks} blocks, which hold at most {max_keys} at {BITS_PER_KEY} bits per key")]
    Overloaded {
        /// Key count in the header.
        keys: u64,
        /// Block count in the header.
        blocks: u64,
        /// Keys those blocks hold.
        max_keys: u64,
    },
    /// The checksum does not match the one in the partition's row.
    #[error("its checksum does not match its partition row's: damaged, or written for another partition or file")]
    ChecksumMismatch,
    /// An insert past what the blocks hold.
    #[error("it is full: its blocks hold {max_keys} keys at {BITS_PER_KEY} bits per key")]
    Full {
        /// Keys the blocks hold.
        max_keys: u64,
    },
    /// A key hashed with another file's seed, offered for insertion.
    #[error("a key hashed with another file's filter seed was offered to it")]
    ForeignHash,
    /// An insert into a sealed partition's filter kept in a group
    /// (`filter_group.rs`), whose blocks are shared and immutable.
    #[error("it is sealed and kept in a group of filters: it takes no more keys")]
    Grouped,
    /// The blocks could not be allocated.
    #[error("{blocks} blocks of {BLOCK_BYTES} bytes cannot be allocated")]
    TooLarge {
        /// Blocks asked for.
        blocks: u64,
    },
}

/// A filter that cannot be built, decoded or trusted: its partition and
/// what is wrong. Never an answer: the caller rebuilds the filter from its
/// table, or refuses.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("the key filter of partition {partition}: {problem}")]
pub(crate) struct FilterError {
    /// The partition number.
    pub(crate) partition: u64,
    /// What is wrong.
    pub(crate) problem: FilterProblem,
}

/// The blocks a filter for `capacity` keys gets: 24 bits per key, at
/// least one block.
pub(crate) fn blocks_for(capacity: u64) -> u64 {
    capacity
        .saturating_mul(BITS_PER_KEY)
        .div_ceil(BLOCK_BITS)
        .max(1)
}

/// The most keys `blocks` blocks hold at 24 bits per key: the largest `n`
/// with `blocks_for(n) <= blocks`.
pub(crate) fn max_keys(blocks: u64) -> u64 {
    let n = u128::from(blocks) * u128::from(BLOCK_BITS) / u128::from(BITS_PER_KEY);
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// The key filter of one partition (see the module docs).
#[derive(Clone)]
pub(crate) struct PartitionFilter {
    partition: u64,
    hasher: FilterHasher,
    bits: Bits,
    keys: u64,
}

/// Blocks shared by several filters of one block count, each in a slot:
/// a group of sealed filters (`filter_group.rs` implements it; declared
/// here so that a filter can read its blocks from one without this file
/// depending on how groups are built).
pub(crate) trait SharedBlocks: Send + Sync {
    /// Blocks per slot.
    fn blocks(&self) -> usize;
    /// Block `i` of slot `slot` (`i < self.blocks()`, `slot` a member).
    fn block(&self, i: usize, slot: usize) -> Block;
    /// The slots whose filter may hold the key hashed as `h`, as a bit set
    /// (bit `s`: slot `s`); every slot for a hash of another seed.
    fn maybe_members(&self, h: &KeyHash) -> u64;
    /// How many slots.
    #[cfg(test)]
    fn width(&self) -> usize;
    /// Whether the group is bit-sliced (full).
    #[cfg(test)]
    fn is_sliced(&self) -> bool;
}

/// What one lookup learned of the last group of filters it probed
/// ([`PartitionFilter::may_contain_seen`]): the group's address and the
/// bit set of its members that may hold the key.
#[derive(Debug, Default)]
pub(crate) struct GroupAnswers {
    last: Option<(usize, u64)>,
}

/// Where a filter's blocks are.
#[derive(Clone)]
enum Bits {
    /// Its own, in order: a filter being built, decoded, or too large to
    /// group.
    Own(Vec<Block>),
    /// Slot `slot` of a group of sealed filters of one block count, whose
    /// blocks are interleaved (`filter_group.rs`).
    Grouped {
        group: Arc<dyn SharedBlocks>,
        slot: usize,
    },
}

impl Bits {
    /// How many blocks.
    fn len(&self) -> usize {
        match self {
            Bits::Own(blocks) => blocks.len(),
            Bits::Grouped { group, .. } => group.blocks(),
        }
    }

    /// Block `i` (`i < self.len()`).
    fn block(&self, i: usize) -> Block {
        match self {
            Bits::Own(blocks) => blocks[i],
            Bits::Grouped { group, slot } => group.block(i, *slot),
        }
    }
}

impl std::fmt::Debug for PartitionFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the blocks: about 3 MiB per million keys.
        f.debug_struct("PartitionFilter")
            .field("partition", &self.partition)
            .field("keys", &self.keys)
            .field("blocks", &self.bits.len())
            .field("grouped", &matches!(self.bits, Bits::Grouped { .. }))
            .finish_non_exhaustive()
    }
}

impl PartitionFilter {
    /// An empty filter of partition `partition` sized for `capacity` keys
    /// ([`blocks_for`]), hashing with `hasher`.
    ///
    /// # Errors
    ///
    /// [`FilterProblem::TooLarge`] when the blocks cannot be allocated.
    pub(crate) fn with_capacity(
        partition: u64,
        capacity: u64,
        hasher: &FilterHasher,
    ) -> Result<PartitionFilter, FilterError> {
        let blocks = blocks_for(capacity);
        Ok(PartitionFilter {
            partition,
            hasher: hasher.clone(),
            bits: Bits::Own(zeroed_blocks(partition, blocks)?),
            keys: 0,
        })
    }

    /// The partition number.
    #[cfg(test)]
    pub(crate) fn partition(&self) -> u64 {
        self.partition
    }

    /// Keys inserted (each insert counts, so a key is inserted once: the
    /// engine inserts a key only after every partition said it is not
    /// there).
    pub(crate) fn len(&self) -> u64 {
        self.keys
    }

    /// Whether no key was inserted.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.keys == 0
    }

    /// The most keys this filter holds ([`max_keys`] of its blocks; at
    /// least the capacity it was built with).
    pub(crate) fn max_keys(&self) -> u64 {
        max_keys(self.bits.len() as u64)
    }

    /// How many 64-byte blocks it has.
    pub(crate) fn block_count(&self) -> usize {
        self.bits.len()
    }

    /// Block `i` (`i < self.block_count()`), for a group to copy.
    pub(super) fn block(&self, i: usize) -> Block {
        self.bits.block(i)
    }

    /// Whether its blocks are kept in a group.
    pub(crate) fn is_grouped(&self) -> bool {
        matches!(self.bits, Bits::Grouped { .. })
    }

    /// The same filter (partition, hasher, key count, bits) reading its
    /// blocks from slot `slot` of `group`, which holds a copy of them.
    pub(super) fn in_group(&self, group: Arc<dyn SharedBlocks>, slot: usize) -> PartitionFilter {
        PartitionFilter {
            partition: self.partition,
            hasher: self.hasher.clone(),
            bits: Bits::Grouped { group, slot },
            keys: self.keys,
        }
    }

    /// The group and slot its blocks are in, if grouped.
    #[cfg(test)]
    pub(super) fn group_slot(&self) -> Option<(&Arc<dyn SharedBlocks>, usize)> {
        match &self.bits {
            Bits::Own(_) => None,
            Bits::Grouped { group, slot } => Some((group, *slot)),
        }
    }

    /// The identity of its hasher (`KeyHash::hasher_identity`).
    pub(super) fn hasher_identity(&self) -> u64 {
        self.hasher.identity
    }

    /// [`Self::may_contain_hash`] through `seen`, which keeps the answers
    /// of the last group this lookup met: a grouped filter's answer is
    /// taken from its group's answers for all members at once
    /// ([`SharedBlocks::maybe_members`]), computed once per group and key.
    /// `seen` must be used for one key only.
    pub(crate) fn may_contain_seen(&self, h: &KeyHash, seen: &mut GroupAnswers) -> bool {
        let Bits::Grouped { group, slot } = &self.bits else {
            return self.may_contain_hash(h);
        };
        // The address names the group while this lookup holds it (its
        // probes hold an `Arc` of each group).
        let at = Arc::as_ptr(group).cast::<()>() as usize;
        let members = match seen.last {
            Some((last, members)) if last == at => members,
            _ => {
                let members = group.maybe_members(h);
                seen.last = Some((at, members));
                members
            }
        };
        (members >> slot) & 1 == 1
    }

    /// Adds record key `key`.
    ///
    /// # Errors
    ///
    /// [`FilterProblem::Full`] when the filter already holds
    /// [`Self::max_keys`] keys (the partition is sealed before that).
    pub(crate) fn insert(&mut self, key: &[u8]) -> Result<(), FilterError> {
        let h = self.hasher.hash(key);
        self.insert_hash(&h)
    }

    /// Adds the key hashed as `h` (by this file's [`FilterHasher`]).
    ///
    /// # Errors
    ///
    /// [`FilterProblem::Full`] as [`Self::insert`];
    /// [`FilterProblem::ForeignHash`] for a hash of another file's hasher
    /// (its bits would mean nothing here).
    pub(crate) fn insert_hash(&mut self, h: &KeyHash) -> Result<(), FilterError> {
        if h.hasher != self.hasher.identity {
            return Err(self.error(FilterProblem::ForeignHash));
        }
        let max = self.max_keys();
        if self.keys >= max {
            return Err(self.error(FilterProblem::Full { max_keys: max }));
        }
        let b = h.block_index(self.bits.len());
        let Bits::Own(blocks) = &mut self.bits else {
            return Err(self.error(FilterProblem::Grouped));
        };
        let block = &mut blocks[b];
        for (word, mask) in h.probes() {
            block[word] |= mask;
        }
        self.keys += 1;
        Ok(())
    }

    /// Whether record key `key` may be in the partition: `false` means it
    /// is not, `true` that its table must be read to know.
    pub(crate) fn may_contain(&self, key: &[u8]) -> bool {
        self.may_contain_hash(&self.hasher.hash(key))
    }

    /// [`Self::may_contain`] of the key hashed as `h`. A hash of another
    /// file's hasher gets "maybe": an "absent" is never guessed.
    pub(crate) fn may_contain_hash(&self, h: &KeyHash) -> bool {
        if h.hasher != self.hasher.identity {
            return true;
        }
        if let Bits::Grouped { group, slot } = &self.bits {
            return (group.maybe_members(h) >> slot) & 1 == 1;
        }
        let block = self.bits.block(h.block_index(self.bits.len()));
        h.probes().all(|(word, mask)| block[word] & mask != 0)
    }

    /// The stored value (module docs) and its checksum, for the
    /// partition's row.
    pub(crate) fn encode(&self) -> (Vec<u8>, FilterChecksum) {
        let blocks = self.bits.len();
        let mut out = Vec::with_capacity(HEADER_BYTES + blocks * BLOCK_BYTES);
        out.push(FILTER_VERSION);
        out.extend_from_slice(&self.keys.to_le_bytes());
        out.extend_from_slice(&(blocks as u64).to_le_bytes());
        for i in 0..blocks {
            for word in &self.bits.block(i) {
                out.extend_from_slice(&word.to_le_bytes());
            }
        }
        let sum = self.hasher.checksum(self.partition, &out);
        (out, sum)
    }

    /// The filter of partition `partition` stored as `bytes`, whose
    /// partition row holds `checksum`. The header is checked first
    /// (version, length against block count, key count against what the
    /// blocks hold), then the checksum; nothing is allocated before the
    /// length matched the bytes given.
    ///
    /// # Errors
    ///
    /// A [`FilterError`] naming `partition` and the first check that
    /// failed. Never a panic, whatever `bytes` hold.
    pub(crate) fn decode(
        partition: u64,
        bytes: &[u8],
        checksum: &FilterChecksum,
        hasher: &FilterHasher,
    ) -> Result<PartitionFilter, FilterError> {
        let fail = |problem| FilterError { partition, problem };
        let Some(&version) = bytes.first() else {
            return Err(fail(FilterProblem::Truncated { len: 0 }));
        };
        if version != FILTER_VERSION {
            return Err(fail(FilterProblem::UnknownVersion(version)));
        }
        let (Some(keys), Some(blocks)) = (le_u64(bytes, 1), le_u64(bytes, 9)) else {
            return Err(fail(FilterProblem::Truncated { len: bytes.len() }));
        };
        if blocks == 0 {
            return Err(fail(FilterProblem::NoBlocks));
        }
        let expected = HEADER_BYTES as u128 + u128::from(blocks) * BLOCK_BYTES as u128;
        if bytes.len() as u128 != expected {
            return Err(fail(FilterProblem::Length {
                len: bytes.len(),
                blocks,
                expected,
            }));
        }
        let max = max_keys(blocks);
        if keys > max {
            return Err(fail(FilterProblem::Overloaded {
                keys,
                blocks,
                max_keys: max,
            }));
        }
        if hasher.checksum(partition, bytes) != *checksum {
            return Err(fail(FilterProblem::ChecksumMismatch));
        }
        let mut stored = Vec::new();
        stored
            .try_reserve_exact((bytes.len() - HEADER_BYTES) / BLOCK_BYTES)
            .map_err(|_| fail(FilterProblem::TooLarge { blocks }))?;
        for chunk in bytes[HEADER_BYTES..].chunks_exact(BLOCK_BYTES) {
            let mut block = [0u64; 8];
            for (w, word) in block.iter_mut().zip(chunk.chunks_exact(8)) {
                let mut b = [0u8; 8];
                b.copy_from_slice(word);
                *w = u64::from_le_bytes(b);
            }
            stored.push(block);
        }
        Ok(PartitionFilter {
            partition,
            hasher: hasher.clone(),
            bits: Bits::Own(stored),
            keys,
        })
    }

    fn error(&self, problem: FilterProblem) -> FilterError {
        FilterError {
            partition: self.partition,
            problem,
        }
    }

    /// The block of `key` and the bits set in it, ascending: for the
    /// golden test, which pins them.
    #[cfg(test)]
    pub(crate) fn bits_of(&self, key: &[u8]) -> (usize, Vec<u16>) {
        let h = self.hasher.hash(key);
        let mut bits: Vec<u16> = h
            .probes()
            .map(|(word, mask)| {
                u16::try_from(word * 64 + mask.trailing_zeros() as usize).unwrap_or(u16::MAX)
            })
            .collect();
        bits.sort_unstable();
        bits.dedup();
        (h.block_index(self.bits.len()), bits)
    }
}

/// `blocks` zeroed blocks, or [`FilterProblem::TooLarge`] (never an abort
/// on a huge capacity).
fn zeroed_blocks(partition: u64, blocks: u64) -> Result<Vec<Block>, FilterError> {
    let too_large = || FilterError {
        partition,
        problem: FilterProblem::TooLarge { blocks },
    };
    let n = usize::try_from(blocks).map_err(|_| too_large())?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| too_large())?;
    v.resize(n, [0; 8]);
    Ok(v)
}

/// The u64 LE at `at` in `bytes`, if all 8 bytes are there.
fn le_u64(bytes: &[u8], at: usize) -> Option<u64> {
    let b = bytes.get(at..at.checked_add(8)?)?;
    let mut out = [0u8; 8];
    out.copy_from_slice(b);
    Some(u64::from_le_bytes(out))
}

#[cfg(test)]
#[path = "filter_tests.rs"]
mod tests;

/// The `stored_structures` fuzz target's filters: `bytes` decoded as the
/// stored filter of partition `partition`, under a fixed seed, with the
/// row's checksum computed over `bytes` (so mutations get past it to the
/// header and length rules). A filter that decodes encodes back to the
/// same bytes and checksum. Returns whether it decoded.
#[cfg(any(test, fuzzing))]
pub(crate) fn fuzz_decode(partition: u64, bytes: &[u8]) -> bool {
    let hasher = FilterHasher::new(&[0x5a; 16]);
    let checksum = hasher.checksum(partition, bytes);
    match PartitionFilter::decode(partition, bytes, &checksum, &hasher) {
        Ok(filter) => {
            let (again, sum) = filter.encode();
            assert!(
                again == bytes && sum == checksum,
                "a filter that does not re-encode"
            );
            true
        }
        Err(_) => false,
    }
}
