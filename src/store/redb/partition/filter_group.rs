//! Sealed partitions' filters kept side by side in memory, so a fresh
//! key's probes read adjacent cache lines instead of one scattered line
//! per partition.
//!
//! A fresh key is probed against every sealed partition's filter: 306 at
//! 10M records (BENCHMARKS.md, "Format 3 at 10M"), where the probes took
//! 56 % of the CPU that grew from 10k to 10M records. Each probe reads one
//! 64-byte block, chosen by the key's hash and the filter's block count
//! alone (`filter.rs`, "Hash"). So filters of one block count put the key
//! in the same block number, and a [`FilterGroup`] stores the blocks of up
//! to [`GROUP_WIDTH`] such filters interleaved, block-major: block `i` of
//! member `s` is at `i × width + s`. A key's blocks in every member are
//! then one contiguous run (4 KiB for 64 members) instead of 64 lines in
//! 64 arrays, each likely a cache and TLB miss. A full group is then
//! bit-sliced: one word per bit of a block, bit `s` for member `s`, so a
//! key's answer for all 64 members is the AND of its 11 words.
//!
//! Grouping changes where the bits live, never which bits: a grouped
//! filter answers exactly as the filter it was copied from, and what is
//! stored on disk is unchanged (in-memory only, no format change). Kept
//! filters are grouped as they arrive (at each seal and at open), into the
//! group of their block count still taking members (the tail), which is
//! copied with the newcomer; a full tail is left as it is and a new one
//! started. The writer seals partitions at one size
//! (`SealRule::filter_capacity`), so under load every sealed partition
//! has one block count.
//!
//! Store layer (layer 2).

use std::collections::HashMap;
use std::sync::Arc;

use super::filter::{Block, FilterChecksum, KeyHash, PartitionFilter};

/// The most filters one group holds: a key's blocks in a full group are
/// 4 KiB, one page.
pub(crate) const GROUP_WIDTH: usize = 64;
// A group's answers for a key are one bit per member in a u64
// (`FilterGroup::maybe_members`).
const _: () = assert!(GROUP_WIDTH <= 64);

/// Filters of more blocks than this (1 MiB: about 350,000 keys) are kept
/// on their own: a partition the engine built in key order (a migrated
/// file's), one per file, whose copy would cost more than its probe.
const MAX_GROUPED_BLOCKS: usize = 16_384;

/// Bits of one block (`filter.rs`).
const BLOCK_BITS: usize = 512;

/// The blocks of up to [`GROUP_WIDTH`] sealed filters of one block count
/// (module docs). Immutable once built.
pub(crate) struct FilterGroup {
    /// Blocks per member.
    blocks: usize,
    /// The identity of the members' hasher (all hash with one seed).
    hasher: u64,
    /// Slot → the member's partition and its filter's checksum.
    members: Vec<(u64, FilterChecksum)>,
    bits: GroupBits,
}

/// How a group lays out its members' blocks.
enum GroupBits {
    /// A group still taking members: `blocks × width` blocks,
    /// block-major (block `i` of slot `s` at `i × width + s`).
    Interleaved(Vec<Block>),
    /// A full group ([`GROUP_WIDTH`] members): bit-sliced, `blocks × 512`
    /// words, word `i × 512 + b` holding bit `b` of block `i` of every
    /// member (bit `s`: slot `s`). A key's answer for all 64 members is
    /// the AND of its 11 words: 11 loads where the interleaved layout
    /// reads 64 blocks. Same memory as interleaved at full width; a tail
    /// is never sliced, as a word per bit would cost a partial group up to
    /// 64 times its members' size.
    Sliced(Vec<u64>),
}

impl std::fmt::Debug for FilterGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FilterGroup")
            .field("blocks", &self.blocks)
            .field("width", &self.members.len())
            .field("sliced", &matches!(self.bits, GroupBits::Sliced(_)))
            .finish_non_exhaustive()
    }
}

impl FilterGroup {
    /// Blocks per member.
    pub(super) fn blocks(&self) -> usize {
        self.blocks
    }

    /// Block `i` of the member in slot `slot` (`i < self.blocks()`, `slot`
    /// one of its members).
    pub(super) fn block(&self, i: usize, slot: usize) -> Block {
        match &self.bits {
            GroupBits::Interleaved(data) => data[i * self.members.len() + slot],
            GroupBits::Sliced(words) => {
                let mut block = [0u64; 8];
                let from = i * BLOCK_BITS;
                for (b, word) in words[from..from + BLOCK_BITS].iter().enumerate() {
                    block[b / 64] |= ((word >> slot) & 1) << (b % 64);
                }
                block
            }
        }
    }

    /// The members that may hold the key hashed as `h`, as a bit set (bit
    /// `s`: slot `s`): the answer of [`PartitionFilter::may_contain_hash`]
    /// for each, from one pass over the key's block in every member
    /// (interleaved) or the AND of the key's words (sliced). Every member
    /// for a hash of another seed ("maybe", never a guessed "absent").
    pub(super) fn maybe_members(&self, h: &KeyHash) -> u64 {
        let width = self.members.len();
        let all = if width >= 64 {
            u64::MAX
        } else {
            (1u64 << width) - 1
        };
        if h.hasher_identity() != self.hasher {
            return all;
        }
        let i = h.block_index(self.blocks);
        match &self.bits {
            GroupBits::Interleaved(data) => {
                let want = h.wanted();
                let at = i * width;
                let mut maybe = 0u64;
                for (slot, block) in data[at..at + width].iter().enumerate() {
                    // Branch-free: the bits the key wants that the block lacks.
                    let mut missing = 0u64;
                    for (w, b) in want.iter().zip(block) {
                        missing |= w & !b;
                    }
                    maybe |= u64::from(missing == 0) << slot;
                }
                maybe
            }
            GroupBits::Sliced(words) => {
                let from = i * BLOCK_BITS;
                h.bits().fold(all, |maybe, b| maybe & words[from + b])
            }
        }
    }

    /// How many members.
    #[cfg(test)]
    pub(super) fn width(&self) -> usize {
        self.members.len()
    }

    /// Whether it is bit-sliced (full).
    #[cfg(test)]
    pub(super) fn is_sliced(&self) -> bool {
        matches!(self.bits, GroupBits::Sliced(_))
    }

    /// A group of `members` (partition, checksum, filter), each of
    /// `blocks` blocks, in that slot order: bit-sliced when it is full.
    /// `None` when the memory cannot be allocated: the filters are then
    /// kept on their own.
    fn build(
        blocks: usize,
        members: &[(u64, FilterChecksum, Arc<PartitionFilter>)],
    ) -> Option<FilterGroup> {
        let hasher = members.first()?.2.hasher_identity();
        let bits = if members.len() >= GROUP_WIDTH {
            let n = blocks.checked_mul(BLOCK_BITS)?;
            let mut words = Vec::new();
            words.try_reserve_exact(n).ok()?;
            words.resize(n, 0u64);
            for (slot, (_, _, filter)) in members.iter().enumerate() {
                for i in 0..blocks {
                    let block = filter.block(i);
                    let at = &mut words[i * BLOCK_BITS..(i + 1) * BLOCK_BITS];
                    for (w, mut word) in block.into_iter().enumerate() {
                        // Each set bit of the member's block, lowest first.
                        while word != 0 {
                            let b = word.trailing_zeros() as usize;
                            at[w * 64 + b] |= 1u64 << slot;
                            word &= word - 1;
                        }
                    }
                }
            }
            GroupBits::Sliced(words)
        } else {
            let n = blocks.checked_mul(members.len())?;
            let mut data = Vec::new();
            data.try_reserve_exact(n).ok()?;
            for i in 0..blocks {
                for (_, _, filter) in members {
                    data.push(filter.block(i));
                }
            }
            GroupBits::Interleaved(data)
        };
        Some(FilterGroup {
            blocks,
            hasher,
            members: members.iter().map(|(p, s, _)| (*p, *s)).collect(),
            bits,
        })
    }
}

/// The decoded filters of sealed partitions, each under its partition and
/// the checksum its row names, grouped as they arrive (module docs).
#[derive(Debug, Default)]
pub(super) struct Kept {
    by_partition: HashMap<u64, (FilterChecksum, Arc<PartitionFilter>)>,
    /// Block count → the group of that block count still taking members.
    tails: HashMap<usize, Arc<FilterGroup>>,
}

impl Kept {
    /// The filter of `partition`, if one is kept under `checksum`.
    pub(super) fn get(
        &self,
        partition: u64,
        checksum: &FilterChecksum,
    ) -> Option<Arc<PartitionFilter>> {
        let (sum, filter) = self.by_partition.get(&partition)?;
        (sum == checksum).then(|| filter.clone())
    }

    /// Keeps `filter` for `partition` under `checksum` and returns the
    /// filter kept, which answers as `filter` does and is what a probe
    /// should hold: a view into a group when it was grouped. A partition
    /// already kept under `checksum` keeps its filter.
    pub(super) fn keep(
        &mut self,
        partition: u64,
        checksum: FilterChecksum,
        filter: Arc<PartitionFilter>,
    ) -> Arc<PartitionFilter> {
        if let Some(kept) = self.get(partition, &checksum) {
            return kept;
        }
        let blocks = filter.block_count();
        if filter.is_grouped() || blocks > MAX_GROUPED_BLOCKS {
            self.by_partition
                .insert(partition, (checksum, filter.clone()));
            return filter;
        }
        let mut members = self.live_tail(blocks, partition, &filter);
        if members.len() >= GROUP_WIDTH {
            members.clear();
        }
        members.push((partition, checksum, filter.clone()));
        let Some(group) = FilterGroup::build(blocks, &members) else {
            self.by_partition
                .insert(partition, (checksum, filter.clone()));
            return filter;
        };
        let group = Arc::new(group);
        let mut mine = filter;
        for (slot, (p, sum, member)) in members.iter().enumerate() {
            let view = Arc::new(member.in_group(group.clone(), slot));
            if *p == partition {
                mine = view.clone();
            }
            self.by_partition.insert(*p, (*sum, view));
        }
        self.tails.insert(blocks, group);
        mine
    }

    /// The members of the tail of `blocks` blocks still kept under the
    /// checksum they were grouped with (not `partition`, which is being
    /// kept again), with their kept filters.
    fn live_tail(
        &self,
        blocks: usize,
        partition: u64,
        like: &PartitionFilter,
    ) -> Vec<(u64, FilterChecksum, Arc<PartitionFilter>)> {
        let Some(tail) = self.tails.get(&blocks) else {
            return Vec::new();
        };
        tail.members
            .iter()
            .filter(|(p, _)| *p != partition)
            .filter_map(|(p, sum)| {
                let kept = self.get(*p, sum)?;
                (kept.block_count() == blocks && kept.same_hasher(like)).then_some((*p, *sum, kept))
            })
            .collect()
    }

    /// Forgets `partition`'s filter (its partition was dropped). A group
    /// is freed when no kept filter or probe holds a view into it.
    pub(super) fn forget(&mut self, partition: u64) {
        self.by_partition.remove(&partition);
        let by_partition = &self.by_partition;
        self.tails.retain(|_, tail| {
            tail.members
                .iter()
                .any(|(p, sum)| by_partition.get(p).is_some_and(|(s, _)| s == sum))
        });
    }
}

#[cfg(test)]
#[path = "filter_group_tests.rs"]
mod tests;
