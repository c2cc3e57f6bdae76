//! splitmix64: a small, seedable generator for the tests that pick random
//! offsets, delays or bodies (no dependency, the same sequence everywhere,
//! so a seed printed by a failing run replays it).

#![allow(dead_code)] // each test file uses some of it

/// The generator; its state is the seed.
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next value of the sequence.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0; the bias is negligible for these sizes).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
