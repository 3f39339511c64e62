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
