//! `PrefixIndex`: a frozen Python handle on a shared, locked core index.
//!
//! The index lives in an `Arc<Mutex<..>>` so that other handles (the scheduler) can share it.
//! Calls take the lock under the GIL when it is free and the work is small: releasing the GIL
//! costs more than a match. Large payloads and inputs, and any wait for a contended lock, run
//! with the GIL released, so other Python threads keep running.
use std::sync::Arc;

use kvroute_core::index::{IndexConfig, IndexCounters, IndexStats, PrefixIndex, WorkerMatch};
use kvroute_core::{Nanos, WorkerId};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{IntoPyDict, PyDict};

use crate::buffers;
use crate::errors::{invalid_argument, map_err, new_err, Kind};
use crate::hashing::{check_block_size, hash_tokens};

/// A worker's resident blocks by tier: (gpu, cpu, speculative).
type Tiers = (u64, u64, u64);

/// Payloads larger than this are decoded and applied with the GIL released.
const DETACH_PAYLOAD_BYTES: usize = 16 << 10;
/// Hash lists longer than this are matched with the GIL released.
const DETACH_BLOCKS: usize = 4096;

static MONOTONIC_NS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// `now_ns`, or Python's `time.monotonic_ns()` (the same clock callers pass explicitly).
pub(crate) fn now(py: Python<'_>, now_ns: Option<Nanos>) -> PyResult<Nanos> {
    match now_ns {
        Some(t) => Ok(t),
        None => MONOTONIC_NS
            .import(py, "time", "monotonic_ns")?
            .call0()?
            .extract(),
    }
}

/// `now + ttl_s`, saturating; `ttl_s` must be a finite, non-negative number of seconds.
pub(crate) fn deadline(now: Nanos, ttl_s: f64) -> PyResult<Nanos> {
    if !(ttl_s.is_finite() && ttl_s >= 0.0) {
        return Err(invalid_argument(format!(
            "ttl_s must be finite and >= 0, got {ttl_s}"
        )));
    }
    Ok(now.saturating_add((ttl_s * 1e9) as u64))
}

/// Index of which worker holds which prefix of blocks, in which tier.
#[pyclass(module = "kvroute._native", name = "PrefixIndex", frozen)]
pub(crate) struct PyPrefixIndex {
    inner: Arc<Mutex<PrefixIndex>>,
    block_size: usize,
    max_entries: u64,
}

impl PyPrefixIndex {
    /// The shared core index (for handles that route on the same index).
    pub(crate) fn shared(&self) -> Arc<Mutex<PrefixIndex>> {
        Arc::clone(&self.inner)
    }

    /// Runs `f` on the index: under the GIL if the lock is free and the work is small (`!heavy`),
    /// otherwise with the GIL released.
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        heavy: bool,
        f: impl FnOnce(&mut PrefixIndex) -> R + Send,
    ) -> R {
        if !heavy {
            if let Some(mut guard) = self.inner.try_lock() {
                return f(&mut guard);
            }
        }
        py.detach(|| f(&mut self.inner.lock()))
    }
}

#[pymethods]
impl PyPrefixIndex {
    /// `max_entries`: budget of resident (block, worker) entries (0 = unbounded);
    /// `block_size`: tokens per block for `match_tokens`.
    #[new]
    #[pyo3(signature = (max_entries = 0, block_size = 16))]
    fn new(max_entries: u64, block_size: usize) -> PyResult<Self> {
        check_block_size(block_size)?;
        let cfg = IndexConfig {
            max_entries,
            ..IndexConfig::default()
        };
        Ok(Self {
            inner: Arc::new(Mutex::new(PrefixIndex::new(cfg))),
            block_size,
            max_entries,
        })
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }

    #[getter]
    fn max_entries(&self) -> u64 {
        self.max_entries
    }

    /// Registers a worker (idempotent).
    fn add_worker(&self, py: Python<'_>, worker: WorkerId) -> PyResult<()> {
        self.with(py, false, |i| i.add_worker(worker))
            .map_err(map_err)
    }

    /// Unregisters a worker and drops all it holds; returns the entries dropped.
    fn remove_worker(&self, py: Python<'_>, worker: WorkerId) -> u64 {
        self.with(py, false, |i| i.remove_worker(worker))
    }

    /// Drops all a worker holds but keeps it registered; returns the entries dropped.
    fn clear_worker(&self, py: Python<'_>, worker: WorkerId) -> u64 {
        self.with(py, false, |i| i.clear_worker(worker))
    }

    /// Registered worker ids.
    fn workers(&self, py: Python<'_>) -> Vec<WorkerId> {
        self.with(py, false, |i| i.workers())
    }

    /// Resident blocks of one worker (any tier, speculative included).
    fn worker_entries(&self, py: Python<'_>, worker: WorkerId) -> u64 {
        self.with(py, false, |i| i.worker_entries(worker))
    }

    /// Applies one raw vLLM KV-event payload frame for `worker` (registered on first use).
    #[pyo3(signature = (worker, payload, now_ns = None))]
    fn apply(
        &self,
        py: Python<'_>,
        worker: WorkerId,
        payload: &Bound<'_, PyAny>,
        now_ns: Option<Nanos>,
    ) -> PyResult<()> {
        let now = now(py, now_ns)?;
        let payload = buffers::payload(payload)?;
        let heavy = payload.len() > DETACH_PAYLOAD_BYTES;
        self.with(py, heavy, |i| i.apply_payload(worker, &payload, now))
            .map_err(map_err)
    }

    /// Per worker, its cached prefix of `hashes` as `(gpu_blocks, cpu_blocks)`.
    #[pyo3(signature = (hashes, now_ns = None))]
    fn find_matches<'py>(
        &self,
        py: Python<'py>,
        hashes: &Bound<'py, PyAny>,
        now_ns: Option<Nanos>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let now = now(py, now_ns)?;
        let hashes = buffers::hashes(hashes, "hashes")?;
        let heavy = hashes.len() > DETACH_BLOCKS;
        matches_dict(py, &self.with(py, heavy, |i| i.find_matches(&hashes, now)))
    }

    /// `block_hashes` with this index's block size, then `find_matches`.
    #[pyo3(signature = (tokens, lora = None, salt = None, now_ns = None))]
    fn match_tokens<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        lora: Option<&str>,
        salt: Option<&str>,
        now_ns: Option<Nanos>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let now = now(py, now_ns)?;
        let tokens = buffers::tokens(tokens, "tokens")?;
        let hashes = hash_tokens(py, &tokens, self.block_size, lora, salt);
        let heavy = hashes.len() > DETACH_BLOCKS;
        matches_dict(py, &self.with(py, heavy, |i| i.find_matches(&hashes, now)))
    }

    /// Counts `hashes` as on `worker`'s GPU for `ttl_s` seconds (or until its events arrive).
    #[pyo3(signature = (worker, hashes, ttl_s, now_ns = None))]
    fn speculate(
        &self,
        py: Python<'_>,
        worker: WorkerId,
        hashes: &Bound<'_, PyAny>,
        ttl_s: f64,
        now_ns: Option<Nanos>,
    ) -> PyResult<()> {
        let now = now(py, now_ns)?;
        let until = deadline(now, ttl_s)?;
        let hashes = buffers::hashes(hashes, "hashes")?;
        let heavy = hashes.len() > DETACH_BLOCKS;
        self.with(py, heavy, |i| i.speculate(worker, &hashes, until, now))
            .map_err(map_err)
    }

    /// Frees speculative entries past their deadline.
    #[pyo3(signature = (now_ns = None))]
    fn expire(&self, py: Python<'_>, now_ns: Option<Nanos>) -> PyResult<()> {
        let now = now(py, now_ns)?;
        self.with(py, false, |i| i.expire(now));
        Ok(())
    }

    /// Per worker, its resident blocks by tier: `(gpu, cpu, speculative)`.
    #[pyo3(signature = (now_ns = None))]
    fn tier_entries(
        &self,
        py: Python<'_>,
        now_ns: Option<Nanos>,
    ) -> PyResult<Vec<(WorkerId, Tiers)>> {
        let now = now(py, now_ns)?;
        let t = self.with(py, false, |i| i.tier_entries(now));
        Ok(t.into_iter()
            .map(|(w, t)| (w, (t.gpu, t.cpu, t.speculative)))
            .collect())
    }

    /// Sizes, memory and every ingestion counter, as a flat dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.with(py, false, |i| i.stats()))
    }

    /// Verifies the tree's structural invariants (O(size); tests and debugging).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, true, |i| i.check_invariants())
            .map_err(|msg| new_err(Kind::Kvroute, format!("index invariant violated: {msg}")))
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let (workers, entries) = self.with(py, false, |i| (i.workers().len(), i.entries()));
        format!(
            "PrefixIndex(max_entries={}, block_size={}, workers={workers}, entries={entries})",
            self.max_entries, self.block_size
        )
    }
}

/// `{worker: (gpu_blocks, cpu_blocks)}`, in the core's order.
fn matches_dict<'py>(py: Python<'py>, matches: &[WorkerMatch]) -> PyResult<Bound<'py, PyDict>> {
    matches
        .iter()
        .map(|m| (m.worker, (m.gpu, m.cpu)))
        .into_py_dict(py)
}

/// Stats as a flat dict. The destructuring is exhaustive on purpose: a counter added to the core
/// fails to compile here until it is exported (and added to the stub's `IndexStats`).
fn stats_dict<'py>(py: Python<'py>, s: &IndexStats) -> PyResult<Bound<'py, PyDict>> {
    macro_rules! put {
        ($d:ident; $($k:ident),* $(,)?) => { $( $d.set_item(stringify!($k), $k)?; )* };
    }
    let d = PyDict::new(py);
    let IndexStats {
        workers,
        nodes,
        blocks,
        entries,
        memory_bytes,
        counters,
    } = s;
    let bytes_per_entry = if *entries == 0 {
        0.0
    } else {
        *memory_bytes as f64 / *entries as f64
    };
    put!(d; workers, nodes, blocks, entries, memory_bytes, bytes_per_entry);
    let IndexCounters {
        payloads,
        malformed_payloads,
        events,
        stored_blocks,
        removed_blocks,
        cleared,
        unknown_events,
        skipped_group_blocks,
        skipped_medium_blocks,
        orphan_blocks,
        unknown_removals,
        unplaced_blocks,
        evicted_entries,
        speculative_blocks,
    } = counters;
    put!(d; payloads, malformed_payloads, events, stored_blocks, removed_blocks, cleared,
        unknown_events, skipped_group_blocks, skipped_medium_blocks, orphan_blocks,
        unknown_removals, unplaced_blocks, evicted_entries, speculative_blocks);
    Ok(d)
}
