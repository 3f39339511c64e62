"""fastokens vs Hugging Face ``tokenizers`` on the DeepSeek tokenizer: same ids? how fast?

For prompts of about 1K, 8K and 32K tokens (fresh random text each call, chat-rendered with
kvroute's default template, so special tokens are included) it checks that both give identical ids
and times one encode each (median of ``--reps``). Then a growing 20-turn conversation is encoded
turn by turn, whole history each time, as the router does, with fastokens' segment cache off and on.

    python benches/tokenizer_compare.py          # about 20 seconds
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import fastokens

from kvroute.chat_template import ChatTemplate
from kvroute.tokenization import Tokenizer, default_tokenizer_path

WORDS = [
    *("the", "router", "sends", "each", "request", "to", "engine", "holding", "its", "prefix", "日本語"),
    *("cache", "token", "block", "überall", "naïve", "🎉", "def", "f(x):", "return", "x**2", "\n", "  "),
]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    path = str(default_tokenizer_path())
    hf = Tokenizer(path)
    fast = fastokens.Tokenizer.from_file(path)
    template = ChatTemplate()
    rng = random.Random(0)
    fast.encode_batch_flat(["warm up"])
    ratio = len(hf.encode(text(rng, 2000))) / 2000
    print(f"tokenizer: {path}")
    for target in (1024, 8192, 32768):
        t_hf, t_fast, same = [], [], 0
        n = 0
        for _ in range(args.reps):
            msgs = [
                {"role": "system", "content": text(rng, int(target / ratio) // 4)},
                {"role": "user", "content": text(rng, int(target / ratio) * 3 // 4)},
            ]
            prompt = template.render(msgs)
            t0 = time.perf_counter()
            ids = hf.encode(prompt, add_special_tokens=False)
            t1 = time.perf_counter()
            flat, _ = fast.encode_batch_flat([prompt], add_special_tokens=False)
            t2 = time.perf_counter()
            t_hf.append(t1 - t0)
            t_fast.append(t2 - t1)
            same += memoryview(flat).cast("I").tolist() == ids
            n = len(ids)
        print(
            f"~{n:>6} tokens: identical {same}/{args.reps}; "
            f"HF tokenizers {1e3 * statistics.median(t_hf):7.2f} ms, "
            f"fastokens {1e3 * statistics.median(t_fast):6.3f} ms (median)"
        )
    for cache in (False, True):
        fast = fastokens.Tokenizer.from_file(path)
        fast.encode_batch_flat(["warm up"])
        if cache:
            fast.enable_segment_cache(64 << 20)
        msgs = [{"role": "system", "content": text(rng, 1500)}]
        total = 0.0
        for _ in range(20):
            msgs.append({"role": "user", "content": text(rng, 300)})
            prompt = template.render(msgs)
            t0 = time.perf_counter()
            fast.encode_batch_flat([prompt], add_special_tokens=False)
            total += time.perf_counter() - t0
            msgs.append({"role": "assistant", "content": text(rng, 200)})
        n = len(hf.encode(prompt, add_special_tokens=False))
        print(
            f"20-turn conversation (last turn {n} tokens), segment cache {'on ' if cache else 'off'}: "
            f"{1e3 * total / 20:.3f} ms per turn (mean)"
        )


if __name__ == "__main__":
    main()
