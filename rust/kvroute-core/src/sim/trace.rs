//! Mooncake traces (`shared/traces/README.md`): one JSON object per line with `timestamp` (ms),
//! `input_length`, `output_length` and `hash_ids`, prefix-chained ids of 512-token blocks.
//!
//! Prompts are synthesised so that equal ids give equal tokens: block `id` is always the same
//! 512 tokens drawn from a generator seeded with `(seed, id)`, and the last block is cut to
//! `input_length`. Two requests therefore share exactly their first `k * 512` tokens when they
//! share their first `k` ids, which is what the trace encodes.
use std::path::Path;

use serde_json::Value;

use super::request::splitmix64;
use crate::{Error, Result};

/// Tokens per `hash_ids` entry in Mooncake traces.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

/// One trace line.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRecord {
    pub timestamp_ms: f64,
    pub input_length: usize,
    pub output_length: usize,
    pub hash_ids: Vec<u64>,
}

fn bad(line: usize, what: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("trace line {line}: {what}"))
}

fn field_u64(v: &Value, key: &str, line: usize) -> Result<u64> {
    v.get(key)
        .and_then(Value::as_u64)
        .ok_or_else(|| bad(line, format!("{key:?} must be a non-negative integer")))
}

/// Parses a Mooncake JSONL text (blank lines skipped), at most `limit` records.
///
/// `input_length` is clamped to what the ids can carry (as Dynamo's loader does) and a zero
/// `output_length` becomes 1 (an engine request generates at least one token).
pub fn parse_mooncake(text: &str, limit: Option<usize>) -> Result<Vec<TraceRecord>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if limit.is_some_and(|l| out.len() >= l) {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let n = i + 1;
        let v: Value = serde_json::from_str(line).map_err(|e| bad(n, e))?;
        let timestamp_ms = v
            .get("timestamp")
            .and_then(Value::as_f64)
            .filter(|t| t.is_finite() && *t >= 0.0)
            .ok_or_else(|| bad(n, "\"timestamp\" must be a non-negative number"))?;
        let hash_ids = v
            .get("hash_ids")
            .and_then(Value::as_array)
            .ok_or_else(|| bad(n, "\"hash_ids\" must be an array"))?
            .iter()
            .map(|x| {
                x.as_u64()
                    .ok_or_else(|| bad(n, "hash ids must be integers"))
            })
            .collect::<Result<Vec<u64>>>()?;
        let input = field_u64(&v, "input_length", n)? as usize;
        let input_length = input.min(hash_ids.len() * MOONCAKE_BLOCK_TOKENS);
        if input_length == 0 {
            return Err(bad(n, "empty prompt"));
        }
        out.push(TraceRecord {
            timestamp_ms,
            input_length,
            output_length: (field_u64(&v, "output_length", n)? as usize).max(1),
            hash_ids,
        });
    }
    Ok(out)
}

/// Reads and parses a Mooncake JSONL file.
pub fn load_mooncake(path: &Path, limit: Option<usize>) -> Result<Vec<TraceRecord>> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::InvalidArgument(format!("cannot read trace {}: {e}", path.display()))
    })?;
    parse_mooncake(&text, limit)
}

/// Turns a record's ids into prompt tokens.
#[derive(Debug, Clone, Copy)]
pub struct TokenSynth {
    seed: u64,
    vocab_size: u32,
    block_tokens: usize,
}

impl TokenSynth {
    /// Blocks of [`MOONCAKE_BLOCK_TOKENS`] tokens.
    pub fn new(seed: u64, vocab_size: u32) -> Self {
        Self::with_block_tokens(seed, vocab_size, MOONCAKE_BLOCK_TOKENS)
    }

    /// Blocks of `block_tokens` tokens (the built-in generators use finer blocks than Mooncake).
    pub fn with_block_tokens(seed: u64, vocab_size: u32, block_tokens: usize) -> Self {
        TokenSynth {
            seed: splitmix64(seed ^ 0x6d6f_6f6e_6361_6b65),
            vocab_size: vocab_size.max(1),
            block_tokens: block_tokens.max(1),
        }
    }

    /// Appends the record's prompt to `out`.
    pub fn prompt(&self, rec: &TraceRecord, out: &mut Vec<u32>) {
        out.reserve(rec.input_length);
        let mut left = rec.input_length;
        for &id in &rec.hash_ids {
            let n = left.min(self.block_tokens);
            self.block(id, n, out);
            left -= n;
            if left == 0 {
                break;
            }
        }
    }

    /// The first `n` tokens of block `id`: two tokens per 64-bit draw, mapped into the vocabulary
    /// by a multiply-shift (no division).
    fn block(&self, id: u64, n: usize, out: &mut Vec<u32>) {
        let vocab = u64::from(self.vocab_size);
        let mut state = splitmix64(self.seed ^ id.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut i = 0;
        while i < n {
            state = splitmix64(state);
            out.push((((state & 0xffff_ffff) * vocab) >> 32) as u32);
            if i + 1 < n {
                out.push((((state >> 32) * vocab) >> 32) as u32);
            }
            i += 2;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_clamps_and_reports_bad_lines() {
        let text = "{\"timestamp\": 0, \"input_length\": 700, \"output_length\": 0, \"hash_ids\": [1, 2]}\n\n\
                    {\"timestamp\": 5.5, \"input_length\": 2000, \"output_length\": 3, \"hash_ids\": [1]}\n";
        let r = parse_mooncake(text, None).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].input_length, r[0].output_length), (700, 1));
        assert_eq!((r[1].timestamp_ms, r[1].input_length), (5.5, 512));
        assert_eq!(parse_mooncake(text, Some(1)).unwrap().len(), 1);
        let e = parse_mooncake("{\"timestamp\": 1}\n", None).unwrap_err();
        assert!(e.to_string().contains("line 1"), "{e}");
        assert!(parse_mooncake("nope", None).is_err());
    }

    #[test]
    fn equal_ids_give_equal_tokens_and_the_last_block_is_cut() {
        let s = TokenSynth::new(3, 128_000);
        let rec = |ids: Vec<u64>, len| TraceRecord {
            timestamp_ms: 0.0,
            input_length: len,
            output_length: 1,
            hash_ids: ids,
        };
        let (mut a, mut b) = (Vec::new(), Vec::new());
        s.prompt(&rec(vec![0, 1, 2], 1300), &mut a);
        s.prompt(&rec(vec![0, 1, 9], 1536), &mut b);
        assert_eq!((a.len(), b.len()), (1300, 1536));
        assert_eq!(a[..1024], b[..1024]);
        assert_ne!(a[1024..1300], b[1024..1300]);
        assert!(a.iter().all(|&t| t < 128_000));
        let mut c = Vec::new();
        TokenSynth::new(4, 128_000).prompt(&rec(vec![0], 512), &mut c);
        assert_ne!(c[..], a[..512], "another seed, other tokens");
    }
}
