//! The engine's configuration: a preset with overrides, validated once.
use super::blockhash::HashAlgo;
use super::latency::LatencyModel;
use super::preset::{preset, PRESETS};
use crate::{Error, Result};

/// Everything an [`crate::sim::Engine`] is built from.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// The preset the defaults came from.
    pub preset: String,
    pub block_size: usize,
    /// GPU KV blocks, vLLM's null block included (`num_gpu_blocks - 1` are usable).
    pub num_gpu_blocks: usize,
    /// CPU offload tier capacity in blocks (0 = no tier).
    pub num_cpu_blocks: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub hash_algo: HashAlgo,
    /// The engine's `PYTHONHASHSEED` (`None`: unset).
    pub hash_seed: Option<String>,
    /// Seeds the generated tokens.
    pub seed: u64,
    pub vocab_size: u32,
    /// LoRA adapters as `(name, path)`; the path enters the block hash, and adapters get vLLM
    /// integer ids 1, 2, ... in this order.
    pub lora_paths: Vec<(String, String)>,
    pub latency: LatencyModel,
    /// Collect KV events (off only for runs that never look at them).
    pub emit_events: bool,
}

impl EngineConfig {
    /// The named preset's configuration with the simulator's other defaults (`sha256` hashes, no
    /// CPU tier, seed 0, a 128,000-token vocabulary).
    pub fn from_preset(name: &str) -> Result<Self> {
        let p = preset(name).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "unknown engine preset {name:?} (known: {})",
                PRESETS.join(", ")
            ))
        })?;
        Ok(EngineConfig {
            preset: p.name.to_owned(),
            block_size: p.block_size,
            num_gpu_blocks: p.num_gpu_blocks,
            num_cpu_blocks: 0,
            max_num_seqs: p.max_num_seqs,
            max_num_batched_tokens: p.max_num_batched_tokens,
            hash_algo: HashAlgo::Sha256,
            hash_seed: None,
            seed: 0,
            vocab_size: 128_000,
            lora_paths: Vec::new(),
            latency: p.latency,
            emit_events: true,
        })
    }

    /// Checks every value; the first bad one is reported.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(Error::InvalidArgument(what));
        if self.block_size == 0 || self.block_size > 1 << 16 {
            return bad(format!(
                "block_size must be in 1..=65536, got {}",
                self.block_size
            ));
        }
        if self.num_gpu_blocks < 2 || self.num_gpu_blocks >= u32::MAX as usize {
            return bad(format!(
                "num_gpu_blocks must be at least 2 (one is vLLM's null block), got {}",
                self.num_gpu_blocks
            ));
        }
        if self.num_cpu_blocks >= u32::MAX as usize {
            return bad(format!("num_cpu_blocks too large: {}", self.num_cpu_blocks));
        }
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs must be positive".into());
        }
        if self.max_num_batched_tokens == 0 {
            return bad("max_num_batched_tokens must be positive".into());
        }
        if self.vocab_size == 0 {
            return bad("vocab_size must be positive".into());
        }
        let coefs = self.latency.items();
        if let Some((name, v)) = coefs.iter().find(|(_, v)| !v.is_finite()) {
            return bad(format!(
                "latency coefficient {name} must be finite, got {v}"
            ));
        }
        Ok(())
    }

    /// The vLLM integer id and path of LoRA adapter `name` (configured adapters first; others
    /// get the adapter's name as path and the next free id).
    pub fn lora(&self, name: &str) -> (i64, String) {
        match self.lora_paths.iter().position(|(n, _)| n == name) {
            Some(i) => (i as i64 + 1, self.lora_paths[i].1.clone()),
            None => (self.lora_paths.len() as i64 + 1, name.to_owned()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_validate_and_bad_values_are_named() {
        for p in PRESETS {
            EngineConfig::from_preset(p).unwrap().validate().unwrap();
        }
        assert!(EngineConfig::from_preset("gpt-9").is_err());
        let mut c = EngineConfig::from_preset("dynamo-mocker").unwrap();
        c.num_gpu_blocks = 1;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("num_gpu_blocks"), "{e}");
    }
}
