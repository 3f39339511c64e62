//! Block hashing: kvroute's own content hash chain, and vLLM-compatible hashes.
//! (temporary minimal version; replaced by the hashing branch)
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

pub const DEFAULT_BLOCK_SIZE: usize = 16;

pub fn root_hash(lora: Option<&str>, salt: Option<&str>) -> u64 {
    let mut buf = b"kvroute/1".to_vec();
    for part in [lora, salt] {
        match part {
            Some(s) => {
                buf.push(1);
                buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
                buf.extend_from_slice(s.as_bytes());
            }
            None => buf.push(0),
        }
    }
    xxh3_64(&buf)
}

pub fn chain_hash(parent: u64, tokens: &[u32], extra: u64) -> u64 {
    let mut buf = Vec::with_capacity(tokens.len() * 4 + 8);
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    if extra != 0 {
        buf.extend_from_slice(&extra.to_le_bytes());
    }
    xxh3_64_with_seed(&buf, parent)
}

pub fn block_hashes(
    tokens: &[u32],
    block_size: usize,
    lora: Option<&str>,
    salt: Option<&str>,
) -> Vec<u64> {
    let mut out = Vec::new();
    let mut h = root_hash(lora, salt);
    for c in tokens.chunks_exact(block_size) {
        h = chain_hash(h, c, 0);
        out.push(h);
    }
    out
}
