//! What the engine reports: per-step results, per-request outputs, gauges and counters.
use std::sync::Arc;

use super::latency::StepShape;
use crate::events::EventBatch;

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// The EOS token was sampled (and EOS is not ignored).
    Stop,
    /// [`crate::sim::Engine::abort`] was called.
    Abort,
}

impl FinishReason {
    /// OpenAI's / vLLM's `finish_reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Abort => "abort",
        }
    }
}

/// What one request got from one step.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutput {
    pub id: Arc<str>,
    pub tag: u64,
    /// The sampled token (none for an abort).
    pub token: Option<u32>,
    /// This is the request's first output token.
    pub first: bool,
    pub finish: Option<FinishReason>,
    /// Prompt tokens found in the prefix cache (GPU and CPU) when first scheduled.
    pub num_cached_tokens: u32,
    pub prompt_tokens: u32,
}

/// The result of one step.
#[derive(Debug, Clone, Default)]
pub struct StepResult {
    /// Modelled duration of the step, seconds (0 when nothing was computed).
    pub duration_s: f64,
    /// The step's KV events, if any.
    pub events: Option<EventBatch>,
    /// The batch's sequence number (with `events`).
    pub seq: Option<u64>,
    pub outputs: Vec<RequestOutput>,
    /// What the latency model was given.
    pub shape: StepShape,
}

/// Engine gauges and counters (vLLM's `/metrics` names in comments).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineMetrics {
    /// `vllm:num_requests_running`
    pub running: usize,
    /// `vllm:num_requests_waiting`
    pub waiting: usize,
    /// `vllm:kv_cache_usage_perc`, 0..1
    pub kv_cache_usage: f64,
    /// `vllm:prefix_cache_queries` (tokens; first scheduling of each request)
    pub prefix_cache_queries: u64,
    /// `vllm:prefix_cache_hits` (tokens found on the GPU)
    pub prefix_cache_hits: u64,
    /// `vllm:external_prefix_cache_queries` (tokens asked of the CPU tier)
    pub external_prefix_cache_queries: u64,
    /// `vllm:external_prefix_cache_hits` (tokens loaded from the CPU tier)
    pub external_prefix_cache_hits: u64,
    /// `vllm:num_preemptions`
    pub preemptions: u64,
    pub prompt_tokens_computed: u64,
    /// `vllm:generation_tokens`
    pub generation_tokens: u64,
    /// Non-empty steps.
    pub steps: u64,
    pub cpu_blocks_used: usize,
}
