"""Where a decode step's GPU time goes: every CUDA kernel and copy of N generated tokens, as recorded by CUPTI
(through torch.profiler, which the device machine has), summed per kernel name and divided by N; with
--prompt P, of one prompt batch of P tokens instead (per batch).

    python -m tools.profile_decode -m MODEL.gguf [--budget 0.9 | -ngl 99] [-n 16 | --prompt 512] [-t 16]

--budget is a fraction of the file's bytes (as tools.bench_hybrid counts budgets). Prints a
markdown table, slowest first, and the wall time per token (or batch) next to the kernels' sum.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict

import numpy as np

from pyinfer.console import run_cli
from pyinfer.engine.threads import default_threads
from pyinfer.errors import UnsupportedError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="profile_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--budget", type=float, help="VRAM budget as a fraction of the file's bytes")
    where.add_argument("-ngl", "--n-gpu-layers", type=int, help="whole layers on the GPU instead")
    p.add_argument("-n", "--tokens", type=int, default=16, help="decoded tokens profiled (after as many warm-up ones)")
    p.add_argument("--prompt", type=int, default=0, metavar="P",
                   help="profile one prompt batch of P tokens (after a warm-up batch) instead of decoding")
    p.add_argument("-t", "--threads", type=int, default=default_threads())
    p.add_argument("--machine", help="placement figures: a preset name or profile file (default: this machine's)")
    p.add_argument("--dense", action="store_true", help="the dense FFN even if the file has predictors")
    return p


def kernel_family(name: str) -> str:
    """A kernel's name without template arguments and parameters: one row per kernel, not per instance."""
    name = re.sub(r"\(.*", "", name)
    name = re.sub(r"<.*>", "", name)
    return name.removeprefix("void ").strip() or "?"


def profile(a: argparse.Namespace) -> int:
    try:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile
    except ImportError:
        raise UnsupportedError("profile_decode reads CUPTI through torch.profiler: install torch") from None
    from pyinfer.engine.driver import Model
    from pyinfer.formats.gguf_file import GGUFFile

    options = {"n_threads": a.threads, "n_ctx": max(2 * a.tokens, a.prompt) + 16, "n_batch": max(512, a.prompt)}
    if a.dense:
        options["sparse"] = False
    if a.budget is not None:
        total = sum(t.data.nbytes for t in GGUFFile(a.model).tensors.values())
        options["vram_budget"] = int(a.budget * total)
        options["machine"] = a.machine
    else:
        options["n_gpu_layers"] = a.n_gpu_layers
    model = Model(a.model, **options)
    rng = np.random.default_rng(0)
    if a.prompt:  # one batch, after a warm-up batch
        steps, unit = [rng.integers(0, model.config.n_vocab, size=a.prompt).tolist()], f"batch of {a.prompt}"
    else:  # decode steps, after as many warm-up ones
        steps, unit = [[int(t)] for t in rng.integers(0, model.config.n_vocab, size=a.tokens)], "token"

    def run_steps() -> None:
        model.reset()
        for step in steps:
            model.eval(step)

    run_steps()  # graphs built and captured
    times: dict[str, list[float]] = defaultdict(list)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        run_steps()
        wall = time.perf_counter() - t0
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            times[kernel_family(ev.name)].append(ev.device_time_total)
    n = len(steps)
    rows = sorted(times.items(), key=lambda kv: -sum(kv[1]))
    busy = sum(sum(v) for v in times.values()) / n
    plan = model.plan
    where = (f"budget {a.budget:g} of the file: {sum(plan.attn_gpu)} attention layers and "
             f"{sum(plan.hot_rows)} FFN rows on the GPU" if plan else f"-ngl {a.n_gpu_layers}")
    print(f"{a.model}: {where}; {'sparse' if model.sparse_spec else 'dense'} FFN, {a.threads} threads")
    print(f"wall {1e6 * wall / n:.1f} us per {unit}, GPU kernels and copies {busy:.1f} us per {unit}\n")
    print(f"| kernel | calls per {unit} | us per {unit} | us per call | share |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, v in rows:
        print(f"| {name[:60]} | {len(v) / n:.1f} | {sum(v) / n:.1f} | {sum(v) / len(v):.2f} | "
              f"{100 * sum(v) / n / busy:.1f} % |")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("profile_decode", parser(), profile, argv)


if __name__ == "__main__":
    sys.exit(main())
