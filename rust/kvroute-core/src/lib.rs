//! kvroute-core: the routing core of kvroute, free of Python.
//!
//! * [`hashing`]: token ids -> chained block hashes (kvroute's own xxh3 chain, and vLLM-compatible
//!   `sha256` / `sha256_cbor` hashes that reproduce the engine's event values).
//! * [`events`]: decoding of vLLM's msgpack KV-event batches (map and legacy array encodings).
//! * [`index`]: the prefix index, a radix tree of blocks with per-worker, per-tier residency.
//! * [`scheduler`]: worker registry, in-flight ledger, routing policies and the atomic
//!   select-and-reserve.
//!
//! The core never reads the wall clock or a global RNG: every call that needs time takes a
//! [`Nanos`] timestamp, and every random choice comes from a seeded generator, so a simulator can
//! drive the production code on virtual time.
#![forbid(unsafe_code)]

pub mod error;
pub mod events;
pub mod hashing;
pub mod index;
pub mod msgpack;
pub mod scheduler;
pub mod sim;

pub use error::{Error, EventError, Result};

/// A point in time in nanoseconds on a caller-chosen monotonic clock (real or virtual).
pub type Nanos = u64;

/// A worker (one engine replica, or one data-parallel rank of it), named by the caller.
pub type WorkerId = u64;
