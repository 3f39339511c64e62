//! One request inside the simulated engine: its tokens, block hashes, blocks and progress, and
//! the deterministic token generator.
use std::sync::Arc;

use super::blockhash::{Chain, EngineHasher};
use super::cache::{BlockId, SeqView};

/// A request as handed to [`crate::sim::Engine::add_request`].
#[derive(Debug, Clone, PartialEq)]
pub struct NewRequest {
    pub id: Arc<str>,
    /// Caller data echoed in every output (the replay driver keeps its trace index here).
    pub tag: u64,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub lora: Option<String>,
    pub salt: Option<String>,
    pub ignore_eos: bool,
    pub eos_token_id: Option<u32>,
}

impl NewRequest {
    /// A plain request: no LoRA, no salt, EOS ignored.
    pub fn new(id: &str, prompt: Vec<u32>, max_tokens: u32) -> Self {
        NewRequest {
            id: id.into(),
            tag: 0,
            prompt,
            max_tokens,
            lora: None,
            salt: None,
            ignore_eos: true,
            eos_token_id: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    Waiting,
    Running,
}

/// Engine-side state of one request.
#[derive(Debug)]
pub(crate) struct Req {
    pub id: Arc<str>,
    pub tag: u64,
    /// Prompt then output tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub max_tokens: usize,
    /// Tokens whose KV is computed (or loaded); vLLM's `num_computed_tokens`.
    pub computed: usize,
    /// Engine hashes of the full blocks of `tokens`.
    pub hashes: Vec<u64>,
    pub chain: Chain,
    pub blocks: Vec<BlockId>,
    /// Leading blocks already cached (announced); vLLM's `num_cached_block`.
    pub num_cached_blocks: usize,
    pub lora: Option<Arc<str>>,
    pub lora_id: Option<i64>,
    pub salt: Option<Arc<str>>,
    pub eos: Option<u32>,
    /// Seeds the token generator: a hash of the engine seed and the request id.
    pub token_seed: u64,
    pub status: Status,
    pub preemptions: u32,
    /// Prompt tokens found cached (GPU and CPU) when first scheduled.
    pub num_cached_tokens: Option<usize>,
}

impl Req {
    pub fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    pub fn view(&self) -> SeqView<'_> {
        SeqView {
            tokens: &self.tokens,
            hashes: &self.hashes,
            lora_name: self.lora.as_deref(),
            lora_id: self.lora_id,
            salt: self.salt.as_deref(),
        }
    }

    /// Hashes every full block of `tokens` not hashed yet.
    pub fn extend_hashes(&mut self, hasher: &EngineHasher, block_size: usize, buf: &mut Vec<u8>) {
        let full = self.tokens.len() / block_size;
        for i in self.hashes.len()..full {
            let h = hasher.next(
                &mut self.chain,
                &self.tokens[i * block_size..(i + 1) * block_size],
                buf,
            );
            self.hashes.push(h);
        }
    }

    /// The next output token: a pure function of the seed, the request id and the position, so
    /// scheduling, preemption and batching never change what a request generates.
    pub fn next_token(&self, vocab_size: u32) -> u32 {
        let x = splitmix64(
            self.token_seed ^ (self.output_len() as u64).wrapping_mul(0xa076_1d64_78bd_642f),
        );
        (x % u64::from(vocab_size.max(1))) as u32
    }
}

/// One step of the splitmix64 generator (a good 64-bit mixer).
#[inline]
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Seed of a request's tokens.
pub fn token_seed(engine_seed: u64, id: &str) -> u64 {
    splitmix64(engine_seed ^ xxhash_rust::xxh3::xxh3_64(id.as_bytes()))
}
