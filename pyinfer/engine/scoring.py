"""What a model's logits say of a text, as llama.cpp's perplexity counts it: whole n_ctx chunks (the first token
BOS where the vocabulary adds one), the second half of each scored, perplexity and KL statistics over the scored
tokens. `pyinfer perplexity` (apps) prints them; `sparsify` reports them on held-out text."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pyinfer.errors import InvalidArgumentError


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(n, n_vocab) logits -> log-probabilities in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def chunk_tokens(tokens: list[int], n_ctx: int, bos_id: int | None, n_chunks: int = -1) -> list[np.ndarray]:
    """llama.cpp's chunks: whole n_ctx windows, first token replaced by BOS when there is one."""
    if n_ctx < 2:
        raise InvalidArgumentError(f"context size must be >= 2, not {n_ctx}")
    n = len(tokens) // n_ctx
    if n_chunks >= 0:
        n = min(n, n_chunks)
    if n == 0:
        raise InvalidArgumentError(f"need at least {n_ctx} tokens for one chunk, the text has {len(tokens)}")
    out = []
    for i in range(n):
        c = np.asarray(tokens[i * n_ctx:(i + 1) * n_ctx], dtype=np.int32)
        if bos_id is not None:
            c[0] = bos_id
        out.append(c)
    return out


def scored_logprobs(model, chunk: np.ndarray) -> np.ndarray:
    """Log-probabilities (n_ctx - first - 1, n_vocab) that predict chunk[first+1:], first = n_ctx // 2."""
    first = len(chunk) // 2
    logits = model.logits(chunk)  # (n_ctx, n_vocab)
    return log_softmax(logits[first:-1])


@dataclass
class Stats:
    """Running sums of llama.cpp's perplexity and KL statistics."""

    nll: list[float] = field(default_factory=list)  # per scored token
    kl: list[float] = field(default_factory=list)
    same_top: int = 0
    base_nll: list[float] = field(default_factory=list)

    def add(self, logp: np.ndarray, targets: np.ndarray, base: np.ndarray | None = None) -> None:
        self.nll.extend((-logp[np.arange(len(targets)), targets]).tolist())
        if base is not None:
            base = base.astype(np.float64)
            self.kl.extend((np.exp(base) * (base - logp)).sum(axis=-1).tolist())
            self.same_top += int((base.argmax(-1) == logp.argmax(-1)).sum())
            self.base_nll.extend((-base[np.arange(len(targets)), targets]).tolist())

    @staticmethod
    def ppl(nll: list[float]) -> tuple[float, float]:
        """exp(mean nll) and its standard error (llama.cpp's estimate)."""
        x = np.asarray(nll, dtype=np.float64)
        mean = float(x.mean())
        err = float(math.sqrt(max(float((x * x).mean()) - mean * mean, 0.0) / max(len(x) - 1, 1)))
        return math.exp(mean), err * math.exp(mean)
