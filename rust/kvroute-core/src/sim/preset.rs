//! Named engine configurations: cache geometry, batch limits and step-time constants.
//!
//! # Where the numbers come from
//!
//! The two Llama presets are derived from hardware and model specifications, with the two
//! efficiencies calibrated on published measurements:
//!
//! * H100 SXM (<https://www.nvidia.com/en-us/data-center/h100/>): 989 TFLOPS dense BF16, 3.35 TB/s
//!   HBM3, 80 GB; PCIe Gen5 x16 (64 GB/s per direction) to the host.
//! * Llama 3 8B (<https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json>):
//!   8.03 B parameters, 32 layers, hidden 4096, 8 KV heads of dimension 128, so 16.06 GB of BF16
//!   weights and `2 * 32 * 8 * 128 * 2` = 131,072 bytes of KV per token. Llama 3 70B
//!   (<https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json>): 70.6 B
//!   parameters, 80 layers, hidden 8192, 8 KV heads: 141.2 GB of weights, 327,680 KV bytes per
//!   token (1/8 of each on every GPU with tensor parallelism 8).
//! * Calibration: NVIDIA's NIM benchmarks
//!   (<https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance>) report, at concurrency 1,
//!   Llama-3.3-70B FP8 on 2x H100 with 5,000 input tokens: TTFT 406.77 ms and ITL 18.58 ms, and
//!   Llama-3.1-8B: ITL 4.63 ms. The TTFT implies ~46% of peak FLOPS for prefill (7.4e14 FLOPs in
//!   0.407 s on 2 x 1,979 FP8 TFLOPS), so prefill runs at 45% MFU here (40% with TP 8). The ITLs
//!   fit "weights read at 80% of HBM bandwidth + 1.5 ms per step + 20 us per all-reduce" (8B FP8:
//!   3.0 + 1.5 = 4.5 ms; 70B FP8 TP2: 13.2 + 1.5 + 3.2 = 17.9 ms), which gives the step overheads.
//!
//! So, per preset: `step_overhead = weights / (gpus * 3.35 TB/s * 0.8) + 1.5 ms (+ 2 * layers *
//! 20 us with TP)`, `prefill_s_per_token = 2 * params / (gpus * 989 TFLOPS * MFU)`,
//! `attn_s_per_token_pair = 4 * layers * hidden / (gpus * 989 TFLOPS * MFU)` (QK^T and PV),
//! `decode_s_per_ctx_token = KV bytes per token / (gpus * 3.35 TB/s * 0.8)`,
//! `cpu_load_s_per_token = KV bytes per token per GPU / (64 GB/s * 0.8)`. A decoding sequence
//! costs `decode_s_per_seq`, about 40% of a prefill token's compute (the rest overlaps with
//! reading the weights at small batch). KV capacity follows vLLM's `gpu_memory_utilization=0.9`
//! minus weights and ~4 GB of activations and CUDA graphs per GPU. Batch limits are vLLM's
//! defaults (`max_num_seqs=256`, `max_num_batched_tokens=8192`, block size 16).
//!
//! `dynamo-mocker` mirrors NVIDIA Dynamo's mocker engine as shipped in `ai-dynamo-runtime` 1.6.1:
//! the defaults of `dynamo._core._normalize_mocker_config({})` (block size 64, 16,384 GPU blocks,
//! 256 sequences, 8,192 batched tokens, chunked prefill, LIFO preemption) and its polynomial
//! timing model (`lib/mocker/src/common/perf_model.rs`, `PerfModel::Polynomial`, in
//! <https://github.com/ai-dynamo/dynamo>): prefill `16.50142 + 1.518344e-2 * T + 4.209989e-7 *
//! T^2` ms for `T` new tokens in the step, plus, when any request emits a token, decode
//! `max(1, 5.74 + 54.01 * u - 25.74 * u^2)` ms with `u` the fraction of KV blocks in use.
use super::latency::LatencyModel;

/// Preset names; the first is the default.
pub const PRESETS: [&str; 3] = ["llama3-8b-h100", "llama3-70b-h100x8", "dynamo-mocker"];

/// The default preset's name.
pub const DEFAULT_PRESET: &str = PRESETS[0];

/// An engine configuration by name.
#[derive(Debug, Clone, PartialEq)]
pub struct Preset {
    pub name: &'static str,
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub latency: LatencyModel,
}

/// Llama 3 8B, BF16, one H100 SXM.
fn llama3_8b_h100() -> Preset {
    Preset {
        name: "llama3-8b-h100",
        block_size: 16,
        // (0.9 * 80 GiB - 16.06 GB weights - 4 GB) / 131,072 B = 436 K tokens.
        num_gpu_blocks: 27_000,
        max_num_seqs: 256,
        max_num_batched_tokens: 8192,
        latency: LatencyModel {
            // 16.06 GB / (3.35 TB/s * 0.8) = 6.0 ms, + 1.5 ms.
            step_overhead_s: 7.5e-3,
            prefill_base_s: 0.0,
            // 2 * 8.03e9 / (989e12 * 0.45) = 36.1 us (27.7 K tokens/s).
            prefill_s_per_token: 3.61e-5,
            prefill_s_per_token_sq: 0.0,
            // 4 * 32 * 4096 / (989e12 * 0.45).
            attn_s_per_token_pair: 1.18e-9,
            decode_base_s: 0.0,
            decode_usage_s: [0.0, 0.0],
            decode_min_s: 0.0,
            decode_s_per_seq: 1.5e-5,
            // 131,072 B / (3.35 TB/s * 0.8).
            decode_s_per_ctx_token: 4.89e-8,
            // 131,072 B / (64 GB/s * 0.8).
            cpu_load_s_per_token: 2.56e-6,
        },
    }
}

/// Llama 3 70B, BF16, eight H100 SXM with tensor parallelism 8.
fn llama3_70b_h100x8() -> Preset {
    Preset {
        name: "llama3-70b-h100x8",
        block_size: 16,
        // Per GPU (77.3 GB - 17.65 GB weights - 4 GB) / 40,960 B = 1.36 M tokens.
        num_gpu_blocks: 84_000,
        max_num_seqs: 256,
        max_num_batched_tokens: 8192,
        latency: LatencyModel {
            // 141.2 GB / (8 * 3.35 TB/s * 0.8) = 6.6 ms, + 1.5 ms, + 2 * 80 * 20 us.
            step_overhead_s: 11.3e-3,
            prefill_base_s: 0.0,
            // 2 * 70.6e9 / (8 * 989e12 * 0.40) = 44.6 us.
            prefill_s_per_token: 4.46e-5,
            prefill_s_per_token_sq: 0.0,
            // 4 * 80 * 8192 / (8 * 989e12 * 0.40).
            attn_s_per_token_pair: 8.3e-10,
            decode_base_s: 0.0,
            decode_usage_s: [0.0, 0.0],
            decode_min_s: 0.0,
            decode_s_per_seq: 2.0e-5,
            // 327,680 B / (8 * 3.35 TB/s * 0.8).
            decode_s_per_ctx_token: 1.53e-8,
            // 40,960 B per GPU / (64 GB/s * 0.8).
            cpu_load_s_per_token: 8.0e-7,
        },
    }
}

/// Dynamo's mocker defaults and polynomial timing (see the module documentation).
fn dynamo_mocker() -> Preset {
    Preset {
        name: "dynamo-mocker",
        block_size: 64,
        num_gpu_blocks: 16_384,
        max_num_seqs: 256,
        max_num_batched_tokens: 8192,
        latency: LatencyModel {
            step_overhead_s: 0.0,
            prefill_base_s: 16.50142e-3,
            prefill_s_per_token: 1.518344e-5,
            prefill_s_per_token_sq: 4.209989e-10,
            attn_s_per_token_pair: 0.0,
            decode_base_s: 5.74e-3,
            decode_usage_s: [54.01e-3, -25.74e-3],
            decode_min_s: 1.0e-3,
            decode_s_per_seq: 0.0,
            decode_s_per_ctx_token: 0.0,
            // The mocker has no CPU tier; charge the 8B preset's PCIe cost if one is configured.
            cpu_load_s_per_token: 2.56e-6,
        },
    }
}

/// The preset called `name`, if there is one.
pub fn preset(name: &str) -> Option<Preset> {
    match name {
        "llama3-8b-h100" => Some(llama3_8b_h100()),
        "llama3-70b-h100x8" => Some(llama3_70b_h100x8()),
        "dynamo-mocker" => Some(dynamo_mocker()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::latency::StepShape;

    #[test]
    fn every_name_resolves() {
        for name in PRESETS {
            assert_eq!(preset(name).unwrap().name, name);
        }
        assert!(preset("nope").is_none());
    }

    /// Uncached prefill dominates TTFT: a 10 K-token prompt on the 8B preset costs ~0.4 s of
    /// compute against a few milliseconds of per-step overhead, and a decode step is ~10 ms.
    #[test]
    fn prefill_dominates_on_the_llama_presets() {
        for p in [llama3_8b_h100(), llama3_70b_h100x8()] {
            let mut prefill = StepShape::default();
            prefill.add_prefill(8192, 0);
            prefill.sampled = 0;
            let t = p.latency.step_time(&prefill);
            assert!(t > 0.3 && t < 0.5, "{}: {t}", p.name);
            let mut decode = StepShape::default();
            decode.add_decode(2000);
            decode.sampled = 1;
            let d = p.latency.step_time(&decode);
            assert!(d > 0.005 && d < 0.015, "{}: {d}", p.name);
            assert!(t > 20.0 * d);
        }
    }

    #[test]
    fn dynamo_polynomial_matches_the_mocker() {
        let m = dynamo_mocker().latency;
        let mut s = StepShape::default();
        s.add_prefill(1000, 0);
        let want_ms = 4.209989e-07 * 1e6 + 1.518344e-02 * 1000.0 + 1.650142e+01;
        assert!((m.step_time(&s) * 1e3 - want_ms).abs() < 1e-9);
        let mut d = StepShape {
            sampled: 3,
            kv_usage: 0.5,
            ..Default::default()
        };
        d.add_decode(10);
        let want_ms = -25.74 * 0.25 + 54.01 * 0.5 + 5.74;
        assert!((m.step_time(&d) * 1e3 - want_ms).abs() < 1e-9);
    }
}
