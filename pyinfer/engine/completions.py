"""OpenAI-shaped completions on a loaded Model: the dicts that `pyinfer serve` sends and that
`Model.create_completion` / `Model.create_chat_completion` return (llama-cpp-python's API shape), so scripts
need no server.

One sequence at a time: a request keeps the longest prefix that the KV cache shares with it (a follow-up chat
turn processes only its new tokens), samples with llama.cpp's chain, and cuts the text at the first stop
string without ever handing out a piece of one.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pyinfer.engine.sampling import SamplerParams
from pyinfer.errors import ContextFullError, InvalidArgumentError, PyInferError
from pyinfer.formats.chat_template import ChatTemplate

ROLES = ("system", "user", "assistant", "tool")


class GenerationStopped(PyInferError):
    """should_stop ended a generation before it finished (the server is shutting down)."""


@dataclass(frozen=True)
class CompletionOptions:
    """What steers one generation, by OpenAI's names (plus llama.cpp's repeat_penalty, ignore_eos and
    cache_prompt). Sampling fields left None take the defaults given to `sampler_params`."""

    max_tokens: int | None = None  # None: until end of turn or the context is full
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None  # None: random
    stop: str | Sequence[str] | None = None
    ignore_eos: bool = False
    cache_prompt: bool = True  # False: the prompt is processed from scratch

    def sampler_params(self, defaults: SamplerParams | None = None) -> SamplerParams:
        given = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty")
                 if getattr(self, name) is not None}
        return dataclasses.replace(defaults or SamplerParams(), **given, frequency_penalty=self.frequency_penalty,
                                   presence_penalty=self.presence_penalty)

    @property
    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return [s for s in stops if s]


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, reused from the KV cache
    completion_tokens: int = 0
    prompt_ms: float = 0.0  # until the first token was sampled
    generation_ms: float = 0.0  # from the first token to the last

    def openai(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    @property
    def tokens_per_second(self) -> float:
        """Decoding speed: every token after the first cost one evaluation and one draw."""
        n = self.completion_tokens - 1
        return 1e3 * n / self.generation_ms if n > 0 and self.generation_ms > 0 else 0.0

    def timings(self) -> dict:
        """llama-server's `timings` object, which its users' tools read."""
        processed = self.prompt_tokens - self.cached_tokens
        return {"cache_n": self.cached_tokens, "prompt_n": processed, "prompt_ms": round(self.prompt_ms, 3),
                "prompt_per_second": round(1e3 * processed / self.prompt_ms, 3) if self.prompt_ms > 0 else 0.0,
                "predicted_n": self.completion_tokens, "predicted_ms": round(self.generation_ms, 3),
                "predicted_per_second": round(self.tokens_per_second, 3)}


class StopStrings:
    """Cuts streamed text at the first stop string: `push` returns the text that is final (it cannot be the
    start of a stop string) and whether a stop string was found; `flush` the rest at the end."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.text = ""
        self.sent = 0  # text[:sent] has been returned

    def push(self, piece: str) -> tuple[str, bool]:
        self.text += piece
        # a stop string cannot start before `sent`: that text was returned only once no stop could start in it
        found = [i for s in self.stops if (i := self.text.find(s, self.sent)) >= 0]
        if found:
            return self._take(min(found)), True
        held = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        return self._take(len(self.text) - held), False

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        out = self.text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out


class Generation:
    """One request on the model: iterate for the text pieces as they become final. Afterwards
    `finish_reason` is "stop" (end of turn or a stop string) or "length" (max_tokens or the context), and
    `usage` is filled in; a generation that should_stop ended early raises GenerationStopped at its end.
    Checks the request when made, touches the model only when iterated."""

    def __init__(self, model, prompt_tokens: Sequence[int], options: CompletionOptions | None = None,
                 defaults: SamplerParams | None = None, should_stop: Callable[[], bool] | None = None) -> None:
        options = options or CompletionOptions()
        if not prompt_tokens:
            raise InvalidArgumentError("the prompt is empty")
        room = model.n_ctx - len(prompt_tokens)
        if room < 1:
            raise ContextFullError(f"the prompt is {len(prompt_tokens)} tokens, but the context (-c) holds "
                                   f"{model.n_ctx} with the answer; shorten the prompt")
        if options.max_tokens is not None and options.max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be at least 1, not {options.max_tokens}")
        self.model = model
        self.prompt_tokens = list(prompt_tokens)
        self.options = options
        self.params = options.sampler_params(defaults)
        self.n_predict = room if options.max_tokens is None else min(options.max_tokens, room)
        self.should_stop = should_stop
        self.finish_reason: str | None = None
        self.usage = Usage(prompt_tokens=len(self.prompt_tokens))

    def __iter__(self) -> Iterator[str]:
        model, options, usage = self.model, self.options, self.usage
        if not options.cache_prompt:
            model.reset()
        usage.cached_tokens = model.reuse_prefix(self.prompt_tokens)
        stops = StopStrings(options.stop_strings)
        decoder = model.tokenizer.stream_decoder(skip_special=True)
        t_start = time.perf_counter()
        t_first = t_start
        tokens = model.generate_tokens(self.prompt_tokens[usage.cached_tokens:], self.n_predict, self.params,
                                       options.seed, stop_at_eos=not options.ignore_eos,
                                       should_stop=self.should_stop)
        try:
            for token in tokens:
                if usage.completion_tokens == 0:
                    t_first = time.perf_counter()
                usage.completion_tokens += 1
                text, hit = stops.push(decoder.push(token))
                if text:
                    yield text
                if hit:
                    self.finish_reason = "stop"
                    return
            tail, hit = stops.push(decoder.flush())
            if text := tail if hit else tail + stops.flush():
                yield text
            if hit:
                self.finish_reason = "stop"
            elif usage.completion_tokens == self.n_predict:
                self.finish_reason = "length"
            elif self.should_stop and self.should_stop():
                raise GenerationStopped(f"generation stopped after {usage.completion_tokens} tokens")
            else:
                self.finish_reason = "stop"  # end of turn
        except PyInferError as exc:
            if not isinstance(exc, GenerationStopped):
                model.reset()  # the cache may hold part of the failed step
            raise
        finally:
            tokens.close()
            t_end = time.perf_counter()
            if usage.completion_tokens == 0:
                t_first = t_end
            usage.prompt_ms = 1e3 * (t_first - t_start)
            usage.generation_ms = 1e3 * (t_end - t_first)


# ---- the OpenAI objects ----

@dataclass(frozen=True)
class _Kind:
    """The shape of one endpoint's objects: chat completions or text completions."""

    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def choice(self, text: str | None, finish_reason: str | None, chunk: bool) -> dict:
        if not self.chat:
            body = {"text": text or ""}
        elif chunk:
            body = {"delta": {} if text is None else {"content": text}}
        else:
            body = {"message": {"role": "assistant", "content": text}}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish_reason}


CHAT = _Kind("chatcmpl", "chat.completion", "chat.completion.chunk", chat=True)
TEXT = _Kind("cmpl", "text_completion", "text_completion", chat=False)


def _head(kind: _Kind, model_name: str, chunk: bool) -> dict:
    return {"id": f"{kind.id_prefix}-{uuid.uuid4().hex}", "object": kind.chunk_object if chunk else kind.object,
            "created": int(time.time()), "model": model_name}


def response(gen: Generation, kind: _Kind, model_name: str) -> dict:
    """The whole answer as one object (`stream: false`)."""
    text = "".join(gen)
    return {**_head(kind, model_name, chunk=False), "choices": [kind.choice(text, gen.finish_reason, chunk=False)],
            "usage": gen.usage.openai(), "timings": gen.usage.timings()}


def chunks(gen: Generation, kind: _Kind, model_name: str, include_usage: bool = False) -> Iterator[dict]:
    """The answer as stream chunks (`stream: true`): chat opens with the role, every piece of text is one
    chunk, the last chunk carries finish_reason and llama-server's timings; with include_usage (OpenAI's
    stream_options) one more chunk without choices carries the usage, and all others have usage null."""
    head = _head(kind, model_name, chunk=True)
    extra = {"usage": None} if include_usage else {}
    if kind.chat:
        yield {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}], **extra}
    for text in gen:
        yield {**head, "choices": [kind.choice(text, None, chunk=True)], **extra}
    yield {**head, "choices": [kind.choice(None, gen.finish_reason, chunk=True)], **extra,
           "timings": gen.usage.timings()}
    if include_usage:
        yield {**head, "choices": [], "usage": gen.usage.openai()}


# ---- requests ----

def model_name(llm) -> str:
    """The name a model answers to: its file name without the extension."""
    return Path(llm.file.path).stem


def chat_messages(messages: Sequence[Mapping]) -> list[dict]:
    """OpenAI messages as chat templates take them: text content parts joined, "developer" as "system",
    null content (an assistant turn that only called tools) as ""."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidArgumentError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, Mapping) else None
        role = "system" if role == "developer" else role
        if role not in ROLES:
            raise InvalidArgumentError(f"messages[{i}].role must be one of {', '.join(ROLES)} or developer, "
                                       f"not {role!r}")
        out.append({"role": role, "content": _text_content(m.get("content"), i)})
    return out


def _text_content(content, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, Sequence) and all(isinstance(p, Mapping) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise InvalidArgumentError(f"messages[{i}].content: only text parts ({{type: text, text}}) are supported")
        return "".join(p["text"] for p in content)
    raise InvalidArgumentError(f"messages[{i}].content must be a string or a list of text parts")


def text_prompt_tokens(llm, prompt: str | Sequence[int]) -> list[int]:
    """A completion prompt: text (with BOS where the model wants it, as `pyinfer run`) or token ids."""
    if isinstance(prompt, str):
        return llm.tokenize(prompt)
    ids = list(prompt)
    if not all(isinstance(t, int) and 0 <= t < llm.config.n_vocab for t in ids):
        raise InvalidArgumentError(f"a prompt of token ids needs integers in [0, {llm.config.n_vocab})")
    return ids


def _run(llm, prompt_tokens, kind: _Kind, stream: bool, stream_options: Mapping | None, model: str | None,
         options: dict) -> dict | Iterator[dict]:
    gen = Generation(llm, prompt_tokens, CompletionOptions(**options))
    name = model or model_name(llm)
    include_usage = bool((stream_options or {}).get("include_usage"))
    return chunks(gen, kind, name, include_usage) if stream else response(gen, kind, name)


def create_chat_completion(llm, messages: Sequence[Mapping], *, stream: bool = False,
                           stream_options: Mapping | None = None, template: ChatTemplate | None = None,
                           model: str | None = None, content_control_tokens: bool = False,
                           **options) -> dict | Iterator[dict]:
    """A chat completion of `messages` by the Model `llm` through its chat template (or `template`): the
    response dict, or with stream=True an iterator of chunk dicts. `model` names the model in them;
    `options` are CompletionOptions' fields. Control tokens spelled in a message stay text unless
    content_control_tokens. Errors in the request raise before anything is generated."""
    template = template or ChatTemplate.from_tokenizer(llm.tokenizer)
    tokens = template.encode(llm.tokenizer, chat_messages(messages), content_control_tokens)
    return _run(llm, tokens, CHAT, stream, stream_options, model, options)


def create_completion(llm, prompt: str | Sequence[int], *, stream: bool = False,
                      stream_options: Mapping | None = None, model: str | None = None,
                      **options) -> dict | Iterator[dict]:
    """A text completion of `prompt` by the Model `llm`: the response dict, or with stream=True an iterator
    of chunk dicts."""
    return _run(llm, text_prompt_tokens(llm, prompt), TEXT, stream, stream_options, model, options)
