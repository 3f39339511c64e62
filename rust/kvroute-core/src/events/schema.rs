//! vLLM's KV-event wire vocabulary: the type tags, the fields kvroute reads (by map key and by
//! legacy position), the struct sizes msgspec writes headers for, and the medium and spec-kind
//! strings.

use super::{Medium, SpecKind};

pub(super) const TAG_STORED: &str = "BlockStored";
pub(super) const TAG_REMOVED: &str = "BlockRemoved";
pub(super) const TAG_CLEARED: &str = "AllBlocksCleared";

/// Fields (tag included) of vLLM 0.33's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`.
/// msgspec sizes a struct's map header for all of them before omitting defaults, so a
/// `BlockStored` always starts with `de 00 NN` (map16) and the others with a fixmap.
pub(super) const STORED_MAX_FIELDS: usize = 16;
pub(super) const REMOVED_MAX_FIELDS: usize = 6;
pub(super) const CLEARED_MAX_FIELDS: usize = 1;

/// Event fields kvroute reads. Anything else is skipped (after checking it is well formed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Field {
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
pub(super) enum Kind {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

impl Kind {
    pub(super) fn of(tag: &str) -> Kind {
        match tag {
            TAG_STORED => Kind::Stored,
            TAG_REMOVED => Kind::Removed,
            TAG_CLEARED => Kind::Cleared,
            _ => Kind::Unknown,
        }
    }

    /// The field a map key names for this kind of event, if kvroute reads it.
    pub(super) fn field(self, key: &[u8]) -> Option<Field> {
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

    pub(super) fn positional(self) -> &'static [Field] {
        match self {
            Kind::Stored => &STORED_ORDER,
            Kind::Removed => &REMOVED_ORDER,
            Kind::Cleared | Kind::Unknown => &[],
        }
    }
}

pub(super) fn field_name(f: Field) -> &'static str {
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

pub(super) fn parse_medium(s: &str) -> Medium {
    if s.eq_ignore_ascii_case("GPU") {
        Medium::Gpu
    } else if s.eq_ignore_ascii_case("CPU") {
        Medium::Cpu
    } else {
        Medium::Other
    }
}

pub(super) fn medium_str(m: Medium) -> &'static str {
    match m {
        Medium::Gpu => "GPU",
        Medium::Cpu => "CPU",
        Medium::Other => "STORAGE",
    }
}

pub(super) fn spec_kind_str(k: SpecKind) -> &'static str {
    match k {
        SpecKind::FullAttention => "full_attention",
        SpecKind::Other => "sliding_window",
    }
}
