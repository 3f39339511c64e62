//! `replay` and `hit_bounds`: the benchmark side of `kvroute_core::sim`, converted to Python
//! types and nothing more. Both run with the GIL released; `replay` re-acquires it only to call
//! its progress callback.
use kvroute_core::sim::replay::engine_config;
use kvroute_core::sim::{
    hit_bounds as core_bounds, replay_workload, Arrival, ReplayConfig, Workload,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{invalid_argument, map_err};

fn size(name: &str, v: i64) -> PyResult<usize> {
    usize::try_from(v).map_err(|_| invalid_argument(format!("{name} must be >= 0, got {v}")))
}

fn opt_size(name: &str, v: Option<i64>) -> PyResult<Option<usize>> {
    v.map(|v| size(name, v)).transpose()
}

/// Replays a workload (a generator name or a Mooncake trace path) on simulated engines behind
/// one or more routers, on virtual time; returns the report as a dict.
#[pyfunction]
#[pyo3(signature = (source, *, requests = None, replicas = 8, policy = "round_robin",
    preset = "llama3-8b-h100", speedup = 1.0, rate = None, arrival = "trace", arrival_rate = None,
    arrival_trace = None, num_gpu_blocks = None, num_cpu_blocks = 0, block_size = None,
    event_delay_s = 0.005, routers = 1, fanout_delay_s = None, params = None, seed = 0,
    progress = None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn replay<'py>(
    py: Python<'py>,
    source: &str,
    requests: Option<i64>,
    replicas: i64,
    policy: &str,
    preset: &str,
    speedup: f64,
    rate: Option<f64>,
    arrival: &str,
    arrival_rate: Option<f64>,
    arrival_trace: Option<std::path::PathBuf>,
    num_gpu_blocks: Option<i64>,
    num_cpu_blocks: i64,
    block_size: Option<i64>,
    event_delay_s: f64,
    routers: i64,
    fanout_delay_s: Option<f64>,
    params: Option<Vec<(String, f64)>>,
    seed: i64,
    progress: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let seed = size("seed", seed)? as u64;
    let cfg = ReplayConfig {
        replicas: size("replicas", replicas)?,
        policy: policy.into(),
        preset: preset.into(),
        speedup,
        rate,
        arrival: Arrival::from_spec(arrival, arrival_rate, arrival_trace.as_deref())
            .map_err(map_err)?,
        num_gpu_blocks: opt_size("num_gpu_blocks", num_gpu_blocks)?,
        num_cpu_blocks: size("num_cpu_blocks", num_cpu_blocks)?,
        block_size: opt_size("block_size", block_size)?,
        event_delay_s,
        seed,
        routers: size("routers", routers)?,
        fanout_delay_s,
        params: params.unwrap_or_default(),
        ..Default::default()
    };
    let requests = opt_size("requests", requests)?;
    let mut failure: Option<PyErr> = None;
    let mut report = |done: usize, total: usize| match &progress {
        None => true,
        Some(cb) => Python::attach(|py| {
            let r = py
                .check_signals()
                .and_then(|()| cb.call1(py, (done, total)).map(drop));
            r.map_err(|e| failure = Some(e)).is_ok()
        }),
    };
    let r = py.detach(|| {
        let w = Workload::load(source, requests, seed)?;
        replay_workload(&w, &cfg, &mut report)
    });
    if let Some(e) = failure {
        return Err(e);
    }
    let r = r.map_err(map_err)?;
    let d = PyDict::new(py);
    d.set_item("policy", &r.policy)?;
    d.set_item("preset", &r.preset)?;
    d.set_item("workload", &r.workload)?;
    for (k, v) in r.counts() {
        d.set_item(k, v)?;
    }
    for (k, v) in r.figures() {
        d.set_item(k, v)?;
    }
    d.set_item("requests_per_replica", &r.requests_per_replica)?;
    d.set_item("prefill_tokens_per_replica", &r.prefill_tokens_per_replica)?;
    Ok(d)
}

/// Offline bounds on the token hit ratio of a workload on `replicas` engines of a preset
/// (`infinite`, `pooled_lru`, `belady`), plus the workload's size and mean arrival rate.
#[pyfunction]
#[pyo3(signature = (source, *, requests = None, replicas = 8, preset = "llama3-8b-h100",
    num_gpu_blocks = None, block_size = None, seed = 0))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn hit_bounds<'py>(
    py: Python<'py>,
    source: &str,
    requests: Option<i64>,
    replicas: i64,
    preset: &str,
    num_gpu_blocks: Option<i64>,
    block_size: Option<i64>,
    seed: i64,
) -> PyResult<Bound<'py, PyDict>> {
    let cfg = ReplayConfig {
        preset: preset.into(),
        num_gpu_blocks: opt_size("num_gpu_blocks", num_gpu_blocks)?,
        block_size: opt_size("block_size", block_size)?,
        seed: size("seed", seed)? as u64,
        ..Default::default()
    };
    let (replicas, requests) = (size("replicas", replicas)?, opt_size("requests", requests)?);
    let (w, b) = py
        .detach(|| {
            let e = engine_config(&cfg)?;
            let w = Workload::load(source, requests, cfg.seed)?;
            let cap = replicas * (e.num_gpu_blocks - 1);
            let b = core_bounds(&w, e.block_size, cap, cfg.seed, e.vocab_size);
            Ok((w, b))
        })
        .map_err(map_err)?;
    let d = PyDict::new(py);
    for (k, v) in b.items() {
        d.set_item(k, v)?;
    }
    d.set_item("workload", &w.name)?;
    d.set_item("num_requests", w.records.len())?;
    d.set_item("prompt_tokens", w.prompt_tokens())?;
    d.set_item("mean_rate", w.mean_rate())?;
    Ok(d)
}

/// A workload's records after its arrival process, as `(block_tokens, [(arrival_s,
/// input_length, output_length, hash_ids), ...])` (for the live load generator).
#[pyfunction]
#[pyo3(signature = (source, *, requests = None, arrival = "trace", arrival_rate = None,
    arrival_trace = None, seed = 0))]
#[allow(clippy::type_complexity)]
pub(crate) fn load_workload(
    py: Python<'_>,
    source: &str,
    requests: Option<i64>,
    arrival: &str,
    arrival_rate: Option<f64>,
    arrival_trace: Option<std::path::PathBuf>,
    seed: i64,
) -> PyResult<(usize, Vec<(f64, usize, usize, Vec<u64>)>)> {
    let seed = size("seed", seed)? as u64;
    let requests = opt_size("requests", requests)?;
    let arrival =
        Arrival::from_spec(arrival, arrival_rate, arrival_trace.as_deref()).map_err(map_err)?;
    let mut w = py
        .detach(|| Workload::load(source, requests, seed))
        .map_err(map_err)?;
    arrival.apply(&mut w.records, seed).map_err(map_err)?;
    let records = w
        .records
        .into_iter()
        .map(|r| {
            (
                r.timestamp_ms / 1000.0,
                r.input_length,
                r.output_length,
                r.hash_ids,
            )
        })
        .collect();
    Ok((w.block_tokens, records))
}
