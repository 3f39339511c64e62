//! Block hashing: kvroute's own content hash chain, and vLLM-compatible hashes.
//!
//! Two hash families live here because they serve two different jobs:
//!
//! * **kvroute's chain** ([`root_hash`], [`chain_hash`], [`block_hashes`], [`extend_chain`]) keys
//!   the prefix index. It hashes the token ids that `BlockStored` events carry, so it never needs
//!   the engine's seed, hash algorithm or LoRA adapter path to agree with ours; it only has to be
//!   fast (it runs on every routed request) and collision-resistant enough for a cache index.
//!   xxh3-64 over the little-endian token bytes, chained through the parent hash, does both.
//! * **vLLM-compatible hashing** ([`VllmHasher`]) reproduces the engine's own block hashes
//!   byte-for-byte (`--prefix-caching-hash-algo sha256` and `sha256_cbor`). It is needed where an
//!   event carries only hashes (CPU-offload placeholders) and to check our reading of the engine
//!   against golden streams. vLLM hashes a Python object, so this module carries small,
//!   hand-written serialisers that are byte-identical to CPython's `pickle` (protocol 5) and to
//!   `cbor2.dumps(x, canonical=True)` for the few types that occur in a hash input.

use sha2::{Digest as _, Sha256};
use smallvec::SmallVec;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed, Xxh3Default};

/// vLLM's default `--block-size` (tokens per KV block).
pub const DEFAULT_BLOCK_SIZE: usize = 16;

// ------------------------------------------------------------------------------------------------
// kvroute's own chain (xxh3-64)
// ------------------------------------------------------------------------------------------------

/// Domain separator for [`root_hash`]: keeps a root's hash input apart from any block's input
/// (which starts with an 8-byte parent hash), and versions the scheme.
const ROOT_DOMAIN: &[u8] = b"kvroute/root/v1";

/// Tokens converted per fill of the stack buffer. 64 covers the usual block sizes (16, 32, 64) in
/// one one-shot xxh3 call; larger blocks stream through the same buffer.
const CHUNK_TOKENS: usize = 64;
/// Parent hash (8 bytes) followed by up to [`CHUNK_TOKENS`] little-endian `u32`s.
const BUF_BYTES: usize = 8 + 4 * CHUNK_TOKENS;

/// Seed of kvroute's chain for one request: covers the LoRA adapter name and the cache salt.
///
/// Requests with different adapters or salts must never share KV blocks, and since every block
/// hash chains from the root, putting both into the root separates *every* block (block 0 and all
/// later ones) without touching the per-block hot loop. Each field is encoded as absent (`0`) or
/// present (`1`, length, bytes), so `None` and `Some("")` differ and a value cannot move between
/// the LoRA and the salt slot.
#[must_use]
pub fn root_hash(lora: Option<&str>, salt: Option<&str>) -> u64 {
    fn field(h: &mut Xxh3Default, value: Option<&str>) {
        match value {
            None => h.update(&[0]),
            Some(s) => {
                h.update(&[1]);
                h.update(&(s.len() as u64).to_le_bytes());
                h.update(s.as_bytes());
            }
        }
    }
    let mut h = Xxh3Default::new();
    h.update(ROOT_DOMAIN);
    field(&mut h, lora);
    field(&mut h, salt);
    h.digest()
}

/// Hash of one block given its parent's hash: xxh3-64 of `parent (LE) ++ tokens (LE u32s)`.
///
/// `extra` is an optional digest of anything else that distinguishes the block's KV (e.g. a
/// multimodal input); `0` means "none" and gives exactly the hash without extra, so callers that
/// have nothing extra need no separate code path.
#[must_use]
pub fn chain_hash(parent: u64, tokens: &[u32], extra: u64) -> u64 {
    let mut buf = [0u8; BUF_BYTES];
    mix_extra(chain_hash_buf(&mut buf, parent, tokens), extra)
}

/// Full-block hashes of `tokens` for a request with the given LoRA adapter name and cache salt.
/// A trailing partial block is ignored: the engine never caches it.
///
/// # Panics
/// If `block_size` is 0.
#[must_use]
pub fn block_hashes(
    tokens: &[u32],
    block_size: usize,
    lora: Option<&str>,
    salt: Option<&str>,
) -> Vec<u64> {
    let mut out = Vec::new();
    block_hashes_into(tokens, block_size, lora, salt, &mut out);
    out
}

/// Like [`block_hashes`], but writes into `out` (cleared first) so a caller can reuse one buffer
/// across requests.
///
/// # Panics
/// If `block_size` is 0.
pub fn block_hashes_into(
    tokens: &[u32],
    block_size: usize,
    lora: Option<&str>,
    salt: Option<&str>,
    out: &mut Vec<u64>,
) {
    out.clear();
    extend_chain(root_hash(lora, salt), tokens, block_size, out);
}

/// Continues a chain from a known parent hash: appends the hashes of the full blocks of `tokens`
/// to `out` (a trailing partial block is ignored). A `BlockStored` event with a parent, or a
/// request whose prefix was hashed before, is hashed this way without re-hashing the prefix.
///
/// # Panics
/// If `block_size` is 0.
pub fn extend_chain(parent: u64, tokens: &[u32], block_size: usize, out: &mut Vec<u64>) {
    assert!(block_size > 0, "block_size must be at least 1");
    out.reserve(tokens.len() / block_size);
    // One stack buffer for the whole chain: no allocation per block, and it is zeroed once.
    let mut buf = [0u8; BUF_BYTES];
    let mut hash = parent;
    for block in tokens.chunks_exact(block_size) {
        hash = chain_hash_buf(&mut buf, hash, block);
        out.push(hash);
    }
}

/// xxh3-64 of `parent.to_le_bytes() ++ le_bytes(tokens)`, built in `buf` without allocating.
/// Blocks longer than [`CHUNK_TOKENS`] stream through the buffer; the streaming and one-shot
/// xxh3 APIs give the same value for the same bytes, so the result depends on the bytes alone.
#[inline]
fn chain_hash_buf(buf: &mut [u8; BUF_BYTES], parent: u64, tokens: &[u32]) -> u64 {
    if tokens.len() > CHUNK_TOKENS {
        return chain_hash_streamed(buf, parent, tokens);
    }
    buf[..8].copy_from_slice(&parent.to_le_bytes());
    let end = 8 + 4 * tokens.len();
    write_le(&mut buf[8..end], tokens);
    xxh3_64(&buf[..end])
}

/// The rare path of [`chain_hash_buf`], kept out of line so the common one stays small enough
/// to inline into the chain loop (the streaming state alone is over 500 bytes).
#[cold]
#[inline(never)]
fn chain_hash_streamed(buf: &mut [u8; BUF_BYTES], parent: u64, tokens: &[u32]) -> u64 {
    let mut h = Xxh3Default::new();
    h.update(&parent.to_le_bytes());
    for chunk in tokens.chunks(CHUNK_TOKENS) {
        let end = 4 * chunk.len();
        write_le(&mut buf[..end], chunk);
        h.update(&buf[..end]);
    }
    h.digest()
}

/// Writes `tokens` as little-endian `u32`s into `dst` (exactly `4 * tokens.len()` bytes): the
/// safe stand-in for a byte cast. Four tokens go out as one 16-byte store, because xxh3 reads its
/// input in 8-byte words: a load that spans two separate 4-byte stores cannot be forwarded from
/// the store buffer and stalls (token-by-token stores measured 2-3x slower for the whole chain).
#[inline]
fn write_le(dst: &mut [u8], tokens: &[u32]) {
    let mut quads = tokens.chunks_exact(4);
    let mut out = dst.chunks_exact_mut(16);
    for (d, q) in (&mut out).zip(&mut quads) {
        let word = u128::from(q[0])
            | (u128::from(q[1]) << 32)
            | (u128::from(q[2]) << 64)
            | (u128::from(q[3]) << 96);
        d.copy_from_slice(&word.to_le_bytes());
    }
    for (d, t) in out
        .into_remainder()
        .chunks_exact_mut(4)
        .zip(quads.remainder())
    {
        d.copy_from_slice(&t.to_le_bytes());
    }
}

/// Folds an extra digest into a block hash; `0` leaves the hash unchanged (see [`chain_hash`]).
#[inline]
fn mix_extra(hash: u64, extra: u64) -> u64 {
    if extra == 0 {
        hash
    } else {
        xxh3_64_with_seed(&extra.to_le_bytes(), hash)
    }
}

// ------------------------------------------------------------------------------------------------
// vLLM-compatible hashing
// ------------------------------------------------------------------------------------------------

/// The vLLM `--prefix-caching-hash-algo` values this module reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VllmHashAlgo {
    /// `sha256`: SHA-256 of `pickle.dumps(x, protocol=5)` (vLLM's default).
    Sha256,
    /// `sha256_cbor`: SHA-256 of `cbor2.dumps(x, canonical=True)`.
    Sha256Cbor,
}

impl VllmHashAlgo {
    /// Parses vLLM's flag value (`"sha256"`, `"sha256_cbor"`). The xxhash variants are not
    /// supported: their seed is random per process, so they cannot be reproduced from outside.
    #[must_use]
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "sha256" => Some(Self::Sha256),
            "sha256_cbor" => Some(Self::Sha256Cbor),
            _ => None,
        }
    }
}

/// A full vLLM block hash (SHA-256 digest). The chain uses full digests; events carry only
/// [`event_hash`] of them.
pub type Digest = [u8; 32];

/// One entry of a block's extra keys, as vLLM puts it into the hash input: each is a *tagged*
/// tuple, `("lora", name, path)`, `("mm", id, offset)` or `("cache_salt", salt)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraKey {
    /// LoRA adapter: its name and its path (the path is in the hash but not in events).
    Lora { name: String, path: String },
    /// A multimodal input overlapping the block: its identifier and its start offset relative to
    /// the block's first token (negative when the input began in an earlier block).
    Mm { id: String, offset: i64 },
    /// The request's cache salt (block 0 only).
    CacheSalt(String),
}

/// The seed vLLM 0.33 hashes into `NONE_HASH` when `PYTHONHASHSEED` is unset (sha256 and
/// sha256_cbor; older releases used a random seed instead).
const VLLM_NONE_HASH_SEED: &str = "vllm-none-hash";

/// Reproduces vLLM's block hashes: `H((parent_digest, tuple(tokens), extra_keys_or_None))`, with
/// `NONE_HASH = H(seed)` as the parent of block 0.
#[derive(Debug, Clone)]
pub struct VllmHasher {
    algo: VllmHashAlgo,
    none_hash: Digest,
}

impl VllmHasher {
    /// A hasher for one engine configuration.
    ///
    /// `seed`: the engine's `PYTHONHASHSEED` value if it has one set, else `None`, which means
    /// `"vllm-none-hash"` (the vLLM 0.33 rule; older releases used a random seed, which cannot
    /// be reproduced). The seed is hashed as a Python `str`, as vLLM passes the variable's text.
    #[must_use]
    pub fn new(algo: VllmHashAlgo, seed: Option<&str>) -> Self {
        let seed = seed.unwrap_or(VLLM_NONE_HASH_SEED);
        let mut buf = Vec::with_capacity(64);
        match algo {
            VllmHashAlgo::Sha256 => {
                let mut p = Pickler::new(&mut buf);
                p.str(PyStr::Value(seed));
                p.finish();
            }
            VllmHashAlgo::Sha256Cbor => Cbor(&mut buf).str(PyStr::Value(seed)),
        }
        Self {
            algo,
            none_hash: Sha256::digest(&buf).into(),
        }
    }

    /// The algorithm this hasher reproduces.
    #[must_use]
    pub fn algo(&self) -> VllmHashAlgo {
        self.algo
    }

    /// `NONE_HASH`, the parent of every chain's first block.
    #[must_use]
    pub fn none_hash(&self) -> Digest {
        self.none_hash
    }

    /// Hash of one block. `extra` is hashed as a tuple in the given order; an empty slice is
    /// `None` in the hash input (vLLM's `tuple(keys) if keys else None`).
    #[must_use]
    pub fn hash_block(&self, parent: &Digest, tokens: &[u32], extra: &[ExtraKey]) -> Digest {
        self.hash_block_with(&mut Vec::new(), parent, tokens, extra)
    }

    /// Chain over full blocks of `tokens` (a trailing partial block is ignored).
    ///
    /// The LoRA adapter `(name, path)` goes into every block's extra keys, the salt into block
    /// 0's only, in vLLM's order (lora, mm, cache_salt). An empty salt adds nothing, as in vLLM,
    /// which tests the salt for truthiness. (Multimodal keys depend on where each input sits;
    /// hash such blocks with [`Self::hash_block`].)
    ///
    /// # Panics
    /// If `block_size` is 0.
    #[must_use]
    pub fn block_hashes(
        &self,
        tokens: &[u32],
        block_size: usize,
        lora: Option<(&str, &str)>,
        salt: Option<&str>,
    ) -> Vec<Digest> {
        assert!(block_size > 0, "block_size must be at least 1");
        let lora_key = lora.map(|(name, path)| ExtraKey::Lora {
            name: name.to_owned(),
            path: path.to_owned(),
        });
        let later: Vec<ExtraKey> = lora_key.into_iter().collect();
        let mut first = later.clone();
        if let Some(salt) = salt.filter(|s| !s.is_empty()) {
            first.push(ExtraKey::CacheSalt(salt.to_owned()));
        }

        let mut buf = Vec::with_capacity(16 + 6 * block_size);
        let mut out = Vec::with_capacity(tokens.len() / block_size);
        let mut parent = self.none_hash;
        for (i, block) in tokens.chunks_exact(block_size).enumerate() {
            let extra = if i == 0 { &first } else { &later };
            parent = self.hash_block_with(&mut buf, &parent, block, extra);
            out.push(parent);
        }
        out
    }

    /// [`Self::hash_block`] serialising into a caller-owned buffer, so a caller hashing many
    /// blocks (a chain, an engine simulator) allocates nothing per block.
    pub fn hash_block_with(
        &self,
        buf: &mut Vec<u8>,
        parent: &Digest,
        tokens: &[u32],
        extra: &[ExtraKey],
    ) -> Digest {
        buf.clear();
        match self.algo {
            VllmHashAlgo::Sha256 => {
                let mut p = Pickler::new(buf);
                encode_block_input(&mut p, parent, tokens, extra);
                p.finish();
            }
            VllmHashAlgo::Sha256Cbor => encode_block_input(&mut Cbor(buf), parent, tokens, extra),
        }
        Sha256::digest(&buf[..]).into()
    }
}

/// The u64 that events carry: low 64 bits of the digest read big-endian (last 8 bytes, BE).
///
/// This is vLLM's `int.from_bytes(digest, "big") & (2**64 - 1)`.
#[must_use]
pub fn event_hash(d: &Digest) -> u64 {
    let mut low = [0u8; 8];
    low.copy_from_slice(&d[24..]);
    u64::from_be_bytes(low)
}

/// Emits vLLM's hash input `(parent, tuple(tokens), tuple(extra) or None)` into an encoder.
fn encode_block_input<'a, E: Encoder<'a>>(
    e: &mut E,
    parent: &'a Digest,
    tokens: &[u32],
    extra: &'a [ExtraKey],
) {
    e.tuple_begin(3);
    e.bytes(parent);
    e.tuple_begin(tokens.len());
    for &t in tokens {
        e.int(i64::from(t));
    }
    e.tuple_end(tokens.len());
    if extra.is_empty() {
        e.none();
    } else {
        e.tuple_begin(extra.len());
        for key in extra {
            match key {
                ExtraKey::Lora { name, path } => {
                    e.tuple_begin(3);
                    e.str(PyStr::Literal("lora"));
                    e.str(PyStr::Value(name));
                    e.str(PyStr::Value(path));
                    e.tuple_end(3);
                }
                ExtraKey::Mm { id, offset } => {
                    e.tuple_begin(3);
                    e.str(PyStr::Literal("mm"));
                    e.str(PyStr::Value(id));
                    e.int(*offset);
                    e.tuple_end(3);
                }
                ExtraKey::CacheSalt(salt) => {
                    e.tuple_begin(2);
                    e.str(PyStr::Literal("cache_salt"));
                    e.str(PyStr::Value(salt));
                    e.tuple_end(2);
                }
            }
        }
        e.tuple_end(extra.len());
    }
    e.tuple_end(3);
}

/// A Python `str` in a hash input, with what the pickler needs to know about its *identity*.
///
/// Pickle memoizes objects by identity: the second occurrence of the *same object* in one pickle
/// is written as a memo reference (`BINGET n`), not serialised again, which changes the bytes and
/// so the hash. Which strings are the same object is a CPython detail, modelled here as:
/// * a `Literal` (a constant in vLLM's source, such as the `"mm"` tag) is one object per content,
///   so two `("mm", id, offset)` keys in one block share the tag;
/// * a `Value` (request data: LoRA name and path, mm id, salt) is a fresh object, except that
///   CPython shares the empty string and every one-character string below U+0100 (so a salt
///   `"a"` next to a LoRA name `"a"` is one object).
///
/// Not modelled: two equal longer runtime strings that happen to be one object (for example a
/// LoRA name reused as its path by the same Python object). The parent digest is the only
/// `bytes` and the token ints are never memoized, so nothing else in a hash input can repeat.
/// CBOR has no memo, so it ignores the distinction.
#[derive(Debug, Clone, Copy)]
enum PyStr<'a> {
    Literal(&'a str),
    Value(&'a str),
}

impl<'a> PyStr<'a> {
    fn as_str(self) -> &'a str {
        match self {
            PyStr::Literal(s) | PyStr::Value(s) => s,
        }
    }

    /// Whether a second occurrence of this content can be the *same* object, and so be found
    /// in the pickle memo. Equal shareable strings are always one object: a literal and a
    /// singleton with the same content are the same singleton too.
    fn shareable(self) -> bool {
        match self {
            PyStr::Literal(_) => true,
            PyStr::Value(s) => {
                let mut chars = s.chars();
                match (chars.next(), chars.next()) {
                    (None, _) => true,
                    (Some(c), None) => u32::from(c) < 0x100,
                    _ => false,
                }
            }
        }
    }
}

/// The few Python values a vLLM hash input is made of, written in order. A tuple is bracketed by
/// `tuple_begin(n)` / `tuple_end(n)` around its `n` elements, because pickle needs the length
/// after the elements and CBOR before them.
trait Encoder<'a> {
    fn none(&mut self);
    fn int(&mut self, v: i64);
    fn bytes(&mut self, b: &'a [u8]);
    fn str(&mut self, s: PyStr<'a>);
    fn tuple_begin(&mut self, len: usize);
    fn tuple_end(&mut self, len: usize);
}

// ---- pickle protocol 5, byte-identical to CPython 3.11's `pickle.dumps(x, protocol=5)` ----

mod op {
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
struct Pickler<'a, 'o> {
    out: &'o mut Vec<u8>,
    /// Where the open frame's 9-byte header placeholder starts.
    frame_start: usize,
    /// Number of memoized objects so far (the next memo index).
    memo_len: u32,
    /// Memo indices of the strings that can recur as the same object (see [`PyStr`]).
    shared: SmallVec<[(&'a str, u32); 4]>,
}

impl<'a, 'o> Pickler<'a, 'o> {
    fn new(out: &'o mut Vec<u8>) -> Self {
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

    fn finish(mut self) {
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

// ---- canonical CBOR, byte-identical to `cbor2.dumps(x, canonical=True)` ----

/// CBOR encoder: tuples are definite-length arrays, `bytes` a byte string, `str` a text string,
/// `None` is `0xf6`, and ints use major type 0/1 with the shortest length form (canonical CBOR).
struct Cbor<'o>(&'o mut Vec<u8>);

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

#[cfg(test)]
mod tests {
    use super::*;

    /// A Python value for serialiser tests: drives an [`Encoder`] like a hash input does.
    #[derive(Debug)]
    enum Value {
        None,
        Int(i64),
        Bytes(Vec<u8>),
        Str(String),
        /// A source-code constant (one object per content), see [`PyStr`].
        Lit(String),
        Tuple(Vec<Value>),
    }

    fn drive<'a, E: Encoder<'a>>(e: &mut E, v: &'a Value) {
        match v {
            Value::None => e.none(),
            Value::Int(i) => e.int(*i),
            Value::Bytes(b) => e.bytes(b),
            Value::Str(s) => e.str(PyStr::Value(s)),
            Value::Lit(s) => e.str(PyStr::Literal(s)),
            Value::Tuple(items) => {
                e.tuple_begin(items.len());
                for item in items {
                    drive(e, item);
                }
                e.tuple_end(items.len());
            }
        }
    }

    fn pickle(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        let mut p = Pickler::new(&mut out);
        drive(&mut p, v);
        p.finish();
        out
    }

    fn cbor(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        drive(&mut Cbor(&mut out), v);
        out
    }

    fn tuple(items: Vec<Value>) -> Value {
        Value::Tuple(items)
    }

    fn s(x: &str) -> Value {
        Value::Str(x.to_owned())
    }

    fn sha_hex(bytes: &[u8]) -> String {
        hex::encode(Sha256::digest(bytes))
    }

    // ---- serialiser vectors, produced by CPython 3.11 `pickle.dumps(x, protocol=5)` and
    // ---- cbor2 6.3 `cbor2.dumps(x, canonical=True)`

    const INTS: [i64; 22] = [
        0,
        1,
        127,
        128,
        255,
        256,
        65535,
        65536,
        -1,
        -128,
        -129,
        -256,
        (1 << 31) - 1,
        -(1 << 31),
        1 << 31,
        -(1 << 31) - 1,
        1 << 32,
        4_294_967_295,
        i64::MAX,
        i64::MIN,
        (1 << 40) + 5,
        -(1 << 47),
    ];

    #[test]
    fn ints_of_every_size_class_match_python() {
        let v = tuple(INTS.iter().map(|&i| Value::Int(i)).collect());
        let expected_pickle = concat!(
            "8005957700000000000000284b004b014b7f4b804bff4d00014dffff4a000001004affffffff4a80ffff",
            "ff4a7fffffff4a00ffffff4affffff7f4a000000808a0500000080008a05ffffff7fff8a050000000001",
            "8a05ffffffff008a08ffffffffffffff7f8a0800000000000000808a060500000000018a060000000000",
            "8074942e",
        );
        let expected_cbor = concat!(
            "960001187f188018ff19010019ffff1a0001000020387f388038ff1a7fffffff3a7fffffff1a80000000",
            "3a800000001b00000001000000001affffffff1b7fffffffffffffff3b7fffffffffffffff1b00000100",
            "000000053b00007fffffffffff",
        );
        assert_eq!(hex::encode(pickle(&v)), expected_pickle);
        assert_eq!(hex::encode(cbor(&v)), expected_cbor);
    }

    #[test]
    fn long_strings_bytes_and_small_tuples_match_python() {
        // ("é"*150 + "x", b"\x01\x02"*150, None, (), (7,), ("€", None))
        let v = tuple(vec![
            Value::Str(format!("{}x", "é".repeat(150))),
            Value::Bytes([1u8, 2].repeat(150)),
            Value::None,
            tuple(vec![]),
            tuple(vec![Value::Int(7)]),
            tuple(vec![s("€"), Value::None]),
        ]);
        let expected_pickle = [
            "800595780200000000000028",
            "582d010000",
            &"c3a9".repeat(150),
            "7894",
            "422c010000",
            &"0102".repeat(150),
            "944e294b0785948c03e282ac944e869474942e",
        ]
        .concat();
        let expected_cbor = [
            "8679012d",
            &"c3a9".repeat(150),
            "7859012c",
            &"0102".repeat(150),
            "f68081078263e282acf6",
        ]
        .concat();
        assert_eq!(hex::encode(pickle(&v)), expected_pickle);
        assert_eq!(hex::encode(cbor(&v)), expected_cbor);
    }

    #[test]
    fn pickle_memo_refers_back_to_shared_strings() {
        // Python: a = json.loads('["a","a","","","ab","ab"]'); lit = "mm"
        //         (*a, (lit, "x", 1), (lit, "y", 2)): one-character and empty strings are
        //         CPython singletons and so are literals, "ab" twice is two objects.
        let v = tuple(vec![
            s("a"),
            s("a"),
            s(""),
            s(""),
            s("ab"),
            s("ab"),
            tuple(vec![Value::Lit("mm".into()), s("x"), Value::Int(1)]),
            tuple(vec![Value::Lit("mm".into()), s("y"), Value::Int(2)]),
        ]);
        assert_eq!(
            hex::encode(pickle(&v)),
            concat!(
                "8005953000000000000000288c01619468008c009468018c026162948c026162948c026d6d948c01",
                "78944b01879468048c0179944b02879474942e",
            )
        );
        assert_eq!(
            hex::encode(cbor(&v)),
            "8861616161606062616262616283626d6d61780183626d6d617902"
        );
    }

    #[test]
    fn pickle_splits_frames_at_64_kib_like_python() {
        // tuple(range(30000)): two frames, of 65538 and 24210 bytes.
        let v = tuple((0..30000).map(Value::Int).collect());
        let p = pickle(&v);
        assert_eq!(p.len(), 89768);
        assert_eq!(hex::encode(&p[..12]), "800595020001000000000028");
        assert_eq!(p[65549], op::FRAME);
        assert_eq!(
            u64::from_le_bytes(p[65550..65558].try_into().unwrap()),
            24210
        );
        assert_eq!(
            sha_hex(&p),
            "1a53b16e73d3a5de19dbf0900cc72c1eaf5506f502c58c718f543621f25aa560"
        );
        let c = cbor(&v);
        assert_eq!(c.len(), 89723);
        assert_eq!(
            sha_hex(&c),
            "54b8b69a82a13d9489f613ed11e5dc328df13fc68b519dbcdeaa9d362baea464"
        );
    }

    #[test]
    fn pickle_writes_large_payloads_between_frames_like_python() {
        let big = "ab".repeat(35000);
        // ("ab"*35000, 1): the empty frame before the string vanishes, its memo opcode opens the
        // next frame.
        let p = pickle(&tuple(vec![s(&big), Value::Int(1)]));
        assert_eq!(p.len(), 70022);
        assert_eq!(hex::encode(&p[..7]), "80055870110100");
        assert_eq!(
            hex::encode(&p[p.len() - 15..]),
            "950600000000000000944b0186942e"
        );
        assert_eq!(
            sha_hex(&p),
            "12b88f142ba32ce811c9c07d0ae2edc78d5e00f49a074c388e0e00c6966742cd"
        );
        // (1, "ab"*35000): a 2-byte frame before the string is written without FRAME header.
        let p = pickle(&tuple(vec![Value::Int(1), s(&big)]));
        assert_eq!(hex::encode(&p[..9]), "80054b015870110100");
        assert_eq!(
            sha_hex(&p),
            "f82bf1dabf0018612c6cec65df6133a4416778add623700c61281e6e547c2310"
        );
    }

    #[test]
    fn none_hash_input_matches_python() {
        // pickle.dumps("vllm-none-hash", protocol=5)
        let mut out = Vec::new();
        let mut p = Pickler::new(&mut out);
        p.str(PyStr::Value(VLLM_NONE_HASH_SEED));
        p.finish();
        assert_eq!(
            hex::encode(&out),
            "80059512000000000000008c0e766c6c6d2d6e6f6e652d68617368942e"
        );
    }

    #[test]
    fn block_input_matches_python() {
        // pickle.dumps((b"\x00" * 32, (0, 70000, 2**31),
        //               (("lora", "n", "/p"), ("cache_salt", "s"))), protocol=5)
        let parent = [0u8; 32];
        let extra = [
            ExtraKey::Lora {
                name: "n".into(),
                path: "/p".into(),
            },
            ExtraKey::CacheSalt("s".into()),
        ];
        let mut out = Vec::new();
        let mut p = Pickler::new(&mut out);
        encode_block_input(&mut p, &parent, &[0, 70000, 1 << 31], &extra);
        p.finish();
        let expected = [
            "8005955d000000000000004320",
            &"00".repeat(32),
            "944b004a701101008a050000008000",
            "87948c046c6f7261948c016e948c022f7094",
            "87948c0a63616368655f73616c74948c017394",
            "8694869487942e",
        ]
        .concat();
        assert_eq!(hex::encode(&out), expected);
    }

    /// Cross-checks both serialisers against CPython on many random values (ints of all size
    /// classes, strings up to 70,000 bytes, tuples up to 30,000 items, shared strings). Needs
    /// `python3` with `cbor2`; run with `cargo test -p kvroute-core --lib hashing -- --ignored`
    /// (`KVROUTE_PY_SEED=n` picks another random seed).
    #[test]
    #[ignore = "needs python3 with cbor2"]
    fn serialisers_match_python_on_random_values() {
        const SCRIPT: &str = r#"
import json, pickle, random, sys, cbor2
r = random.Random(int(sys.argv[1]))
ALPHA = ["a", "b", "\u00e9", "\u00ff", "\u0100", "\u20ac", "\U0001d11e", "\x00", "z"]
def rint():
    k = r.choice([1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 40, 56, 63])
    v = r.getrandbits(k)
    return -v - r.randint(0, 1) if r.random() < 0.4 else v
def rstr():
    n = r.choice([0, 1, 1, 1, 2, 3, 10, 84, 85, 86, 255, 256, 300, 1000, 21846, 70000])
    return "".join(r.choice(ALPHA) for _ in range(n))
def rval(depth):
    c = r.random()
    if depth > 8: return rint() if c < 0.8 else r.choice(["", "a", "\u00e9", "ab"])
    if depth > 3 or c < 0.35: return rint()
    if c < 0.50: return rstr()
    if c < 0.55: return {"lit": r.choice(["lora", "mm", "cache_salt", "a"])}
    if c < 0.60: return None
    if c < 0.65: return {"b": r.randbytes(r.choice([2, 32, 255, 256, 1000, 65536])).hex()}
    n = r.choice([0, 1, 2, 3, 4, 5, 16] + ([64, 300, 20000, 30000] if depth == 0 else []))
    return [rval(depth + 1 if n <= 16 else 9) for _ in range(n)]
LIT = {}
def conv(v):
    if isinstance(v, list): return tuple(conv(x) for x in v)
    if isinstance(v, dict):
        if "lit" in v: return LIT.setdefault(v["lit"], v["lit"])
        return bytes.fromhex(v["b"])
    return v
for _ in range(int(sys.argv[2])):
    LIT.clear()
    spec = json.dumps(rval(0))
    x = conv(json.loads(spec))
    p, c = pickle.dumps(x, protocol=5), cbor2.dumps(x, canonical=True)
    print(json.dumps({"spec": spec, "pickle": p.hex(), "cbor": c.hex()}))
"#;
        fn from_json(j: &serde_json::Value) -> Value {
            match j {
                serde_json::Value::Null => Value::None,
                serde_json::Value::Number(n) => Value::Int(n.as_i64().expect("i64")),
                serde_json::Value::String(x) => Value::Str(x.clone()),
                serde_json::Value::Array(items) => {
                    Value::Tuple(items.iter().map(from_json).collect())
                }
                serde_json::Value::Object(m) => match (m.get("lit"), m.get("b")) {
                    (Some(l), _) => Value::Lit(l.as_str().unwrap().to_owned()),
                    (_, Some(b)) => Value::Bytes(hex::decode(b.as_str().unwrap()).unwrap()),
                    _ => panic!("bad spec {m:?}"),
                },
                serde_json::Value::Bool(_) => panic!("no bools in hash inputs"),
            }
        }
        let seed = std::env::var("KVROUTE_PY_SEED").unwrap_or_else(|_| "20260501".into());
        let output = std::process::Command::new("python3")
            .args(["-c", SCRIPT, &seed, "400"])
            .output()
            .expect("python3 must be installed for this test");
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let mut checked = 0;
        for line in String::from_utf8(output.stdout).unwrap().lines() {
            let rec: serde_json::Value = serde_json::from_str(line).unwrap();
            let spec: serde_json::Value =
                serde_json::from_str(rec["spec"].as_str().unwrap()).unwrap();
            let v = from_json(&spec);
            let case = format!("case {checked}");
            assert_same_bytes(
                &pickle(&v),
                rec["pickle"].as_str().unwrap(),
                &format!("pickle, {case}"),
            );
            assert_same_bytes(
                &cbor(&v),
                rec["cbor"].as_str().unwrap(),
                &format!("cbor, {case}"),
            );
            checked += 1;
        }
        assert_eq!(checked, 400);
    }

    /// Compares serialised bytes with Python's hex, reporting only the first difference (the
    /// random inputs are far too large to print whole).
    fn assert_same_bytes(got: &[u8], want_hex: &str, what: &str) {
        let want = hex::decode(want_hex).unwrap();
        if got == want {
            return;
        }
        let at = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        let window = |b: &[u8]| hex::encode(&b[at.saturating_sub(16)..(at + 16).min(b.len())]);
        panic!(
            "{what}: lengths {} (rust) vs {} (python), first difference at byte {at}:\n  \
             rust   {}\n  python {}",
            got.len(),
            want.len(),
            window(got),
            window(&want)
        );
    }

    // ---- kvroute chain internals

    /// The stack-buffer/streaming implementation hashes exactly `parent LE ++ tokens LE`.
    #[test]
    fn chain_hash_is_xxh3_of_parent_and_token_bytes_for_all_lengths() {
        let tokens: Vec<u32> = (0..1000u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        for len in [0, 1, 15, 16, 17, 63, 64, 65, 128, 129, 1000] {
            let block = &tokens[..len];
            let mut bytes = 0xdead_beef_u64.to_le_bytes().to_vec();
            for t in block {
                bytes.extend_from_slice(&t.to_le_bytes());
            }
            assert_eq!(
                chain_hash(0xdead_beef, block, 0),
                xxh3_64(&bytes),
                "len {len}"
            );
        }
    }

    #[test]
    fn extra_zero_is_no_extra_and_other_extras_differ() {
        let t = [1, 2, 3, 4];
        let plain = chain_hash(7, &t, 0);
        assert_ne!(chain_hash(7, &t, 1), plain);
        assert_ne!(chain_hash(7, &t, 1), chain_hash(7, &t, 2));
    }
}
