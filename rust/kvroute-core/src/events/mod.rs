//! vLLM KV-cache event batches (ZMQ payload frame) <-> typed events.
//!
//! Wire contract: `shared/docs/vllm.md` §1. A batch is the msgpack array `[ts, events, dp_rank]`;
//! each event is a map with a `"type"` key (vLLM >= 0.24, fields equal to their default omitted,
//! unknown keys ignored) or a positional array with the type tag first (vLLM <= 0.23).
//!
//! Decoding validates the whole payload before anything is returned, so a malformed payload is
//! rejected as a unit and the index never sees half of it.
//!
//! Layout: the event types are here; `decode.rs` and `encode.rs` convert them from and to the
//! wire, `schema.rs` holds the wire's type tags, field names and value strings, and
//! `extra_keys.rs` the per-block `extra_keys` (both ways).

use crate::error::EventError;

mod decode;
mod encode;
mod extra_keys;
mod schema;

pub use decode::{decode_batch, fold_hash_bytes};
pub use encode::encode_batch;

/// The engine's block hash as carried in events: the low 64 bits of the digest read big-endian.
/// Byte-string hashes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`) are folded to the same value.
pub type EngineHash = u64;

/// Where the engine holds a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    Gpu,
    Cpu,
    /// `"STORAGE"` or any other medium string: not routed on, counted and skipped by the index.
    Other,
}

/// The KV-cache group kind carried by `kv_cache_spec_kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SpecKind {
    FullAttention,
    /// sliding_window, mamba, chunked local attention, ...: not used for prefix routing.
    Other,
}

#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    pub block_hashes: Vec<EngineHash>,
    /// `None` = the first block is block 0 of its sequence.
    pub parent: Option<EngineHash>,
    /// All tokens of all blocks, concatenated (empty for hash-only CPU placeholder events).
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    /// vLLM's deprecated integer LoRA id (`lora_id`), carried only so that re-encoding reproduces
    /// the engine's bytes; route on `lora_name`.
    pub lora_id: Option<i64>,
    pub lora_name: Option<String>,
    pub medium: Medium,
    /// `cache_salt`, recovered from the first block's untagged `extra_keys` when `parent` is None
    /// (the engine puts the salt on block 0 of a sequence only, so it is not carried otherwise).
    pub cache_salt: Option<String>,
    /// Per block: a digest of the extra keys other than the LoRA name and the salt (multimodal
    /// hashes, embedding digests), 0 where there are none. `None` when no block has any.
    pub extra: Option<Vec<u64>>,
    pub group_idx: u32,
    /// `None` when the event does not say (older releases, or the field omitted).
    pub spec_kind: Option<SpecKind>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<EngineHash>,
    pub medium: Medium,
    pub group_idx: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    Stored(BlockStored),
    Removed(BlockRemoved),
    AllCleared,
    /// A well-formed event of a type this version does not know: skipped and counted.
    Unknown(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub dp_rank: Option<u32>,
}

/// How to encode events (the simulator can emit either).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// vLLM >= 0.24: each event a map with `"type"`.
    Map,
    /// vLLM <= 0.23: each event a positional array, type tag first.
    Array,
}

type Result<T> = std::result::Result<T, EventError>;

/// Prefixes a schema error with where it happened (only on the error path).
fn context(what: impl std::fmt::Display) -> impl FnOnce(EventError) -> EventError {
    move |e| match e {
        EventError::Schema(msg) => EventError::Schema(format!("{what}: {msg}")),
        other => other,
    }
}

fn schema(msg: impl Into<String>) -> EventError {
    EventError::Schema(msg.into())
}
