//! The engine's configuration: a preset with overrides, validated once.
use super::blockhash::HashAlgo;
use super::latency::LatencyModel;
use super::preset::{preset, DEFAULT_PRESET, PRESETS};
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

/// A preset name plus optional overrides, as a CLI or a binding receives them (`None`: the
/// preset's value). Integers are signed so that a negative value is reported by name.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineOptions {
    pub preset: String,
    pub block_size: Option<i64>,
    pub num_gpu_blocks: Option<i64>,
    pub num_cpu_blocks: i64,
    pub max_num_seqs: Option<i64>,
    pub max_num_batched_tokens: Option<i64>,
    pub hash_algo: String,
    pub hash_seed: Option<String>,
    pub seed: u64,
    pub vocab_size: i64,
    pub lora_paths: Vec<(String, String)>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            preset: DEFAULT_PRESET.into(),
            block_size: None,
            num_gpu_blocks: None,
            num_cpu_blocks: 0,
            max_num_seqs: None,
            max_num_batched_tokens: None,
            hash_algo: HashAlgo::Sha256.name().into(),
            hash_seed: None,
            seed: 0,
            vocab_size: 128_000,
            lora_paths: Vec::new(),
        }
    }
}

/// `v` as a `usize`, or an error naming `name`.
fn size(name: &str, v: i64) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::InvalidArgument(format!("{name} must be >= 0, got {v}")))
}

impl EngineOptions {
    /// The validated configuration.
    pub fn resolve(&self) -> Result<EngineConfig> {
        let mut c = EngineConfig::from_preset(&self.preset)?;
        let pick = |name, v: Option<i64>, default| v.map_or(Ok(default), |v| size(name, v));
        c.block_size = pick("block_size", self.block_size, c.block_size)?;
        c.num_gpu_blocks = pick("num_gpu_blocks", self.num_gpu_blocks, c.num_gpu_blocks)?;
        c.num_cpu_blocks = size("num_cpu_blocks", self.num_cpu_blocks)?;
        c.max_num_seqs = pick("max_num_seqs", self.max_num_seqs, c.max_num_seqs)?;
        c.max_num_batched_tokens = pick(
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            c.max_num_batched_tokens,
        )?;
        c.hash_algo = HashAlgo::parse(&self.hash_algo).ok_or_else(|| {
            let known: Vec<_> = HashAlgo::ALL.iter().map(|a| a.name()).collect();
            Error::InvalidArgument(format!(
                "unknown hash_algo {:?} (known: {})",
                self.hash_algo,
                known.join(", ")
            ))
        })?;
        c.hash_seed = self.hash_seed.clone();
        c.seed = self.seed;
        c.vocab_size = u32::try_from(self.vocab_size).map_err(|_| {
            Error::InvalidArgument(format!(
                "vocab_size must be in 1..2^32, got {}",
                self.vocab_size
            ))
        })?;
        c.lora_paths = self.lora_paths.clone();
        c.validate()?;
        Ok(c)
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

    #[test]
    fn options_override_the_preset_and_name_bad_values() {
        let o = EngineOptions {
            preset: "dynamo-mocker".into(),
            num_gpu_blocks: Some(100),
            hash_algo: "xxh3".into(),
            ..Default::default()
        };
        let c = o.resolve().unwrap();
        assert_eq!(
            (c.block_size, c.num_gpu_blocks, c.hash_algo),
            (64, 100, HashAlgo::Xxh3)
        );
        for (o, what) in [
            (
                EngineOptions {
                    block_size: Some(-1),
                    ..Default::default()
                },
                "block_size",
            ),
            (
                EngineOptions {
                    num_cpu_blocks: -3,
                    ..Default::default()
                },
                "num_cpu_blocks",
            ),
            (
                EngineOptions {
                    hash_algo: "md5".into(),
                    ..Default::default()
                },
                "hash_algo",
            ),
            (
                EngineOptions {
                    vocab_size: 0,
                    ..Default::default()
                },
                "vocab_size",
            ),
            (
                EngineOptions {
                    max_num_seqs: Some(0),
                    ..Default::default()
                },
                "max_num_seqs",
            ),
            (
                EngineOptions {
                    preset: "x".into(),
                    ..Default::default()
                },
                "preset",
            ),
        ] {
            let e = o.resolve().unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        }
    }
}
