//! `Scheduler` and `Decision`: the routing decision as one Python call.
//!
//! `select_and_reserve` takes the prompt's token ids as a buffer, hashes, matches, scores and
//! books in one crossing; the returned `Decision` is a small frozen object.
use kvroute_core::scheduler::{
    Decision, EngineMetrics, Load, PolicyKind, RemoteReservation, RemoteUpdate, Request, Scheduler,
    SchedulerConfig, WorkerInfo,
};
use kvroute_core::{Nanos, WorkerId};
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyDict};

use crate::buffers;
use crate::errors::{map_err, new_err, Kind};
use crate::hashing::{check_block_size, hash_tokens};
use crate::index::{deadline, now, PyPrefixIndex};

/// Prompts longer than this are routed with the GIL released.
const DETACH_BLOCKS: usize = 4096;

fn secs(s: f64) -> PyResult<Nanos> {
    deadline(0, s)
}

/// The outcome of one routing decision.
#[pyclass(module = "kvroute._native", name = "Decision", frozen, get_all)]
pub(crate) struct PyDecision {
    worker: WorkerId,
    reservation: u64,
    gpu_blocks: u32,
    cpu_blocks: u32,
    prefill_tokens: u32,
    candidates: u32,
    score: f64,
    est_ttft_s: f64,
    queued_prefill_tokens: u64,
    uncached_tokens: u64,
    cpu_tokens: u64,
    active: u32,
    decoding: u32,
    kv_usage: f64,
}

impl From<Decision> for PyDecision {
    fn from(d: Decision) -> Self {
        let b = d.breakdown;
        PyDecision {
            worker: d.worker,
            reservation: d.reservation,
            gpu_blocks: d.gpu_blocks,
            cpu_blocks: d.cpu_blocks,
            prefill_tokens: d.prefill_tokens,
            candidates: d.candidates,
            score: b.score,
            est_ttft_s: b.est_ttft_s,
            queued_prefill_tokens: b.queued_prefill_tokens,
            uncached_tokens: b.uncached_tokens,
            cpu_tokens: b.cpu_tokens,
            active: b.active,
            decoding: b.decoding,
            kv_usage: b.kv_usage,
        }
    }
}

#[pymethods]
impl PyDecision {
    fn __repr__(&self) -> String {
        format!(
            "Decision(worker={}, reservation={}, gpu_blocks={}, cpu_blocks={}, prefill_tokens={}, est_ttft_s={:.6})",
            self.worker, self.reservation, self.gpu_blocks, self.cpu_blocks, self.prefill_tokens, self.est_ttft_s
        )
    }
}

/// Worker registry, in-flight ledger and routing policy over a shared `PrefixIndex`.
#[pyclass(module = "kvroute._native", name = "Scheduler", frozen)]
pub(crate) struct PyScheduler {
    inner: Scheduler,
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (index, policy = "kvroute", *, block_size = 16, router_id = 0, reservation_ttl_s = 600.0,
        tombstone_ttl_s = 600.0, speculative_ttl_s = 5.0, approx_tree_entries = 4_000_000,
        max_inflight_per_worker = 0, seed = 0, params = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        index: &PyPrefixIndex,
        policy: &str,
        block_size: u32,
        router_id: u64,
        reservation_ttl_s: f64,
        tombstone_ttl_s: f64,
        speculative_ttl_s: f64,
        approx_tree_entries: u64,
        max_inflight_per_worker: u32,
        seed: u64,
        params: Option<std::collections::HashMap<String, f64>>,
    ) -> PyResult<Self> {
        check_block_size(block_size as usize)?;
        let mut cfg = SchedulerConfig {
            policy: PolicyKind::parse(policy).map_err(map_err)?,
            block_size,
            router_id,
            reservation_ttl: secs(reservation_ttl_s)?,
            tombstone_ttl: secs(tombstone_ttl_s)?,
            speculative_ttl: secs(speculative_ttl_s)?,
            approx_tree_entries,
            max_inflight_per_worker,
            seed,
            ..Default::default()
        };
        for (k, v) in params.unwrap_or_default() {
            cfg.params.set(&k, v).map_err(map_err)?;
        }
        Ok(Self {
            inner: Scheduler::new(cfg, index.shared()).map_err(map_err)?,
        })
    }

    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.config().policy.name()
    }

    #[getter]
    fn router_id(&self) -> u64 {
        self.inner.config().router_id
    }

    #[getter]
    fn block_size(&self) -> u32 {
        self.inner.config().block_size
    }

    /// Every policy knob and its value.
    fn params<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.inner.config().params.items().into_py_dict(py)
    }

    /// Adds a worker, or updates its capacity (KV blocks; 0 = unknown) and health.
    #[pyo3(signature = (worker, capacity_blocks = 0, cpu_capacity_blocks = 0, healthy = true))]
    fn upsert_worker(
        &self,
        worker: WorkerId,
        capacity_blocks: u32,
        cpu_capacity_blocks: u32,
        healthy: bool,
    ) -> PyResult<()> {
        let info = WorkerInfo {
            id: worker,
            capacity_blocks,
            cpu_capacity_blocks,
            healthy,
            metrics: None,
        };
        self.inner.upsert_worker(info).map_err(map_err)
    }

    /// Removes a worker, its reservations and its index residency; returns reservations dropped.
    #[pyo3(signature = (worker, now_ns = None))]
    fn remove_worker(
        &self,
        py: Python<'_>,
        worker: WorkerId,
        now_ns: Option<Nanos>,
    ) -> PyResult<usize> {
        let now = now(py, now_ns)?;
        py.detach(|| self.inner.remove_worker(worker, now))
            .map_err(map_err)
    }

    fn set_healthy(&self, worker: WorkerId, healthy: bool) -> PyResult<()> {
        self.inner.set_healthy(worker, healthy).map_err(map_err)
    }

    /// Engine-reported load from `/metrics`; `None` clears it.
    #[pyo3(signature = (worker, running = None, waiting = 0, kv_usage = 0.0))]
    fn set_metrics(
        &self,
        worker: WorkerId,
        running: Option<u32>,
        waiting: u32,
        kv_usage: f64,
    ) -> PyResult<()> {
        let m = running.map(|running| EngineMetrics {
            running,
            waiting,
            kv_usage,
        });
        self.inner.set_metrics(worker, m).map_err(map_err)
    }

    /// Registered workers as `(id, capacity_blocks, cpu_capacity_blocks, healthy)`.
    fn workers(&self) -> Vec<(WorkerId, u32, u32, bool)> {
        self.inner
            .workers()
            .iter()
            .map(|w| (w.id, w.capacity_blocks, w.cpu_capacity_blocks, w.healthy))
            .collect()
    }

    /// Hashes `tokens` (a uint32 buffer), scores every eligible worker, picks one and books it.
    #[pyo3(signature = (tokens, *, expected_output_tokens = 0, lora = None, salt = None, exclude = Vec::new(), now_ns = None))]
    #[allow(clippy::too_many_arguments)]
    fn select_and_reserve(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        expected_output_tokens: u32,
        lora: Option<&str>,
        salt: Option<&str>,
        exclude: Vec<WorkerId>,
        now_ns: Option<Nanos>,
    ) -> PyResult<PyDecision> {
        let now = now(py, now_ns)?;
        let tokens = buffers::tokens(tokens, "tokens")?;
        let hashes = hash_tokens(
            py,
            &tokens,
            self.inner.config().block_size as usize,
            lora,
            salt,
        );
        let req = Request {
            hashes: &hashes,
            prompt_tokens: tokens.len() as u32,
            expected_output_tokens,
            exclude: &exclude,
        };
        self.route(py, &req, now)
    }

    /// As `select_and_reserve`, from precomputed block hashes and the prompt length.
    #[pyo3(signature = (hashes, prompt_tokens, *, expected_output_tokens = 0, exclude = Vec::new(), now_ns = None))]
    fn select_and_reserve_hashes(
        &self,
        py: Python<'_>,
        hashes: &Bound<'_, PyAny>,
        prompt_tokens: u32,
        expected_output_tokens: u32,
        exclude: Vec<WorkerId>,
        now_ns: Option<Nanos>,
    ) -> PyResult<PyDecision> {
        let now = now(py, now_ns)?;
        let hashes = buffers::hashes(hashes, "hashes")?;
        let req = Request {
            hashes: &hashes,
            prompt_tokens,
            expected_output_tokens,
            exclude: &exclude,
        };
        self.route(py, &req, now)
    }

    /// The request's first token arrived.
    #[pyo3(signature = (reservation, now_ns = None))]
    fn prefill_done(
        &self,
        py: Python<'_>,
        reservation: u64,
        now_ns: Option<Nanos>,
    ) -> PyResult<bool> {
        Ok(self.inner.prefill_done(reservation, now(py, now_ns)?))
    }

    /// The request has generated `generated` tokens so far.
    #[pyo3(signature = (reservation, generated, now_ns = None))]
    fn decode_progress(
        &self,
        py: Python<'_>,
        reservation: u64,
        generated: u64,
        now_ns: Option<Nanos>,
    ) -> PyResult<bool> {
        Ok(self
            .inner
            .decode_progress(reservation, generated, now(py, now_ns)?))
    }

    /// Ends a reservation; idempotent (False if it was already gone).
    #[pyo3(signature = (reservation, now_ns = None))]
    fn release(&self, py: Python<'_>, reservation: u64, now_ns: Option<Nanos>) -> PyResult<bool> {
        Ok(self.inner.release(reservation, now(py, now_ns)?))
    }

    /// A peer router booked `(origin, id)` on `worker`. Idempotent; returns whether it applied.
    #[pyo3(signature = (origin, id, worker, prefill_tokens, prompt_blocks, hashes = None, now_ns = None))]
    #[allow(clippy::too_many_arguments)]
    fn apply_remote_reserve(
        &self,
        py: Python<'_>,
        origin: u64,
        id: u64,
        worker: WorkerId,
        prefill_tokens: u64,
        prompt_blocks: u64,
        hashes: Option<&Bound<'_, PyAny>>,
        now_ns: Option<Nanos>,
    ) -> PyResult<bool> {
        let hashes = hashes
            .map(|h| buffers::hashes(h, "hashes"))
            .transpose()?
            .unwrap_or_default();
        let r = RemoteReservation {
            origin,
            id,
            worker,
            prefill_tokens,
            prefill_work: 0,
            prompt_blocks,
            hashes,
        };
        self.remote(py, RemoteUpdate::Reserve(r), now_ns)
    }

    #[pyo3(signature = (origin, id, now_ns = None))]
    fn apply_remote_prefill_done(
        &self,
        py: Python<'_>,
        origin: u64,
        id: u64,
        now_ns: Option<Nanos>,
    ) -> PyResult<bool> {
        self.remote(py, RemoteUpdate::PrefillDone { origin, id }, now_ns)
    }

    #[pyo3(signature = (origin, id, generated, now_ns = None))]
    fn apply_remote_progress(
        &self,
        py: Python<'_>,
        origin: u64,
        id: u64,
        generated: u64,
        now_ns: Option<Nanos>,
    ) -> PyResult<bool> {
        self.remote(
            py,
            RemoteUpdate::Progress {
                origin,
                id,
                generated,
            },
            now_ns,
        )
    }

    #[pyo3(signature = (origin, id, now_ns = None))]
    fn apply_remote_finished(
        &self,
        py: Python<'_>,
        origin: u64,
        id: u64,
        now_ns: Option<Nanos>,
    ) -> PyResult<bool> {
        self.remote(py, RemoteUpdate::Finished { origin, id }, now_ns)
    }

    /// Expires overdue reservations and speculative entries; returns reservations expired.
    #[pyo3(signature = (now_ns = None))]
    fn expire(&self, py: Python<'_>, now_ns: Option<Nanos>) -> PyResult<usize> {
        Ok(self.inner.expire(now(py, now_ns)?))
    }

    /// `{worker: {prefill_tokens, kv_blocks, active, decoding}}` as booked in the ledger.
    fn loads<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (w, l) in self.inner.loads() {
            d.set_item(w, load_dict(py, &l)?)?;
        }
        Ok(d)
    }

    /// Live reservations (local and remote).
    fn reservations(&self) -> usize {
        self.inner.reservations()
    }

    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.inner.counters();
        [
            ("decisions", c.decisions),
            ("no_eligible", c.no_eligible),
            ("saturated", c.saturated),
            ("released", c.released),
            ("expired", c.expired),
            ("remote_applied", c.remote_applied),
            ("remote_ignored", c.remote_ignored),
            ("hedged", c.hedged),
            ("paced", c.paced),
        ]
        .into_py_dict(py)
    }

    /// Seconds a request arriving now should wait before `select_and_reserve`: 0.0 unless peer
    /// routers are deciding concurrently (a burst), when this router takes one decision per
    /// `peer_window_s` so each sees the peers' previous ones. Books the slot.
    #[pyo3(signature = (now_ns = None))]
    fn pace(&self, py: Python<'_>, now_ns: Option<Nanos>) -> PyResult<f64> {
        let now = now(py, now_ns)?;
        Ok(self.inner.pace(now) as f64 / 1e9)
    }

    /// Expected peer decisions concurrent with one of this router's (a running estimate).
    fn peer_concurrency(&self) -> f64 {
        self.inner.peer_concurrency()
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.inner
            .check_invariants()
            .map_err(|m| new_err(Kind::Kvroute, format!("ledger invariant violated: {m}")))
    }
}

impl PyScheduler {
    fn route(&self, py: Python<'_>, req: &Request<'_>, now: Nanos) -> PyResult<PyDecision> {
        let d = if req.hashes.len() > DETACH_BLOCKS {
            py.detach(|| self.inner.select_and_reserve(req, now))
        } else {
            self.inner.select_and_reserve(req, now)
        };
        d.map(PyDecision::from).map_err(map_err)
    }

    fn remote(&self, py: Python<'_>, u: RemoteUpdate, now_ns: Option<Nanos>) -> PyResult<bool> {
        let now = now(py, now_ns)?;
        self.inner.apply_remote(&u, now).map_err(map_err)
    }
}

fn load_dict<'py>(py: Python<'py>, l: &Load) -> PyResult<Bound<'py, PyDict>> {
    [
        ("prefill_tokens", l.prefill_tokens),
        ("kv_blocks", l.kv_blocks),
        ("active", u64::from(l.active)),
        ("decoding", u64::from(l.decoding)),
    ]
    .into_py_dict(py)
}
