//! Python bindings for kvroute-core (`kvroute._native`): conversions and error mapping only.
//!
//! * [`errors`]: the exception hierarchy and the one `map_err` from core errors;
//! * [`buffers`]: token ids / hashes from buffers (zero Python objects per element), payloads;
//! * [`index`]: the `PrefixIndex` class;
//! * [`hashing`]: block hashing helpers;
//! * [`scheduler`]: the `Scheduler` and its `Decision`;
//! * [`sim`]: the simulated engine (`SimEngine`, `StepResult`) and `replay_mooncake`;
//! * [`bench`]: workload replay (`replay`) and offline hit-ratio bounds (`hit_bounds`).
use pyo3::prelude::*;

mod bench;
mod buffers;
mod errors;
mod hashing;
mod index;
mod scheduler;
mod sim;

#[pymodule(gil_used = false)]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add(
        "DEFAULT_BLOCK_SIZE",
        kvroute_core::hashing::DEFAULT_BLOCK_SIZE,
    )?;
    m.add("MAX_WORKERS", kvroute_core::index::MAX_WORKERS)?;
    errors::register(m)?;
    m.add_class::<index::PyPrefixIndex>()?;
    m.add_class::<scheduler::PyScheduler>()?;
    m.add_class::<scheduler::PyDecision>()?;
    m.add(
        "POLICIES",
        kvroute_core::scheduler::PolicyKind::ALL
            .map(|p| p.name())
            .to_vec(),
    )?;
    m.add(
        "POLICY_PARAMS",
        kvroute_core::scheduler::PolicyParams::NAMES.to_vec(),
    )?;
    m.add_function(wrap_pyfunction!(hashing::block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::block_hashes_list, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::root_hash, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::chain_hash, m)?)?;
    m.add_function(wrap_pyfunction!(hashing::vllm_block_hashes, m)?)?;
    m.add_class::<sim::PySimEngine>()?;
    m.add_class::<sim::PyStepResult>()?;
    m.add_function(wrap_pyfunction!(sim::replay_mooncake, m)?)?;
    m.add_function(wrap_pyfunction!(bench::replay, m)?)?;
    m.add_function(wrap_pyfunction!(bench::hit_bounds, m)?)?;
    m.add_function(wrap_pyfunction!(bench::load_workload, m)?)?;
    m.add("GENERATORS", kvroute_core::sim::GENERATORS.to_vec())?;
    m.add("SIM_PRESETS", kvroute_core::sim::preset::PRESETS.to_vec())?;
    m.add(
        "SIM_HASH_ALGOS",
        kvroute_core::sim::HashAlgo::ALL.map(|a| a.name()).to_vec(),
    )?;
    Ok(())
}
