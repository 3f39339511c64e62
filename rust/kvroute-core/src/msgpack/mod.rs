//! A small msgpack reader and a writer, enough for vLLM's KV events.
//!
//! [`Reader`] is a cursor over a borrowed buffer. Every read is bounds-checked and never panics:
//! malformed input (truncation, the reserved marker `0xc1`, invalid UTF-8, a length larger than
//! the bytes left, nesting deeper than [`MAX_DEPTH`]) is an [`EventError::Msgpack`]; well-formed
//! input of the wrong type or out of range (a string where an int is expected, a negative
//! `u64`) is an [`EventError::Schema`]. A declared length is checked against the bytes left
//! before the caller can allocate for it: every element takes at least one byte, so an array
//! header claiming 2^32 elements in a short buffer fails at once. The reader borrows strings and
//! byte strings from the buffer and allocates nothing itself, except the `Vec` that
//! [`Reader::read_u32_array`] returns. After an error the cursor's position is unspecified (most
//! reads leave it where it was): callers give up on the buffer.
//!
//! [`Writer`] appends to a `Vec<u8>` and always picks the shortest form, byte-for-byte what
//! msgspec (and msgpack-python) produce: ints as positive/negative fixint or the narrowest
//! `uint*`/`int*`, floats as float64, `str` as fixstr/str8/16/32, `bin` as bin8/16/32.
//!
//! Layout: `reader/` holds [`Reader`] (numeric reads in `reader/numbers.rs`), `writer.rs` holds
//! [`Writer`]; the value types and errors they share are here.

use crate::error::EventError;

mod reader;
#[cfg(test)]
mod tests;
mod writer;

pub use reader::Reader;
pub use writer::Writer;

/// The deepest nesting [`Reader::skip_value`] follows (vLLM's events nest at most ~6 levels).
pub const MAX_DEPTH: usize = 64;

/// The kind of the next value, from its marker byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueType {
    Nil,
    Bool,
    /// Any int width, signed or unsigned.
    Int,
    /// float32 or float64.
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
}

impl ValueType {
    fn name(self) -> &'static str {
        match self {
            ValueType::Nil => "nil",
            ValueType::Bool => "bool",
            ValueType::Int => "int",
            ValueType::Float => "float",
            ValueType::Str => "str",
            ValueType::Bin => "bin",
            ValueType::Array => "array",
            ValueType::Map => "map",
            ValueType::Ext => "ext",
        }
    }

    /// `None` for the reserved marker `0xc1`.
    fn of(marker: u8) -> Option<ValueType> {
        Some(match marker {
            0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3 => ValueType::Int,
            0x80..=0x8f | 0xde | 0xdf => ValueType::Map,
            0x90..=0x9f | 0xdc | 0xdd => ValueType::Array,
            0xa0..=0xbf | 0xd9..=0xdb => ValueType::Str,
            0xc0 => ValueType::Nil,
            0xc2 | 0xc3 => ValueType::Bool,
            0xc4..=0xc6 => ValueType::Bin,
            0xc7..=0xc9 | 0xd4..=0xd8 => ValueType::Ext,
            0xca | 0xcb => ValueType::Float,
            0xc1 => return None,
        })
    }
}

/// The header forms of a length-prefixed type: one table that [`Reader`] and [`Writer`] both
/// follow. A *fix* form carries the length in the marker's low bits; the other forms are a
/// marker followed by an 8-, 16- or 32-bit big-endian length.
struct LenForms {
    /// The fix form's first marker and the mask of its length bits (the marker is
    /// `first | len`), if the type has a fix form.
    fix: Option<(u8, u8)>,
    /// The marker of the 8-bit length form, if the type has one.
    m8: Option<u8>,
    m16: u8,
    m32: u8,
    /// The type's name, for errors.
    name: &'static str,
}

/// fixarray (`0x90..=0x9f`), array16, array32.
const ARRAY: LenForms = LenForms {
    fix: Some((0x90, 0x0f)),
    m8: None,
    m16: 0xdc,
    m32: 0xdd,
    name: "array",
};
/// fixmap (`0x80..=0x8f`), map16, map32 (the length counts key/value pairs).
const MAP: LenForms = LenForms {
    fix: Some((0x80, 0x0f)),
    m8: None,
    m16: 0xde,
    m32: 0xdf,
    name: "map",
};
/// fixstr (`0xa0..=0xbf`), str8, str16, str32.
const STR: LenForms = LenForms {
    fix: Some((0xa0, 0x1f)),
    m8: Some(0xd9),
    m16: 0xda,
    m32: 0xdb,
    name: "str",
};
/// bin8, bin16, bin32 (no fix form).
const BIN: LenForms = LenForms {
    fix: None,
    m8: Some(0xc4),
    m16: 0xc5,
    m32: 0xc6,
    name: "bin",
};

type Result<T> = std::result::Result<T, EventError>;

#[inline]
fn malformed(offset: usize, what: &'static str) -> EventError {
    EventError::Msgpack { offset, what }
}

/// Validates the bytes of a msgpack `str` that starts at `offset` (for the error).
#[inline]
pub fn check_utf8(bytes: &[u8], offset: usize) -> Result<&str> {
    std::str::from_utf8(bytes).map_err(|_| malformed(offset, "invalid UTF-8 in str"))
}
