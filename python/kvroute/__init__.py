"""kvroute: a KV-cache-aware, load-aware request router for fleets of vLLM replicas.

The routing core is Rust (``kvroute._native``); this package is its public Python API.
"""

from kvroute._native import (
    DEFAULT_BLOCK_SIZE,
    MAX_WORKERS,
    POLICIES,
    POLICY_PARAMS,
    Decision,
    InvalidArgumentError,
    InvalidEventError,
    KvrouteError,
    NoEligibleWorkerError,
    PrefixIndex,
    SaturatedError,
    Scheduler,
    TooManyWorkersError,
    UnknownPolicyError,
    UnknownWorkerError,
    __version__,
    block_hashes,
    block_hashes_list,
    chain_hash,
    root_hash,
    vllm_block_hashes,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "MAX_WORKERS",
    "POLICIES",
    "POLICY_PARAMS",
    "Decision",
    "InvalidArgumentError",
    "InvalidEventError",
    "KvrouteError",
    "NoEligibleWorkerError",
    "PrefixIndex",
    "SaturatedError",
    "Scheduler",
    "TooManyWorkersError",
    "UnknownPolicyError",
    "UnknownWorkerError",
    "__version__",
    "block_hashes",
    "block_hashes_list",
    "chain_hash",
    "root_hash",
    "vllm_block_hashes",
]
