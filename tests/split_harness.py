"""Shared by the tests of placed and split models: a plan with given GPU rows (or experts) per layer, decode steps
one token at a time, and prompt graphs run on the CPU where a GPU would have streamed host weights in."""
from __future__ import annotations

import numpy as np

from pyinfer.engine.driver import Model
from pyinfer.engine.placement import Plan
from pyinfer.native import ggml


def split_plan(hot_rows: tuple[int, ...], head: bool = True) -> Plan:
    """Every layer's attention on the GPU, with hot_rows[il] of its FFN rows (or experts) there."""
    n = len(hot_rows)
    return Plan(attn_gpu=(True,) * n, hot_rows=hot_rows, head_gpu=head, device_bytes=1, budget=1 << 30,
                layer_us=(0.0,) * n, head_us=0.0)


def decode_steps(model: Model, tokens) -> np.ndarray:
    """(n, n_vocab): the logits of each token decoded one at a time from an empty cache."""
    model.reset()
    return np.stack([model.eval([t]).copy() for t in tokens])


class _CpuGraph(ggml.Graph):
    def __init__(self, ctx, outputs, backend="cpu", stream_min_cols=0):
        super().__init__(ctx, outputs, backend)


def streamed_graphs_on_cpu(monkeypatch) -> None:
    """Prompt batches still build the graph that streams host weights to the GPU, but run it on the CPU."""
    monkeypatch.setattr("pyinfer.engine.driver.ggml.Graph", _CpuGraph)
    monkeypatch.setattr(Model, "pin_host_weights", lambda self: None)
