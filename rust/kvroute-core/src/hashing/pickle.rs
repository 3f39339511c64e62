//! Pickle protocol 5, byte-identical to CPython 3.11's `pickle.dumps(x, protocol=5)`.

use smallvec::SmallVec;

use super::encoder::{Encoder, PyStr};

pub(super) mod op {
    pub const PROTO: u8 = 0x80;
    pub const FRAME: u8 = 0x95;
    pub const STOP: u8 = b'.';
    pub const NONE: u8 = b'N';
    pub const BININT: u8 = b'J';
    pub const BININT1: u8 = b'K';
    pub const BININT2: u8 = b'M';
    pub const LONG1: u8 = 0x8a;
    pub const SHORT_BINBYTES: u8 = b'C';
    pub const BINBYTES: u8 = b'B';
    pub const BINBYTES8: u8 = 0x8e;
    pub const SHORT_BINUNICODE: u8 = 0x8c;
    pub const BINUNICODE: u8 = b'X';
    pub const BINUNICODE8: u8 = 0x8d;
    pub const MARK: u8 = b'(';
    pub const EMPTY_TUPLE: u8 = b')';
    pub const TUPLE: u8 = b't';
    pub const TUPLE1: u8 = 0x85;
    pub const TUPLE2: u8 = 0x86;
    pub const TUPLE3: u8 = 0x87;
    pub const MEMOIZE: u8 = 0x94;
    pub const BINGET: u8 = b'h';
    pub const LONG_BINGET: u8 = b'j';
}

/// `FRAME` opcode + 8-byte length.
const FRAME_HEADER: usize = 9;
/// Frames shorter than this get no `FRAME` header (pickle's `_FRAME_SIZE_MIN`).
const FRAME_SIZE_MIN: usize = 4;
/// A frame is closed at the next object once it holds this much (pickle's `_FRAME_SIZE_TARGET`);
/// bytes/str payloads at least this long are written outside any frame.
const FRAME_SIZE_TARGET: usize = 64 * 1024;

/// A protocol-5 pickler for [`Encoder`] values, following CPython's framing rules exactly: the
/// output is `PROTO 5`, then frames (`FRAME len` + opcodes), where a frame is closed when an
/// object starts after it reached 64 KiB, large payloads go between frames, and a frame under 4
/// bytes is written without header.
pub(super) struct Pickler<'a, 'o> {
    out: &'o mut Vec<u8>,
    /// Where the open frame's 9-byte header placeholder starts.
    frame_start: usize,
    /// Number of memoized objects so far (the next memo index).
    memo_len: u32,
    /// Memo indices of the strings that can recur as the same object (see [`PyStr`]).
    shared: SmallVec<[(&'a str, u32); 4]>,
}

impl<'a, 'o> Pickler<'a, 'o> {
    pub(super) fn new(out: &'o mut Vec<u8>) -> Self {
        out.clear();
        out.extend_from_slice(&[op::PROTO, 5]);
        let mut p = Self {
            out,
            frame_start: 0,
            memo_len: 0,
            shared: SmallVec::new(),
        };
        p.open_frame();
        p
    }

    fn open_frame(&mut self) {
        self.frame_start = self.out.len();
        self.out.extend_from_slice(&[0; FRAME_HEADER]);
    }

    fn commit_frame(&mut self) {
        let start = self.frame_start;
        let len = self.out.len() - start - FRAME_HEADER;
        if len >= FRAME_SIZE_MIN {
            self.out[start] = op::FRAME;
            self.out[start + 1..start + FRAME_HEADER].copy_from_slice(&(len as u64).to_le_bytes());
        } else {
            self.out.drain(start..start + FRAME_HEADER);
        }
    }

    /// `framer.commit_frame()` at the start of every `save()`: a frame ends between objects.
    fn object_boundary(&mut self) {
        if self.out.len() - self.frame_start - FRAME_HEADER >= FRAME_SIZE_TARGET {
            self.commit_frame();
            self.open_frame();
        }
    }

    fn memoize(&mut self) -> u32 {
        self.out.push(op::MEMOIZE);
        self.memo_len += 1;
        self.memo_len - 1
    }

    fn get(&mut self, idx: u32) {
        if let Ok(small) = u8::try_from(idx) {
            self.out.extend_from_slice(&[op::BINGET, small]);
        } else {
            self.out.push(op::LONG_BINGET);
            self.out.extend_from_slice(&idx.to_le_bytes());
        }
    }

    /// `save_bytes` / `save_str`: a 1-byte length, a 4-byte length, or (if the payload is at least
    /// [`FRAME_SIZE_TARGET`]) the header inside the frame stream but the payload between frames.
    fn payload(&mut self, short: u8, long: u8, long8: u8, data: &[u8]) {
        let n = data.len();
        if let Ok(n8) = u8::try_from(n) {
            self.out.extend_from_slice(&[short, n8]);
            self.out.extend_from_slice(data);
            return;
        }
        let mut header: SmallVec<[u8; 9]> = SmallVec::new();
        match u32::try_from(n) {
            Ok(n32) => {
                header.push(long);
                header.extend_from_slice(&n32.to_le_bytes());
            }
            Err(_) => {
                header.push(long8);
                header.extend_from_slice(&(n as u64).to_le_bytes());
            }
        }
        if n >= FRAME_SIZE_TARGET {
            self.commit_frame();
            self.out.extend_from_slice(&header);
            self.out.extend_from_slice(data);
            self.open_frame();
        } else {
            self.out.extend_from_slice(&header);
            self.out.extend_from_slice(data);
        }
    }

    pub(super) fn finish(mut self) {
        self.out.push(op::STOP);
        self.commit_frame();
    }
}

impl<'a> Encoder<'a> for Pickler<'a, '_> {
    fn none(&mut self) {
        self.object_boundary();
        self.out.push(op::NONE);
    }

    fn int(&mut self, v: i64) {
        self.object_boundary();
        if let Ok(b) = u8::try_from(v) {
            self.out.extend_from_slice(&[op::BININT1, b]);
        } else if let Ok(h) = u16::try_from(v) {
            self.out.push(op::BININT2);
            self.out.extend_from_slice(&h.to_le_bytes());
        } else if let Ok(i) = i32::try_from(v) {
            self.out.push(op::BININT);
            self.out.extend_from_slice(&i.to_le_bytes());
        } else {
            // LONG1: minimal little-endian two's complement (pickle's `encode_long`).
            let le = v.to_le_bytes();
            let mut n = 8;
            while n > 1 {
                let (top, next) = (le[n - 1], le[n - 2]);
                let redundant = (top == 0 && next & 0x80 == 0) || (top == 0xff && next & 0x80 != 0);
                if !redundant {
                    break;
                }
                n -= 1;
            }
            self.out.extend_from_slice(&[op::LONG1, n as u8]);
            self.out.extend_from_slice(&le[..n]);
        }
    }

    fn bytes(&mut self, b: &'a [u8]) {
        self.object_boundary();
        self.payload(op::SHORT_BINBYTES, op::BINBYTES, op::BINBYTES8, b);
        self.memoize();
    }

    fn str(&mut self, s: PyStr<'a>) {
        self.object_boundary();
        let text = s.as_str();
        let shareable = s.shareable();
        if shareable {
            if let Some(&(_, idx)) = self.shared.iter().find(|(k, _)| *k == text) {
                self.get(idx);
                return;
            }
        }
        self.payload(
            op::SHORT_BINUNICODE,
            op::BINUNICODE,
            op::BINUNICODE8,
            text.as_bytes(),
        );
        let idx = self.memoize();
        if shareable {
            self.shared.push((text, idx));
        }
    }

    fn tuple_begin(&mut self, len: usize) {
        self.object_boundary();
        if len == 0 {
            // The empty tuple is a singleton that pickle never memoizes.
            self.out.push(op::EMPTY_TUPLE);
        } else if len > 3 {
            self.out.push(op::MARK);
        }
    }

    fn tuple_end(&mut self, len: usize) {
        let code = match len {
            0 => return,
            1 => op::TUPLE1,
            2 => op::TUPLE2,
            3 => op::TUPLE3,
            _ => op::TUPLE,
        };
        self.out.push(code);
        self.memoize();
    }
}
