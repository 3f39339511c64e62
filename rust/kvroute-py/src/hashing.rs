//! Block hashing helpers: kvroute's content hash chain over token ids.
use kvroute_core::hashing;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::buffers::{self, hashes_to_bytes};
use crate::errors::invalid_argument;

/// Token counts above which hashing runs with the GIL released (xxh3 does ~1 token per ns, so
/// below this the detach costs about as much as the work).
const DETACH_TOKENS: usize = 1 << 16;

// Signatures spell the default block size as a literal so that Python sees `block_size=16`.
const _: () = assert!(hashing::DEFAULT_BLOCK_SIZE == 16);

pub(crate) fn check_block_size(block_size: usize) -> PyResult<()> {
    if block_size == 0 {
        return Err(invalid_argument("block_size must be at least 1"));
    }
    Ok(())
}

/// Chained hashes of the full blocks of `tokens` (a partial last block is not hashed).
pub(crate) fn hash_tokens(
    py: Python<'_>,
    tokens: &[u32],
    block_size: usize,
    lora: Option<&str>,
    salt: Option<&str>,
) -> Vec<u64> {
    if tokens.len() > DETACH_TOKENS {
        py.detach(|| hashing::block_hashes(tokens, block_size, lora, salt))
    } else {
        hashing::block_hashes(tokens, block_size, lora, salt)
    }
}

fn hash_arg(
    py: Python<'_>,
    tokens: &Bound<'_, PyAny>,
    block_size: usize,
    lora: Option<&str>,
    salt: Option<&str>,
) -> PyResult<Vec<u64>> {
    check_block_size(block_size)?;
    let tokens = buffers::tokens(tokens, "tokens")?;
    Ok(hash_tokens(py, &tokens, block_size, lora, salt))
}

/// Block hashes as `bytes` of little-endian u64 (8 bytes per full block).
#[pyfunction]
#[pyo3(signature = (tokens, block_size = 16, lora = None, salt = None))]
pub(crate) fn block_hashes<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    block_size: usize,
    lora: Option<&str>,
    salt: Option<&str>,
) -> PyResult<Bound<'py, PyBytes>> {
    hashes_to_bytes(py, &hash_arg(py, tokens, block_size, lora, salt)?)
}

/// Block hashes as a list of ints (convenient, slower for long inputs).
#[pyfunction]
#[pyo3(signature = (tokens, block_size = 16, lora = None, salt = None))]
pub(crate) fn block_hashes_list(
    py: Python<'_>,
    tokens: &Bound<'_, PyAny>,
    block_size: usize,
    lora: Option<&str>,
    salt: Option<&str>,
) -> PyResult<Vec<u64>> {
    hash_arg(py, tokens, block_size, lora, salt)
}

/// The chain's root: the parent hash of block 0 for this LoRA adapter and cache salt.
#[pyfunction]
#[pyo3(signature = (lora = None, salt = None))]
pub(crate) fn root_hash(lora: Option<&str>, salt: Option<&str>) -> u64 {
    hashing::root_hash(lora, salt)
}

/// The hash of one block of `tokens` chained onto `parent` (`extra`: a digest of extra keys).
#[pyfunction]
#[pyo3(signature = (parent, tokens, extra = 0))]
pub(crate) fn chain_hash(parent: u64, tokens: &Bound<'_, PyAny>, extra: u64) -> PyResult<u64> {
    let tokens = buffers::tokens(tokens, "tokens")?;
    Ok(hashing::chain_hash(parent, &tokens, extra))
}

/// vLLM's own block hashes, as the u64 values its KV events carry (low 64 bits, big-endian).
#[pyfunction]
#[pyo3(signature = (tokens, block_size = 16, algo = "sha256", seed = None, lora = None, salt = None))]
pub(crate) fn vllm_block_hashes(
    py: Python<'_>,
    tokens: &Bound<'_, PyAny>,
    block_size: usize,
    algo: &str,
    seed: Option<&str>,
    lora: Option<(String, String)>,
    salt: Option<&str>,
) -> PyResult<Vec<u64>> {
    check_block_size(block_size)?;
    let algo = hashing::VllmHashAlgo::parse(algo).ok_or_else(|| {
        invalid_argument(format!(
            "unknown hash algorithm {algo:?} (sha256, sha256_cbor)"
        ))
    })?;
    let tokens = buffers::tokens(tokens, "tokens")?;
    let lora = lora.as_ref().map(|(n, p)| (n.as_str(), p.as_str()));
    let h = hashing::VllmHasher::new(algo, seed);
    let digests = py.detach(|| h.block_hashes(&tokens, block_size, lora, salt));
    Ok(digests.iter().map(hashing::event_hash).collect())
}
