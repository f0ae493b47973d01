"""`pyinfer bench`: llama-bench's pp/tg tests on our engine, markdown or JSON.

pp N: N prompt tokens in one go; tg N: N single-token steps; each from an empty cache, or with -d D from a cache
already holding D tokens (llama-bench's depth: "pp512 @ d4096"), as llama-bench measures them (no sampling,
random token ids; filling the cache is not timed).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from pyinfer.engine.driver import Model
from pyinfer.errors import InvalidArgumentError
from pyinfer.native import ggml

# general.file_type -> llama.cpp's llama_model_ftype_name
FILE_TYPE_NAMES = {
    0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K - Medium",
    11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large", 14: "Q4_K - Small", 15: "Q4_K - Medium",
    16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K", 19: "IQ2_XXS - 2.0625 bpw", 20: "IQ2_XS - 2.3125 bpw",
    21: "Q2_K - Small", 22: "IQ3_XS - 3.3 bpw", 23: "IQ3_XXS - 3.0625 bpw", 24: "IQ1_S - 1.5625 bpw",
    25: "IQ4_NL - 4.5 bpw", 26: "IQ3_S - 3.4375 bpw", 27: "IQ3_S mix - 3.66 bpw", 28: "IQ2_S - 2.5 bpw",
    29: "IQ2_M - 2.7 bpw", 30: "IQ4_XS - 4.25 bpw", 31: "IQ1_M - 1.75 bpw", 32: "BF16",
    36: "TQ1_0 - 1.69 bpw ternary", 37: "TQ2_0 - 2.06 bpw ternary", 38: "MXFP4 MoE",
}
# tensor type -> the file type llama.cpp guesses when general.file_type is absent
GUESSED_FILE_TYPE = {0: 0, 1: 1, 2: 2, 3: 3, 6: 8, 7: 9, 8: 7, 10: 10, 11: 12, 12: 15, 13: 17, 14: 18, 30: 32, 39: 38}
GUESSED_BIT = 1024


def file_type_name(metadata: dict, tensor_types: list[int]) -> str:
    """The model's type as llama-bench names it: from general.file_type, else guessed from the commonest
    tensor type (llama.cpp's rule, which counts every tensor) and marked "(guessed)"."""
    ftype = metadata.get("general.file_type")
    if not isinstance(ftype, int) or isinstance(ftype, bool):
        if not tensor_types:
            return "unknown, may not work"
        commonest = max(set(tensor_types), key=tensor_types.count)
        ftype = GUESSED_FILE_TYPE.get(commonest, 0) | GUESSED_BIT
    name = FILE_TYPE_NAMES.get(ftype & ~GUESSED_BIT, "unknown, may not work")
    return f"{name} (guessed)" if ftype & GUESSED_BIT else name


def _model_label(model: Model) -> tuple[str, float, float]:
    """(description, size GiB, params B) as llama-bench prints them."""
    size = sum(t.data.nbytes for t in model.file.tensors.values())
    params = sum(int(np.prod(t.ne)) for t in model.file.tensors.values())
    ftype = file_type_name(model.file.metadata, [t.type for t in model.file.tensors.values()])
    label = f"{model.config.arch} {params / 1e6:.0f}M {ftype}"
    return label, size / 2**30, params / 1e9


STEP_FIELDS = ("wall_ms", "cpu_busy_ms", "gpu_busy_ms", "overlap_ms", "wait_ms")


def step_report(model: Model) -> dict:
    """Per decoded token of a timed model: wall time, CPU busy, GPU busy, both at once and the CPU's wait for
    the GPU (ms; busy times are unions of intervals on one clock), as lists and medians."""
    steps = model.step_stats
    per_token = {f: [round(s[f], 4) for s in steps] for f in STEP_FIELDS}
    medians = {f: float(np.median(v)) if v else 0.0 for f, v in per_token.items()}
    last = steps[-1] if steps else {}
    return {"tokens": len(steps), "median": medians, "per_token": per_token,
            "gpu_runs_per_token": last.get("n_gpu_runs", 0), "replayed_runs": last.get("n_replayed", 0),
            "cpu_nodes_per_token": last.get("n_cpu_nodes", 0)}


def run_test(model: Model, kind: str, n: int, reps: int, rng: np.random.Generator, depth: int = 0) -> list[float]:
    """Tokens per second of each repetition (after one warm-up run), each after `depth` tokens fill the cache."""
    rates = []
    for rep in range(reps + 1):
        tokens = rng.integers(0, model.config.n_vocab, size=n, dtype=np.int32)
        model.reset()
        if depth:
            model.eval(rng.integers(0, model.config.n_vocab, size=depth, dtype=np.int32))
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


def bench(path: str, pp: list[int], tg: list[int], reps: int, output: str, options: dict,
          depths: list[int] = (0,)) -> str:
    """options: Model() keyword arguments (the context size is set to fit the deepest, longest test); every test
    runs at every depth."""
    if any(d < 0 for d in depths):
        raise InvalidArgumentError(f"depths must be >= 0, not {', '.join(str(d) for d in depths if d < 0)}")
    n_ctx = max([*pp, *tg, 1]) + max(depths, default=0) + 16
    # the driver's count besides the allocator's: CUDA graphs, the cuBLAS handle and workspace hold memory too
    free_before = ggml.cuda_memory()[1] if ggml.cuda_available() else None
    model = Model(path, **{**options, "n_ctx": n_ctx})
    backend = "CUDA" if model.n_gpu_layers else "CPU"
    label, size_gib, params_b = _model_label(model)
    rng = np.random.default_rng(1234)
    rows = []
    tests = [(kind, n, d) for d in depths for kind, sizes in (("pp", pp), ("tg", tg)) for n in sizes if n > 0]
    for kind, n, depth in tests:
        rates = run_test(model, kind, n, reps, rng, depth)
        steps = {}
        if kind == "tg" and model.n_gpu_layers:  # one more run, timed: how CPU and GPU shared the tokens
            model.timed, model.step_stats = True, []
            for g in model._graphs.values():
                g.graph.set_timed(True)
            run_test(model, kind, n, 0, rng, depth)
            steps = step_report(model)["median"]
            model.timed = False
            for g in model._graphs.values():
                g.graph.set_timed(False)
        rows.append({
            "model": label, "size_gib": size_gib, "params_b": params_b, "backend": backend,
            "threads": model.n_threads, "n_gpu_layers": model.n_gpu_layers, "n_batch": model.n_batch,
            "sparse": model.sparse_spec is not None, "precise": model.precise, "n_depth": depth,
            "test": f"{kind}{n}" + (f" @ d{depth}" if depth else ""),
            "avg_ts": float(np.mean(rates)), "stddev_ts": float(np.std(rates)),
            "median_ts": float(np.median(rates)), "samples_ts": rates,
            "build": os.environ.get("PYINFER_BUILD_LABEL", ""),
            "vram_budget": model.vram_budget, "device_bytes": model.device_bytes,
            "device_peak_bytes": model.device_peak_bytes,
            "modelled_ts": model.plan.tokens_per_second if model.plan else None,
            **{f"step_{k}": v for k, v in steps.items()},
        })
    driver_bytes = free_before - ggml.cuda_memory()[1] if free_before is not None else None
    for row in rows:
        row["driver_bytes"] = driver_bytes  # after every test: what the model holds at the end of a generation
    if output == "json":
        return json.dumps(rows, indent=2)
    lines = ["| model | size | params | backend | threads | precise | test | t/s |",
             "| --- | ---: | ---: | --- | ---: | --- | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['size_gib'] * 1024:.2f} MiB | {r['params_b'] * 1e3:.2f} M | "
                     f"{r['backend']} | {r['threads']} | {'on' if r['precise'] else 'off'} | {r['test']} | "
                     f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} |")
    return "\n".join(lines)
