"""`pyinfer chat`'s conversation: a model, a chat template and the messages so far.

The KV cache is reused across turns: the conversation is rendered with the chat template every turn and
only the tokens after the longest prefix already in the cache are processed. When the context is full
the oldest turns are dropped (the caller is told how many), never the new message. An answer ends at the
end of its turn, at -n tokens, when the context is full, or when it keeps repeating itself (small models at
low temperature fall into loops such as "la France, la France, ..."; -n -1 must still end soon).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from pyinfer.engine.driver import Model
from pyinfer.engine.sampling import SamplerParams
from pyinfer.errors import ContextFullError, PyInferError
from pyinfer.formats.chat_template import ChatTemplate

# an answer whose last tokens are one piece of at most REPEAT_PERIOD tokens said REPEAT_TIMES times over (and
# at least REPEAT_MIN_TOKENS long) is stopped: no useful text repeats a phrase a dozen times in a row
REPEAT_PERIOD = 16
REPEAT_TIMES = 12
REPEAT_MIN_TOKENS = 48
ENDINGS = {  # TurnStats.ending -> what the user is told ("" for none)
    "turn": "",
    "limit": "",
    "stopped": "",
    "context": "[answer cut: the context is full (-c); older turns make room on the next message]",
    "repeat": "[answer stopped: it kept repeating itself]",
}

HELP = """commands:
  /help           this help
  /reset          forget the conversation (keeps the system prompt)
  /system TEXT    set the system prompt (and start over); /system alone removes it
  /stats          speed and timings of the last answer and of the session
  /save FILE      write the conversation as JSON
  /load FILE      read a conversation written by /save
  /exit           leave (also Ctrl-D, or Ctrl-C at an empty prompt)
end a line with \\ to continue the message on the next line; Ctrl-C stops an answer"""


@dataclass
class TurnStats:
    prompt_tokens: int = 0  # tokens processed for this turn (after the cached prefix)
    cached_tokens: int = 0  # tokens reused from the KV cache
    prompt_ms: float = 0.0
    gen_tokens: int = 0
    gen_ms: float = 0.0
    dropped_turns: int = 0  # oldest turns removed so that this one fits the context
    ending: str = "turn"  # why the answer ended: a key of ENDINGS

    def line(self) -> str:
        pp = 1e3 * self.prompt_tokens / self.prompt_ms if self.prompt_ms else 0.0
        tg = 1e3 * self.gen_tokens / self.gen_ms if self.gen_ms else 0.0
        return (f"prompt: {self.prompt_tokens} tokens ({self.cached_tokens} cached) in {self.prompt_ms:.0f} ms, "
                f"{pp:.1f} t/s | generation: {self.gen_tokens} tokens in {self.gen_ms:.0f} ms, {tg:.1f} t/s")


def repeats_itself(tokens: list[int]) -> bool:
    """True when tokens end in one piece of <= REPEAT_PERIOD tokens repeated REPEAT_TIMES times in a row."""
    for period in range(1, REPEAT_PERIOD + 1):
        span = max(period * REPEAT_TIMES, REPEAT_MIN_TOKENS)
        if len(tokens) >= span and tokens[-span:-period] == tokens[-span + period:]:
            return True
    return False


@dataclass
class ChatSession:
    """A conversation on a model; `reply` renders, reuses the cache, generates and records the answer."""

    model: Model
    system: str | None = None
    template: ChatTemplate | None = None  # None: the model's template (ChatML when it has none)
    params: SamplerParams = field(default_factory=SamplerParams)
    seed: int | None = None
    n_predict: int = -1  # -1: until end of turn or the context is full
    content_control_tokens: bool = False  # messages may spell control tokens (ChatTemplate.encode)
    messages: list[dict] = field(default_factory=list)
    last: TurnStats = field(default_factory=TurnStats)
    n_turns: int = 0

    def __post_init__(self):
        if self.template is None:
            self.template = ChatTemplate.from_tokenizer(self.model.tokenizer)

    def conversation(self, messages: list[dict] | None = None) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + (self.messages if messages is None else messages)

    def reset(self) -> None:
        self.messages.clear()
        self.model.reset()

    def _tokens(self, messages: list[dict] | None = None) -> list[int]:
        return self.template.encode(self.model.tokenizer, self.conversation(messages), self.content_control_tokens)

    def _reserve(self) -> int:
        """Context kept free for the answer."""
        return max(16, min(self.n_predict if self.n_predict > 0 else 256, self.model.n_ctx // 4))

    def _fit_context(self, stats: TurnStats) -> list[int]:
        """Prompt tokens of the conversation (ending in the new message), dropping the oldest turns while
        the prompt leaves no room to answer. A message too long on its own drops nothing."""
        limit = self.model.n_ctx - self._reserve()
        alone = len(self._tokens(self.messages[-1:]))
        if alone > limit:
            raise ContextFullError(f"message too long: {alone} tokens, but the context of {self.model.n_ctx} "
                                   f"(-c) holds {limit} besides the answer; history kept")
        while len(tokens := self._tokens()) > limit:
            del self.messages[0]  # a turn: a user message and what follows up to the next one
            while len(self.messages) > 1 and self.messages[0]["role"] != "user":
                del self.messages[0]
            stats.dropped_turns += 1
        return tokens

    def reply(self, user_text: str, on_text: Callable[[str], None] | None = None,
              on_dropped: Callable[[int], None] | None = None) -> str:
        """Adds the user's message, streams the answer through on_text, returns it. on_dropped hears how
        many old turns made room first. A KeyboardInterrupt stops the answer; what was said is kept."""
        self.messages.append({"role": "user", "content": user_text})
        stats = TurnStats()
        try:
            tokens = self._fit_context(stats)
        except PyInferError:
            self.messages.pop()
            raise
        if stats.dropped_turns and on_dropped:
            on_dropped(stats.dropped_turns)
        common = self.model.reuse_prefix(tokens)
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
        answer: list[int] = []
        try:
            for tok in self.model.generate_tokens(tokens[common:], n_predict, self.params, seed):
                answer.append(tok)
                if text := stream.push(tok):
                    pieces.append(text)
                    if on_text:
                        on_text(text)
                if repeats_itself(answer):
                    stats.ending = "repeat"
                    break
        except KeyboardInterrupt:
            pieces.append(stream.flush())
            stats.gen_tokens, stats.ending = len(answer), "stopped"
            self._finish(pieces, stats, p0, e0)
            raise
        except PyInferError:
            self.messages.pop()
            self.model.reset()  # the cache may hold part of the failed step
            raise
        if tail := stream.flush():
            pieces.append(tail)
            if on_text:
                on_text(tail)
        stats.gen_tokens = len(answer)
        if stats.ending == "turn" and len(answer) == n_predict:
            stats.ending = "context" if len(tokens) + n_predict >= self.model.n_ctx else "limit"
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
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"system": self.system, "messages": self.messages}, f, ensure_ascii=False, indent=1)
                f.write("\n")
        except OSError as exc:
            raise PyInferError(f"cannot save the conversation to {path}: {exc.strerror or exc}") from None

    def load(self, path: str) -> None:
        """Replaces the conversation (and system prompt) with a file written by `save`."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            messages, system = data["messages"], data.get("system")
            if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in messages):
                raise ValueError("every message needs a role and a content string")
            if system is not None and not isinstance(system, str):
                raise ValueError("system must be a string or null")
        except OSError as exc:
            raise PyInferError(f"cannot load a conversation from {path}: {exc.strerror or exc}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise PyInferError(f"cannot load a conversation from {path}: {exc}") from None
        self.system = system
        self.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
