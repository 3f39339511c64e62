//! A hasher for map keys that are already hashes (block hashes).
use std::hash::{BuildHasher, Hasher};

/// Hasher for keys that are already hashes: one multiply spreads them over hashbrown's control
/// bits (which come from the top of the value) without the cost of SipHash.
#[derive(Debug, Clone, Copy, Default)]
pub struct IdHashBuilder;

#[derive(Debug, Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = x.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

impl BuildHasher for IdHashBuilder {
    type Hasher = IdHasher;
    fn build_hasher(&self) -> IdHasher {
        IdHasher(0)
    }
}
