"""Router-side tokenization: the ids the engine will prefill, as a buffer, fast or reference."""

from __future__ import annotations

import random
from array import array
from pathlib import Path

import pytest
from tests.router_support import async_test

from kvroute.chat_template import ChatTemplate
from kvroute.prompts import PromptEncoder, load_tokenizer_files
from kvroute.tokenization import Tokenizer, default_tokenizer_path

WORDS = [
    *("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "日本語", "中文", "ÄÖÜ", "🎉"),
    *("def", "return", "{x}", "3.14", "\n\t", "", ""),
]


@pytest.fixture(scope="module")
def fast() -> PromptEncoder:
    return PromptEncoder(load_tokenizer_files(None, None), "auto")


@pytest.fixture(scope="module")
def reference() -> Tokenizer:
    return Tokenizer(default_tokenizer_path())


def conversation(rng: random.Random, turns: int) -> list[dict[str, object]]:
    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    msgs: list[dict[str, object]] = [{"role": "system", "content": text(50)}]
    for _ in range(turns):
        msgs.append({"role": "user", "content": text(rng.randint(1, 200))})
        msgs.append({"role": "assistant", "content": text(rng.randint(1, 100))})
    msgs.append(
        {"role": "user", "content": [{"type": "text", "text": text(20)}, {"type": "text", "text": "x"}]}
    )
    return msgs


def test_auto_picks_fastokens_when_identical(fast: PromptEncoder) -> None:
    assert fast.backend == "fastokens"
    assert fast.segment_cache_stats() is not None


@async_test()
async def test_chat_ids_equal_the_reference(fast: PromptEncoder, reference: Tokenizer) -> None:
    rng = random.Random(7)
    template = ChatTemplate()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for i in range(30):
        msgs = conversation(rng, rng.randint(0, 6))
        kw = {"tools": tools if i % 3 == 0 else None, "add_generation_prompt": i % 2 == 0}
        prompt = await fast.chat(msgs, **kw)  # type: ignore[arg-type]
        expected = reference.encode(template.render(msgs, **kw), add_special_tokens=False)  # type: ignore[arg-type]
        assert array("I", prompt.tokens).tolist() == expected
        assert prompt.exact
        assert prompt.count == len(expected)


@async_test()
async def test_long_prompt_is_encoded_off_the_loop_and_identical(
    fast: PromptEncoder, reference: Tokenizer
) -> None:
    rng = random.Random(1)
    text = " ".join(rng.choice(WORDS) for _ in range(60_000))
    prompt = await fast.completion(text)
    assert array("I", prompt.tokens).tolist() == reference.encode(text)


@async_test()
async def test_hf_backend_matches_and_inexact_requests_still_get_ids(reference: Tokenizer) -> None:
    hf = PromptEncoder(load_tokenizer_files(None, None), "hf")
    assert hf.backend == "hf"
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {}}]}
    ]
    p = await hf.chat(msgs, non_text=True)
    assert not p.exact
    assert p.count > 0
    bad = await hf.chat([{"role": "narrator", "content": "hello there"}])  # the template raises
    assert not bad.exact
    assert array("I", bad.tokens).tolist() == reference.encode("hello there", add_special_tokens=False)


def test_from_ids() -> None:
    assert PromptEncoder.from_ids([1, 2, 3]).tokens == array("I", [1, 2, 3]).tobytes()
    assert not PromptEncoder.from_ids([2**40]).exact


def test_tokenizer_folder_with_template_and_specials(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes(default_tokenizer_path().read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}",'
        ' "bos_token": {"content": "<B>"}, "eos_token": "<E>"}'
    )
    files = load_tokenizer_files(str(tmp_path), None)
    assert files.template.render([{"role": "user", "content": "hi"}]) == "<B>[user]hi"
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}!")
    files = load_tokenizer_files(str(tmp_path), str(tmp_path / "t.jinja"))
    assert files.template.render([{"role": "user", "content": "hi"}]) == "hi!"
    with pytest.raises(FileNotFoundError):
        load_tokenizer_files(str(tmp_path / "missing"), None)
