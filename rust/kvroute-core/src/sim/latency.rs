//! The step-time model: how long one engine step (one forward pass) takes.
//!
//! One formula covers every preset ([`crate::sim::preset`] documents the constants):
//!
//! ```text
//! t = step_overhead
//!   + [T > 0] * (prefill_base + T * prefill_per_token + T^2 * prefill_per_token_sq)
//!   + P * attn_per_token_pair
//!   + [S > 0] * max(decode_min, decode_base + u * decode_usage[0] + u^2 * decode_usage[1])
//!   + D * decode_per_seq + C * decode_per_ctx_token
//!   + L * cpu_load_per_token
//! ```
//!
//! with `T` prefill (non-decode) tokens computed in the step, `P` the attention work of those
//! tokens in (query, key) pairs (a chunk of `n` tokens after `c` cached or computed ones attends
//! to `n * c + n * (n + 1) / 2` keys), `S` requests that sample a token at the end of the step,
//! `D` decoding requests, `C` their total context length, `u` the GPU KV-cache usage (0..1) and
//! `L` tokens loaded from the CPU tier. The physically derived presets use the linear terms
//! (weights read once per step, FLOPs per token, attention FLOPs per pair, KV bytes read per
//! context token); the Dynamo preset uses the polynomial terms of Dynamo's mocker. The model is
//! on the engine's own time scale: a caller that runs faster than real time divides by its
//! `time_scale` itself.

/// Coefficients of the step-time formula, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyModel {
    /// Every non-empty step (weights read, kernel launches, scheduling).
    pub step_overhead_s: f64,
    /// Added once when the step computes any prefill tokens.
    pub prefill_base_s: f64,
    pub prefill_s_per_token: f64,
    /// Quadratic term in the step's prefill tokens (Dynamo's fit).
    pub prefill_s_per_token_sq: f64,
    /// Attention of prefill tokens over their context, per (query, key) pair.
    pub attn_s_per_token_pair: f64,
    /// Added once when any request samples a token.
    pub decode_base_s: f64,
    /// Linear and quadratic coefficients of the decode term in the KV-cache usage.
    pub decode_usage_s: [f64; 2],
    /// Lower bound of the sampled-step term (`decode_base + usage terms`) when it applies.
    pub decode_min_s: f64,
    pub decode_s_per_seq: f64,
    /// KV read per context token of each decoding request.
    pub decode_s_per_ctx_token: f64,
    /// CPU -> GPU transfer per loaded token.
    pub cpu_load_s_per_token: f64,
}

/// What one step does, as the latency model sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepShape {
    pub prefill_tokens: u64,
    /// Attention work of the prefill tokens, in (query, key) pairs.
    pub prefill_pairs: f64,
    pub decode_seqs: u64,
    pub decode_ctx_tokens: u64,
    /// Requests that sample a token at the end of the step.
    pub sampled: u64,
    pub loaded_tokens: u64,
    /// GPU KV-cache usage after scheduling, 0..1.
    pub kv_usage: f64,
}

impl StepShape {
    /// Adds a prefill chunk of `n` tokens after `ctx` tokens already in the KV cache.
    pub fn add_prefill(&mut self, n: u64, ctx: u64) {
        self.prefill_tokens += n;
        self.prefill_pairs += n as f64 * ctx as f64 + (n as f64) * (n as f64 + 1.0) / 2.0;
    }

    /// Adds one decoding request whose new token attends to `ctx` tokens (itself included).
    pub fn add_decode(&mut self, ctx: u64) {
        self.decode_seqs += 1;
        self.decode_ctx_tokens += ctx;
    }

    pub fn is_empty(&self) -> bool {
        self.prefill_tokens == 0 && self.decode_seqs == 0 && self.loaded_tokens == 0
    }
}

impl LatencyModel {
    /// A model where every step takes `overhead_s` plus `per_token_s` per computed token: handy
    /// in tests that need exact times.
    pub fn linear(overhead_s: f64, per_token_s: f64) -> Self {
        LatencyModel {
            step_overhead_s: overhead_s,
            prefill_base_s: 0.0,
            prefill_s_per_token: per_token_s,
            prefill_s_per_token_sq: 0.0,
            attn_s_per_token_pair: 0.0,
            decode_base_s: 0.0,
            decode_usage_s: [0.0, 0.0],
            decode_min_s: 0.0,
            decode_s_per_seq: per_token_s,
            decode_s_per_ctx_token: 0.0,
            cpu_load_s_per_token: 0.0,
        }
    }

    /// Modelled duration of a step, in seconds; 0 for an empty step.
    pub fn step_time(&self, s: &StepShape) -> f64 {
        if s.is_empty() {
            return 0.0;
        }
        let mut t = self.step_overhead_s;
        if s.prefill_tokens > 0 {
            let n = s.prefill_tokens as f64;
            t += self.prefill_base_s
                + n * self.prefill_s_per_token
                + n * n * self.prefill_s_per_token_sq;
        }
        t += s.prefill_pairs * self.attn_s_per_token_pair;
        if s.sampled > 0 {
            let u = s.kv_usage.clamp(0.0, 1.0);
            let d =
                self.decode_base_s + u * self.decode_usage_s[0] + u * u * self.decode_usage_s[1];
            t += d.max(self.decode_min_s);
        }
        t += s.decode_seqs as f64 * self.decode_s_per_seq
            + s.decode_ctx_tokens as f64 * self.decode_s_per_ctx_token
            + s.loaded_tokens as f64 * self.cpu_load_s_per_token;
        t
    }

    /// Every coefficient by name (configuration dumps).
    pub fn items(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("step_overhead_s", self.step_overhead_s),
            ("prefill_base_s", self.prefill_base_s),
            ("prefill_s_per_token", self.prefill_s_per_token),
            ("prefill_s_per_token_sq", self.prefill_s_per_token_sq),
            ("attn_s_per_token_pair", self.attn_s_per_token_pair),
            ("decode_base_s", self.decode_base_s),
            ("decode_usage_s_linear", self.decode_usage_s[0]),
            ("decode_usage_s_quadratic", self.decode_usage_s[1]),
            ("decode_min_s", self.decode_min_s),
            ("decode_s_per_seq", self.decode_s_per_seq),
            ("decode_s_per_ctx_token", self.decode_s_per_ctx_token),
            ("cpu_load_s_per_token", self.cpu_load_s_per_token),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_step_takes_no_time_and_terms_add_up() {
        let m = LatencyModel::linear(0.005, 1e-4);
        assert_eq!(m.step_time(&StepShape::default()), 0.0);
        let mut s = StepShape::default();
        s.add_prefill(100, 0);
        s.add_decode(50);
        s.sampled = 2;
        let t = m.step_time(&s);
        assert!((t - (0.005 + 100.0 * 1e-4 + 1e-4)).abs() < 1e-12, "{t}");
    }

    #[test]
    fn attention_pairs_count_the_causal_triangle_and_the_context() {
        let mut s = StepShape::default();
        s.add_prefill(4, 0);
        assert_eq!(s.prefill_pairs, 10.0);
        s.add_prefill(2, 10);
        assert_eq!(s.prefill_pairs, 10.0 + 20.0 + 3.0);
    }
}
