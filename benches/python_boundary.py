#!/usr/bin/env python3
"""The routing decision as the router makes it: one Python call per request.

Builds a `PrefixIndex` from real vLLM-format KV-event payloads (16 workers, about one million
resident (block, worker) entries, prefix-sharing sequences like `shared/bench`'s workload), then
times `Scheduler.select_and_reserve(tokens)` + `release` for 8,192- and 32,768-token prompts,
with token ids in a NumPy uint32 array, an `array('I')`, `bytes`, and (for contrast) a list.

Run: `python benches/python_boundary.py [--entries 1000000] [--calls 3000] [--out FILE]`
(`taskset -c 0` for single-core figures). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from array import array

import msgpack
import numpy as np

import kvroute

BS = 16


def payload(parent: int | None, hashes: list[int], tokens: np.ndarray) -> bytes:
    ev = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens.tolist(),
        "block_size": BS,
        "medium": "GPU",
    }
    return msgpack.packb([time.time(), [ev], 0])


def build(
    workers: int, entries: int, seq_blocks: int, seed: int
) -> tuple[kvroute.PrefixIndex, list[np.ndarray]]:
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    idx = kvroute.PrefixIndex()
    seqs: list[tuple[int, np.ndarray, list[int]]] = []
    held: list[set[int]] = [set() for _ in range(workers)]
    total = 0
    while total < entries:
        if seqs and rng.random() < 0.8:
            pw, ptoks, peng = rng.choice(seqs)
            b = rng.randint(1, seq_blocks - 1)
            toks = np.concatenate(
                [ptoks[: b * BS], nrng.integers(0, 128_000, (seq_blocks - b) * BS, dtype=np.uint32)]
            )
            eng = peng[:b] + [rng.getrandbits(64) for _ in range(seq_blocks - b)]
            w = pw if rng.random() < 0.5 else rng.randrange(workers)
        else:
            toks = nrng.integers(0, 128_000, seq_blocks * BS, dtype=np.uint32)
            eng = [rng.getrandbits(64) for _ in range(seq_blocks)]
            w = rng.randrange(workers)
        k = 0
        while k < seq_blocks and eng[k] in held[w]:
            k += 1
        parent = eng[k - 1] if k else None
        for s in range(k, seq_blocks, 32):
            e = min(s + 32, seq_blocks)
            idx.apply(w, payload(parent, eng[s:e], toks[s * BS : e * BS]))
            parent = eng[e - 1]
        held[w].update(eng[k:])
        total += seq_blocks - k
        seqs.append((w, toks, eng))
    return idx, [t for _, t, _ in seqs[-64:]]


def median_us(ns: list[int]) -> dict[str, float]:
    s = sorted(ns)
    return {
        "median_us": round(statistics.median(s) / 1000, 2),
        "p99_us": round(s[int(0.99 * (len(s) - 1))] / 1000, 2),
    }


def time_decisions(sched: kvroute.Scheduler, prompts: list[object], calls: int) -> dict[str, float]:
    for p in prompts[:50]:
        sched.release(sched.select_and_reserve(p, expected_output_tokens=128, now_ns=1).reservation, now_ns=1)
    pc = time.perf_counter_ns
    ns = []
    for i in range(calls):
        p = prompts[i % len(prompts)]
        t0 = pc()
        d = sched.select_and_reserve(p, expected_output_tokens=128, now_ns=1)
        sched.release(d.reservation, now_ns=1)
        ns.append(pc() - t0)
    return median_us(ns)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out: dict[str, object] = {"entries_target": a.entries}
    for workers, tokens in ((16, 8192), (16, 32768), (64, 8192)):
        t0 = time.perf_counter()
        idx, seqs = build(workers, a.entries, tokens // BS, a.seed)
        build_s = time.perf_counter() - t0
        sched = kvroute.Scheduler(idx, "kvroute")
        for w in range(workers):
            sched.upsert_worker(w, capacity_blocks=25_000)
        key = f"{workers}w_{tokens}tok"
        res: dict[str, object] = {
            "index": {
                k: v for k, v in idx.stats().items() if k in ("entries", "blocks", "nodes", "bytes_per_entry")
            }
        }
        res["build_s"] = round(build_s, 1)
        res["numpy_uint32"] = time_decisions(sched, list(seqs), a.calls)
        res["array_I"] = time_decisions(sched, [array("I", s.tobytes()) for s in seqs], a.calls)
        res["bytes"] = time_decisions(sched, [s.tobytes() for s in seqs], a.calls)
        res["list_of_int"] = time_decisions(sched, [s.tolist() for s in seqs], max(200, a.calls // 10))
        out[key] = res
        print(key, json.dumps(res), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
