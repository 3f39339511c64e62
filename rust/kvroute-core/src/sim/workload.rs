//! Workloads: a Mooncake trace or one of the built-in generators, as [`TraceRecord`]s.
//!
//! The generators produce the prefix-sharing shapes the routing literature measures (Preble,
//! SGLang, Mooncake), in the Mooncake format: each record lists the ids of its prompt's blocks of
//! [`GENERATOR_BLOCK_TOKENS`] tokens, and equal leading ids mean equal leading tokens
//! ([`super::trace::TokenSynth`]). Every generator is a pure function of `(requests, seed)`:
//!
//! * `shared-prefix`: many clients sharing a few long system prompts (6 prompts of 2K-8K tokens,
//!   Zipf popularity), each request one short unique question after it.
//! * `multi-turn`: chat sessions whose history grows: each turn resends the system prompt (one of
//!   4), every earlier user message and answer, then a new message. 64 sessions are open at a
//!   time, 2-12 turns each.
//! * `tool-agent`: agent episodes over shared tool descriptions (3 sets of 4K-12K tokens): a task,
//!   then 3-10 steps, each resending everything so far plus the last action and observation.
//! * `doc-qa`: long-document question answering: 16 documents of 8K-32K tokens open at a time,
//!   8-40 questions each, interleaved.
//!
//! Arrivals are a Poisson process at the generator's own rate ([`natural_rate`]); the replay can
//! replace them ([`super::arrival`]) and scale them to a load.
use std::path::Path;

use super::request::splitmix64;
use super::trace::{load_mooncake, TraceRecord, MOONCAKE_BLOCK_TOKENS};
use crate::{Error, Result};

/// Tokens per id in generated workloads: fine enough that sharing stops close to where the
/// shared text does, and a multiple of every preset's KV block size.
pub const GENERATOR_BLOCK_TOKENS: usize = 64;

/// Names of the built-in generators.
pub const GENERATORS: [&str; 4] = ["shared-prefix", "multi-turn", "tool-agent", "doc-qa"];

/// Requests to replay, with the size of their id blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    pub name: String,
    /// Tokens per entry of each record's `hash_ids`.
    pub block_tokens: usize,
    /// In arrival order (timestamps in ms, not decreasing).
    pub records: Vec<TraceRecord>,
}

impl Workload {
    /// A Mooncake JSONL trace (512-token ids), at most `limit` records.
    pub fn mooncake(path: &Path, limit: Option<usize>) -> Result<Self> {
        Ok(Workload {
            name: path
                .file_stem()
                .map_or_else(|| "trace".into(), |s| s.to_string_lossy().into_owned()),
            block_tokens: MOONCAKE_BLOCK_TOKENS,
            records: load_mooncake(path, limit)?,
        })
    }

    /// The generator called `name` ([`GENERATORS`]), `requests` long.
    pub fn generate(name: &str, requests: usize, seed: u64) -> Result<Self> {
        let mut g = Gen::new(seed ^ xxhash_rust::xxh3::xxh3_64(name.as_bytes()));
        let records = match name {
            "shared-prefix" => g.shared_prefix(requests),
            "multi-turn" => g.multi_turn(requests),
            "tool-agent" => g.tool_agent(requests),
            "doc-qa" => g.doc_qa(requests),
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "unknown workload generator {name:?} (known: {})",
                    GENERATORS.join(", ")
                )))
            }
        };
        let mut w = Workload {
            name: name.into(),
            block_tokens: GENERATOR_BLOCK_TOKENS,
            records,
        };
        let rate = natural_rate(name).expect("a known generator");
        super::arrival::Arrival::Poisson { rate }.apply(&mut w.records, seed)?;
        Ok(w)
    }

    /// A generator's workload when `source` names one ([`GENERATORS`], `requests` long, 2,000
    /// by default), else the Mooncake trace at path `source` (its first `requests` records).
    pub fn load(source: &str, requests: Option<usize>, seed: u64) -> Result<Self> {
        if GENERATORS.contains(&source) {
            Self::generate(source, requests.unwrap_or(2000), seed)
        } else {
            Self::mooncake(Path::new(source), requests)
        }
    }

    /// Mean arrival rate (requests per second over the span of the timestamps).
    pub fn mean_rate(&self) -> f64 {
        let n = self.records.len();
        let span = match (self.records.first(), self.records.last()) {
            (Some(a), Some(b)) => (b.timestamp_ms - a.timestamp_ms) / 1000.0,
            _ => 0.0,
        };
        if n < 2 || span <= 0.0 {
            0.0
        } else {
            (n - 1) as f64 / span
        }
    }

    /// Total prompt tokens.
    pub fn prompt_tokens(&self) -> u64 {
        self.records.iter().map(|r| r.input_length as u64).sum()
    }
}

/// A generator's own arrival rate, requests per second (about the load 8 H100s with an 8B model
/// carry comfortably; benchmarks rescale it).
pub fn natural_rate(name: &str) -> Option<f64> {
    Some(match name {
        "shared-prefix" => 20.0,
        "multi-turn" => 10.0,
        "tool-agent" => 6.0,
        "doc-qa" => 6.0,
        _ => return None,
    })
}

/// Draws and block ids for the generators.
struct Gen {
    state: u64,
    next_id: u64,
}

impl Gen {
    fn new(seed: u64) -> Self {
        Gen {
            state: splitmix64(seed),
            next_id: 0,
        }
    }

    fn u64(&mut self) -> u64 {
        self.state = splitmix64(self.state);
        self.state
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.u64() % (hi - lo + 1) as u64) as usize
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Index in `0..n` with Zipf(1) weights (item 0 the most popular).
    fn zipf(&mut self, n: usize) -> usize {
        let total: f64 = (1..=n).map(|i| 1.0 / i as f64).sum();
        let mut x = self.unit() * total;
        for i in 0..n {
            x -= 1.0 / (i + 1) as f64;
            if x < 0.0 {
                return i;
            }
        }
        n - 1
    }

    /// `n` blocks of never-seen content.
    fn fresh(&mut self, n: usize) -> Vec<u64> {
        let ids = (self.next_id..self.next_id + n as u64).collect();
        self.next_id += n as u64;
        ids
    }

    /// A record whose prompt is `ids`, its last block cut by up to a block, with `output` tokens.
    fn record(&mut self, ids: Vec<u64>, output: usize) -> TraceRecord {
        let cut = self.range(0, GENERATOR_BLOCK_TOKENS - 1);
        TraceRecord {
            timestamp_ms: 0.0,
            input_length: ids.len() * GENERATOR_BLOCK_TOKENS - cut,
            output_length: output.max(1),
            hash_ids: ids,
        }
    }

    /// `n` shared prefixes of `lo..=hi` blocks.
    fn prefixes(&mut self, n: usize, lo: usize, hi: usize) -> Vec<Vec<u64>> {
        (0..n)
            .map(|_| {
                let len = self.range(lo, hi);
                self.fresh(len)
            })
            .collect()
    }

    fn shared_prefix(&mut self, requests: usize) -> Vec<TraceRecord> {
        let systems = self.prefixes(6, 32, 128);
        (0..requests)
            .map(|_| {
                let mut ids = systems[self.zipf(systems.len())].clone();
                let q = self.range(1, 16);
                ids.extend(self.fresh(q));
                let out = self.range(32, 512);
                self.record(ids, out)
            })
            .collect()
    }

    /// Interleaved sessions: `open` at a time, each a growing context over one of `prefixes`;
    /// `turns` draws a session's length, `step` one turn's (new input blocks, output tokens).
    fn sessions(
        &mut self,
        requests: usize,
        open: usize,
        prefixes: &[Vec<u64>],
        turns: (usize, usize),
        step: impl Fn(&mut Gen, usize) -> (usize, usize),
    ) -> Vec<TraceRecord> {
        struct Session {
            ctx: Vec<u64>,
            turn: usize,
            turns: usize,
        }
        let start = |g: &mut Gen| Session {
            ctx: prefixes[g.zipf(prefixes.len())].clone(),
            turn: 0,
            turns: g.range(turns.0, turns.1),
        };
        let mut live: Vec<Session> = (0..open).map(|_| start(self)).collect();
        let mut out = Vec::with_capacity(requests);
        while out.len() < requests {
            let i = self.range(0, live.len() - 1);
            let (new_in, new_out) = step(self, live[i].turn);
            let s = &mut live[i];
            let input = self.fresh(new_in);
            s.ctx.extend(input);
            let ids = s.ctx.clone();
            out.push(self.record(ids, new_out));
            // The answer becomes part of the next turn's prompt.
            let answer = self.fresh(new_out.div_ceil(GENERATOR_BLOCK_TOKENS));
            let s = &mut live[i];
            s.ctx.extend(answer);
            s.turn += 1;
            if s.turn >= s.turns {
                live[i] = start(self);
            }
        }
        out
    }

    fn multi_turn(&mut self, requests: usize) -> Vec<TraceRecord> {
        let systems = self.prefixes(4, 8, 32);
        self.sessions(requests, 64, &systems, (2, 12), |g, _| {
            (g.range(1, 8), g.range(64, 512))
        })
    }

    fn tool_agent(&mut self, requests: usize) -> Vec<TraceRecord> {
        let tools = self.prefixes(3, 64, 192);
        self.sessions(requests, 32, &tools, (3, 10), |g, turn| {
            // The first step carries the task; later ones an observation of the last action.
            let input = if turn == 0 {
                g.range(2, 16)
            } else {
                g.range(2, 24)
            };
            (input, g.range(64, 256))
        })
    }

    fn doc_qa(&mut self, requests: usize) -> Vec<TraceRecord> {
        let instructions = self.fresh(4);
        let open_doc = |g: &mut Gen| {
            let mut ids = instructions.clone();
            let len = g.range(128, 512);
            ids.extend(g.fresh(len));
            (ids, g.range(8, 40))
        };
        let mut docs: Vec<(Vec<u64>, usize)> = (0..16).map(|_| open_doc(self)).collect();
        let mut out = Vec::with_capacity(requests);
        while out.len() < requests {
            let i = self.range(0, docs.len() - 1);
            let mut ids = docs[i].0.clone();
            let q = self.range(1, 3);
            ids.extend(self.fresh(q));
            let answer = self.range(16, 256);
            out.push(self.record(ids, answer));
            docs[i].1 -= 1;
            if docs[i].1 == 0 {
                docs[i] = open_doc(self);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Leading ids two records share.
    fn shared(a: &TraceRecord, b: &TraceRecord) -> usize {
        a.hash_ids
            .iter()
            .zip(&b.hash_ids)
            .take_while(|(x, y)| x == y)
            .count()
    }

    #[test]
    fn generators_are_deterministic_and_well_formed() {
        for name in GENERATORS {
            let a = Workload::generate(name, 500, 7).unwrap();
            assert_eq!(a, Workload::generate(name, 500, 7).unwrap(), "{name}");
            assert_ne!(a, Workload::generate(name, 500, 8).unwrap(), "{name}");
            assert_eq!(a.records.len(), 500);
            assert_eq!(a.block_tokens, GENERATOR_BLOCK_TOKENS);
            let mut last = 0.0;
            for r in &a.records {
                assert!(r.timestamp_ms >= last, "{name}: arrivals in order");
                last = r.timestamp_ms;
                let full = r.hash_ids.len() * GENERATOR_BLOCK_TOKENS;
                assert!(r.input_length > full - GENERATOR_BLOCK_TOKENS && r.input_length <= full);
                assert!(r.output_length >= 1 && r.input_length < 60_000, "{name}");
            }
            let rate = a.mean_rate();
            let want = natural_rate(name).unwrap();
            assert!((rate / want - 1.0).abs() < 0.15, "{name}: {rate} vs {want}");
        }
        assert!(Workload::generate("nope", 1, 0).is_err());
    }

    #[test]
    fn each_generator_has_its_sharing_shape() {
        // shared-prefix: one of six system prompts, then a unique question.
        let w = Workload::generate("shared-prefix", 2000, 1).unwrap();
        let firsts: std::collections::HashSet<u64> =
            w.records.iter().map(|r| r.hash_ids[0]).collect();
        assert_eq!(firsts.len(), 6);
        let r = &w.records;
        let s = (1..r.len())
            .filter(|&i| r[i].hash_ids[0] == r[0].hash_ids[0])
            .map(|i| shared(&r[0], &r[i]))
            .max()
            .unwrap();
        assert!((32..=128).contains(&s), "{s}");

        // multi-turn: a later turn extends an earlier request of its session.
        let w = Workload::generate("multi-turn", 2000, 1).unwrap();
        let grows = w.records.iter().enumerate().any(|(i, a)| {
            w.records[i + 1..]
                .iter()
                .any(|b| shared(a, b) == a.hash_ids.len() && b.hash_ids.len() > a.hash_ids.len())
        });
        assert!(grows);

        // doc-qa: many questions per document, long shared prefixes.
        let w = Workload::generate("doc-qa", 2000, 1).unwrap();
        let long_shares = (1..200)
            .filter(|&i| (0..i).any(|j| shared(&w.records[i], &w.records[j]) >= 128))
            .count();
        assert!(long_shares > 100, "{long_shares}");

        // tool-agent: three tool sets of 64-192 blocks open every prompt.
        let w = Workload::generate("tool-agent", 2000, 1).unwrap();
        let firsts: std::collections::HashSet<u64> =
            w.records.iter().map(|r| r.hash_ids[0]).collect();
        assert_eq!(firsts.len(), 3);
        assert!(w.records.iter().all(|r| r.hash_ids.len() >= 66));
    }
}
