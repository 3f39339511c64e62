//! `SimEngine`, `StepResult` and `replay_mooncake`: the simulated vLLM engine of
//! `kvroute_core::sim`, converted to Python types and nothing more.
use std::path::PathBuf;
use std::sync::Arc;

use kvroute_core::events::{encode_batch, Encoding};
use kvroute_core::sim::{
    replay_mooncake as core_replay, Engine, EngineOptions, NewRequest, ReplayConfig,
};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::buffers;
use crate::errors::{invalid_argument, map_err};

/// Prompts longer than this are hashed with the GIL released (sha256 is ~1 µs per block).
const DETACH_TOKENS: usize = 4096;

/// `v` as a non-negative size, or `InvalidArgumentError` naming `name`.
fn size(name: &str, v: i64) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| invalid_argument(format!("{name} must be >= 0, got {v}")))
}

/// A simulated vLLM engine: feed it requests, call `step(now_s)` whenever it has work.
#[pyclass(module = "kvroute._native", name = "SimEngine", frozen)]
pub(crate) struct PySimEngine {
    inner: Mutex<Engine>,
}

/// One engine step: its modelled duration, its KV-event batch (both wire encodings) and the
/// requests' outputs.
#[pyclass(module = "kvroute._native", name = "StepResult", frozen, get_all)]
pub(crate) struct PyStepResult {
    duration_s: f64,
    events: Option<Py<PyBytes>>,
    events_legacy: Option<Py<PyBytes>>,
    seq: Option<u64>,
    outputs: Py<PyList>,
}

#[pymethods]
impl PyStepResult {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "StepResult(duration_s={:.6}, seq={:?}, events={} bytes, outputs={})",
            self.duration_s,
            self.seq,
            self.events
                .as_ref()
                .map_or(0, |b| b.bind(py).as_bytes().len()),
            self.outputs.bind(py).len()
        )
    }
}

#[pymethods]
impl PySimEngine {
    #[new]
    #[pyo3(signature = (*, preset = "llama3-8b-h100", block_size = None, num_gpu_blocks = None,
        num_cpu_blocks = 0, max_num_seqs = None, max_num_batched_tokens = None, hash_algo = "sha256",
        hash_seed = None, seed = 0, vocab_size = 128_000, lora_paths = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        preset: &str,
        block_size: Option<i64>,
        num_gpu_blocks: Option<i64>,
        num_cpu_blocks: i64,
        max_num_seqs: Option<i64>,
        max_num_batched_tokens: Option<i64>,
        hash_algo: &str,
        hash_seed: Option<String>,
        seed: i64,
        vocab_size: i64,
        lora_paths: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let lora_paths = match lora_paths {
            Some(d) => d
                .iter()
                .map(|(k, v)| Ok((k.extract()?, v.extract()?)))
                .collect::<PyResult<_>>()?,
            None => Vec::new(),
        };
        let opts = EngineOptions {
            preset: preset.into(),
            block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            max_num_seqs,
            max_num_batched_tokens,
            hash_algo: hash_algo.into(),
            hash_seed,
            seed: size("seed", seed)? as u64,
            vocab_size,
            lora_paths,
        };
        let engine = Engine::new(opts.resolve().map_err(map_err)?).map_err(map_err)?;
        Ok(Self {
            inner: Mutex::new(engine),
        })
    }

    /// Queues a request. Raises `InvalidArgumentError` for a duplicate id or a bad request.
    #[pyo3(signature = (request_id, prompt_tokens, max_tokens, *, lora = None, salt = None,
        ignore_eos = true, eos_token_id = None))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &self,
        py: Python<'_>,
        request_id: &str,
        prompt_tokens: &Bound<'_, PyAny>,
        max_tokens: i64,
        lora: Option<String>,
        salt: Option<String>,
        ignore_eos: bool,
        eos_token_id: Option<i64>,
    ) -> PyResult<()> {
        let prompt = buffers::tokens(prompt_tokens, "prompt_tokens")?;
        let eos_token_id = eos_token_id
            .map(|t| {
                u32::try_from(t)
                    .map_err(|_| invalid_argument(format!("eos_token_id out of range: {t}")))
            })
            .transpose()?;
        let max_tokens = u32::try_from(max_tokens).map_err(|_| {
            invalid_argument(format!("max_tokens must be in 1..2^32, got {max_tokens}"))
        })?;
        let req = NewRequest {
            id: Arc::from(request_id),
            tag: 0,
            prompt,
            max_tokens,
            lora,
            salt,
            ignore_eos,
            eos_token_id,
        };
        let heavy = req.prompt.len() > DETACH_TOKENS;
        let add = || self.inner.lock().add_request(req);
        if heavy { py.detach(add) } else { add() }.map_err(map_err)
    }

    /// Drops a request; the next step reports it finished with reason `"abort"`.
    fn abort(&self, request_id: &str) -> bool {
        self.inner.lock().abort(request_id)
    }

    fn has_work(&self) -> bool {
        self.inner.lock().has_work()
    }

    /// Runs one engine step starting at `now_s` (the event batch's timestamp).
    fn step(&self, py: Python<'_>, now_s: f64) -> PyResult<PyStepResult> {
        let r = self.inner.lock().step(now_s);
        let encode = |enc| {
            r.events
                .as_ref()
                .map(|b| PyBytes::new(py, &encode_batch(b, enc)).unbind())
        };
        let outputs = PyList::empty(py);
        for o in &r.outputs {
            let tokens: Vec<u32> = o.token.into_iter().collect();
            let reason = o.finish.map(|f| f.as_str());
            outputs.append((
                &*o.id,
                tokens,
                o.finish.is_some(),
                reason,
                o.num_cached_tokens,
                o.prompt_tokens,
            ))?;
        }
        Ok(PyStepResult {
            duration_s: r.duration_s,
            events: encode(Encoding::Map),
            events_legacy: encode(Encoding::Array),
            seq: r.seq,
            outputs: outputs.unbind(),
        })
    }

    /// A restart: requests dropped, caches emptied, event sequence numbers restart at 0.
    fn reset(&self) {
        self.inner.lock().reset();
    }

    /// vLLM-style gauges and counters.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let e = self.inner.lock();
        let (m, c) = (e.metrics(), e.config());
        let d = PyDict::new(py);
        for (k, v) in [
            ("running", m.running as f64),
            ("waiting", m.waiting as f64),
            ("kv_cache_usage", m.kv_cache_usage),
            ("prefix_cache_queries", m.prefix_cache_queries as f64),
            ("prefix_cache_hits", m.prefix_cache_hits as f64),
            (
                "external_prefix_cache_queries",
                m.external_prefix_cache_queries as f64,
            ),
            (
                "external_prefix_cache_hits",
                m.external_prefix_cache_hits as f64,
            ),
            ("preemptions", m.preemptions as f64),
            ("prompt_tokens_computed", m.prompt_tokens_computed as f64),
            ("generation_tokens", m.generation_tokens as f64),
            ("cpu_blocks_used", m.cpu_blocks_used as f64),
            ("num_gpu_blocks", c.num_gpu_blocks as f64),
            ("num_cpu_blocks", c.num_cpu_blocks as f64),
            ("block_size", c.block_size as f64),
            ("steps", m.steps as f64),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// The preset and every resolved parameter.
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let e = self.inner.lock();
        let c = e.config();
        let d = PyDict::new(py);
        d.set_item("preset", &c.preset)?;
        d.set_item("block_size", c.block_size)?;
        d.set_item("num_gpu_blocks", c.num_gpu_blocks)?;
        d.set_item("num_cpu_blocks", c.num_cpu_blocks)?;
        d.set_item("max_num_seqs", c.max_num_seqs)?;
        d.set_item("max_num_batched_tokens", c.max_num_batched_tokens)?;
        d.set_item("hash_algo", c.hash_algo.name())?;
        d.set_item("hash_seed", c.hash_seed.as_deref())?;
        d.set_item("seed", c.seed)?;
        d.set_item("vocab_size", c.vocab_size)?;
        let loras = PyDict::new(py);
        for (name, path) in &c.lora_paths {
            loras.set_item(name, path)?;
        }
        d.set_item("lora_paths", loras)?;
        let lat = PyDict::new(py);
        for (k, v) in c.latency.items() {
            lat.set_item(k, v)?;
        }
        d.set_item("latency", lat)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let e = self.inner.lock();
        let (c, m) = (e.config(), e.metrics());
        format!(
            "SimEngine(preset={:?}, block_size={}, num_gpu_blocks={}, running={}, waiting={})",
            c.preset, c.block_size, c.num_gpu_blocks, m.running, m.waiting
        )
    }
}

/// Replays a Mooncake trace on `replicas` simulated engines behind the router, on virtual time,
/// with the GIL released; returns the report as a dict.
#[pyfunction]
#[pyo3(signature = (path, *, replicas = 8, policy = "round_robin", preset = "llama3-8b-h100",
    speedup = 1.0, num_gpu_blocks = None, num_cpu_blocks = 0, block_size = None, event_delay_s = 0.005,
    limit = None, seed = 0))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn replay_mooncake<'py>(
    py: Python<'py>,
    path: PathBuf,
    replicas: i64,
    policy: &str,
    preset: &str,
    speedup: f64,
    num_gpu_blocks: Option<i64>,
    num_cpu_blocks: i64,
    block_size: Option<i64>,
    event_delay_s: f64,
    limit: Option<i64>,
    seed: i64,
) -> PyResult<Bound<'py, PyDict>> {
    let cfg = ReplayConfig {
        replicas: size("replicas", replicas)?,
        policy: policy.into(),
        preset: preset.into(),
        speedup,
        num_gpu_blocks: num_gpu_blocks
            .map(|v| size("num_gpu_blocks", v))
            .transpose()?,
        num_cpu_blocks: size("num_cpu_blocks", num_cpu_blocks)?,
        block_size: block_size.map(|v| size("block_size", v)).transpose()?,
        event_delay_s,
        limit: limit.map(|v| size("limit", v)).transpose()?,
        seed: size("seed", seed)? as u64,
        ..Default::default()
    };
    let r = py.detach(|| core_replay(&path, &cfg)).map_err(map_err)?;
    let d = PyDict::new(py);
    d.set_item("policy", &r.policy)?;
    d.set_item("preset", &r.preset)?;
    for (k, v) in r.counts() {
        d.set_item(k, v)?;
    }
    for (k, v) in r.figures() {
        d.set_item(k, v)?;
    }
    d.set_item("requests_per_replica", &r.requests_per_replica)?;
    Ok(d)
}
