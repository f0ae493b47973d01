"""Decoding with the expert cache against static placement, on token streams with and without temporal locality
(issue 28's third kind of routing), a mixture under a VRAM budget; llama.cpp's best configuration for the same
bytes decoding random tokens in the same run (its layer split reads the same bytes whatever the routing).

    python -m tools.bench_trace -m MODEL.gguf --budget 0.333 [--machine h100] [--tokens 256] [--window 32] \\
        [--pool 4] [--rounds 2] [--llama-bench BIN]

A local stream is windows of `window` tokens, each drawn from its own `pool` random token ids: a synthetic
mixture routes a repeated token alike, so consecutive tokens reuse experts for a window, then move on.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from pyinfer.console import run_cli
from pyinfer.engine.threads import default_threads
from pyinfer.formats.gguf_file import GGUFFile


def stream(kind: str, n: int, window: int, pool: int, n_vocab: int, rng: np.random.Generator) -> list[int]:
    if kind == "random":
        return rng.integers(0, n_vocab, n).tolist()
    out: list[int] = []
    while len(out) < n:
        out += rng.choice(rng.integers(0, n_vocab, pool), window).tolist()
    return out[:n]


def decode_rate(model, tokens: list[int]) -> float:
    """Tokens per second decoding `tokens` one at a time (after the first)."""
    model.reset()
    model.eval(tokens[:1])
    t0 = time.perf_counter()
    for t in tokens[1:]:
        model.eval([t])
    return (len(tokens) - 1) / (time.perf_counter() - t0)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_trace", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--budget", type=float, default=0.333, help="VRAM budget as a fraction of the file's bytes")
    p.add_argument("--machine", default=None, metavar="NAME|FILE")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--pool", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("-t", "--threads", type=int, default=default_threads())
    p.add_argument("--llama-bench", default=None, help="path of llama-bench: its best configuration's tg too")
    return p


def measure(a: argparse.Namespace) -> int:
    from pyinfer.engine.driver import Model
    from pyinfer.engine.placement import model_costs
    from tools.bench_hybrid import llama_configs, run_llama

    g = GGUFFile(a.model)
    budget = int(a.budget * sum(t.data.nbytes for t in g.tensors.values()))
    rng = np.random.default_rng(7)
    streams = {kind: stream(kind, a.tokens, a.window, a.pool, g.config.n_vocab, rng) for kind in ("random", "local")}
    rates: dict[str, list[float]] = {}
    swaps: dict[str, int] = {}
    for _ in range(a.rounds):
        for cache in (False, True):
            for kind, tokens in streams.items():  # a fresh model each: a cache starts from the plan's placement
                model = Model(a.model, n_ctx=a.tokens + 16, n_threads=a.threads, vram_budget=budget,
                              machine=a.machine, expert_cache=cache)
                key = f"{kind}, {'cache' if cache else 'static'}"
                rates.setdefault(key, []).append(decode_rate(model, tokens))
                if model.expert_cache is not None:
                    swaps[key] = swaps.get(key, 0) + model.expert_cache.swaps
                del model
        if a.llama_bench:
            costs = model_costs(g, a.tokens + 16, 2, False, 512)
            for label, flags in llama_configs(g, budget, costs.reserve_bytes - costs.dequantized_bytes):
                r = run_llama(a.llama_bench, a.model, flags, a.threads, 512, 0, a.tokens, 1)
                rates.setdefault(f"llama.cpp {label}, random", []).append(r.get("tg", float("nan")))
    print(f"{a.model}: budget {budget / 2**30:.2f} GiB ({a.budget:g}), {a.tokens} tokens, local windows of {a.window} "
          f"from {a.pool} ids")
    print("| stream, placement | t/s median (range) | moves, all rounds |\n| --- | ---: | ---: |")
    for key, values in rates.items():
        print(f"| {key} | {np.median(values):.1f} ({min(values):.1f}-{max(values):.1f}) | {swaps.get(key, '')} |")
    print(json.dumps(rates), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("bench_trace", parser(), measure, argv)


if __name__ == "__main__":
    sys.exit(main())
