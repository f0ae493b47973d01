"""Request bodies of the endpoints, parsed strictly (a string is no number, a number no boolean), so a wrong
field is a 400 that names it. Unknown fields are ignored: OpenAI clients send many (user, store, metadata).
Fields this engine cannot honour are refused by name instead of being silently dropped."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pyinfer.apps.server.openai_errors import ApiError, from_validation
from pyinfer.engine.completions import CompletionOptions


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @classmethod
    def parse(cls, raw: bytes):
        try:
            return cls.model_validate_json(raw or b"{}")
        except ValidationError as exc:
            raise from_validation(exc) from None


class StreamOptions(_Body):
    include_usage: bool = False


class _Completion(_Body):
    """The fields both completion endpoints share (OpenAI's, plus llama-server's top_k, min_p,
    repeat_penalty, ignore_eos and cache_prompt)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name of max_tokens
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-1)  # -1: random, as llama-server
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    cache_prompt: bool = True
    logit_bias: dict[str, float] | None = None

    def options(self, default_max_tokens: int | None, default_seed: int | None) -> CompletionOptions:
        """The generation options; fields the request leaves out take the server's defaults."""
        self._refuse_unsupported()
        max_tokens = self.max_tokens or self.max_completion_tokens or default_max_tokens
        seed = default_seed if self.seed is None else self.seed
        return CompletionOptions(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repeat_penalty=self.repeat_penalty, frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0, seed=None if seed == -1 else seed,
            stop=self.stop, ignore_eos=self.ignore_eos, cache_prompt=self.cache_prompt)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _refuse_unsupported(self) -> None:
        if self.n not in (None, 1):
            raise ApiError(400, f"n must be 1: this server generates one choice per request, not {self.n}",
                           param="n")
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", param="logit_bias")
        for name, value in self._unsupported().items():
            if value:
                raise ApiError(400, f"{name} is not supported by this server", param=name)

    def _unsupported(self) -> dict[str, Any]:
        return {}


class ChatCompletionRequest(_Completion):
    # checked by pyinfer.engine.completions.chat_messages (the Python API takes the same messages)
    messages: list[dict[str, Any]]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def _unsupported(self) -> dict[str, Any]:
        json_mode = self.response_format is not None and self.response_format.get("type") != "text"
        return {"logprobs": self.logprobs, "top_logprobs": self.top_logprobs, "tools": self.tools,
                "response_format": json_mode}


class CompletionRequest(_Completion):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def _unsupported(self) -> dict[str, Any]:
        return {"logprobs": self.logprobs, "echo": self.echo, "suffix": self.suffix,
                "best_of": self.best_of not in (None, 1)}

    @property
    def single_prompt(self) -> str | list[int]:
        """The one prompt: text or token ids (a list of one string is that string)."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ApiError(400, f"prompt: one prompt per request, not {len(self.prompt)}", param="prompt")
            return self.prompt[0]
        return self.prompt


class TokenizeRequest(_Body):
    """llama-server's /tokenize."""

    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    tokens: list[int]
