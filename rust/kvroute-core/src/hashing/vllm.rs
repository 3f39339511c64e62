//! vLLM-compatible block hashes: [`VllmHasher`] reproduces the engine's own block hashes
//! byte-for-byte (`--prefix-caching-hash-algo sha256` and `sha256_cbor`), and [`event_hash`] is
//! the u64 that events carry.

use sha2::{Digest as _, Sha256};

use super::cbor::Cbor;
use super::encoder::{Encoder, PyStr};
use super::pickle::Pickler;

/// The vLLM `--prefix-caching-hash-algo` values this module reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VllmHashAlgo {
    /// `sha256`: SHA-256 of `pickle.dumps(x, protocol=5)` (vLLM's default).
    Sha256,
    /// `sha256_cbor`: SHA-256 of `cbor2.dumps(x, canonical=True)`.
    Sha256Cbor,
}

impl VllmHashAlgo {
    /// Parses vLLM's flag value (`"sha256"`, `"sha256_cbor"`). The xxhash variants are not
    /// supported: their seed is random per process, so they cannot be reproduced from outside.
    #[must_use]
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "sha256" => Some(Self::Sha256),
            "sha256_cbor" => Some(Self::Sha256Cbor),
            _ => None,
        }
    }
}

/// A full vLLM block hash (SHA-256 digest). The chain uses full digests; events carry only
/// [`event_hash`] of them.
pub type Digest = [u8; 32];

/// One entry of a block's extra keys, as vLLM puts it into the hash input: each is a *tagged*
/// tuple, `("lora", name, path)`, `("mm", id, offset)` or `("cache_salt", salt)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraKey {
    /// LoRA adapter: its name and its path (the path is in the hash but not in events).
    Lora { name: String, path: String },
    /// A multimodal input overlapping the block: its identifier and its start offset relative to
    /// the block's first token (negative when the input began in an earlier block).
    Mm { id: String, offset: i64 },
    /// The request's cache salt (block 0 only).
    CacheSalt(String),
}

/// The seed vLLM 0.33 hashes into `NONE_HASH` when `PYTHONHASHSEED` is unset (sha256 and
/// sha256_cbor; older releases used a random seed instead).
pub(super) const VLLM_NONE_HASH_SEED: &str = "vllm-none-hash";

/// Reproduces vLLM's block hashes: `H((parent_digest, tuple(tokens), extra_keys_or_None))`, with
/// `NONE_HASH = H(seed)` as the parent of block 0.
#[derive(Debug, Clone)]
pub struct VllmHasher {
    algo: VllmHashAlgo,
    none_hash: Digest,
}

impl VllmHasher {
    /// A hasher for one engine configuration.
    ///
    /// `seed`: the engine's `PYTHONHASHSEED` value if it has one set, else `None`, which means
    /// `"vllm-none-hash"` (the vLLM 0.33 rule; older releases used a random seed, which cannot
    /// be reproduced). The seed is hashed as a Python `str`, as vLLM passes the variable's text.
    #[must_use]
    pub fn new(algo: VllmHashAlgo, seed: Option<&str>) -> Self {
        let seed = seed.unwrap_or(VLLM_NONE_HASH_SEED);
        let mut buf = Vec::with_capacity(64);
        match algo {
            VllmHashAlgo::Sha256 => {
                let mut p = Pickler::new(&mut buf);
                p.str(PyStr::Value(seed));
                p.finish();
            }
            VllmHashAlgo::Sha256Cbor => Cbor(&mut buf).str(PyStr::Value(seed)),
        }
        Self {
            algo,
            none_hash: Sha256::digest(&buf).into(),
        }
    }

    /// The algorithm this hasher reproduces.
    #[must_use]
    pub fn algo(&self) -> VllmHashAlgo {
        self.algo
    }

    /// `NONE_HASH`, the parent of every chain's first block.
    #[must_use]
    pub fn none_hash(&self) -> Digest {
        self.none_hash
    }

    /// Hash of one block. `extra` is hashed as a tuple in the given order; an empty slice is
    /// `None` in the hash input (vLLM's `tuple(keys) if keys else None`).
    #[must_use]
    pub fn hash_block(&self, parent: &Digest, tokens: &[u32], extra: &[ExtraKey]) -> Digest {
        self.hash_block_with(&mut Vec::new(), parent, tokens, extra)
    }

    /// Chain over full blocks of `tokens` (a trailing partial block is ignored).
    ///
    /// The LoRA adapter `(name, path)` goes into every block's extra keys, the salt into block
    /// 0's only, in vLLM's order (lora, mm, cache_salt). An empty salt adds nothing, as in vLLM,
    /// which tests the salt for truthiness. (Multimodal keys depend on where each input sits;
    /// hash such blocks with [`Self::hash_block`].)
    ///
    /// # Panics
    /// If `block_size` is 0.
    #[must_use]
    pub fn block_hashes(
        &self,
        tokens: &[u32],
        block_size: usize,
        lora: Option<(&str, &str)>,
        salt: Option<&str>,
    ) -> Vec<Digest> {
        assert!(block_size > 0, "block_size must be at least 1");
        let lora_key = lora.map(|(name, path)| ExtraKey::Lora {
            name: name.to_owned(),
            path: path.to_owned(),
        });
        let later: Vec<ExtraKey> = lora_key.into_iter().collect();
        let mut first = later.clone();
        if let Some(salt) = salt.filter(|s| !s.is_empty()) {
            first.push(ExtraKey::CacheSalt(salt.to_owned()));
        }

        let mut buf = Vec::with_capacity(16 + 6 * block_size);
        let mut out = Vec::with_capacity(tokens.len() / block_size);
        let mut parent = self.none_hash;
        for (i, block) in tokens.chunks_exact(block_size).enumerate() {
            let extra = if i == 0 { &first } else { &later };
            parent = self.hash_block_with(&mut buf, &parent, block, extra);
            out.push(parent);
        }
        out
    }

    /// [`Self::hash_block`] serialising into a caller-owned buffer, so a caller hashing many
    /// blocks (a chain, an engine simulator) allocates nothing per block.
    pub fn hash_block_with(
        &self,
        buf: &mut Vec<u8>,
        parent: &Digest,
        tokens: &[u32],
        extra: &[ExtraKey],
    ) -> Digest {
        buf.clear();
        match self.algo {
            VllmHashAlgo::Sha256 => {
                let mut p = Pickler::new(buf);
                encode_block_input(&mut p, parent, tokens, extra);
                p.finish();
            }
            VllmHashAlgo::Sha256Cbor => encode_block_input(&mut Cbor(buf), parent, tokens, extra),
        }
        Sha256::digest(&buf[..]).into()
    }
}

/// The u64 that events carry: low 64 bits of the digest read big-endian (last 8 bytes, BE).
///
/// This is vLLM's `int.from_bytes(digest, "big") & (2**64 - 1)`.
#[must_use]
pub fn event_hash(d: &Digest) -> u64 {
    let mut low = [0u8; 8];
    low.copy_from_slice(&d[24..]);
    u64::from_be_bytes(low)
}

/// Emits vLLM's hash input `(parent, tuple(tokens), tuple(extra) or None)` into an encoder.
pub(super) fn encode_block_input<'a, E: Encoder<'a>>(
    e: &mut E,
    parent: &'a Digest,
    tokens: &[u32],
    extra: &'a [ExtraKey],
) {
    e.tuple_begin(3);
    e.bytes(parent);
    e.tuple_begin(tokens.len());
    for &t in tokens {
        e.int(i64::from(t));
    }
    e.tuple_end(tokens.len());
    if extra.is_empty() {
        e.none();
    } else {
        e.tuple_begin(extra.len());
        for key in extra {
            match key {
                ExtraKey::Lora { name, path } => {
                    e.tuple_begin(3);
                    e.str(PyStr::Literal("lora"));
                    e.str(PyStr::Value(name));
                    e.str(PyStr::Value(path));
                    e.tuple_end(3);
                }
                ExtraKey::Mm { id, offset } => {
                    e.tuple_begin(3);
                    e.str(PyStr::Literal("mm"));
                    e.str(PyStr::Value(id));
                    e.int(*offset);
                    e.tuple_end(3);
                }
                ExtraKey::CacheSalt(salt) => {
                    e.tuple_begin(2);
                    e.str(PyStr::Literal("cache_salt"));
                    e.str(PyStr::Value(salt));
                    e.tuple_end(2);
                }
            }
        }
        e.tuple_end(extra.len());
    }
    e.tuple_end(3);
}
