//! Block hashing: kvroute's own content hash chain, and vLLM-compatible hashes.
