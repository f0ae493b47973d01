"""Token sampling with llama.cpp's default chain and defaults: penalties (repeat, frequency, presence) ->
top-k -> top-p -> min-p -> temperature -> seeded draw; temperature <= 0 is greedy. Vectorised numpy, no loop
over the vocabulary."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pyinfer import arguments
from pyinfer.errors import InvalidArgumentError


@dataclass(frozen=True)
class SamplerParams:
    temperature: float = 0.8  # <= 0: greedy
    top_k: int = 40  # <= 0: off
    top_p: float = 0.95  # >= 1: off
    min_p: float = 0.05  # <= 0: off
    repeat_penalty: float = 1.0  # 1: off
    repeat_last_n: int = 64  # 0: off, -1: the whole history
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the last repeat_last_n tokens
    presence_penalty: float = 0.0  # subtracted once from every token in the last repeat_last_n tokens

    def __post_init__(self) -> None:
        arguments.number("temperature", self.temperature)
        arguments.integer("top_k", self.top_k)
        arguments.number("top_p", self.top_p)
        arguments.number("min_p", self.min_p)
        if arguments.number("repeat_penalty", self.repeat_penalty) <= 0:
            raise InvalidArgumentError(f"repeat_penalty must be > 0, not {self.repeat_penalty}")
        arguments.integer("repeat_last_n", self.repeat_last_n, lo=-1)


def penalize_repeats(logits: np.ndarray, history: Sequence[int], penalty: float, last_n: int,
                     frequency: float = 0.0, presence: float = 0.0) -> np.ndarray:
    """Copy of logits (n_vocab,) with llama.cpp's penalties on each distinct token of the last `last_n` of
    history: positive logits divided by `penalty`, the others multiplied, then `frequency` times the token's
    count and `presence` subtracted (OpenAI's frequency and presence penalties)."""
    out = np.array(logits, dtype=np.float32, copy=True)
    if (penalty == 1.0 and frequency == 0.0 and presence == 0.0) or last_n == 0 or len(history) == 0:
        return out
    window = np.asarray(history if last_n < 0 else history[-last_n:], dtype=np.int64)
    recent, counts = np.unique(window, return_counts=True)  # (n_distinct,) each
    vals = out[recent]
    vals = np.where(vals > 0, vals / penalty, vals * penalty)
    out[recent] = vals - counts * frequency - presence
    return out


def top_k_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest logits, largest first; all ids sorted when k <= 0 or k >= n_vocab."""
    n = logits.shape[0]
    if 0 < k < n:
        part = np.argpartition(-logits, k - 1)[:k]  # (k,) unordered
        return part[np.argsort(-logits[part], kind="stable")]
    return np.argsort(-logits, kind="stable")


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(np.asarray(logits, dtype=np.float64) - np.max(logits))
    return z / z.sum()


def top_p_keep(sorted_logits: np.ndarray, p: float) -> int:
    """How many of the logits (sorted descending) the smallest prefix with probability mass >= p holds."""
    n = sorted_logits.shape[0]
    if p >= 1.0:
        return n
    cum = np.cumsum(softmax(sorted_logits))
    return min(int(np.searchsorted(cum, p, side="left")) + 1, n)


def min_p_keep(sorted_logits: np.ndarray, min_p: float) -> int:
    """How many of the logits (sorted descending) have probability >= min_p times the largest (at least 1)."""
    if min_p <= 0.0:
        return sorted_logits.shape[0]
    threshold = sorted_logits[0] + np.log(min_p)
    return max(int(np.count_nonzero(sorted_logits >= threshold)), 1)


class Sampler:
    """Picks the next token from logits; `seed=None` seeds from the OS."""

    def __init__(self, params: SamplerParams | None = None, seed: int | None = None) -> None:
        self.params = params or SamplerParams()
        self.rng = np.random.default_rng(None if seed is None else arguments.integer("seed", seed, lo=0))

    def candidates(self, logits: np.ndarray, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """(ids, probabilities) the draw chooses from, after every stage of the chain; one id when greedy."""
        p = self.params
        x = penalize_repeats(logits, history, p.repeat_penalty, p.repeat_last_n, p.frequency_penalty,
                             p.presence_penalty)  # (n_vocab,)
        if p.temperature <= 0:
            return np.array([int(np.argmax(x))]), np.ones(1)
        ids = top_k_ids(x, p.top_k)  # (k,) largest first
        lg = x[ids].astype(np.float64)  # (k,)
        n = top_p_keep(lg, p.top_p)
        n = min_p_keep(lg[:n], p.min_p)
        return ids[:n], softmax(lg[:n] / p.temperature)

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        ids, probs = self.candidates(logits, history)
        if ids.shape[0] == 1:
            return int(ids[0])
        i = int(np.searchsorted(np.cumsum(probs), self.rng.random(), side="right"))
        return int(ids[min(i, ids.shape[0] - 1)])
