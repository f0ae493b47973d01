"""`pyinfer chat`: a conversation with a model, interactive (readline, slash commands, Ctrl-C to stop an
answer) or scripted (one message per stdin line, answers on stdout, `--json` for one object per turn).

The KV cache is reused across turns: the conversation is rendered with the chat template every turn and
only the tokens after the longest prefix already in the cache are processed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from pyinfer.chat_template import render_chat
from pyinfer.errors import ContextFullError, PyInferError
from pyinfer.runtime import Model
from pyinfer.sampling import SamplerParams

HELP = """commands:
  /help           this help
  /reset          forget the conversation (keeps the system prompt)
  /system TEXT    set the system prompt (and start over)
  /stats          speed and timings of the last answer and of the session
  /save FILE      write the conversation as JSON
  /load FILE      read a conversation written by /save
  /exit           leave (also Ctrl-D, or Ctrl-C at an empty prompt)
end a line with \\ to continue the message on the next line"""


@dataclass
class TurnStats:
    prompt_tokens: int = 0  # tokens processed for this turn (after the cached prefix)
    cached_tokens: int = 0  # tokens reused from the KV cache
    prompt_ms: float = 0.0
    gen_tokens: int = 0
    gen_ms: float = 0.0
    dropped_turns: int = 0

    def line(self) -> str:
        pp = 1e3 * self.prompt_tokens / self.prompt_ms if self.prompt_ms else 0.0
        tg = 1e3 * self.gen_tokens / self.gen_ms if self.gen_ms else 0.0
        return (f"prompt: {self.prompt_tokens} tokens ({self.cached_tokens} cached) in {self.prompt_ms:.0f} ms, "
                f"{pp:.1f} t/s | generation: {self.gen_tokens} tokens in {self.gen_ms:.0f} ms, {tg:.1f} t/s")


@dataclass
class ChatSession:
    """A conversation on a model; `reply` renders, reuses the cache, generates and records the answer."""

    model: Model
    system: str | None = None
    template: str | None = None
    params: SamplerParams = field(default_factory=SamplerParams)
    seed: int | None = None
    n_predict: int = -1  # -1: until end of turn or the context is full
    messages: list[dict] = field(default_factory=list)
    last: TurnStats = field(default_factory=TurnStats)
    n_turns: int = 0

    def __post_init__(self):
        if self.template is None:
            self.template = self.model.file.metadata.get("tokenizer.chat_template")
        self._turn_seed = self.seed

    def conversation(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def reset(self) -> None:
        self.messages.clear()
        self.model.reset()

    def _prompt_tokens(self) -> list[int]:
        tok = self.model.tokenizer
        text = render_chat(self.template, self.conversation(), add_generation_prompt=True,
                           bos_token=tok.token_to_piece(tok.bos_id) if tok.bos_id is not None else "",
                           eos_token=tok.token_to_piece(tok.eos_id) if tok.eos_id is not None else "")
        # the template writes BOS itself where the model wants it
        return tok.encode(text, add_special=False, parse_special=True)

    def _fit_context(self, stats: TurnStats) -> list[int]:
        """Prompt tokens, dropping the oldest turns while the prompt leaves no room to answer."""
        reserve = max(16, min(self.n_predict if self.n_predict > 0 else 256, self.model.n_ctx // 4))
        while True:
            tokens = self._prompt_tokens()
            if len(tokens) + reserve <= self.model.n_ctx:
                return tokens
            if len(self.messages) <= 1:
                raise ContextFullError(
                    f"the message needs {len(tokens)} tokens but the context holds {self.model.n_ctx} (-c)")
            drop = 2 if len(self.messages) > 2 and self.messages[0]["role"] == "user" else 1
            del self.messages[:drop]
            stats.dropped_turns += 1

    def reply(self, user_text: str, on_text: Callable[[str], None] | None = None) -> str:
        """Adds the user's message, streams the answer through on_text, returns it.
        A KeyboardInterrupt stops the answer; what was said so far is kept."""
        self.messages.append({"role": "user", "content": user_text})
        stats = TurnStats()
        try:
            tokens = self._fit_context(stats)
        except PyInferError:
            self.messages.pop()
            raise
        cached = self.model.tokens
        common = 0
        for a, b in zip(cached, tokens[:-1]):  # at least one new token must be evaluated for logits
            if a != b:
                break
            common += 1
        self.model.truncate(common)
        stats.cached_tokens = common
        stats.prompt_tokens = len(tokens) - common
        stream = self.model.tokenizer.stream_decoder(skip_special=True)
        pieces: list[str] = []
        n_predict = self.n_predict if self.n_predict > 0 else self.model.n_ctx
        n_predict = min(n_predict, self.model.n_ctx - len(tokens))
        timings = self.model.timings
        p0, e0 = timings.prompt_ms, timings.eval_ms
        self.n_turns += 1
        seed = None if self.seed is None else self.seed + self.n_turns
        try:
            for tok in self.model.generate_tokens(tokens[common:], n_predict, self.params, seed):
                stats.gen_tokens += 1
                text = stream.push(tok)
                if text:
                    pieces.append(text)
                    if on_text:
                        on_text(text)
        except KeyboardInterrupt:
            pieces.append(stream.flush())
            self._finish(pieces, stats, p0, e0)
            raise
        tail = stream.flush()
        if tail:
            pieces.append(tail)
            if on_text:
                on_text(tail)
        return self._finish(pieces, stats, p0, e0)

    def _finish(self, pieces, stats, p0, e0) -> str:
        answer = "".join(pieces)
        self.messages.append({"role": "assistant", "content": answer})
        timings = self.model.timings
        stats.prompt_ms = timings.prompt_ms - p0
        stats.gen_ms = timings.eval_ms - e0
        self.last = stats
        return answer

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"system": self.system, "messages": self.messages}, f, ensure_ascii=False, indent=1)

    def load(self, path: str) -> None:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            messages = data["messages"]
            if not all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in messages):
                raise ValueError("messages need a role and a content")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PyInferError(f"cannot load conversation from {path}: {exc}") from None
        self.system = data.get("system")
        self.messages = messages
