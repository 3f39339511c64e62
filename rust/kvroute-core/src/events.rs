//! vLLM KV-cache event batches (ZMQ payload frame) <-> typed events.
//!
//! Wire contract: `shared/docs/vllm.md` §1. A batch is the msgpack array `[ts, events, dp_rank]`;
//! each event is a map with a `"type"` key (vLLM >= 0.24, fields equal to their default omitted,
//! unknown keys ignored) or a positional array with the type tag first (vLLM <= 0.23).
//!
//! Decoding validates the whole payload before anything is returned, so a malformed payload is
//! rejected as a unit and the index never sees half of it.

use crate::error::EventError;
use crate::msgpack::{check_utf8, Reader, ValueType, Writer};

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

const TAG_STORED: &str = "BlockStored";
const TAG_REMOVED: &str = "BlockRemoved";
const TAG_CLEARED: &str = "AllBlocksCleared";

/// Fields (tag included) of vLLM 0.33's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`.
/// msgspec sizes a struct's map header for all of them before omitting defaults, so a
/// `BlockStored` always starts with `de 00 NN` (map16) and the others with a fixmap.
const STORED_MAX_FIELDS: usize = 16;
const REMOVED_MAX_FIELDS: usize = 6;
const CLEARED_MAX_FIELDS: usize = 1;

/// Event fields kvroute reads. Anything else is skipped (after checking it is well formed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    SpecKind,
}

/// Positional order of the legacy (array-like) encodings; later, unknown positions are skipped.
const STORED_ORDER: [Field; 10] = [
    Field::BlockHashes,
    Field::Parent,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
    Field::GroupIdx,
    Field::SpecKind,
];
const REMOVED_ORDER: [Field; 3] = [Field::BlockHashes, Field::Medium, Field::GroupIdx];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

impl Kind {
    fn of(tag: &str) -> Kind {
        match tag {
            TAG_STORED => Kind::Stored,
            TAG_REMOVED => Kind::Removed,
            TAG_CLEARED => Kind::Cleared,
            _ => Kind::Unknown,
        }
    }

    /// The field a map key names for this kind of event, if kvroute reads it.
    fn field(self, key: &[u8]) -> Option<Field> {
        let f = match key {
            b"block_hashes" => Field::BlockHashes,
            b"parent_block_hash" => Field::Parent,
            b"token_ids" => Field::TokenIds,
            b"block_size" => Field::BlockSize,
            b"lora_id" => Field::LoraId,
            b"medium" => Field::Medium,
            b"lora_name" => Field::LoraName,
            b"extra_keys" => Field::ExtraKeys,
            b"group_idx" => Field::GroupIdx,
            b"kv_cache_spec_kind" => Field::SpecKind,
            _ => return None,
        };
        match self {
            Kind::Stored => Some(f),
            Kind::Removed => REMOVED_ORDER.contains(&f).then_some(f),
            Kind::Cleared | Kind::Unknown => None,
        }
    }

    fn positional(self) -> &'static [Field] {
        match self {
            Kind::Stored => &STORED_ORDER,
            Kind::Removed => &REMOVED_ORDER,
            Kind::Cleared | Kind::Unknown => &[],
        }
    }
}

fn field_name(f: Field) -> &'static str {
    match f {
        Field::BlockHashes => "block_hashes",
        Field::Parent => "parent_block_hash",
        Field::TokenIds => "token_ids",
        Field::BlockSize => "block_size",
        Field::LoraId => "lora_id",
        Field::Medium => "medium",
        Field::LoraName => "lora_name",
        Field::ExtraKeys => "extra_keys",
        Field::GroupIdx => "group_idx",
        Field::SpecKind => "kv_cache_spec_kind",
    }
}

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

/// Folds a byte-string block hash to the engine's u64: the low 64 bits read big-endian (the last
/// 8 bytes; a shorter string counts as left-padded with zeros). Equal to the int vLLM sends with
/// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`.
pub fn fold_hash_bytes(bytes: &[u8]) -> EngineHash {
    let tail = bytes
        .get(bytes.len().saturating_sub(8)..)
        .unwrap_or_default();
    tail.iter().fold(0, |acc, &b| (acc << 8) | u64::from(b))
}

#[inline]
fn read_hash(r: &mut Reader<'_>) -> Result<EngineHash> {
    if let Some(h) = r.try_read_uint64() {
        return Ok(h);
    }
    match r.peek_type()? {
        ValueType::Int => r.read_int_bits(),
        ValueType::Bin => Ok(fold_hash_bytes(r.read_bin()?)),
        t => Err(schema(format!(
            "a block hash must be an int or bytes, found {t:?} at byte {}",
            r.pos()
        ))),
    }
}

fn parse_medium(s: &str) -> Medium {
    if s.eq_ignore_ascii_case("GPU") {
        Medium::Gpu
    } else if s.eq_ignore_ascii_case("CPU") {
        Medium::Cpu
    } else {
        Medium::Other
    }
}

fn medium_str(m: Medium) -> &'static str {
    match m {
        Medium::Gpu => "GPU",
        Medium::Cpu => "CPU",
        Medium::Other => "STORAGE",
    }
}

fn spec_kind_str(k: SpecKind) -> &'static str {
    match k {
        SpecKind::FullAttention => "full_attention",
        SpecKind::Other => "sliding_window",
    }
}

/// The fields of one event as read, before validation.
struct Fields<'a> {
    block_hashes: Option<Vec<EngineHash>>,
    parent: Option<EngineHash>,
    token_ids: Vec<u32>,
    block_size: u32,
    lora_id: Option<i64>,
    medium: Medium,
    lora_name: Option<&'a str>,
    /// Where the `extra_keys` value starts; interpreted once `lora_name` and the parent are known.
    extra_keys: Option<Reader<'a>>,
    /// `extra_keys` already interpreted while reading (the usual field order puts it after
    /// `block_hashes`, `parent_block_hash` and `lora_name`), with the inputs it was read with.
    extra_parsed: Option<(ExtraKeyInputs<'a>, ParsedExtraKeys)>,
    seen_parent: bool,
    seen_lora: bool,
    group_idx: u32,
    spec_kind: Option<SpecKind>,
}

/// What the interpretation of `extra_keys` depends on: block count, LoRA name, chain root.
type ExtraKeyInputs<'a> = (usize, Option<&'a str>, bool);
/// `(cache_salt, extra)`.
type ParsedExtraKeys = (Option<String>, Option<Vec<u64>>);

impl<'a> Fields<'a> {
    fn new() -> Self {
        Fields {
            block_hashes: None,
            parent: None,
            token_ids: Vec::new(),
            block_size: 0,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            extra_keys: None,
            extra_parsed: None,
            seen_parent: false,
            seen_lora: false,
            group_idx: 0,
            spec_kind: None,
        }
    }

    fn read(&mut self, f: Field, r: &mut Reader<'a>, scratch: &mut Vec<u8>) -> Result<()> {
        self.read_inner(f, r, scratch)
            .map_err(context(field_name(f)))
    }

    fn extra_key_inputs(&self) -> Option<ExtraKeyInputs<'a>> {
        let n = self.block_hashes.as_ref()?.len();
        Some((n, self.lora_name, self.parent.is_none()))
    }

    fn read_inner(&mut self, f: Field, r: &mut Reader<'a>, scratch: &mut Vec<u8>) -> Result<()> {
        match f {
            Field::BlockHashes => {
                let n = r.read_array_len()?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(read_hash(r)?);
                }
                self.block_hashes = Some(v);
            }
            Field::Parent => {
                self.seen_parent = true;
                self.parent = if r.try_nil() {
                    None
                } else {
                    Some(read_hash(r)?)
                };
            }
            Field::TokenIds => self.token_ids = r.read_u32_array()?,
            Field::BlockSize => self.block_size = r.read_u32()?,
            Field::LoraId => {
                self.lora_id = if r.try_nil() {
                    None
                } else {
                    Some(r.read_i64()?)
                };
            }
            Field::Medium => {
                self.medium = if r.try_nil() {
                    Medium::Gpu
                } else {
                    parse_medium(r.read_str()?)
                };
            }
            Field::LoraName => {
                self.seen_lora = true;
                self.lora_name = if r.try_nil() {
                    None
                } else {
                    Some(r.read_str()?)
                };
            }
            Field::ExtraKeys => {
                self.extra_keys = Some(*r);
                self.extra_parsed = None;
                // Interpret it right away when what it depends on is known (one pass instead of
                // a skip now and a parse later); on any doubt, defer to `finish`.
                if let (true, true, Some(inputs)) =
                    (self.seen_parent, self.seen_lora, self.extra_key_inputs())
                {
                    let mut probe = *r;
                    if let Ok(parsed) = parse_extra_keys(&mut probe, inputs, scratch) {
                        *r = probe;
                        self.extra_parsed = Some((inputs, parsed));
                        return Ok(());
                    }
                }
                r.skip_value()?;
            }
            Field::GroupIdx => self.group_idx = if r.try_nil() { 0 } else { r.read_u32()? },
            Field::SpecKind => {
                self.spec_kind = if r.try_nil() {
                    None
                } else if r.read_str()? == "full_attention" {
                    Some(SpecKind::FullAttention)
                } else {
                    Some(SpecKind::Other)
                };
            }
        }
        Ok(())
    }

    fn finish(self, kind: Kind, tag: &str, scratch: &mut Vec<u8>) -> Result<KvEvent> {
        match kind {
            Kind::Stored => self.finish_stored(scratch).map(KvEvent::Stored),
            Kind::Removed => Ok(KvEvent::Removed(BlockRemoved {
                block_hashes: self
                    .block_hashes
                    .ok_or_else(|| schema("BlockRemoved without block_hashes"))?,
                medium: self.medium,
                group_idx: self.group_idx,
            })),
            Kind::Cleared => Ok(KvEvent::AllCleared),
            Kind::Unknown => Ok(KvEvent::Unknown(tag.to_owned())),
        }
    }

    fn finish_stored(self, scratch: &mut Vec<u8>) -> Result<BlockStored> {
        let block_hashes = self
            .block_hashes
            .ok_or_else(|| schema("BlockStored without block_hashes"))?;
        let n_blocks = block_hashes.len();
        if n_blocks == 0 {
            return Err(schema("BlockStored with no block_hashes"));
        }
        if !self.token_ids.is_empty() {
            let expected = n_blocks as u64 * u64::from(self.block_size);
            if self.block_size == 0 || self.token_ids.len() as u64 != expected {
                return Err(schema(format!(
                    "BlockStored carries {} token_ids for {n_blocks} blocks of block_size {}",
                    self.token_ids.len(),
                    self.block_size
                )));
            }
        }
        let inputs = (n_blocks, self.lora_name, self.parent.is_none());
        let (cache_salt, extra) = match (self.extra_parsed, self.extra_keys) {
            (Some((used, parsed)), _) if used == inputs => parsed,
            (_, None) => (None, None),
            (_, Some(mut r)) => {
                parse_extra_keys(&mut r, inputs, scratch).map_err(context("extra_keys"))?
            }
        };
        Ok(BlockStored {
            block_hashes,
            parent: self.parent,
            token_ids: self.token_ids,
            block_size: self.block_size,
            lora_id: self.lora_id,
            lora_name: self.lora_name.map(str::to_owned),
            medium: self.medium,
            cache_salt,
            extra,
            group_idx: self.group_idx,
            spec_kind: self.spec_kind,
        })
    }
}

/// Splits vLLM's untagged per-block `extra_keys` into the cache salt and a per-block digest of
/// everything else. Per block, the first string equal to `lora_name` is the LoRA name; on block 0
/// of a sequence (`root`), the first other string is the salt; all other items (mm `[id, offset]`
/// pairs, embedding digests, further strings) are hashed with xxh3-64 over their raw msgpack
/// bytes, in order (0 is mapped to 1 so that 0 keeps meaning "none").
fn parse_extra_keys(
    r: &mut Reader<'_>,
    (n_blocks, lora_name, root): ExtraKeyInputs<'_>,
    scratch: &mut Vec<u8>,
) -> Result<ParsedExtraKeys> {
    if r.try_nil() {
        return Ok((None, None));
    }
    let len = r.read_array_len()?;
    if len != n_blocks {
        return Err(schema(format!(
            "{len} entries for {n_blocks} blocks (one per block expected)"
        )));
    }
    let mut salt = None;
    let mut extra: Option<Vec<u64>> = None;
    for i in 0..len {
        if r.try_nil() {
            continue;
        }
        let items = r.read_array_len().map_err(context(format!("block {i}")))?;
        scratch.clear();
        let mut lora_seen = false;
        for _ in 0..items {
            let mut look = *r;
            let raw = r.value_span()?;
            if look.peek_type()? == ValueType::Str {
                let s = look.read_str()?;
                if !lora_seen && lora_name == Some(s) {
                    lora_seen = true;
                    continue;
                }
                if i == 0 && root && salt.is_none() {
                    salt = Some(s.to_owned());
                    continue;
                }
            }
            scratch.extend_from_slice(raw);
        }
        if !scratch.is_empty() {
            let digest = xxhash_rust::xxh3::xxh3_64(scratch).max(1);
            extra.get_or_insert_with(|| vec![0; len])[i] = digest;
        }
    }
    Ok((salt, extra))
}

fn decode_event(r: &mut Reader<'_>, scratch: &mut Vec<u8>) -> Result<KvEvent> {
    match r.peek_type()? {
        ValueType::Map => decode_map_event(r, scratch),
        ValueType::Array => decode_array_event(r, scratch),
        t => Err(schema(format!(
            "an event must be a map or an array, found {t:?} at byte {}",
            r.pos()
        ))),
    }
}

/// vLLM >= 0.24: `{"type": tag, field: value, ...}`, `"type"` usually (not necessarily) first.
fn decode_map_event(r: &mut Reader<'_>, scratch: &mut Vec<u8>) -> Result<KvEvent> {
    let n = r.read_map_len()?;
    let body = *r;
    let mut probe = *r;
    let mut found = None;
    for i in 0..n {
        if probe.read_str()? == "type" {
            found = Some((probe.read_str().map_err(context("type"))?, i));
            break;
        }
        probe.skip_value()?;
    }
    let Some((tag, at)) = found else {
        return Err(schema("event map without a \"type\" key"));
    };
    // Common case: the tag came first, carry on after it. Otherwise rescan from the start (the
    // "type" key is skipped like any key the event kind does not read).
    let (mut rest, count) = if at == 0 { (probe, n - 1) } else { (body, n) };
    let kind = Kind::of(tag);
    let mut decode = || {
        let mut fields = Fields::new();
        for _ in 0..count {
            // Known keys are ASCII, so only keys that match none need their UTF-8 checked.
            let at = rest.pos();
            let key = rest.read_str_bytes()?;
            match kind.field(key) {
                Some(f) => fields.read(f, &mut rest, scratch)?,
                None => {
                    if !key.is_ascii() {
                        check_utf8(key, at)?;
                    }
                    rest.skip_value()?;
                }
            }
        }
        *r = rest;
        fields.finish(kind, tag, scratch)
    };
    decode().map_err(context(tag))
}

/// vLLM <= 0.23: `[tag, field0, field1, ...]`; missing trailing fields take their defaults.
fn decode_array_event(r: &mut Reader<'_>, scratch: &mut Vec<u8>) -> Result<KvEvent> {
    let n = r.read_array_len()?;
    if n == 0 {
        return Err(schema("empty event array (no type tag)"));
    }
    let tag = r.read_str().map_err(context("type tag"))?;
    let kind = Kind::of(tag);
    let order = kind.positional();
    let mut decode = || {
        let mut fields = Fields::new();
        for i in 0..n - 1 {
            match order.get(i) {
                Some(&f) => fields.read(f, r, scratch)?,
                None => r.skip_value()?,
            }
        }
        fields.finish(kind, tag, scratch)
    };
    decode().map_err(context(tag))
}

/// Decodes one ZMQ payload frame, `[ts, [event, ...], data_parallel_rank]`.
///
/// Accepts map- and array-encoded events (also mixed), int and bytes hashes, a missing
/// `data_parallel_rank` and extra trailing batch elements. The whole payload is validated before
/// anything is returned: any malformed or mistyped part rejects the batch.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch> {
    let mut r = Reader::new(payload);
    let n = r.read_array_len().map_err(context("batch"))?;
    if n < 2 {
        return Err(schema(format!(
            "batch: {n} elements, expected [ts, events, data_parallel_rank]"
        )));
    }
    let ts = r.read_f64().map_err(context("ts"))?;
    let n_events = r.read_array_len().map_err(context("events"))?;
    // The declared count is bounded by the bytes left; still, grow rather than trust it fully.
    let mut events = Vec::with_capacity(n_events.min(1024));
    let mut scratch = Vec::new();
    for i in 0..n_events {
        let ev = decode_event(&mut r, &mut scratch).map_err(context(format_args!("event {i}")))?;
        events.push(ev);
    }
    let dp_rank = if n >= 3 && !r.try_nil() {
        Some(r.read_u32().map_err(context("data_parallel_rank"))?)
    } else {
        None
    };
    for _ in 3..n {
        r.skip_value()?;
    }
    r.finish()?;
    Ok(EventBatch {
        ts,
        events,
        dp_rank,
    })
}

/// Encodes a batch as vLLM's `ZmqEventPublisher` does (msgspec, `omit_defaults`).
///
/// With [`Encoding::Map`] the bytes equal vLLM 0.33's for every event whose fields kvroute
/// carries (every event of the golden stream). Lossy spots, all decoding back to the same value:
/// `Medium::Other` is written `"STORAGE"`, `SpecKind::Other` `"sliding_window"`, a `cache_salt` only
/// when `parent` is None (on block 0's `extra_keys`), and each non-zero `extra[i]` as one 8-byte
/// `bin` item (big-endian) on block i, so decoding yields a digest *of* it rather than the value
/// itself (deterministic, so equal inputs still compare equal). `extra_keys` (one entry per
/// block, nil where a block has no items) and `group_idx` are always written, `dp_rank: None` as
/// nil.
///
/// With [`Encoding::Array`] each event is the positional form of vLLM <= 0.23, the type tag first:
/// `BlockStored` always through `lora_name`, then `extra_keys`, `group_idx`, `kv_cache_spec_kind`
/// only as far as the last one that is not at its default; `BlockRemoved` is
/// `[tag, block_hashes, medium]` plus `group_idx` when non-zero.
pub fn encode_batch(batch: &EventBatch, enc: Encoding) -> Vec<u8> {
    let estimate: usize = 16
        + batch
            .events
            .iter()
            .map(|e| match e {
                KvEvent::Stored(s) => 160 + 9 * s.block_hashes.len() + 5 * s.token_ids.len(),
                KvEvent::Removed(r) => 48 + 9 * r.block_hashes.len(),
                _ => 24,
            })
            .sum::<usize>();
    let mut w = Writer::with_capacity(estimate);
    w.write_array_len(3);
    w.write_f64(batch.ts);
    w.write_array_len(batch.events.len());
    for ev in &batch.events {
        match enc {
            Encoding::Map => encode_event_map(&mut w, ev),
            Encoding::Array => encode_event_array(&mut w, ev),
        }
    }
    match batch.dp_rank {
        Some(d) => w.write_uint(u64::from(d)),
        None => w.write_nil(),
    }
    w.into_inner()
}

fn write_hashes(w: &mut Writer, hashes: &[EngineHash]) {
    w.write_array_len(hashes.len());
    for &h in hashes {
        w.write_uint(h);
    }
}

fn write_opt_str(w: &mut Writer, s: Option<&str>) {
    match s {
        Some(s) => w.write_str(s),
        None => w.write_nil(),
    }
}

/// The untagged extra-key items of block `i`, in vLLM's order (LoRA name, salt, other digests).
fn extra_items(s: &BlockStored, i: usize) -> (Option<&str>, Option<&str>, Option<u64>) {
    let salt = if i == 0 && s.parent.is_none() {
        s.cache_salt.as_deref()
    } else {
        None
    };
    let digest = s
        .extra
        .as_ref()
        .and_then(|e| e.get(i).copied())
        .filter(|&d| d != 0);
    (s.lora_name.as_deref(), salt, digest)
}

fn has_extra_items(s: &BlockStored) -> bool {
    (0..s.block_hashes.len()).any(|i| {
        let (l, c, d) = extra_items(s, i);
        l.is_some() || c.is_some() || d.is_some()
    })
}

fn write_extra_keys(w: &mut Writer, s: &BlockStored) {
    w.write_array_len(s.block_hashes.len());
    for i in 0..s.block_hashes.len() {
        let (lora, salt, digest) = extra_items(s, i);
        let n = usize::from(lora.is_some())
            + usize::from(salt.is_some())
            + usize::from(digest.is_some());
        if n == 0 {
            w.write_nil();
            continue;
        }
        w.write_array_len(n);
        if let Some(l) = lora {
            w.write_str(l);
        }
        if let Some(c) = salt {
            w.write_str(c);
        }
        if let Some(d) = digest {
            w.write_bin(&d.to_be_bytes());
        }
    }
}

fn write_tokens(w: &mut Writer, tokens: &[u32]) {
    w.write_array_len(tokens.len());
    for &t in tokens {
        w.write_uint(u64::from(t));
    }
}

fn write_opt_int(w: &mut Writer, v: Option<i64>) {
    match v {
        Some(v) => w.write_int(v),
        None => w.write_nil(),
    }
}

fn encode_event_map(w: &mut Writer, ev: &KvEvent) {
    match ev {
        KvEvent::Stored(s) => {
            let n = 10 + usize::from(s.spec_kind.is_some());
            w.write_map_len_sized_for(n, STORED_MAX_FIELDS);
            w.write_str("type");
            w.write_str(TAG_STORED);
            w.write_str("block_hashes");
            write_hashes(w, &s.block_hashes);
            w.write_str("parent_block_hash");
            match s.parent {
                Some(p) => w.write_uint(p),
                None => w.write_nil(),
            }
            w.write_str("token_ids");
            write_tokens(w, &s.token_ids);
            w.write_str("block_size");
            w.write_uint(u64::from(s.block_size));
            w.write_str("lora_id");
            write_opt_int(w, s.lora_id);
            w.write_str("medium");
            w.write_str(medium_str(s.medium));
            w.write_str("lora_name");
            write_opt_str(w, s.lora_name.as_deref());
            w.write_str("extra_keys");
            write_extra_keys(w, s);
            w.write_str("group_idx");
            w.write_uint(u64::from(s.group_idx));
            if let Some(k) = s.spec_kind {
                w.write_str("kv_cache_spec_kind");
                w.write_str(spec_kind_str(k));
            }
        }
        KvEvent::Removed(rm) => {
            w.write_map_len_sized_for(4, REMOVED_MAX_FIELDS);
            w.write_str("type");
            w.write_str(TAG_REMOVED);
            w.write_str("block_hashes");
            write_hashes(w, &rm.block_hashes);
            w.write_str("medium");
            w.write_str(medium_str(rm.medium));
            w.write_str("group_idx");
            w.write_uint(u64::from(rm.group_idx));
        }
        KvEvent::AllCleared => {
            w.write_map_len_sized_for(1, CLEARED_MAX_FIELDS);
            w.write_str("type");
            w.write_str(TAG_CLEARED);
        }
        KvEvent::Unknown(tag) => {
            w.write_map_len(1);
            w.write_str("type");
            w.write_str(tag);
        }
    }
}

fn encode_event_array(w: &mut Writer, ev: &KvEvent) {
    match ev {
        KvEvent::Stored(s) => {
            let n_fields = if s.spec_kind.is_some() {
                10
            } else if s.group_idx != 0 {
                9
            } else if has_extra_items(s) {
                8
            } else {
                7
            };
            w.write_array_len(1 + n_fields);
            w.write_str(TAG_STORED);
            write_hashes(w, &s.block_hashes);
            match s.parent {
                Some(p) => w.write_uint(p),
                None => w.write_nil(),
            }
            write_tokens(w, &s.token_ids);
            w.write_uint(u64::from(s.block_size));
            write_opt_int(w, s.lora_id);
            w.write_str(medium_str(s.medium));
            write_opt_str(w, s.lora_name.as_deref());
            if n_fields >= 8 {
                if has_extra_items(s) {
                    write_extra_keys(w, s);
                } else {
                    w.write_nil();
                }
            }
            if n_fields >= 9 {
                w.write_uint(u64::from(s.group_idx));
            }
            if let Some(k) = s.spec_kind {
                w.write_str(spec_kind_str(k));
            }
        }
        KvEvent::Removed(rm) => {
            w.write_array_len(if rm.group_idx != 0 { 4 } else { 3 });
            w.write_str(TAG_REMOVED);
            write_hashes(w, &rm.block_hashes);
            w.write_str(medium_str(rm.medium));
            if rm.group_idx != 0 {
                w.write_uint(u64::from(rm.group_idx));
            }
        }
        KvEvent::AllCleared => {
            w.write_array_len(1);
            w.write_str(TAG_CLEARED);
        }
        KvEvent::Unknown(tag) => {
            w.write_array_len(1);
            w.write_str(tag);
        }
    }
}
