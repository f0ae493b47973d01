"""Chat templates: render a GGUF's `tokenizer.chat_template` (Jinja) the way transformers'
`apply_chat_template` does, in jinja2's immutable sandbox, since templates come with untrusted files."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from pyinfer import arguments
from pyinfer.console import one_line
from pyinfer.errors import InvalidArgumentError, ModelFormatError, PyInferError

# Used when a model carries no template (llama.cpp falls back to ChatML too).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Gemma's turns (its files may carry no template; llama.cpp then picks its built-in "gemma" one): the text of
# Google's Gemma 3 template, for text messages. A system message becomes the first user turn's first paragraph.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\\n' }}"
    "{%- endif -%}"
)


class ChatTemplateError(PyInferError):
    """A chat template failed to parse or raised while rendering (e.g. through raise_exception)."""


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """HF's tojson: plain json.dumps, without Jinja's HTML escaping, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except Exception as e:  # a template is untrusted code: whatever breaks in it (RecursionError too) is its fault
        raise ChatTemplateError(f"chat template does not parse: {one_line(e)}") from e


def load_template_file(path: str | Path) -> str:
    """A template override: a Jinja file, or a JSON file (tokenizer_config.json) with a chat_template key."""
    path = Path(path)
    try:
        text = arguments.utf8(f"chat template {path}", path.read_bytes())
    except OSError as e:
        raise InvalidArgumentError(f"{path}: cannot read chat template ({e.strerror})") from e
    if path.suffix == ".json":
        try:
            template = json.loads(text).get("chat_template")
        except (ValueError, RecursionError, AttributeError) as e:
            raise ModelFormatError(f"{path}: not a JSON object with a chat_template") from e
        if not isinstance(template, str):
            raise ModelFormatError(f"{path}: chat_template is missing or not a single string")
        return template
    return text


class ChatTemplate:
    """One chat template with the special token strings it may refer to."""

    def __init__(self, source: str | None = None, bos_token: str = "", eos_token: str = "",
                 **special_tokens: str) -> None:
        self.source = source or CHATML_TEMPLATE
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token, **special_tokens}
        self._template = _compile(self.source)

    @classmethod
    def from_tokenizer(cls, tokenizer, override: str | Path | None = None) -> ChatTemplate:
        """The template of a `pyinfer.formats.tokenizer.Tokenizer`'s file, or the file `override`; for a file without
        one, Gemma's when the vocabulary has its turn tokens, else ChatML."""
        source = load_template_file(override) if override else tokenizer.chat_template
        if source is None and "<start_of_turn>" in tokenizer.tokens:
            source = GEMMA_TEMPLATE

        def text(i):
            return tokenizer.tokens[i] if i is not None else ""

        return cls(source, bos_token=text(tokenizer.bos_id), eos_token=text(tokenizer.eos_id),
                   unk_token=text(tokenizer.unk_id), pad_token=text(tokenizer.pad_id))

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...])."""
        variables = {**self.special_tokens, **kwargs}  # as HF, explicit kwargs win over special tokens
        try:
            return self._template.render(messages=[dict(m) for m in messages], tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except Exception as e:  # untrusted code, as above: TypeError, ZeroDivisionError, RecursionError, ...
            raise ChatTemplateError(f"chat template failed: {one_line(e)}") from e

    def encode(self, tokenizer, messages: Sequence[Mapping[str, Any]],
               content_control_tokens: bool = False) -> list[int]:
        """Prompt tokens of `messages` (a `pyinfer.formats.tokenizer.Tokenizer`'s), ending where the answer begins.
        The template writes BOS itself where the model wants it. Its own control tokens are parsed; those spelled
        inside a message's content stay text (untrusted text must not forge a turn), unless
        content_control_tokens. Only a content that spells one is tokenized apart from the text around it, so
        every other prompt tokenizes exactly as its whole rendered text does."""
        text = self.render(messages, add_generation_prompt=True)
        pattern = tokenizer.control_text
        spelled = [i for i, m in enumerate(messages)
                   if pattern is not None and isinstance(m.get("content"), str) and pattern.search(m["content"])]
        if content_control_tokens or not spelled:
            return tokenizer.encode(text, add_special=False, parse_special=True)
        # render once more with those contents as marks, to learn where the template put them
        nonce = secrets.token_hex(8)
        marks = {i: f"\ue000{nonce}{i}\ue001" for i in spelled}
        marked = self.render([{**m, "content": marks[i]} if i in marks else m for i, m in enumerate(messages)],
                             add_generation_prompt=True)
        pieces = re.split(f"(\ue000{nonce}\\d+\ue001)", marked)  # template text, a mark, template text, ...
        for trimmed in (False, True):  # as given, or trimmed as templates may trim it
            content = {marks[i]: messages[i]["content"].strip() if trimmed else messages[i]["content"] for i in spelled}
            if "".join(content.get(p, p) for p in pieces) != text:
                continue
            ids: list[int] = []
            for p in pieces:
                ids += tokenizer.encode(content.get(p, p), add_special=False, parse_special=p not in content)
            return ids
        raise ChatTemplateError("the chat template rewrites a message that spells control tokens, so they cannot be "
                                "kept as text; remove them from the message")
