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

use super::filter::{Block, FilterChecksum, KeyHash, PartitionFilter, SharedBlocks, BLOCK_BYTES};

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
const BLOCK_BITS: usize = BLOCK_BYTES * 8;

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

impl SharedBlocks for FilterGroup {
    /// Blocks per member.
    fn blocks(&self) -> usize {
        self.blocks
    }

    /// Block `i` of the member in slot `slot` (`i < self.blocks()`, `slot`
    /// one of its members).
    fn block(&self, i: usize, slot: usize) -> Block {
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
    fn maybe_members(&self, h: &KeyHash) -> u64 {
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
    fn width(&self) -> usize {
        self.members.len()
    }

    /// Whether it is bit-sliced (full).
    #[cfg(test)]
    fn is_sliced(&self) -> bool {
        matches!(self.bits, GroupBits::Sliced(_))
    }
}

impl FilterGroup {
    /// This interleaved group with `members`' last one appended, when
    /// `members` are this group's members in slot order then one more and
    /// the result is still a tail (interleaved): each block row copied
    /// whole, where [`Self::build`] copies block by block. `None`
    /// otherwise, or when the memory cannot be allocated.
    fn appended(
        &self,
        members: &[(u64, FilterChecksum, Arc<PartitionFilter>)],
    ) -> Option<FilterGroup> {
        let GroupBits::Interleaved(old) = &self.bits else {
            return None;
        };
        let (last, before) = members.split_last()?;
        let width = self.members.len();
        let same = before.len() == width
            && before
                .iter()
                .zip(&self.members)
                .all(|((p, s, _), (mp, ms))| p == mp && s == ms);
        let fits = last.2.block_count() == self.blocks && last.2.hasher_identity() == self.hasher;
        if !same || !fits || members.len() >= GROUP_WIDTH {
            return None;
        }
        let mut data = Vec::new();
        data.try_reserve_exact(self.blocks.checked_mul(width + 1)?)
            .ok()?;
        for (i, row) in old.chunks_exact(width.max(1)).enumerate().take(self.blocks) {
            data.extend_from_slice(row);
            data.push(last.2.block(i));
        }
        Some(FilterGroup {
            blocks: self.blocks,
            hasher: self.hasher,
            members: members.iter().map(|(p, s, _)| (*p, *s)).collect(),
            bits: GroupBits::Interleaved(data),
        })
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
            let mut matrix = [0u64; 64];
            for i in 0..blocks {
                let member_blocks: Vec<Block> = members
                    .iter()
                    .take(64)
                    .map(|(_, _, f)| f.block(i))
                    .collect();
                for w in 0..8 {
                    // Row s: word w of member s's block i; transposed, row
                    // t holds bit w × 64 + t of every member.
                    for (row, block) in matrix.iter_mut().zip(&member_blocks) {
                        *row = block[w];
                    }
                    transpose64(&mut matrix);
                    let at = i * BLOCK_BITS + w * 64;
                    words[at..at + 64].copy_from_slice(&matrix);
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

/// Transposes the 64×64 bit matrix `a` (row `r` is `a[r]`, column `c` its
/// bit `c`): afterwards bit `c` of `a[r]` is what bit `r` of `a[c]` was.
/// The off-diagonal blocks are swapped at each scale, 32 down to 1
/// (Hacker's Delight, 7-3, with the least significant bit as column 0).
fn transpose64(a: &mut [u64; 64]) {
    const LOW_HALVES: [(usize, u64); 6] = [
        (32, 0x0000_0000_FFFF_FFFF),
        (16, 0x0000_FFFF_0000_FFFF),
        (8, 0x00FF_00FF_00FF_00FF),
        (4, 0x0F0F_0F0F_0F0F_0F0F),
        (2, 0x3333_3333_3333_3333),
        (1, 0x5555_5555_5555_5555),
    ];
    for (j, low) in LOW_HALVES {
        for r in (0..64).filter(|r| r & j == 0) {
            // Row r's high halves trade places with row r + j's low ones.
            let t = ((a[r] >> j) ^ a[r + j]) & low;
            a[r] ^= t << j;
            a[r + j] ^= t;
        }
    }
}

/// The decoded filters of sealed partitions, each under its partition and
/// the checksum its row names, grouped as they arrive (module docs).
#[derive(Debug, Default)]
pub(super) struct Kept {
    by_partition: HashMap<u64, (FilterChecksum, Arc<PartitionFilter>)>,
    /// While set (an open keeping every stored filter), kept filters are
    /// not grouped one by one: [`Self::group_deferred`] groups them all at
    /// once, each copied once instead of the tail being copied per filter.
    deferred: bool,
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
        if self.deferred || filter.is_grouped() || blocks > MAX_GROUPED_BLOCKS {
            self.by_partition
                .insert(partition, (checksum, filter.clone()));
            return filter;
        }
        let mut members = self.live_tail(blocks, Some(partition), filter.hasher_identity());
        if members.len() >= GROUP_WIDTH {
            members.clear();
        }
        members.push((partition, checksum, filter.clone()));
        // The common case, a seal or an open: the whole tail is live and
        // takes one more member; its rows are copied as they are.
        let appended = self
            .tails
            .get(&blocks)
            .filter(|tail| tail.members.len() + 1 == members.len())
            .and_then(|tail| tail.appended(&members));
        let Some(group) = appended.or_else(|| FilterGroup::build(blocks, &members)) else {
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
    /// checksum they were grouped with and hashing with `hasher` (not
    /// `except`, a partition being kept again), with their kept filters.
    fn live_tail(
        &self,
        blocks: usize,
        except: Option<u64>,
        hasher: u64,
    ) -> Vec<(u64, FilterChecksum, Arc<PartitionFilter>)> {
        let Some(tail) = self.tails.get(&blocks) else {
            return Vec::new();
        };
        tail.members
            .iter()
            .filter(|(p, _)| Some(*p) != except)
            .filter_map(|(p, sum)| {
                let kept = self.get(*p, sum)?;
                let fits = kept.block_count() == blocks && kept.hasher_identity() == hasher;
                fits.then_some((*p, *sum, kept))
            })
            .collect()
    }

    /// Keeps filters ungrouped from now until [`Self::group_deferred`].
    pub(super) fn defer(&mut self) {
        self.deferred = true;
    }

    /// Groups every filter kept since [`Self::defer`], after the live
    /// members of the tail of its block count, in partition order: full
    /// groups of [`GROUP_WIDTH`] and a new tail of the rest. Filters whose
    /// group cannot be allocated stay on their own. Views of the filters
    /// kept before (the kept ones and the tail's) are replaced: callers
    /// take them again (`Probes::refresh`).
    pub(super) fn group_deferred(&mut self) {
        self.deferred = false;
        let mut waiting: HashMap<usize, Vec<(u64, FilterChecksum, Arc<PartitionFilter>)>> =
            HashMap::new();
        for (p, (sum, filter)) in &self.by_partition {
            let blocks = filter.block_count();
            if !filter.is_grouped() && blocks <= MAX_GROUPED_BLOCKS {
                waiting
                    .entry(blocks)
                    .or_default()
                    .push((*p, *sum, filter.clone()));
            }
        }
        for (blocks, mut own) in waiting {
            own.sort_by_key(|(p, _, _)| *p);
            let Some((_, _, first)) = own.first() else {
                continue;
            };
            let mut members = self.live_tail(blocks, None, first.hasher_identity());
            members.extend(own);
            for chunk in members.chunks(GROUP_WIDTH) {
                let Some(group) = FilterGroup::build(blocks, chunk) else {
                    continue;
                };
                let group = Arc::new(group);
                for (slot, (p, sum, member)) in chunk.iter().enumerate() {
                    let view = Arc::new(member.in_group(group.clone(), slot));
                    self.by_partition.insert(*p, (*sum, view));
                }
                self.tails.insert(blocks, group);
            }
        }
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
