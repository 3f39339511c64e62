//! A continuous-batching engine step by step, as vLLM v1's scheduler runs it
//! (`vllm/v1/core/sched/scheduler.py`).
//!
//! Each [`Engine::step`]:
//! 1. schedules the running requests in order, each for all its uncomputed tokens (a decode is
//!    one token) within the step's token budget; when the pool has no blocks left, the *last*
//!    running request is preempted (recompute: its blocks are freed and stay cached, it goes back
//!    to the front of the waiting queue), until the current one fits or is itself preempted;
//! 2. if nothing was preempted, admits waiting requests in FCFS order while the budget lasts and
//!    fewer than `max_num_seqs` run: the prefix hit (GPU, then CPU tier) is capped at
//!    `num_tokens - 1` and block aligned, the rest is prefilled in chunks; the first request that
//!    does not fit stops admission;
//! 3. caches the full blocks each request will have computed (`BlockStored` at schedule time);
//! 4. models the step's duration, advances every scheduled request and samples one token for each
//!    request whose tokens are all computed; finished requests free their blocks, tail first.
//!
//! The step's KV events form one [`EventBatch`] (`ts` = the step's start time, `seq` counting
//! batches from 0), published only when non-empty.
use std::collections::VecDeque;
use std::sync::Arc;

use hashbrown::HashMap;

use super::blockhash::EngineHasher;
use super::cache::{BlockId, BlockPool};
pub use super::config::EngineConfig;
use super::latency::StepShape;
pub use super::output::{EngineMetrics, FinishReason, RequestOutput, StepResult};
use super::request::{token_seed, NewRequest, Req, Status};
use crate::events::EventBatch;
use crate::{Error, Result};

#[derive(Debug, Clone, Copy)]
struct Scheduled {
    slot: u32,
    /// Tokens computed in this step.
    n: usize,
    /// Tokens already in the KV cache before them.
    ctx: usize,
    /// Tokens loaded from the CPU tier for this request.
    loaded: usize,
}

/// One simulated engine.
pub struct Engine {
    cfg: EngineConfig,
    hasher: EngineHasher,
    pool: BlockPool,
    reqs: Vec<Option<Req>>,
    free_slots: Vec<u32>,
    ids: HashMap<Arc<str>, u32>,
    waiting: VecDeque<u32>,
    running: Vec<u32>,
    /// Outputs produced between steps (aborts), delivered by the next step.
    pending: Vec<RequestOutput>,
    seq: u64,
    m: EngineMetrics,
    sched: Vec<Scheduled>,
    hits: Vec<BlockId>,
    hash_buf: Vec<u8>,
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Engine {
            hasher: EngineHasher::new(cfg.hash_algo, cfg.hash_seed.as_deref()),
            pool: BlockPool::new(
                cfg.block_size,
                cfg.num_gpu_blocks,
                cfg.num_cpu_blocks,
                cfg.emit_events,
            ),
            cfg,
            reqs: Vec::new(),
            free_slots: Vec::new(),
            ids: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending: Vec::new(),
            seq: 0,
            m: EngineMetrics::default(),
            sched: Vec::new(),
            hits: Vec::new(),
            hash_buf: Vec::new(),
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The block pool (inspection).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Queues a request. Rejects a duplicate id, an empty prompt, `max_tokens == 0`, token ids
    /// outside the vocabulary and a request that could never fit in the KV cache.
    pub fn add_request(&mut self, r: NewRequest) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if self.ids.contains_key(&r.id) {
            return bad(format!("request id {:?} is already in flight", &*r.id));
        }
        if r.prompt.is_empty() {
            return bad("the prompt must contain at least one token".into());
        }
        if r.max_tokens == 0 {
            return bad("max_tokens must be at least 1".into());
        }
        if let Some(t) = r.prompt.iter().find(|&&t| t >= self.cfg.vocab_size) {
            return bad(format!(
                "token id {t} is out of vocabulary (vocab_size {})",
                self.cfg.vocab_size
            ));
        }
        let bs = self.cfg.block_size;
        let need = (r.prompt.len() + r.max_tokens as usize).div_ceil(bs);
        if need > self.pool.usable_blocks() {
            return bad(format!(
                "the request needs {need} KV blocks of {bs} tokens, the engine has {}",
                self.pool.usable_blocks()
            ));
        }
        let (lora, lora_id, path) = match r.lora.filter(|l| !l.is_empty()) {
            Some(name) => {
                let (id, path) = self.cfg.lora(&name);
                (Some(Arc::<str>::from(name)), Some(id), path)
            }
            None => (None, None, String::new()),
        };
        let salt = r.salt.filter(|s| !s.is_empty()).map(Arc::<str>::from);
        let chain = self
            .hasher
            .start(lora.as_deref().map(|l| (l, path.as_str())), salt.as_deref());
        let prompt_len = r.prompt.len();
        let mut req = Req {
            token_seed: token_seed(self.cfg.seed, &r.id),
            id: r.id,
            tag: r.tag,
            tokens: r.prompt,
            prompt_len,
            max_tokens: r.max_tokens as usize,
            computed: 0,
            hashes: Vec::with_capacity(need),
            chain,
            blocks: Vec::with_capacity(need),
            num_cached_blocks: 0,
            lora,
            lora_id,
            salt,
            eos: if r.ignore_eos { None } else { r.eos_token_id },
            status: Status::Waiting,
            preemptions: 0,
            num_cached_tokens: None,
        };
        req.tokens.reserve(req.max_tokens);
        req.extend_hashes(&self.hasher, bs, &mut self.hash_buf);
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.reqs.push(None);
                (self.reqs.len() - 1) as u32
            }
        };
        self.ids.insert(req.id.clone(), slot);
        self.reqs[slot as usize] = Some(req);
        self.waiting.push_back(slot);
        Ok(())
    }

    /// Drops a request wherever it is; its blocks are freed (and stay cached). The next step
    /// reports it finished with [`FinishReason::Abort`]. False if the id is not in flight.
    pub fn abort(&mut self, id: &str) -> bool {
        let Some(slot) = self.ids.remove(id) else {
            return false;
        };
        let Some(r) = self.reqs[slot as usize].take() else {
            return false;
        };
        self.waiting.retain(|&s| s != slot);
        self.running.retain(|&s| s != slot);
        self.pool.free(&r.blocks);
        self.free_slots.push(slot);
        self.pending.push(RequestOutput {
            token: None,
            first: false,
            finish: Some(FinishReason::Abort),
            num_cached_tokens: r.num_cached_tokens.unwrap_or(0) as u32,
            prompt_tokens: r.prompt_len as u32,
            tag: r.tag,
            id: r.id,
        });
        true
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty() || !self.pending.is_empty()
    }

    /// A restart: every request is dropped without output, every cache tier emptied, event
    /// sequence numbers and counters start again from 0.
    pub fn reset(&mut self) {
        self.reqs.clear();
        self.free_slots.clear();
        self.ids.clear();
        self.waiting.clear();
        self.running.clear();
        self.pending.clear();
        self.pool.reset();
        self.seq = 0;
        self.m = EngineMetrics::default();
    }

    pub fn metrics(&self) -> EngineMetrics {
        EngineMetrics {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_cache_usage: self.pool.usage(),
            cpu_blocks_used: self.pool.cpu().len(),
            ..self.m
        }
    }

    /// One engine step starting at `now` (seconds, the batch timestamp).
    pub fn step(&mut self, now: f64) -> StepResult {
        let mut out = StepResult::default();
        self.step_into(now, &mut out);
        out
    }

    /// [`Self::step`] into a caller-owned result, reusing its output vector.
    pub fn step_into(&mut self, now: f64, out: &mut StepResult) {
        out.outputs.clear();
        out.outputs.append(&mut self.pending);
        out.events = None;
        out.seq = None;
        let mut sched = std::mem::take(&mut self.sched);
        sched.clear();
        let mut budget = self.cfg.max_num_batched_tokens;
        if !self.schedule_running(&mut sched, &mut budget) {
            self.schedule_waiting(&mut sched, &mut budget);
        }
        let mut shape = StepShape::default();
        for s in &sched {
            let r = self.reqs[s.slot as usize]
                .as_ref()
                .expect("scheduled slot holds a request");
            if s.n == 1 && s.loaded == 0 && s.ctx >= r.prompt_len {
                shape.add_decode((s.ctx + 1) as u64);
            } else {
                shape.add_prefill(s.n as u64, s.ctx as u64);
            }
            shape.loaded_tokens += s.loaded as u64;
            shape.sampled += u64::from(s.ctx + s.n == r.tokens.len());
        }
        self.m.prompt_tokens_computed += shape.prefill_tokens;
        shape.kv_usage = self.pool.usage();
        out.duration_s = self.cfg.latency.step_time(&shape);
        out.shape = shape;
        if !shape.is_empty() {
            self.m.steps += 1;
        }
        let mut finished = false;
        for s in &sched {
            finished |= self.advance(s, &mut out.outputs);
        }
        if finished {
            let reqs = &self.reqs;
            self.running.retain(|&s| reqs[s as usize].is_some());
        }
        if self.pool.has_events() {
            out.events = Some(EventBatch {
                ts: now,
                events: self.pool.take_events(),
                dp_rank: Some(0),
            });
            out.seq = Some(self.seq);
            self.seq += 1;
        }
        self.sched = sched;
    }

    fn req(&self, slot: u32) -> &Req {
        self.reqs[slot as usize]
            .as_ref()
            .expect("scheduled slot holds a request")
    }

    /// Schedules the running requests; returns whether any request was preempted.
    fn schedule_running(&mut self, sched: &mut Vec<Scheduled>, budget: &mut usize) -> bool {
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let slot = self.running[i];
            let fits = loop {
                let r = self.reqs[slot as usize]
                    .as_mut()
                    .expect("running slot holds a request");
                let n = (r.tokens.len() - r.computed).min(*budget);
                if self.pool.allocate(&mut r.blocks, &[], r.computed + n) {
                    let (upto, mut cached) = (r.computed + n, r.num_cached_blocks);
                    self.pool
                        .cache_blocks(&r.view(), &r.blocks, &mut cached, upto);
                    r.num_cached_blocks = cached;
                    break Some(n);
                }
                let victim = self.running.pop().expect("the current request is running");
                self.preempt(victim);
                preempted = true;
                if victim == slot {
                    break None;
                }
            };
            let Some(n) = fits else { break };
            let ctx = self.req(slot).computed;
            sched.push(Scheduled {
                slot,
                n,
                ctx,
                loaded: 0,
            });
            *budget -= n;
            i += 1;
        }
        preempted
    }

    fn preempt(&mut self, slot: u32) {
        let r = self.reqs[slot as usize]
            .as_mut()
            .expect("victim slot holds a request");
        self.pool.free(&r.blocks);
        r.blocks.clear();
        r.computed = 0;
        r.num_cached_blocks = 0;
        r.status = Status::Waiting;
        r.preemptions += 1;
        self.m.preemptions += 1;
        self.waiting.push_front(slot);
    }

    fn schedule_waiting(&mut self, sched: &mut Vec<Scheduled>, budget: &mut usize) {
        let bs = self.cfg.block_size;
        while *budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(&slot) = self.waiting.front() else {
                break;
            };
            let r = self.reqs[slot as usize]
                .as_mut()
                .expect("waiting slot holds a request");
            let num_tokens = r.tokens.len();
            let max_hit = (num_tokens - 1) / bs;
            self.hits.clear();
            self.pool.find_cached(&r.hashes[..max_hit], &mut self.hits);
            let gpu = self.hits.len();
            let cpu = self.pool.cpu_prefix(&r.hashes[gpu..max_hit]);
            let hit = (gpu + cpu) * bs;
            let n = (num_tokens - hit).min(*budget);
            if !self.pool.allocate(&mut r.blocks, &self.hits, hit + n) {
                break;
            }
            self.waiting.pop_front();
            self.running.push(slot);
            r.status = Status::Running;
            r.computed = hit;
            self.pool.touch_cpu(&r.hashes[gpu..gpu + cpu]);
            let mut cached = gpu;
            self.pool
                .cache_blocks(&r.view(), &r.blocks, &mut cached, hit + n);
            r.num_cached_blocks = cached;
            if r.preemptions == 0 {
                self.m.prefix_cache_queries += num_tokens as u64;
                self.m.prefix_cache_hits += (gpu * bs) as u64;
                if self.pool.cpu().capacity() > 0 {
                    self.m.external_prefix_cache_queries += num_tokens as u64;
                    self.m.external_prefix_cache_hits += (cpu * bs) as u64;
                }
            }
            r.num_cached_tokens.get_or_insert(hit);
            sched.push(Scheduled {
                slot,
                n,
                ctx: hit,
                loaded: cpu * bs,
            });
            *budget -= n;
        }
    }

    /// Applies a scheduled chunk; samples a token when the request is fully computed. Returns
    /// whether the request finished (it is then gone from `reqs`, still listed in `running`).
    fn advance(&mut self, s: &Scheduled, outputs: &mut Vec<RequestOutput>) -> bool {
        let bs = self.cfg.block_size;
        let r = self.reqs[s.slot as usize]
            .as_mut()
            .expect("scheduled slot holds a request");
        r.computed += s.n;
        if r.computed < r.tokens.len() {
            return false;
        }
        let first = r.output_len() == 0;
        let token = r.next_token(self.cfg.vocab_size);
        r.tokens.push(token);
        if r.tokens.len() / bs > r.hashes.len() {
            r.extend_hashes(&self.hasher, bs, &mut self.hash_buf);
        }
        self.m.generation_tokens += 1;
        let finish = if r.output_len() >= r.max_tokens {
            Some(FinishReason::Length)
        } else if r.eos == Some(token) {
            Some(FinishReason::Stop)
        } else {
            None
        };
        outputs.push(RequestOutput {
            id: r.id.clone(),
            tag: r.tag,
            token: Some(token),
            first,
            finish,
            num_cached_tokens: r.num_cached_tokens.unwrap_or(0) as u32,
            prompt_tokens: r.prompt_len as u32,
        });
        if finish.is_none() {
            return false;
        }
        let r = self.reqs[s.slot as usize]
            .take()
            .expect("finished slot holds a request");
        self.pool.free(&r.blocks);
        self.ids.remove(&r.id);
        self.free_slots.push(s.slot);
        true
    }
}
