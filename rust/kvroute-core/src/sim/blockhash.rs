//! The simulated engine's own block hashes: what it publishes in `BlockStored`/`BlockRemoved`.
//!
//! vLLM hashes `(parent_digest, tuple(tokens), extra_keys)` per full block, chained from
//! `NONE_HASH`; the extra keys are `("lora", name, path)` on every block and `("cache_salt",
//! salt)` on block 0 only (`shared/docs/vllm.md` §2). `sha256` and `sha256_cbor` reproduce that
//! exactly ([`VllmHasher`]). `xxh3` is the simulator's fast option for large replays: the engine
//! hash is then kvroute's own content chain ([`crate::hashing::chain_hash`] rooted in
//! [`crate::hashing::root_hash`] of the LoRA name and salt), the same value the router's index
//! computes from the event's tokens.
use crate::hashing::{
    chain_hash, event_hash, root_hash, Digest, ExtraKey, VllmHashAlgo, VllmHasher,
};

/// The engine's `--prefix-caching-hash-algo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HashAlgo {
    /// vLLM's default: SHA-256 of the pickled hash input.
    Sha256,
    /// SHA-256 of the canonical CBOR hash input.
    Sha256Cbor,
    /// kvroute's xxh3 content chain (simulator only; fast).
    Xxh3,
}

impl HashAlgo {
    pub const ALL: [HashAlgo; 3] = [HashAlgo::Sha256, HashAlgo::Sha256Cbor, HashAlgo::Xxh3];

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            HashAlgo::Sha256 => "sha256",
            HashAlgo::Sha256Cbor => "sha256_cbor",
            HashAlgo::Xxh3 => "xxh3",
        }
    }
}

/// Hashes blocks for one engine configuration (algorithm and seed).
#[derive(Debug, Clone)]
pub struct EngineHasher {
    vllm: Option<VllmHasher>,
}

/// Where one request's chain stands: the parent of its next full block.
#[derive(Debug, Clone)]
pub struct Chain {
    parent: Parent,
    /// Blocks hashed so far (block 0 carries the salt).
    blocks: usize,
    /// vLLM extra keys for block 0 and for later blocks (empty for xxh3).
    first: Vec<ExtraKey>,
    rest: Vec<ExtraKey>,
}

#[derive(Debug, Clone, Copy)]
enum Parent {
    Digest(Digest),
    Fast(u64),
}

impl EngineHasher {
    /// `seed` is the engine's `PYTHONHASHSEED` (`None`: vLLM 0.33's fixed `"vllm-none-hash"`); the
    /// xxh3 chain has no seed.
    pub fn new(algo: HashAlgo, seed: Option<&str>) -> Self {
        let vllm = match algo {
            HashAlgo::Sha256 => Some(VllmHasher::new(VllmHashAlgo::Sha256, seed)),
            HashAlgo::Sha256Cbor => Some(VllmHasher::new(VllmHashAlgo::Sha256Cbor, seed)),
            HashAlgo::Xxh3 => None,
        };
        EngineHasher { vllm }
    }

    /// A new chain for a request with this LoRA adapter (`(name, path)`) and cache salt. An empty
    /// salt counts as none, as in vLLM (which tests it for truthiness).
    pub fn start(&self, lora: Option<(&str, &str)>, salt: Option<&str>) -> Chain {
        let salt = salt.filter(|s| !s.is_empty());
        match &self.vllm {
            None => Chain {
                parent: Parent::Fast(root_hash(lora.map(|(name, _)| name), salt)),
                blocks: 0,
                first: Vec::new(),
                rest: Vec::new(),
            },
            Some(v) => {
                let rest: Vec<ExtraKey> = lora
                    .map(|(name, path)| ExtraKey::Lora {
                        name: name.to_owned(),
                        path: path.to_owned(),
                    })
                    .into_iter()
                    .collect();
                let mut first = rest.clone();
                first.extend(salt.map(|s| ExtraKey::CacheSalt(s.to_owned())));
                Chain {
                    parent: Parent::Digest(v.none_hash()),
                    blocks: 0,
                    first,
                    rest,
                }
            }
        }
    }

    /// Hashes the chain's next full block and advances it; returns the event hash (the u64 the
    /// engine publishes). `buf` is scratch space reused across calls.
    pub fn next(&self, chain: &mut Chain, tokens: &[u32], buf: &mut Vec<u8>) -> u64 {
        let out = match (&self.vllm, chain.parent) {
            (Some(v), Parent::Digest(parent)) => {
                let extra = if chain.blocks == 0 {
                    &chain.first
                } else {
                    &chain.rest
                };
                let d = v.hash_block_with(buf, &parent, tokens, extra);
                chain.parent = Parent::Digest(d);
                event_hash(&d)
            }
            (_, Parent::Fast(parent)) => {
                let h = chain_hash(parent, tokens, 0);
                chain.parent = Parent::Fast(h);
                h
            }
            (None, Parent::Digest(_)) => unreachable!("a digest chain comes from a vLLM hasher"),
        };
        chain.blocks += 1;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::block_hashes;

    #[test]
    fn sha_chains_equal_vllm_hasher_values_with_lora_and_salt() {
        let tokens: Vec<u32> = (0..64).collect();
        for algo in [HashAlgo::Sha256, HashAlgo::Sha256Cbor] {
            let vllm_algo = if algo == HashAlgo::Sha256 {
                VllmHashAlgo::Sha256
            } else {
                VllmHashAlgo::Sha256Cbor
            };
            for (lora, salt) in [(None, None), (Some(("a", "/p/a")), Some("s1"))] {
                let want: Vec<u64> = VllmHasher::new(vllm_algo, Some("7"))
                    .block_hashes(&tokens, 16, lora, salt)
                    .iter()
                    .map(event_hash)
                    .collect();
                let h = EngineHasher::new(algo, Some("7"));
                let mut chain = h.start(lora, salt);
                let mut buf = Vec::new();
                let got: Vec<u64> = tokens
                    .chunks_exact(16)
                    .map(|b| h.next(&mut chain, b, &mut buf))
                    .collect();
                assert_eq!(got, want, "{algo:?} {lora:?} {salt:?}");
            }
        }
    }

    #[test]
    fn xxh3_chain_is_the_routers_content_hash() {
        let tokens: Vec<u32> = (100..164).collect();
        let h = EngineHasher::new(HashAlgo::Xxh3, None);
        let mut chain = h.start(Some(("l", "/ignored")), Some("salt"));
        let mut buf = Vec::new();
        let got: Vec<u64> = tokens
            .chunks_exact(16)
            .map(|b| h.next(&mut chain, b, &mut buf))
            .collect();
        assert_eq!(got, block_hashes(&tokens, 16, Some("l"), Some("salt")));
        // An empty salt is no salt.
        let mut c1 = h.start(None, Some(""));
        let mut c2 = h.start(None, None);
        assert_eq!(
            h.next(&mut c1, &tokens[..16], &mut buf),
            h.next(&mut c2, &tokens[..16], &mut buf)
        );
    }

    #[test]
    fn algo_names_round_trip() {
        for a in HashAlgo::ALL {
            assert_eq!(HashAlgo::parse(a.name()), Some(a));
        }
        assert_eq!(HashAlgo::parse("xxhash"), None);
    }
}
