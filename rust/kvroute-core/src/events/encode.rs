//! Encoding: an [`EventBatch`] -> the bytes vLLM's `ZmqEventPublisher` sends, in either
//! [`Encoding`].

use super::extra_keys::{has_extra_items, write_extra_keys};
use super::schema::{
    medium_str, spec_kind_str, CLEARED_MAX_FIELDS, REMOVED_MAX_FIELDS, STORED_MAX_FIELDS,
    TAG_CLEARED, TAG_REMOVED, TAG_STORED,
};
use super::{Encoding, EngineHash, EventBatch, KvEvent};
use crate::msgpack::Writer;

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
