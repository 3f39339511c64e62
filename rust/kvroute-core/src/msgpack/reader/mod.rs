//! [`Reader`], the bounds-checked msgpack cursor: its primitives, nil and bool, the
//! length-prefixed values (str, bin, array and map headers) and skipping whole values. The numeric
//! reads are in `numbers.rs`.

use super::{check_utf8, malformed, LenForms, Result, ValueType, ARRAY, BIN, MAP, MAX_DEPTH, STR};
use crate::error::EventError;

mod numbers;

/// A bounds-checked msgpack cursor over a borrowed buffer. Cheap to copy (a slice and an offset),
/// so a caller can remember a position and come back to it.
#[derive(Debug, Clone, Copy)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
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

    /// Consumes the header (marker and length) of a length-prefixed value in the given forms and
    /// returns the length, not yet checked against the bytes left. Errors are reported at the
    /// marker. Always inlined, so that the forms, constants at every call, fold away.
    #[inline(always)]
    fn read_len(&mut self, forms: &LenForms) -> Result<usize> {
        let start = self.pos;
        let m = self.peek_byte()?;
        if let Some((first, mask)) = forms.fix {
            if m & !mask == first {
                self.pos += 1;
                return Ok(usize::from(m & mask));
            }
        }
        if forms.m8 == Some(m) {
            self.pos += 1;
            Ok(usize::from(self.take_u8(start)?))
        } else if m == forms.m16 {
            self.pos += 1;
            Ok(usize::from(self.take_u16(start)?))
        } else if m == forms.m32 {
            self.pos += 1;
            Ok(self.take_u32(start)? as usize)
        } else {
            Err(self.mismatch(start, forms.name))
        }
    }

    /// Reads the header of an array; the length is at most the bytes left.
    #[inline]
    pub fn read_array_len(&mut self) -> Result<usize> {
        let start = self.pos;
        let len = self.read_len(&ARRAY)?;
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
        let len = self.read_len(&MAP)?;
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
        let len = self.read_len(&STR)?;
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
        let len = self.read_len(&BIN)?;
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
