//! Block hashing: kvroute's own content hash chain, and vLLM-compatible hashes.
//!
//! Two hash families live here because they serve two different jobs:
//!
//! * **kvroute's chain** ([`root_hash`], [`chain_hash`], [`block_hashes`], [`extend_chain`]) keys
//!   the prefix index. It hashes the token ids that `BlockStored` events carry, so it never needs
//!   the engine's seed, hash algorithm or LoRA adapter path to agree with ours; it only has to be
//!   fast (it runs on every routed request) and collision-resistant enough for a cache index.
//!   xxh3-64 over the little-endian token bytes, chained through the parent hash, does both.
//! * **vLLM-compatible hashing** ([`VllmHasher`]) reproduces the engine's own block hashes
//!   byte-for-byte (`--prefix-caching-hash-algo sha256` and `sha256_cbor`). It is needed where an
//!   event carries only hashes (CPU-offload placeholders) and to check our reading of the engine
//!   against golden streams. vLLM hashes a Python object, so this module carries small,
//!   hand-written serialisers that are byte-identical to CPython's `pickle` (protocol 5) and to
//!   `cbor2.dumps(x, canonical=True)` for the few types that occur in a hash input.
//!
//! Layout: kvroute's chain is this file; `vllm.rs` holds [`VllmHasher`] and its hash input,
//! `encoder.rs` the Python-value model that both serialisers implement, and `pickle.rs` /
//! `cbor.rs` the serialisers themselves.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed, Xxh3Default};

mod cbor;
mod encoder;
mod pickle;
#[cfg(test)]
mod tests;
mod vllm;

pub use vllm::{event_hash, Digest, ExtraKey, VllmHashAlgo, VllmHasher};

/// vLLM's default `--block-size` (tokens per KV block).
pub const DEFAULT_BLOCK_SIZE: usize = 16;

// ------------------------------------------------------------------------------------------------
// kvroute's own chain (xxh3-64)
// ------------------------------------------------------------------------------------------------

/// Domain separator for [`root_hash`]: keeps a root's hash input apart from any block's input
/// (which starts with an 8-byte parent hash), and versions the scheme.
const ROOT_DOMAIN: &[u8] = b"kvroute/root/v1";

/// Tokens converted per fill of the stack buffer. 64 covers the usual block sizes (16, 32, 64) in
/// one one-shot xxh3 call; larger blocks stream through the same buffer.
const CHUNK_TOKENS: usize = 64;
/// Parent hash (8 bytes) followed by up to [`CHUNK_TOKENS`] little-endian `u32`s.
const BUF_BYTES: usize = 8 + 4 * CHUNK_TOKENS;

/// Seed of kvroute's chain for one request: covers the LoRA adapter name and the cache salt.
///
/// Requests with different adapters or salts must never share KV blocks, and since every block
/// hash chains from the root, putting both into the root separates *every* block (block 0 and all
/// later ones) without touching the per-block hot loop. Each field is encoded as absent (`0`) or
/// present (`1`, length, bytes), so `None` and `Some("")` differ and a value cannot move between
/// the LoRA and the salt slot.
#[must_use]
pub fn root_hash(lora: Option<&str>, salt: Option<&str>) -> u64 {
    fn field(h: &mut Xxh3Default, value: Option<&str>) {
        match value {
            None => h.update(&[0]),
            Some(s) => {
                h.update(&[1]);
                h.update(&(s.len() as u64).to_le_bytes());
                h.update(s.as_bytes());
            }
        }
    }
    let mut h = Xxh3Default::new();
    h.update(ROOT_DOMAIN);
    field(&mut h, lora);
    field(&mut h, salt);
    h.digest()
}

/// Hash of one block given its parent's hash: xxh3-64 of `parent (LE) ++ tokens (LE u32s)`.
///
/// `extra` is an optional digest of anything else that distinguishes the block's KV (e.g. a
/// multimodal input); `0` means "none" and gives exactly the hash without extra, so callers that
/// have nothing extra need no separate code path.
#[must_use]
pub fn chain_hash(parent: u64, tokens: &[u32], extra: u64) -> u64 {
    let mut buf = [0u8; BUF_BYTES];
    mix_extra(chain_hash_buf(&mut buf, parent, tokens), extra)
}

/// Full-block hashes of `tokens` for a request with the given LoRA adapter name and cache salt.
/// A trailing partial block is ignored: the engine never caches it.
///
/// # Panics
/// If `block_size` is 0.
#[must_use]
pub fn block_hashes(
    tokens: &[u32],
    block_size: usize,
    lora: Option<&str>,
    salt: Option<&str>,
) -> Vec<u64> {
    let mut out = Vec::new();
    block_hashes_into(tokens, block_size, lora, salt, &mut out);
    out
}

/// Like [`block_hashes`], but writes into `out` (cleared first) so a caller can reuse one buffer
/// across requests.
///
/// # Panics
/// If `block_size` is 0.
pub fn block_hashes_into(
    tokens: &[u32],
    block_size: usize,
    lora: Option<&str>,
    salt: Option<&str>,
    out: &mut Vec<u64>,
) {
    out.clear();
    extend_chain(root_hash(lora, salt), tokens, block_size, out);
}

/// Continues a chain from a known parent hash: appends the hashes of the full blocks of `tokens`
/// to `out` (a trailing partial block is ignored). A `BlockStored` event with a parent, or a
/// request whose prefix was hashed before, is hashed this way without re-hashing the prefix.
///
/// # Panics
/// If `block_size` is 0.
pub fn extend_chain(parent: u64, tokens: &[u32], block_size: usize, out: &mut Vec<u64>) {
    assert!(block_size > 0, "block_size must be at least 1");
    out.reserve(tokens.len() / block_size);
    // One stack buffer for the whole chain: no allocation per block, and it is zeroed once.
    let mut buf = [0u8; BUF_BYTES];
    let mut hash = parent;
    for block in tokens.chunks_exact(block_size) {
        hash = chain_hash_buf(&mut buf, hash, block);
        out.push(hash);
    }
}

/// xxh3-64 of `parent.to_le_bytes() ++ le_bytes(tokens)`, built in `buf` without allocating.
/// Blocks longer than [`CHUNK_TOKENS`] stream through the buffer; the streaming and one-shot
/// xxh3 APIs give the same value for the same bytes, so the result depends on the bytes alone.
#[inline]
fn chain_hash_buf(buf: &mut [u8; BUF_BYTES], parent: u64, tokens: &[u32]) -> u64 {
    if tokens.len() > CHUNK_TOKENS {
        return chain_hash_streamed(buf, parent, tokens);
    }
    buf[..8].copy_from_slice(&parent.to_le_bytes());
    let end = 8 + 4 * tokens.len();
    write_le(&mut buf[8..end], tokens);
    xxh3_64(&buf[..end])
}

/// The rare path of [`chain_hash_buf`], kept out of line so the common one stays small enough
/// to inline into the chain loop (the streaming state alone is over 500 bytes).
#[cold]
#[inline(never)]
fn chain_hash_streamed(buf: &mut [u8; BUF_BYTES], parent: u64, tokens: &[u32]) -> u64 {
    let mut h = Xxh3Default::new();
    h.update(&parent.to_le_bytes());
    for chunk in tokens.chunks(CHUNK_TOKENS) {
        let end = 4 * chunk.len();
        write_le(&mut buf[..end], chunk);
        h.update(&buf[..end]);
    }
    h.digest()
}

/// Writes `tokens` as little-endian `u32`s into `dst` (exactly `4 * tokens.len()` bytes): the
/// safe stand-in for a byte cast. Four tokens go out as one 16-byte store, because xxh3 reads its
/// input in 8-byte words: a load that spans two separate 4-byte stores cannot be forwarded from
/// the store buffer and stalls (token-by-token stores measured 2-3x slower for the whole chain).
#[inline]
fn write_le(dst: &mut [u8], tokens: &[u32]) {
    let mut quads = tokens.chunks_exact(4);
    let mut out = dst.chunks_exact_mut(16);
    for (d, q) in (&mut out).zip(&mut quads) {
        let word = u128::from(q[0])
            | (u128::from(q[1]) << 32)
            | (u128::from(q[2]) << 64)
            | (u128::from(q[3]) << 96);
        d.copy_from_slice(&word.to_le_bytes());
    }
    for (d, t) in out
        .into_remainder()
        .chunks_exact_mut(4)
        .zip(quads.remainder())
    {
        d.copy_from_slice(&t.to_le_bytes());
    }
}

/// Folds an extra digest into a block hash; `0` leaves the hash unchanged (see [`chain_hash`]).
#[inline]
fn mix_extra(hash: u64, extra: u64) -> u64 {
    if extra == 0 {
        hash
    } else {
        xxh3_64_with_seed(&extra.to_le_bytes(), hash)
    }
}
