//! Token ids and block hashes cross into Rust as buffers, never as per-element Python objects.
//!
//! Accepted for a sequence of `T` (u32 token ids or u64 hashes), fastest first:
//! * `bytes`: read in place as little-endian words (length must be a multiple of the word size);
//! * any buffer of unsigned `T`-sized items in native byte order (`array('I')` / `array('Q')`,
//!   NumPy `uint32` / `uint64`, also strided or non-contiguous): one copy;
//! * any byte buffer (`bytearray`, `memoryview`, NumPy `uint8`): little-endian words, like bytes;
//! * a buffer with an explicit byte order (`'<I'`, `'>Q'`, NumPy `'>u4'`...): decoded accordingly;
//! * a `list`/`tuple` (or other sequence) of ints: the slow fallback, one conversion per item.
//!
//! Wrong dtypes, shapes or lengths raise `InvalidArgumentError` (a `ValueError`); objects that are
//! neither buffers nor sequences of ints raise `TypeError`.
//!
//! PyO3's own format check is not used alone: in 0.27 it treats `'>'` (big-endian) as the native
//! order on little-endian machines, so explicit-order formats always take the decoding path.
use std::borrow::Cow;

use pyo3::buffer::{Element, PyBuffer};
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyMemoryView, PyTuple};

use crate::errors::invalid_argument;

/// An unsigned word type that can be read from a buffer.
pub(crate) trait Word: Element + Copy {
    const SIZE: usize;
    const DTYPE: &'static str;
    fn from_bytes(b: &[u8], order: Order) -> Self;
    fn extract_vec(obj: &Bound<'_, PyAny>) -> PyResult<Vec<Self>>;
}

/// Byte order of buffer items.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Order {
    Native,
    Little,
    Big,
}

macro_rules! word {
    ($t:ty, $dtype:literal) => {
        impl Word for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            const DTYPE: &'static str = $dtype;
            fn from_bytes(b: &[u8], order: Order) -> Self {
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(b);
                match order {
                    Order::Native => <$t>::from_ne_bytes(a),
                    Order::Little => <$t>::from_le_bytes(a),
                    Order::Big => <$t>::from_be_bytes(a),
                }
            }
            fn extract_vec(obj: &Bound<'_, PyAny>) -> PyResult<Vec<Self>> {
                obj.extract()
            }
        }
    };
}
word!(u32, "uint32");
word!(u64, "uint64");

/// Token ids (`uint32`) from `obj`; `what` names the argument in error messages.
pub(crate) fn tokens(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u32>> {
    words(obj, what)
}

/// Block hashes (`uint64`) from `obj`.
pub(crate) fn hashes(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    words(obj, what)
}

fn words<T: Word>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<T>> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return decode(b.as_bytes(), Order::Little, what);
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        return sequence(obj, what);
    }
    if let Ok(buf) = PyBuffer::<T>::get(obj) {
        if implicit_order(buf.format().to_bytes()) {
            check_ndim(buf.dimensions(), what)?;
            return buf.to_vec(obj.py());
        }
    } else if let Ok(buf) = PyBuffer::<u8>::get(obj) {
        check_ndim(buf.dimensions(), what)?;
        return decode(&buf.to_vec(obj.py())?, Order::Little, what);
    }
    match PyMemoryView::from(obj) {
        Ok(mv) => from_memoryview(&mv, what),
        Err(_) => sequence(obj, what),
    }
}

/// Whether a struct format string has no explicit byte order (so it is the native one).
fn implicit_order(fmt: &[u8]) -> bool {
    !matches!(fmt.first(), Some(b'<' | b'>' | b'!'))
}

fn check_ndim(ndim: usize, what: &str) -> PyResult<()> {
    if ndim == 1 {
        Ok(())
    } else {
        Err(invalid_argument(format!(
            "{what} must be one-dimensional, got {ndim} dimensions"
        )))
    }
}

/// Words from raw bytes; the length must be a multiple of the word size.
fn decode<T: Word>(raw: &[u8], order: Order, what: &str) -> PyResult<Vec<T>> {
    if raw.len() % T::SIZE != 0 {
        return Err(invalid_argument(format!(
            "{what}: a byte buffer must hold whole {} words ({}-byte little-endian), got {} bytes",
            T::DTYPE,
            T::SIZE,
            raw.len()
        )));
    }
    Ok(raw
        .chunks_exact(T::SIZE)
        .map(|c| T::from_bytes(c, order))
        .collect())
}

/// The slow buffer path: any unsigned format of the right size, in any byte order.
fn from_memoryview<T: Word>(mv: &Bound<'_, PyMemoryView>, what: &str) -> PyResult<Vec<T>> {
    let py = mv.py();
    let fmt: String = mv.getattr(intern!(py, "format"))?.extract()?;
    let itemsize: usize = mv.getattr(intern!(py, "itemsize"))?.extract()?;
    check_ndim(mv.getattr(intern!(py, "ndim"))?.extract()?, what)?;
    let order = item_order(&fmt, itemsize, T::SIZE).ok_or_else(|| {
        invalid_argument(format!(
            "{what} must be {} (or raw bytes), got buffer format {fmt:?} with itemsize {itemsize}",
            T::DTYPE
        ))
    })?;
    let raw = mv.call_method0(intern!(py, "tobytes"))?;
    decode(raw.cast::<PyBytes>()?.as_bytes(), order, what)
}

/// The byte order to read items of `fmt` as `size`-byte words, if the format is an unsigned
/// integer of that size (or single bytes, read as little-endian words).
fn item_order(fmt: &str, itemsize: usize, size: usize) -> Option<Order> {
    let (order, code) = match fmt.as_bytes() {
        [c] | [b'@', c] | [b'=', c] => (Order::Native, *c),
        [b'<', c] => (Order::Little, *c),
        [b'>' | b'!', c] => (Order::Big, *c),
        _ => return None,
    };
    match code {
        b'B' | b'c' if itemsize == 1 => Some(Order::Little),
        b'H' | b'I' | b'L' | b'Q' | b'N' if itemsize == size => Some(order),
        _ => None,
    }
}

/// The fallback for lists, tuples and other sequences of ints.
fn sequence<T: Word>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<T>> {
    T::extract_vec(obj).map_err(|e| {
        let py = obj.py();
        if e.is_instance_of::<PyOverflowError>(py) {
            invalid_argument(format!("{what}: every value must fit in {}", T::DTYPE))
        } else {
            PyTypeError::new_err(format!(
                "{what} must be a {} buffer or a sequence of ints, got {}: {e}",
                T::DTYPE,
                obj.get_type()
                    .name()
                    .map_or_else(|_| "?".into(), |n| n.to_string())
            ))
        }
    })
}

/// A KV-event payload: `bytes` borrowed in place, any other byte buffer copied once.
pub(crate) fn payload<'a>(obj: &'a Bound<'_, PyAny>) -> PyResult<Cow<'a, [u8]>> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(Cow::Borrowed(b.as_bytes()));
    }
    match PyBuffer::<u8>::get(obj) {
        Ok(buf) => Ok(Cow::Owned(buf.to_vec(obj.py())?)),
        Err(_) => Err(PyTypeError::new_err(
            "payload must be bytes or a byte buffer (bytearray, memoryview)",
        )),
    }
}

/// `hashes` as one `bytes` object of little-endian u64 words (accepted back by every method).
pub(crate) fn hashes_to_bytes<'py>(
    py: Python<'py>,
    hashes: &[u64],
) -> PyResult<Bound<'py, PyBytes>> {
    PyBytes::new_with(py, hashes.len() * 8, |buf| {
        for (dst, h) in buf.chunks_exact_mut(8).zip(hashes) {
            dst.copy_from_slice(&h.to_le_bytes());
        }
        Ok(())
    })
}
