//! A simulated vLLM engine, on virtual or real time, and a trace-replay driver.
//!
//! The simulator is the backend of kvroute's end-to-end tests and benchmarks, so it follows
//! vLLM v1 where the router can see the difference (`shared/docs/vllm.md`):
//!
//! * [`cache`]: the block pool. Fixed-size blocks, chained block hashes computed as the engine
//!   computes them ([`blockhash`]), a hash -> blocks map that allows duplicates, reference counts
//!   and an LRU free queue in which freed blocks stay cached until reused; `BlockStored` when
//!   blocks are scheduled, `BlockRemoved` (one hash per event) when a cached block is reused.
//!   An optional CPU tier ([`cpu`]) takes blocks evicted from the GPU.
//! * [`engine`]: continuous batching as vLLM v1's scheduler does it: running requests first, then
//!   the FCFS waiting queue, a per-step token budget, chunked prefill, recompute preemption.
//!   Each [`Engine::step`] returns the modelled step time, one KV-event batch and per-request
//!   outputs with deterministic token ids ([`request`]).
//! * [`latency`] and [`preset`]: the step-time model and named configurations whose constants
//!   document their sources, including one that mirrors NVIDIA Dynamo's mocker.
//! * [`trace`], [`workload`] and [`arrival`]: what to replay (a Mooncake trace or a built-in
//!   generator) and when requests arrive (the trace's times, Poisson, Azure inter-arrivals).
//! * [`cluster`] and [`replay`]: N engines behind one or more production
//!   [`crate::scheduler::Scheduler`]s and [`crate::index::PrefixIndex`]es on virtual time,
//!   summarised in a [`replay::ReplayReport`]; [`bounds`]: offline bounds on the hit ratio.
//!
//! Nothing here reads the wall clock except the replay's own wall-time measurement: time is
//! passed in, and every random choice comes from a seed.
pub mod arrival;
pub mod blockhash;
pub mod bounds;
pub mod cache;
pub mod cluster;
pub mod config;
pub mod cpu;
pub mod engine;
pub mod idhash;
pub mod latency;
pub mod output;
pub mod preset;
pub mod replay;
pub mod request;
pub mod trace;
pub mod workload;

pub use arrival::Arrival;
pub use blockhash::HashAlgo;
pub use bounds::{hit_bounds, HitBounds};
pub use config::EngineOptions;
pub use engine::{Engine, EngineConfig, EngineMetrics, FinishReason, RequestOutput, StepResult};
pub use latency::{LatencyModel, StepShape};
pub use replay::{replay_mooncake, replay_records, replay_workload, ReplayConfig, ReplayReport};
pub use request::NewRequest;
pub use workload::{Workload, GENERATORS};
