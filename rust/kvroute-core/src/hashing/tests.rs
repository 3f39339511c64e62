use sha2::{Digest as _, Sha256};

use super::cbor::Cbor;
use super::encoder::{Encoder, PyStr};
use super::pickle::{op, Pickler};
use super::vllm::{encode_block_input, VLLM_NONE_HASH_SEED};
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
            serde_json::Value::Array(items) => Value::Tuple(items.iter().map(from_json).collect()),
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
        let spec: serde_json::Value = serde_json::from_str(rec["spec"].as_str().unwrap()).unwrap();
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
