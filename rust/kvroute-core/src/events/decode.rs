//! Decoding: one ZMQ payload frame -> an [`EventBatch`], validated as a whole before anything
//! is returned.

use super::extra_keys::{parse_extra_keys, ExtraKeyInputs, ParsedExtraKeys};
use super::schema::{field_name, parse_medium, Field, Kind};
use super::{
    context, schema, BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent, Medium, Result,
    SpecKind,
};
use crate::msgpack::{check_utf8, Reader, ValueType};

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
