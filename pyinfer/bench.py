"""`pyinfer bench`: llama-bench's pp/tg tests on our engine, markdown or JSON.

pp N: N prompt tokens in one go from an empty cache; tg N: N single-token steps from an empty cache,
as llama-bench measures them (no sampling, random token ids).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from pyinfer import ggml
from pyinfer.runtime import Model


def _model_label(model: Model) -> tuple[str, float, float]:
    """(description, size GiB, params B) as llama-bench prints them."""
    size = sum(t.data.nbytes for t in model.file.tensors.values())
    params = sum(int(np.prod(t.ne)) for t in model.file.tensors.values())
    types = [t.type for n, t in model.file.tensors.items() if n.endswith("attn_q.weight")]
    ftype = ggml.type_name(types[0]) if types else "?"
    label = f"{model.config.arch} {params / 1e6:.0f}M {ftype}"
    return label, size / 2**30, params / 1e9


def run_test(model: Model, kind: str, n: int, reps: int, rng: np.random.Generator) -> list[float]:
    """Tokens per second of each repetition (after one warm-up run)."""
    rates = []
    for rep in range(reps + 1):
        tokens = rng.integers(0, model.config.n_vocab, size=n, dtype=np.int32)
        model.reset()
        t0 = time.perf_counter()
        if kind == "pp":
            model.eval(tokens)
        else:
            for tok in tokens:
                model.eval([tok])
        dt = time.perf_counter() - t0
        if rep:  # the first run warms caches and builds graphs
            rates.append(n / dt)
    return rates


def bench(path: str, pp: list[int], tg: list[int], reps: int, output: str, options: dict) -> str:
    """options: Model() keyword arguments (the context size is set to fit the longest test)."""
    n_ctx = max([*pp, *tg, 1]) + 16
    model = Model(path, **{**options, "n_ctx": n_ctx})
    backend = "CUDA" if model.n_gpu_layers else "CPU"
    label, size_gib, params_b = _model_label(model)
    rng = np.random.default_rng(1234)
    rows = []
    for kind, sizes in (("pp", pp), ("tg", tg)):
        for n in sizes:
            if n <= 0:
                continue
            rates = run_test(model, kind, n, reps, rng)
            rows.append({
                "model": label, "size_gib": size_gib, "params_b": params_b, "backend": backend,
                "threads": model.n_threads, "n_gpu_layers": model.n_gpu_layers, "n_batch": model.n_batch,
                "sparse": model.sparse_spec is not None, "test": f"{kind}{n}",
                "avg_ts": float(np.mean(rates)), "stddev_ts": float(np.std(rates)),
                "median_ts": float(np.median(rates)), "samples_ts": rates,
                "build": os.environ.get("PYINFER_BUILD_LABEL", ""),
            })
    if output == "json":
        return json.dumps(rows, indent=2)
    lines = ["| model | size | params | backend | threads | test | t/s |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['size_gib'] * 1024:.2f} MiB | {r['params_b'] * 1e3:.2f} M | "
                     f"{r['backend']} | {r['threads']} | {r['test']} | {r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} |")
    return "\n".join(lines)
