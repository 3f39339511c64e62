//! The few Python values a vLLM hash input is made of, as the serialisers see them: the
//! [`Encoder`] that pickle and CBOR both implement, and [`PyStr`], a `str` with what pickle needs
//! to know about its identity.

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
pub(super) enum PyStr<'a> {
    Literal(&'a str),
    Value(&'a str),
}

impl<'a> PyStr<'a> {
    pub(super) fn as_str(self) -> &'a str {
        match self {
            PyStr::Literal(s) | PyStr::Value(s) => s,
        }
    }

    /// Whether a second occurrence of this content can be the *same* object, and so be found
    /// in the pickle memo. Equal shareable strings are always one object: a literal and a
    /// singleton with the same content are the same singleton too.
    pub(super) fn shareable(self) -> bool {
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
pub(super) trait Encoder<'a> {
    fn none(&mut self);
    fn int(&mut self, v: i64);
    fn bytes(&mut self, b: &'a [u8]);
    fn str(&mut self, s: PyStr<'a>);
    fn tuple_begin(&mut self, len: usize);
    fn tuple_end(&mut self, len: usize);
}
