//! One typed error hierarchy for the core; the bindings map it once to Python exceptions.

/// Why a KV-event payload was rejected. A rejected payload changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    /// The bytes are not valid msgpack (truncated, bad marker, trailing garbage...).
    #[error("malformed msgpack at byte {offset}: {what}")]
    Msgpack { offset: usize, what: &'static str },
    /// Valid msgpack that does not have the shape of a vLLM event batch.
    #[error("invalid KV event batch: {0}")]
    Schema(String),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Event(#[from] EventError),
    #[error("unknown worker {0}")]
    UnknownWorker(u64),
    #[error("worker {0} already exists")]
    DuplicateWorker(u64),
    #[error("no eligible worker (all excluded, unhealthy or none registered)")]
    NoEligibleWorker,
    #[error("every eligible worker is at its in-flight limit")]
    Saturated,
    #[error("unknown routing policy {0:?}")]
    UnknownPolicy(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("too many workers (at most {0})")]
    TooManyWorkers(usize),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
