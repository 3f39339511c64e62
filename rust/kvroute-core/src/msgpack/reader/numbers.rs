//! Numeric reads of [`Reader`]: ints of any width, the fast paths for token-id arrays and block
//! hashes, and floats.

use super::Reader;
use crate::error::EventError;
use crate::msgpack::Result;

impl Reader<'_> {
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
}
