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

use crate::error::EventError;

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

/// A bounds-checked msgpack cursor over a borrowed buffer. Cheap to copy (a slice and an offset),
/// so a caller can remember a position and come back to it.
#[derive(Debug, Clone, Copy)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

type Result<T> = std::result::Result<T, EventError>;

#[inline]
fn malformed(offset: usize, what: &'static str) -> EventError {
    EventError::Msgpack { offset, what }
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// Offset of the next value in the buffer.
    #[inline]
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Bytes not yet consumed.
    #[inline]
    pub fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    #[inline]
    pub fn is_at_end(&self) -> bool {
        self.remaining() == 0
    }

    /// Errors with `trailing bytes` unless the whole buffer was consumed.
    pub fn finish(&self) -> Result<()> {
        if self.is_at_end() {
            Ok(())
        } else {
            Err(malformed(self.pos, "trailing bytes after the value"))
        }
    }

    #[inline]
    fn peek_byte(&self) -> Result<u8> {
        self.buf
            .get(self.pos)
            .copied()
            .ok_or_else(|| malformed(self.pos, "unexpected end of input"))
    }

    /// Consumes `n` bytes; `start` is the offset reported if they are not there.
    #[inline]
    fn take(&mut self, n: usize, start: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .ok_or_else(|| malformed(start, "length overflows"))?;
        let bytes = self
            .buf
            .get(self.pos..end)
            .ok_or_else(|| malformed(start, "unexpected end of input"))?;
        self.pos = end;
        Ok(bytes)
    }

    #[inline]
    fn take_array<const N: usize>(&mut self, start: usize) -> Result<[u8; N]> {
        let bytes = self
            .buf
            .get(self.pos..)
            .and_then(|rest| rest.first_chunk::<N>())
            .ok_or_else(|| malformed(start, "unexpected end of input"))?;
        self.pos += N;
        Ok(*bytes)
    }

    #[inline]
    fn take_u8(&mut self, start: usize) -> Result<u8> {
        Ok(self.take_array::<1>(start)?[0])
    }

    #[inline]
    fn take_u16(&mut self, start: usize) -> Result<u16> {
        Ok(u16::from_be_bytes(self.take_array(start)?))
    }

    #[inline]
    fn take_u32(&mut self, start: usize) -> Result<u32> {
        Ok(u32::from_be_bytes(self.take_array(start)?))
    }

    #[inline]
    fn take_u64(&mut self, start: usize) -> Result<u64> {
        Ok(u64::from_be_bytes(self.take_array(start)?))
    }

    /// The error for a well-formed value of the wrong type at `start`.
    #[cold]
    fn mismatch(&self, start: usize, expected: &str) -> EventError {
        match self.buf.get(start).copied() {
            None => malformed(start, "unexpected end of input"),
            Some(m) => match ValueType::of(m) {
                None => malformed(start, "reserved marker 0xc1"),
                Some(t) => EventError::Schema(format!(
                    "expected {expected} at byte {start}, found {}",
                    t.name()
                )),
            },
        }
    }

    /// The type of the next value, without consuming it.
    pub fn peek_type(&self) -> Result<ValueType> {
        let m = self.peek_byte()?;
        ValueType::of(m).ok_or_else(|| malformed(self.pos, "reserved marker 0xc1"))
    }

    /// Whether the next value is nil (without consuming it). False at the end of input.
    #[inline]
    pub fn is_nil(&self) -> bool {
        self.buf.get(self.pos) == Some(&0xc0)
    }

    /// Consumes a nil.
    pub fn read_nil(&mut self) -> Result<()> {
        if self.is_nil() {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.mismatch(self.pos, "nil"))
        }
    }

    /// Consumes the next value if it is nil and says whether it was.
    #[inline]
    pub fn try_nil(&mut self) -> bool {
        let nil = self.is_nil();
        if nil {
            self.pos += 1;
        }
        nil
    }

    pub fn read_bool(&mut self) -> Result<bool> {
        match self.peek_byte()? {
            0xc2 => {
                self.pos += 1;
                Ok(false)
            }
            0xc3 => {
                self.pos += 1;
                Ok(true)
            }
            _ => Err(self.mismatch(self.pos, "bool")),
        }
    }

    /// Reads an int of any width as its 64-bit two's complement pattern (negative values wrap),
    /// together with whether it was negative.
    #[inline]
    fn read_int_parts(&mut self, expected: &str) -> Result<(u64, bool)> {
        let start = self.pos;
        let m = self.peek_byte()?;
        if m <= 0x7f {
            self.pos += 1;
            return Ok((u64::from(m), false));
        }
        if m >= 0xe0 {
            self.pos += 1;
            return Ok((i64::from(m as i8) as u64, true));
        }
        self.pos += 1;
        let v = match m {
            0xcc => (u64::from(self.take_u8(start)?), false),
            0xcd => (u64::from(self.take_u16(start)?), false),
            0xce => (u64::from(self.take_u32(start)?), false),
            0xcf => (self.take_u64(start)?, false),
            0xd0 => {
                let v = i64::from(self.take_u8(start)? as i8);
                (v as u64, v < 0)
            }
            0xd1 => {
                let v = i64::from(self.take_u16(start)? as i16);
                (v as u64, v < 0)
            }
            0xd2 => {
                let v = i64::from(self.take_u32(start)? as i32);
                (v as u64, v < 0)
            }
            0xd3 => {
                let v = self.take_u64(start)? as i64;
                (v as u64, v < 0)
            }
            _ => {
                self.pos = start;
                return Err(self.mismatch(start, expected));
            }
        };
        Ok(v)
    }

    /// Reads a non-negative int of any width (`uint64` values above `i64::MAX` included).
    #[inline]
    pub fn read_u64(&mut self) -> Result<u64> {
        let start = self.pos;
        let (v, neg) = self.read_int_parts("unsigned int")?;
        if neg {
            self.pos = start;
            return Err(EventError::Schema(format!(
                "expected unsigned int at byte {start}, found negative {}",
                v as i64
            )));
        }
        Ok(v)
    }

    /// Reads a non-negative int that fits in a `u32`.
    #[inline]
    pub fn read_u32(&mut self) -> Result<u32> {
        let start = self.pos;
        // Fast path for the common token encodings.
        match self.peek_byte()? {
            m @ 0x00..=0x7f => {
                self.pos += 1;
                return Ok(u32::from(m));
            }
            0xcd => {
                self.pos += 1;
                return Ok(u32::from(self.take_u16(start)?));
            }
            0xce => {
                self.pos += 1;
                return self.take_u32(start);
            }
            _ => {}
        }
        let v = self.read_u64()?;
        u32::try_from(v).map_err(|_| {
            self.pos = start;
            EventError::Schema(format!("int {v} at byte {start} does not fit in u32"))
        })
    }

    /// Reads an array of non-negative ints that fit in a `u32` (token ids).
    ///
    /// The hot loop of event decoding. Token widths (uint16 vs uint32) vary at random, so the
    /// loop never branches on the width: the encoded length of a fixint/uint8/16/32 is computed
    /// arithmetically from its marker (`0xcc`, `0xcd`, `0xce` -> 2, 3, 5 bytes) and the value is
    /// cut out of one 8-byte big-endian load, keeping the dependency chain from one token's
    /// position to the next short. The branches left (fixint, other markers, the last bytes of
    /// the buffer) are predictable; those cases go through [`Reader::read_u32`], which also
    /// produces the errors.
    pub fn read_u32_array(&mut self) -> Result<Vec<u32>> {
        let n = self.read_array_len()?;
        let mut out = vec![0u32; n];
        let buf = self.buf;
        let mut pos = self.pos;
        for slot in out.iter_mut() {
            if let Some(chunk) = buf.get(pos..).and_then(|rest| rest.first_chunk::<8>()) {
                let marker = chunk[0];
                let k = marker.wrapping_sub(0xcc);
                if k < 3 {
                    // 1, 2 or 4 payload bytes
                    let bytes = 1 + u32::from(k) + u32::from(k >> 1);
                    let x = u64::from_be_bytes(*chunk);
                    *slot = ((x << 8) >> (64 - 8 * bytes)) as u32;
                    pos += 1 + bytes as usize;
                    continue;
                }
                if marker < 0x80 {
                    *slot = u32::from(marker);
                    pos += 1;
                    continue;
                }
            }
            self.pos = pos;
            *slot = self.read_u32()?;
            pos = self.pos;
        }
        self.pos = pos;
        Ok(out)
    }

    /// Reads an int of any width that fits in an `i64`.
    #[inline]
    pub fn read_i64(&mut self) -> Result<i64> {
        let start = self.pos;
        let (v, neg) = self.read_int_parts("int")?;
        if !neg && v > i64::MAX as u64 {
            self.pos = start;
            return Err(EventError::Schema(format!(
                "int {v} at byte {start} does not fit in i64"
            )));
        }
        Ok(v as i64)
    }

    /// Fast path for the common encoding of block hashes: if the next value is a `uint64`
    /// (marker `0xcf`, 9 bytes present), consumes and returns it; otherwise consumes nothing.
    #[inline]
    pub fn try_read_uint64(&mut self) -> Option<u64> {
        match self.buf.get(self.pos..)?.first_chunk::<9>()? {
            [0xcf, rest @ ..] => {
                self.pos += 9;
                Some(u64::from_be_bytes(*rest))
            }
            _ => None,
        }
    }

    /// Reads an int of any width and returns its low 64 bits (two's complement for negatives).
    #[inline]
    pub fn read_int_bits(&mut self) -> Result<u64> {
        Ok(self.read_int_parts("int")?.0)
    }

    /// Reads a float64, a float32 or an int (converted, possibly rounding).
    pub fn read_f64(&mut self) -> Result<f64> {
        let start = self.pos;
        match self.peek_byte()? {
            0xcb => {
                self.pos += 1;
                Ok(f64::from_bits(self.take_u64(start)?))
            }
            0xca => {
                self.pos += 1;
                Ok(f64::from(f32::from_bits(self.take_u32(start)?)))
            }
            _ => {
                let (v, neg) = self.read_int_parts("number")?;
                Ok(if neg { v as i64 as f64 } else { v as f64 })
            }
        }
    }

    /// Reads the header of an array; the length is at most the bytes left.
    #[inline]
    pub fn read_array_len(&mut self) -> Result<usize> {
        let start = self.pos;
        let m = self.peek_byte()?;
        let len = match m {
            0x90..=0x9f => {
                self.pos += 1;
                usize::from(m & 0x0f)
            }
            0xdc => {
                self.pos += 1;
                usize::from(self.take_u16(start)?)
            }
            0xdd => {
                self.pos += 1;
                self.take_u32(start)? as usize
            }
            _ => return Err(self.mismatch(start, "array")),
        };
        if len > self.remaining() {
            self.pos = start;
            return Err(malformed(start, "array length exceeds the bytes left"));
        }
        Ok(len)
    }

    /// Reads the header of a map (number of key/value pairs); twice the length is at most the
    /// bytes left.
    #[inline]
    pub fn read_map_len(&mut self) -> Result<usize> {
        let start = self.pos;
        let m = self.peek_byte()?;
        let len = match m {
            0x80..=0x8f => {
                self.pos += 1;
                usize::from(m & 0x0f)
            }
            0xde => {
                self.pos += 1;
                usize::from(self.take_u16(start)?)
            }
            0xdf => {
                self.pos += 1;
                self.take_u32(start)? as usize
            }
            _ => return Err(self.mismatch(start, "map")),
        };
        if len.saturating_mul(2) > self.remaining() {
            self.pos = start;
            return Err(malformed(start, "map length exceeds the bytes left"));
        }
        Ok(len)
    }

    /// Reads a string's bytes *without* validating their UTF-8: for comparing map keys with known
    /// ASCII names (equal bytes are valid UTF-8). A caller that uses the bytes otherwise must
    /// validate them (see [`check_utf8`]).
    #[inline]
    pub fn read_str_bytes(&mut self) -> Result<&'a [u8]> {
        let start = self.pos;
        let m = self.peek_byte()?;
        let len = match m {
            0xa0..=0xbf => {
                self.pos += 1;
                usize::from(m & 0x1f)
            }
            0xd9 => {
                self.pos += 1;
                usize::from(self.take_u8(start)?)
            }
            0xda => {
                self.pos += 1;
                usize::from(self.take_u16(start)?)
            }
            0xdb => {
                self.pos += 1;
                self.take_u32(start)? as usize
            }
            _ => return Err(self.mismatch(start, "str")),
        };
        self.take(len, start).inspect_err(|_| self.pos = start)
    }

    /// Reads a string, borrowed from the buffer; its UTF-8 is validated.
    #[inline]
    pub fn read_str(&mut self) -> Result<&'a str> {
        let start = self.pos;
        let bytes = self.read_str_bytes()?;
        check_utf8(bytes, start).inspect_err(|_| self.pos = start)
    }

    /// Reads a `bin` value, borrowed from the buffer.
    pub fn read_bin(&mut self) -> Result<&'a [u8]> {
        let start = self.pos;
        let len = match self.peek_byte()? {
            0xc4 => {
                self.pos += 1;
                usize::from(self.take_u8(start)?)
            }
            0xc5 => {
                self.pos += 1;
                usize::from(self.take_u16(start)?)
            }
            0xc6 => {
                self.pos += 1;
                self.take_u32(start)? as usize
            }
            _ => return Err(self.mismatch(start, "bin")),
        };
        self.take(len, start).inspect_err(|_| self.pos = start)
    }

    /// Skips one complete value of any type (containers included), validating its structure
    /// and string UTF-8. Iterative: nesting deeper than [`MAX_DEPTH`] is an error, never a stack
    /// overflow.
    pub fn skip_value(&mut self) -> Result<()> {
        let origin = self.pos;
        let r = self.skip_inner();
        if r.is_err() {
            self.pos = origin;
        }
        r
    }

    fn skip_inner(&mut self) -> Result<()> {
        // stack[d] = values still to skip in the container entered at depth d.
        let mut stack = [0u64; MAX_DEPTH];
        let mut depth = 0usize;
        let mut pending: u64 = 1;
        loop {
            while pending == 0 {
                if depth == 0 {
                    return Ok(());
                }
                depth -= 1;
                pending = stack.get(depth).copied().unwrap_or(0);
            }
            pending -= 1;
            let start = self.pos;
            let m = self.peek_byte()?;
            let children: u64 = match m {
                0x90..=0x9f | 0xdc | 0xdd => self.read_array_len()? as u64,
                0x80..=0x8f | 0xde | 0xdf => 2 * self.read_map_len()? as u64,
                0xa0..=0xbf | 0xd9..=0xdb => {
                    self.read_str()?;
                    0
                }
                0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => {
                    self.pos += 1;
                    0
                }
                0xc1 => return Err(malformed(start, "reserved marker 0xc1")),
                _ => {
                    self.pos += 1;
                    let n = match m {
                        0xcc | 0xd0 => 1,
                        0xcd | 0xd1 => 2,
                        0xce | 0xd2 | 0xca => 4,
                        0xcf | 0xd3 | 0xcb => 8,
                        0xc4 => usize::from(self.take_u8(start)?),
                        0xc5 => usize::from(self.take_u16(start)?),
                        0xc6 => self.take_u32(start)? as usize,
                        // fixext 1/2/4/8/16: type byte + data
                        0xd4 => 2,
                        0xd5 => 3,
                        0xd6 => 5,
                        0xd7 => 9,
                        0xd8 => 17,
                        0xc7 => usize::from(self.take_u8(start)?) + 1,
                        0xc8 => usize::from(self.take_u16(start)?) + 1,
                        0xc9 => (self.take_u32(start)? as usize).saturating_add(1),
                        _ => return Err(malformed(start, "unknown marker")),
                    };
                    self.take(n, start)?;
                    0
                }
            };
            if children > 0 {
                let slot = stack
                    .get_mut(depth)
                    .ok_or_else(|| malformed(start, "nesting too deep"))?;
                *slot = pending;
                depth += 1;
                pending = children;
            }
        }
    }

    /// Skips one value and returns its raw bytes (marker included).
    pub fn value_span(&mut self) -> Result<&'a [u8]> {
        let start = self.pos;
        self.skip_value()?;
        Ok(self.buf.get(start..self.pos).unwrap_or_default())
    }
}

/// Validates the bytes of a msgpack `str` that starts at `offset` (for the error).
#[inline]
pub fn check_utf8(bytes: &[u8], offset: usize) -> Result<&str> {
    std::str::from_utf8(bytes).map_err(|_| malformed(offset, "invalid UTF-8 in str"))
}

/// Appends msgpack to a `Vec<u8>`, shortest forms as msgspec writes them.
///
/// Lengths above `u32::MAX` cannot be expressed in msgpack; the length-writing methods panic on
/// them (no real batch comes near).
#[derive(Debug, Default, Clone)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_capacity(cap: usize) -> Self {
        Writer {
            buf: Vec::with_capacity(cap),
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.buf
    }

    pub fn into_inner(self) -> Vec<u8> {
        self.buf
    }

    fn len32(len: usize) -> u32 {
        u32::try_from(len).expect("msgpack lengths are at most u32::MAX")
    }

    fn header(&mut self, len: usize, fix: u8, fix_max: usize, m16: u8, m32: u8) {
        let len = Self::len32(len);
        if (len as usize) <= fix_max {
            self.buf.push(fix | len as u8);
        } else if let Ok(l) = u16::try_from(len) {
            self.buf.push(m16);
            self.buf.extend_from_slice(&l.to_be_bytes());
        } else {
            self.buf.push(m32);
            self.buf.extend_from_slice(&len.to_be_bytes());
        }
    }

    pub fn write_array_len(&mut self, len: usize) {
        self.header(len, 0x90, 15, 0xdc, 0xdd);
    }

    pub fn write_map_len(&mut self, len: usize) {
        self.header(len, 0x80, 15, 0xde, 0xdf);
    }

    /// A map header of `len` pairs in the width msgspec picks for a struct that *could* have
    /// `max_len` pairs (it reserves the header for all fields, then writes the count of those
    /// not omitted): e.g. `de 00 0b` for 11 of 17 possible fields.
    pub fn write_map_len_sized_for(&mut self, len: usize, max_len: usize) {
        let len32 = Self::len32(len);
        if max_len < 16 && len32 < 16 {
            self.buf.push(0x80 | len32 as u8);
        } else if let (true, Ok(l)) = (max_len < (1 << 16), u16::try_from(len32)) {
            self.buf.push(0xde);
            self.buf.extend_from_slice(&l.to_be_bytes());
        } else {
            self.buf.push(0xdf);
            self.buf.extend_from_slice(&len32.to_be_bytes());
        }
    }

    pub fn write_str(&mut self, s: &str) {
        let len = Self::len32(s.len());
        if len < 32 {
            self.buf.push(0xa0 | len as u8);
        } else if let Ok(l) = u8::try_from(len) {
            self.buf.push(0xd9);
            self.buf.push(l);
        } else if let Ok(l) = u16::try_from(len) {
            self.buf.push(0xda);
            self.buf.extend_from_slice(&l.to_be_bytes());
        } else {
            self.buf.push(0xdb);
            self.buf.extend_from_slice(&len.to_be_bytes());
        }
        self.buf.extend_from_slice(s.as_bytes());
    }

    pub fn write_bin(&mut self, b: &[u8]) {
        let len = Self::len32(b.len());
        if let Ok(l) = u8::try_from(len) {
            self.buf.push(0xc4);
            self.buf.push(l);
        } else if let Ok(l) = u16::try_from(len) {
            self.buf.push(0xc5);
            self.buf.extend_from_slice(&l.to_be_bytes());
        } else {
            self.buf.push(0xc6);
            self.buf.extend_from_slice(&len.to_be_bytes());
        }
        self.buf.extend_from_slice(b);
    }

    #[inline]
    pub fn write_uint(&mut self, v: u64) {
        if v < 0x80 {
            self.buf.push(v as u8);
        } else if let Ok(v) = u8::try_from(v) {
            self.buf.extend_from_slice(&[0xcc, v]);
        } else if let Ok(v) = u16::try_from(v) {
            self.buf.push(0xcd);
            self.buf.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = u32::try_from(v) {
            self.buf.push(0xce);
            self.buf.extend_from_slice(&v.to_be_bytes());
        } else {
            self.buf.push(0xcf);
            self.buf.extend_from_slice(&v.to_be_bytes());
        }
    }

    /// Non-negative values use the unsigned forms (as msgspec does).
    pub fn write_int(&mut self, v: i64) {
        if v >= 0 {
            self.write_uint(v as u64);
        } else if v >= -32 {
            self.buf.push(v as i8 as u8);
        } else if let Ok(v) = i8::try_from(v) {
            self.buf.extend_from_slice(&[0xd0, v as u8]);
        } else if let Ok(v) = i16::try_from(v) {
            self.buf.push(0xd1);
            self.buf.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = i32::try_from(v) {
            self.buf.push(0xd2);
            self.buf.extend_from_slice(&v.to_be_bytes());
        } else {
            self.buf.push(0xd3);
            self.buf.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub fn write_f64(&mut self, v: f64) {
        self.buf.push(0xcb);
        self.buf.extend_from_slice(&v.to_bits().to_be_bytes());
    }

    pub fn write_nil(&mut self) {
        self.buf.push(0xc0);
    }

    pub fn write_bool(&mut self, v: bool) {
        self.buf.push(if v { 0xc3 } else { 0xc2 });
    }

    /// Appends bytes that already are msgpack (one or more complete values).
    pub fn write_raw(&mut self, raw: &[u8]) {
        self.buf.extend_from_slice(raw);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(f: impl FnOnce(&mut Writer)) -> Vec<u8> {
        let mut w = Writer::new();
        f(&mut w);
        w.into_inner()
    }

    fn is_msgpack_err(e: &EventError) -> bool {
        matches!(e, EventError::Msgpack { .. })
    }

    #[test]
    fn uint_shortest_forms() {
        let cases: &[(u64, &[u8])] = &[
            (0, &[0x00]),
            (127, &[0x7f]),
            (128, &[0xcc, 0x80]),
            (255, &[0xcc, 0xff]),
            (256, &[0xcd, 0x01, 0x00]),
            (65535, &[0xcd, 0xff, 0xff]),
            (65536, &[0xce, 0x00, 0x01, 0x00, 0x00]),
            (u32::MAX as u64, &[0xce, 0xff, 0xff, 0xff, 0xff]),
            (1 << 32, &[0xcf, 0, 0, 0, 1, 0, 0, 0, 0]),
            (
                u64::MAX,
                &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
            ),
        ];
        for &(v, bytes) in cases {
            assert_eq!(w(|w| w.write_uint(v)), bytes, "{v}");
            let mut r = Reader::new(bytes);
            assert_eq!(r.read_u64().unwrap(), v);
            assert!(r.is_at_end());
            let mut r = Reader::new(bytes);
            assert_eq!(r.read_int_bits().unwrap(), v);
        }
    }

    #[test]
    fn int_shortest_forms() {
        let cases: &[(i64, &[u8])] = &[
            (5, &[0x05]),
            (-1, &[0xff]),
            (-32, &[0xe0]),
            (-33, &[0xd0, 0xdf]),
            (-128, &[0xd0, 0x80]),
            (-129, &[0xd1, 0xff, 0x7f]),
            (-32768, &[0xd1, 0x80, 0x00]),
            (-32769, &[0xd2, 0xff, 0xff, 0x7f, 0xff]),
            (i32::MIN as i64, &[0xd2, 0x80, 0, 0, 0]),
            (
                i32::MIN as i64 - 1,
                &[0xd3, 0xff, 0xff, 0xff, 0xff, 0x7f, 0xff, 0xff, 0xff],
            ),
            (i64::MIN, &[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0]),
            (
                i64::MAX,
                &[0xcf, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
            ),
        ];
        for &(v, bytes) in cases {
            assert_eq!(w(|w| w.write_int(v)), bytes, "{v}");
            let mut r = Reader::new(bytes);
            assert_eq!(r.read_i64().unwrap(), v);
            assert!(r.is_at_end());
        }
    }

    #[test]
    fn read_ints_any_width_and_range_checks() {
        // uint8 / int8 / int16 positive values all read as u64 and i64.
        for bytes in [
            &[0xcc, 7][..],
            &[0xd0, 7],
            &[0xd1, 0, 7],
            &[0xd2, 0, 0, 0, 7],
        ] {
            assert_eq!(Reader::new(bytes).read_u64().unwrap(), 7);
            assert_eq!(Reader::new(bytes).read_i64().unwrap(), 7);
            assert_eq!(Reader::new(bytes).read_u32().unwrap(), 7);
        }
        // u64 above i64::MAX: fine as u64, out of range as i64.
        let big = w(|w| w.write_uint(u64::MAX - 1));
        assert_eq!(Reader::new(&big).read_u64().unwrap(), u64::MAX - 1);
        let e = Reader::new(&big).read_i64().unwrap_err();
        assert!(matches!(e, EventError::Schema(_)), "{e}");
        // Negative as u64: schema error, cursor not moved.
        let mut r = Reader::new(&[0xff]);
        assert!(matches!(r.read_u64(), Err(EventError::Schema(_))));
        assert_eq!(r.pos(), 0);
        assert_eq!(Reader::new(&[0xff]).read_int_bits().unwrap(), u64::MAX);
        // u32 range.
        let v = w(|w| w.write_uint(1 << 32));
        assert!(matches!(
            Reader::new(&v).read_u32(),
            Err(EventError::Schema(_))
        ));
        let v = w(|w| w.write_uint(u32::MAX as u64));
        assert_eq!(Reader::new(&v).read_u32().unwrap(), u32::MAX);
        // Wrong type.
        let s = w(|w| w.write_str("7"));
        assert!(matches!(
            Reader::new(&s).read_u64(),
            Err(EventError::Schema(_))
        ));
        // Truncated.
        let e = Reader::new(&[0xcf, 1, 2]).read_u64().unwrap_err();
        assert_eq!(
            e,
            EventError::Msgpack {
                offset: 0,
                what: "unexpected end of input"
            }
        );
        assert!(is_msgpack_err(&Reader::new(&[]).read_u64().unwrap_err()));
    }

    #[test]
    fn u32_arrays_fast_and_slow_paths() {
        // Every width, plus encodings only the slow path takes (int8/16/32/64 and uint64 holding
        // small non-negative values), ending right at the end of the buffer (the tail is read
        // without the 8-byte window).
        let values = [
            0u32,
            5,
            127,
            128,
            255,
            256,
            65535,
            65536,
            150_000,
            u32::MAX,
            7,
            8,
            9,
        ];
        let mut wr = Writer::new();
        wr.write_array_len(values.len() + 5);
        for &v in &values {
            wr.write_uint(u64::from(v));
        }
        wr.write_raw(&[0xd0, 0x01]); // int8 1
        wr.write_raw(&[0xd1, 0x00, 0x02]); // int16 2
        wr.write_raw(&[0xd2, 0, 0, 0, 3]); // int32 3
        wr.write_raw(&[0xd3, 0, 0, 0, 0, 0, 0, 0, 4]); // int64 4
        wr.write_raw(&[0xcf, 0, 0, 0, 0, 0, 0, 0, 5]); // uint64 5
        let b = wr.into_inner();
        let mut r = Reader::new(&b);
        let got = r.read_u32_array().unwrap();
        let mut want = values.to_vec();
        want.extend([1, 2, 3, 4, 5]);
        assert_eq!(got, want);
        r.finish().unwrap();

        // Same values followed by more data (the 8-byte window path everywhere).
        let mut padded = b.clone();
        padded.extend_from_slice(&[0xc0; 16]);
        let mut r = Reader::new(&padded);
        assert_eq!(r.read_u32_array().unwrap(), want);
        assert_eq!(r.pos(), b.len());

        // Errors: negative, too big, wrong type, truncated.
        let bad: &[(&[u8], bool)] = &[
            (
                &[0x92, 0x01, 0xff, 0xc0, 0xc0, 0xc0, 0xc0, 0xc0, 0xc0, 0xc0],
                true,
            ),
            (&[0x91, 0xcf, 0, 0, 0, 1, 0, 0, 0, 0], true),
            (&[0x91, 0xa1, b'1'], true),
            (&[0x92, 0x01, 0xce, 0, 0], false),
            (&[0x93, 0x01, 0x02], false),
        ];
        for &(bytes, schema) in bad {
            let e = Reader::new(bytes).read_u32_array().unwrap_err();
            assert_eq!(matches!(e, EventError::Schema(_)), schema, "{bytes:?}: {e}");
        }
    }

    #[test]
    fn uint64_fast_path() {
        let b = w(|w| w.write_uint(u64::MAX - 3));
        let mut r = Reader::new(&b);
        assert_eq!(r.try_read_uint64(), Some(u64::MAX - 3));
        assert!(r.is_at_end());
        // Anything else (or a truncated uint64) consumes nothing.
        for bytes in [
            &[0x05][..],
            &[0xcf, 1, 2],
            &[0xce, 0, 0, 0, 1, 0, 0, 0, 0],
            &[],
        ] {
            let mut r = Reader::new(bytes);
            assert_eq!(r.try_read_uint64(), None);
            assert_eq!(r.pos(), 0);
        }
    }

    #[test]
    fn str_bytes_skip_utf8_validation() {
        let mut r = Reader::new(&[0xa2, 0xff, 0xfe, 0x01]);
        assert_eq!(r.read_str_bytes().unwrap(), &[0xff, 0xfe]);
        assert_eq!(r.pos(), 3);
        assert!(is_msgpack_err(&check_utf8(&[0xff, 0xfe], 0).unwrap_err()));
        assert_eq!(check_utf8(b"ok", 0).unwrap(), "ok");
    }

    #[test]
    fn floats() {
        let b = w(|w| w.write_f64(1.5));
        assert_eq!(b, [0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0]);
        assert_eq!(Reader::new(&b).read_f64().unwrap(), 1.5);
        let f32b = [0xca, 0x3f, 0xc0, 0, 0]; // 1.5f32
        assert_eq!(Reader::new(&f32b).read_f64().unwrap(), 1.5);
        assert_eq!(Reader::new(&[0x03]).read_f64().unwrap(), 3.0);
        assert_eq!(Reader::new(&[0xff]).read_f64().unwrap(), -1.0);
        let big = w(|w| w.write_uint(u64::MAX));
        assert_eq!(Reader::new(&big).read_f64().unwrap(), u64::MAX as f64);
        assert!(matches!(
            Reader::new(&[0xc0]).read_f64(),
            Err(EventError::Schema(_))
        ));
        assert!(is_msgpack_err(
            &Reader::new(&[0xcb, 0]).read_f64().unwrap_err()
        ));
    }

    #[test]
    fn strings() {
        for len in [0usize, 5, 31, 32, 255, 256, 70_000] {
            let s = "x".repeat(len);
            let b = w(|w| w.write_str(&s));
            let hdr = match len {
                0..=31 => 1,
                32..=255 => 2,
                256..=65535 => 3,
                _ => 5,
            };
            assert_eq!(b.len(), len + hdr, "{len}");
            let mut r = Reader::new(&b);
            assert_eq!(r.read_str().unwrap(), s);
            assert!(r.is_at_end());
        }
        assert_eq!(w(|w| w.write_str("type")), b"\xa4type");
        // Invalid UTF-8 is malformed.
        let e = Reader::new(&[0xa2, 0xff, 0xfe]).read_str().unwrap_err();
        assert!(is_msgpack_err(&e));
        // Truncated body; cursor restored.
        let mut r = Reader::new(&[0xa5, b'a']);
        assert!(is_msgpack_err(&r.read_str().unwrap_err()));
        assert_eq!(r.pos(), 0);
        // str32 claiming 4 GiB.
        assert!(is_msgpack_err(
            &Reader::new(&[0xdb, 0xff, 0xff, 0xff, 0xff, b'a'])
                .read_str()
                .unwrap_err()
        ));
        // bin is not str.
        assert!(matches!(
            Reader::new(&[0xc4, 0]).read_str(),
            Err(EventError::Schema(_))
        ));
    }

    #[test]
    fn bins() {
        for len in [0usize, 8, 32, 255, 256, 70_000] {
            let v = vec![7u8; len];
            let b = w(|w| w.write_bin(&v));
            let mut r = Reader::new(&b);
            assert_eq!(r.read_bin().unwrap(), &v[..]);
            assert!(r.is_at_end());
        }
        assert_eq!(w(|w| w.write_bin(&[1, 2])), [0xc4, 2, 1, 2]);
        assert!(is_msgpack_err(
            &Reader::new(&[0xc6, 0xff, 0xff, 0xff, 0xff])
                .read_bin()
                .unwrap_err()
        ));
        assert!(matches!(
            Reader::new(&[0xa0]).read_bin(),
            Err(EventError::Schema(_))
        ));
    }

    #[test]
    fn arrays_and_maps() {
        for len in [0usize, 15, 16, 65535, 65536] {
            let mut wr = Writer::new();
            wr.write_array_len(len);
            for _ in 0..len {
                wr.write_nil();
            }
            let b = wr.into_inner();
            let mut r = Reader::new(&b);
            assert_eq!(r.read_array_len().unwrap(), len);
            for _ in 0..len {
                r.read_nil().unwrap();
            }
            assert!(r.is_at_end());

            let mut wr = Writer::new();
            wr.write_map_len(len);
            for _ in 0..len {
                wr.write_nil();
                wr.write_bool(true);
            }
            let b = wr.into_inner();
            let mut r = Reader::new(&b);
            assert_eq!(r.read_map_len().unwrap(), len);
            for _ in 0..len {
                r.read_nil().unwrap();
                assert!(r.read_bool().unwrap());
            }
            r.finish().unwrap();
        }
        assert_eq!(w(|w| w.write_array_len(3)), [0x93]);
        assert_eq!(w(|w| w.write_array_len(16)), [0xdc, 0, 16]);
        assert_eq!(w(|w| w.write_map_len(1)), [0x81]);
        assert_eq!(w(|w| w.write_map_len_sized_for(11, 17)), [0xde, 0, 11]);
        assert_eq!(w(|w| w.write_map_len_sized_for(4, 6)), [0x84]);
    }

    #[test]
    fn huge_declared_lengths_fail_before_allocating() {
        let cases: &[&[u8]] = &[
            &[0xdd, 0xff, 0xff, 0xff, 0xff, 0x00],
            &[0xdc, 0xff, 0xff, 0x00],
            &[0xdf, 0xff, 0xff, 0xff, 0xff, 0x00, 0x00],
            &[0x92, 0x00],
            &[0x81, 0x00],
        ];
        for &b in cases {
            let mut r = Reader::new(b);
            let e = if b[0] == 0xdf || b[0] == 0x81 {
                r.read_map_len().unwrap_err()
            } else {
                r.read_array_len().unwrap_err()
            };
            assert!(is_msgpack_err(&e), "{b:?}: {e}");
            assert_eq!(r.pos(), 0);
            assert!(is_msgpack_err(&Reader::new(b).skip_value().unwrap_err()));
        }
    }

    #[test]
    fn nil_and_bool() {
        let mut r = Reader::new(&[0xc0, 0xc2, 0xc3, 0x01]);
        assert!(r.is_nil());
        assert!(r.try_nil());
        assert!(!r.is_nil());
        assert!(!r.try_nil());
        assert!(!r.read_bool().unwrap());
        assert!(r.read_bool().unwrap());
        assert!(matches!(r.read_nil(), Err(EventError::Schema(_))));
        assert!(!Reader::new(&[]).is_nil());
        assert!(is_msgpack_err(&Reader::new(&[]).read_nil().unwrap_err()));
        assert_eq!(w(|w| w.write_nil()), [0xc0]);
        assert_eq!(w(|w| w.write_bool(true)), [0xc3]);
    }

    #[test]
    fn peek_type_covers_markers() {
        assert_eq!(Reader::new(&[0x05]).peek_type().unwrap(), ValueType::Int);
        assert_eq!(Reader::new(&[0xd3]).peek_type().unwrap(), ValueType::Int);
        assert_eq!(Reader::new(&[0xa1]).peek_type().unwrap(), ValueType::Str);
        assert_eq!(Reader::new(&[0xc5]).peek_type().unwrap(), ValueType::Bin);
        assert_eq!(Reader::new(&[0x91]).peek_type().unwrap(), ValueType::Array);
        assert_eq!(Reader::new(&[0xde]).peek_type().unwrap(), ValueType::Map);
        assert_eq!(Reader::new(&[0xca]).peek_type().unwrap(), ValueType::Float);
        assert_eq!(Reader::new(&[0xd8]).peek_type().unwrap(), ValueType::Ext);
        assert_eq!(Reader::new(&[0xc0]).peek_type().unwrap(), ValueType::Nil);
        assert_eq!(Reader::new(&[0xc3]).peek_type().unwrap(), ValueType::Bool);
        assert!(is_msgpack_err(
            &Reader::new(&[0xc1]).peek_type().unwrap_err()
        ));
        assert!(is_msgpack_err(&Reader::new(&[]).peek_type().unwrap_err()));
    }

    #[test]
    fn skip_value_and_span() {
        // [1, "ab", {"k": [nil, 1.5]}, bin[2], fixext1, ext8(3)], then a trailing 0x07.
        let mut wr = Writer::new();
        wr.write_array_len(6);
        wr.write_uint(1);
        wr.write_str("ab");
        wr.write_map_len(1);
        wr.write_str("k");
        wr.write_array_len(2);
        wr.write_nil();
        wr.write_f64(1.5);
        wr.write_bin(&[1, 2]);
        wr.write_raw(&[0xd4, 0x01, 0xaa]);
        wr.write_raw(&[0xc7, 0x03, 0x05, 1, 2, 3]);
        let value_len = wr.as_bytes().len();
        wr.write_uint(7);
        let b = wr.into_inner();

        let mut r = Reader::new(&b);
        let span = r.value_span().unwrap();
        assert_eq!(span.len(), value_len);
        assert_eq!(r.pos(), value_len);
        assert_eq!(r.read_u64().unwrap(), 7);
        r.finish().unwrap();

        // Every truncation fails and leaves the cursor where it was.
        for cut in 0..value_len {
            let mut r = Reader::new(&b[..cut]);
            assert!(is_msgpack_err(&r.skip_value().unwrap_err()), "cut {cut}");
            assert_eq!(r.pos(), 0);
        }
        // Reserved marker inside.
        assert!(is_msgpack_err(
            &Reader::new(&[0x92, 0x01, 0xc1]).skip_value().unwrap_err()
        ));
        // Bad UTF-8 inside.
        assert!(is_msgpack_err(
            &Reader::new(&[0x91, 0xa1, 0xff]).skip_value().unwrap_err()
        ));
        // Empty containers.
        let mut r = Reader::new(&[0x90, 0x80, 0x01]);
        r.skip_value().unwrap();
        r.skip_value().unwrap();
        assert_eq!(r.pos(), 2);
    }

    #[test]
    fn skip_value_depth_limit() {
        let ok = [vec![0x91u8; MAX_DEPTH], vec![0xc0]].concat();
        let mut r = Reader::new(&ok);
        r.skip_value().unwrap();
        r.finish().unwrap();

        let deep = [vec![0x91u8; MAX_DEPTH + 1], vec![0xc0]].concat();
        let e = Reader::new(&deep).skip_value().unwrap_err();
        assert_eq!(
            e,
            EventError::Msgpack {
                offset: MAX_DEPTH,
                what: "nesting too deep"
            }
        );
        // Very deep input is an error, not a stack overflow.
        let abyss = vec![0x91u8; 1_000_000];
        assert!(Reader::new(&abyss).skip_value().is_err());
    }

    #[test]
    fn finish_reports_trailing_bytes() {
        let mut r = Reader::new(&[0x01, 0x02]);
        r.read_u64().unwrap();
        assert_eq!(
            r.finish().unwrap_err(),
            EventError::Msgpack {
                offset: 1,
                what: "trailing bytes after the value"
            }
        );
    }
}
