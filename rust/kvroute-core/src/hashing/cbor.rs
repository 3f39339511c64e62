//! Canonical CBOR, byte-identical to `cbor2.dumps(x, canonical=True)`.

use super::encoder::{Encoder, PyStr};

/// CBOR encoder: tuples are definite-length arrays, `bytes` a byte string, `str` a text string,
/// `None` is `0xf6`, and ints use major type 0/1 with the shortest length form (canonical CBOR).
pub(super) struct Cbor<'o>(pub(super) &'o mut Vec<u8>);

impl Cbor<'_> {
    fn head(&mut self, major: u8, value: u64) {
        let m = major << 5;
        if value < 24 {
            self.0.push(m | value as u8);
        } else if let Ok(v) = u8::try_from(value) {
            self.0.extend_from_slice(&[m | 24, v]);
        } else if let Ok(v) = u16::try_from(value) {
            self.0.push(m | 25);
            self.0.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = u32::try_from(value) {
            self.0.push(m | 26);
            self.0.extend_from_slice(&v.to_be_bytes());
        } else {
            self.0.push(m | 27);
            self.0.extend_from_slice(&value.to_be_bytes());
        }
    }
}

impl<'a> Encoder<'a> for Cbor<'_> {
    fn none(&mut self) {
        self.0.push(0xf6);
    }

    fn int(&mut self, v: i64) {
        match u64::try_from(v) {
            Ok(u) => self.head(0, u),
            // -1 - v, computed without overflow for i64::MIN.
            Err(_) => self.head(1, !(v as u64)),
        }
    }

    fn bytes(&mut self, b: &'a [u8]) {
        self.head(2, b.len() as u64);
        self.0.extend_from_slice(b);
    }

    fn str(&mut self, s: PyStr<'a>) {
        let s = s.as_str();
        self.head(3, s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
    }

    fn tuple_begin(&mut self, len: usize) {
        self.head(4, len as u64);
    }

    fn tuple_end(&mut self, _len: usize) {}
}
