//! [`Writer`]: appends msgpack to a `Vec<u8>` in the shortest forms, as msgspec writes them.

use super::{LenForms, ARRAY, BIN, MAP, STR};

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

    /// Writes the shortest header of `forms` for a value of `len` (elements, pairs or bytes).
    fn header(&mut self, len: usize, forms: &LenForms) {
        let len = Self::len32(len);
        if let Some((first, _)) = forms.fix.filter(|&(_, mask)| len <= u32::from(mask)) {
            self.buf.push(first | len as u8);
        } else if let (Some(m8), Ok(l)) = (forms.m8, u8::try_from(len)) {
            self.buf.extend_from_slice(&[m8, l]);
        } else if let Ok(l) = u16::try_from(len) {
            self.buf.push(forms.m16);
            self.buf.extend_from_slice(&l.to_be_bytes());
        } else {
            self.buf.push(forms.m32);
            self.buf.extend_from_slice(&len.to_be_bytes());
        }
    }

    pub fn write_array_len(&mut self, len: usize) {
        self.header(len, &ARRAY);
    }

    pub fn write_map_len(&mut self, len: usize) {
        self.header(len, &MAP);
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
        self.header(s.len(), &STR);
        self.buf.extend_from_slice(s.as_bytes());
    }

    pub fn write_bin(&mut self, b: &[u8]) {
        self.header(b.len(), &BIN);
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
