//! vLLM's untagged per-block `extra_keys`, both ways: split into the cache salt and a digest of
//! the other items per block when decoding, and rebuilt from them when encoding.

use super::{context, schema, BlockStored, Result};
use crate::msgpack::{Reader, ValueType, Writer};

/// What the interpretation of `extra_keys` depends on: block count, LoRA name, chain root.
pub(super) type ExtraKeyInputs<'a> = (usize, Option<&'a str>, bool);
/// `(cache_salt, extra)`.
pub(super) type ParsedExtraKeys = (Option<String>, Option<Vec<u64>>);

/// Splits vLLM's untagged per-block `extra_keys` into the cache salt and a per-block digest of
/// everything else. Per block, the first string equal to `lora_name` is the LoRA name; on block 0
/// of a sequence (`root`), the first other string is the salt; all other items (mm `[id, offset]`
/// pairs, embedding digests, further strings) are hashed with xxh3-64 over their raw msgpack
/// bytes, in order (0 is mapped to 1 so that 0 keeps meaning "none").
pub(super) fn parse_extra_keys(
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

pub(super) fn has_extra_items(s: &BlockStored) -> bool {
    (0..s.block_hashes.len()).any(|i| {
        let (l, c, d) = extra_items(s, i);
        l.is_some() || c.is_some() || d.is_some()
    })
}

pub(super) fn write_extra_keys(w: &mut Writer, s: &BlockStored) {
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
