//! The prototype's key filter: a blocked Bloom filter over std's
//! SipHash of the record key (the engine's is `src/store/redb/partition/
//! filter.rs`, over seeded rapidhash v3).

use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;

use super::mix;

pub(crate) fn key_hash(k: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    h.write(k);
    h.finish()
}

/// A blocked Bloom filter: one 512-bit block per key, `BLOOM_PROBES` bits
/// set in it.
/// It answers "absent" or "maybe", never "present".
pub(crate) struct Bloom {
    blocks: Vec<[u64; 8]>,
}

const BLOOM_BITS_PER_KEY: usize = 24;
const BLOOM_PROBES: u64 = 11;

impl Bloom {
    pub(crate) fn with_capacity(keys: usize) -> Bloom {
        Bloom {
            blocks: vec![[0; 8]; (keys * BLOOM_BITS_PER_KEY).div_ceil(512).max(1)],
        }
    }

    fn probes(&self, h: u64) -> (usize, impl Iterator<Item = usize>) {
        let block = ((u128::from(h) * self.blocks.len() as u128) >> 64) as usize;
        let bits = (0..BLOOM_PROBES).map(move |j| (mix(h ^ j) & 511) as usize);
        (block, bits)
    }

    pub(crate) fn insert(&mut self, h: u64) {
        let (b, bits) = self.probes(h);
        for bit in bits {
            self.blocks[b][bit / 64] |= 1 << (bit % 64);
        }
    }

    pub(crate) fn maybe(&self, h: u64) -> bool {
        let (b, mut bits) = self.probes(h);
        let block = &self.blocks[b];
        bits.all(|bit| block[bit / 64] & (1 << (bit % 64)) != 0)
    }

    pub(crate) fn bytes(&self) -> usize {
        self.blocks.len() * 64
    }
}
