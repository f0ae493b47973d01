"""Shared by the op tests: thread pools, tensors from numpy, poisoned graph runs, weights as really held."""
from __future__ import annotations

import numpy as np

from pyinfer.native import ggml

_POOLS: dict[int, ggml.ThreadPool] = {}


def pool(n: int) -> ggml.ThreadPool:
    if n not in _POOLS:
        _POOLS[n] = ggml.ThreadPool(n)
    return _POOLS[n]


def tensor(ctx: ggml.Context, arr: np.ndarray, type_: int | None = None) -> ggml.Tensor:
    """tensor_from_numpy with leading axes of 1 dropped: ggml shapes do not keep them."""
    arr = np.asarray(arr)
    while arr.ndim > 1 and arr.shape[0] == 1:
        arr = arr[0]
    return ctx.tensor_from_numpy(arr, type_)


def compute(ctx: ggml.Context, outputs: list[ggml.Tensor], n_threads: int, ndim: int = 2) -> list[np.ndarray]:
    """Plans and runs a graph of outputs with their buffers poisoned (NaN) first; results as arrays
    of ndim axes (ggml drops outer axes of size 1, the references keep them)."""
    g = ggml.Graph(ctx, outputs).plan()
    for t in outputs:
        out = t.numpy()
        out[...] = np.nan if out.dtype.kind == "f" else -123456789
    g.compute(pool(n_threads))
    return [t.numpy().reshape(tuple(reversed(t.ne))[4 - ndim:]).copy() for t in outputs]


def weights(ctx: ggml.Context, w: np.ndarray, type_: int) -> tuple[ggml.Tensor, np.ndarray]:
    """A weight tensor of type_ and the float64 values it really holds."""
    t = tensor(ctx, w.astype(np.float32), type_)
    return t, ggml.dequantize(type_, t.raw(), w.size).reshape(w.shape).astype(np.float64)
