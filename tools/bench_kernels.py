"""Benchmark of the CPU matmul kernels: dense GEMV bandwidth and the sparse ops' cost per density.

    python -m tools.bench_kernels --threads 16 [--types q4_0,q8_0] [--working-set-mb 1024]
    python -m tools.bench_kernels --threads 16 --prompt 512   # prompt GEMMs: 4 x 4 tiles against AMX's

Batch-1 decoding is bound by the bytes of weights read, so dense GEMV is reported in GB/s next to
the machine's copy bandwidth (a numpy copy split over the same number of threads, bytes read +
written). Each timed graph cycles through enough copies of the weights that they cannot stay in the
last-level cache. Sparse ops (mask selecting a random fraction rho of the rows, one token) are
reported as time relative to the dense GEMV over the same bytes; the target is <= 1.3 rho.
With --prompt N, one mul_mat of N columns per matrix instead (a prompt's GEMM), in GFLOP/s: the 4 x 4 tiles
against the int8 tile GEMM over the weights' levels (AMX where the CPU has it, else its scalar oracle: not
timed). Prints markdown.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import numpy as np

from pyinfer import arguments
from pyinfer.console import run_cli
from pyinfer.engine.threads import default_threads
from pyinfer.errors import InvalidArgumentError
from pyinfer.native import ggml

TYPES = {"f16": ggml.F16, "q8_0": ggml.Q8_0, "q4_0": ggml.Q4_0, "q4_1": ggml.Q4_1, "q5_0": ggml.Q5_0,
         "q4_K": ggml.Q4_K, "q6_K": ggml.Q6_K, "mxfp4": ggml.MXFP4}
SIZES = ((4096, 11008), (576, 1536))  # (d, n_ff): FFN up is [d, n_ff], down_t is [d, n_ff] too
DENSITIES = (0.01, 0.05, 0.10, 0.25, 0.50, 1.00)


def copy_bandwidth(n_threads: int, mb: int = 1024) -> float:
    """GB/s of a large numpy copy split over n_threads (bytes read + bytes written)."""
    src = np.ones(mb << 18, dtype=np.float32)
    dst = np.empty_like(src)
    chunks = np.array_split(np.arange(src.size), n_threads)
    bounds = [(c[0], c[-1] + 1) for c in chunks if c.size]

    def part(lo: int, hi: int) -> None:
        np.copyto(dst[lo:hi], src[lo:hi])

    best = float("inf")
    for _ in range(5):
        workers = [threading.Thread(target=part, args=b) for b in bounds]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


class Timer:
    """Median seconds per node of graphs whose nodes each read one weight copy."""

    def __init__(self, pool: ggml.ThreadPool, min_seconds: float):
        self.pool = pool
        self.min_seconds = min_seconds

    def per_node(self, ctx: ggml.Context, nodes: list[ggml.Tensor]) -> float:
        g = ggml.Graph(ctx, nodes).plan()
        g.compute(self.pool)  # warm-up: pages touched, threads awake
        times = []
        start = time.perf_counter()
        while len(times) < 5 or (time.perf_counter() - start < self.min_seconds and len(times) < 50):
            t0 = time.perf_counter()
            g.compute(self.pool)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) / len(nodes)


def weight_copies(ctx: ggml.Context, type_: int, shape: tuple[int, int], working_set: int,
                  rng: np.random.Generator) -> list[ggml.Tensor]:
    """Copies of one random weight matrix (numpy shape) of type_, enough to fill working_set bytes."""
    raw = ggml.quantize(type_, rng.standard_normal(shape).astype(np.float32)).reshape(-1)
    copies = max(1, -(-working_set // raw.nbytes))
    tensors = []
    for _ in range(copies):
        t = ctx.new_tensor(type_, shape)
        t.raw()[...] = raw
        tensors.append(t)
    return tensors


def mask(ctx: ggml.Context, n_rows: int, density: float, rng: np.random.Generator) -> ggml.Tensor:
    """F32 [n_rows] (one token) selecting round(density * n_rows) random rows."""
    m = np.zeros(n_rows, np.float32)
    m[rng.permutation(n_rows)[: max(1, round(density * n_rows))]] = 1.0
    return ctx.tensor_from_numpy(m)


def bench_case(timer: Timer, type_: int, d: int, n_ff: int, working_set: int, rng) -> dict | None:
    blk = ggml.block_size(type_)
    if d % blk or n_ff % blk:
        return None
    bytes_w = ggml.row_size(type_, d) * n_ff
    copies = max(1, -(-working_set // bytes_w))
    ctx = ggml.Context(2 * copies * bytes_w + (64 << 20))
    up = weight_copies(ctx, type_, (n_ff, d), working_set, rng)      # [d, n_ff]: n_ff rows of d
    down = weight_copies(ctx, type_, (d, n_ff), working_set, rng)    # [n_ff, d]: the dense down projection
    x = ctx.tensor_from_numpy(rng.standard_normal(d).astype(np.float32))     # [d]: one token
    h = ctx.tensor_from_numpy(rng.standard_normal(n_ff).astype(np.float32))  # [n_ff]
    res = {"dense_up": timer.per_node(ctx, [ctx.mul_mat(w, x) for w in up]),
           "dense_down": timer.per_node(ctx, [ctx.mul_mat(w, h) for w in down]), "bytes": bytes_w}
    for rho in DENSITIES:
        sel = mask(ctx, n_ff, rho, rng)
        res[("mmr", rho)] = timer.per_node(ctx, [ctx.mul_mat_rows(w, x, sel) for w in up])
        res[("axpy", rho)] = timer.per_node(ctx, [ctx.axpy_rows(w, h, sel) for w in up])  # up's layout = down_t's
    return res


def bench_prompt(timer: Timer, type_: int, d: int, n_ff: int, cols: int, rng) -> dict[str, float]:
    """GFLOP/s of an [d, n_ff] weight times cols columns through each prompt kernel this CPU has."""
    ctx = ggml.Context(ggml.row_size(type_, d) * n_ff + 4 * d * cols + (64 << 20))
    (w,) = weight_copies(ctx, type_, (n_ff, d), 0, rng)
    x = ctx.tensor_from_numpy(rng.standard_normal((cols, d)).astype(np.float32))
    modes = {"4x4 tiles": ggml.lib.GGML_LEVELS_GEMM_OFF}
    if ggml.lib.ggml_cpu_has_amx() and ggml.block_size(type_) > 1:  # the quantized types have levels, F16 none
        modes["AMX"] = ggml.lib.GGML_LEVELS_GEMM_AUTO
    res = {}
    try:
        for label, mode in modes.items():
            ggml.lib.ggml_cpu_set_levels_gemm(mode)
            res[label] = 2 * d * n_ff * cols / timer.per_node(ctx, [ctx.mul_mat(w, x)]) / 1e9
    finally:
        ggml.lib.ggml_cpu_set_levels_gemm(ggml.lib.GGML_LEVELS_GEMM_AUTO)
    return res


def measure_prompt(args: argparse.Namespace, sizes, timer: Timer, rng) -> None:
    print(f"# Prompt GEMMs: {args.prompt} columns, {args.threads} threads, AMX "
          f"{'yes' if ggml.lib.ggml_cpu_has_amx() else 'no'}\n")
    print("| type | d x n_ff | kernel | GFLOP/s |\n|---|---|---|---|")
    for d, n_ff in sizes:
        for name in args.types.split(","):
            if d % ggml.block_size(TYPES[name]):
                continue
            for label, gflops in bench_prompt(timer, TYPES[name], d, n_ff, args.prompt, rng).items():
                print(f"| {name} | {d} x {n_ff} | {label} | {gflops:.0f} |")
            sys.stdout.flush()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--types", default=",".join(TYPES), help="comma-separated: " + ",".join(TYPES))
    ap.add_argument("--working-set-mb", type=int, default=1024, help="weight bytes cycled through per graph")
    ap.add_argument("--min-seconds", type=float, default=0.5, help="timing per measurement")
    ap.add_argument("--sizes", default=",".join(f"{d}x{n}" for d, n in SIZES), help="d x n_ff pairs")
    ap.add_argument("--prompt", type=int, default=0, help="columns of a prompt GEMM to time instead (0: decode)")
    return ap


def measure(args: argparse.Namespace) -> int:
    sizes = arguments.shapes("--sizes", args.sizes)
    unknown = [t for t in args.types.split(",") if t not in TYPES]
    if unknown:
        raise InvalidArgumentError(f"--types: unknown {', '.join(unknown)}; known: {', '.join(TYPES)}")
    arguments.integer("--threads", args.threads, 1)
    rng = np.random.default_rng(0)
    pool = ggml.ThreadPool(args.threads)
    timer = Timer(pool, args.min_seconds)
    if args.prompt:
        arguments.integer("--prompt", args.prompt, 1)
        measure_prompt(args, sizes, timer, rng)
        return 0
    copy_gbs = copy_bandwidth(args.threads)
    simd = "AVX2" if ggml.lib.ggml_cpu_has_avx2() else "scalar"
    print(f"# CPU kernels: {args.threads} threads, {simd}, copy bandwidth {copy_gbs:.1f} GB/s "
          f"(numpy copy over {args.threads} threads, read + write)\n")
    print("Dense: one token (GEMV), weights streamed from memory. Sparse: time relative to the dense GEMV "
          "over the same bytes, at mask density rho (target <= 1.3 rho for rho >= 5%).\n")
    rho_cols = " | ".join(f"{int(r * 100)}%" for r in DENSITIES)
    for d, n_ff in sizes:
        print(f"## {d} x {n_ff}\n")
        print(f"| type | op | dense us | GB/s | % copy | {rho_cols} |")
        print("|---|---|---|---|---|" + "---|" * len(DENSITIES))
        for name in args.types.split(","):
            res = bench_case(timer, TYPES[name], d, n_ff, args.working_set_mb << 20, rng)
            if res is None:
                print(f"| {name} | - | n/a: {d} or {n_ff} not a multiple of the block | | |" + " |" * len(DENSITIES))
                continue
            for op, dense_key in (("mmr", "dense_up"), ("axpy", "dense_down")):
                t = res[dense_key]
                gbs = res["bytes"] / t / 1e9
                label = "mul_mat_rows" if op == "mmr" else "axpy_rows"
                ratios = " | ".join(f"{res[(op, r)] / t:.3f}" for r in DENSITIES)
                print(f"| {name} | {label} | {t * 1e6:.0f} | {gbs:.1f} | {100 * gbs / copy_gbs:.0f} | {ratios} |")
            sys.stdout.flush()
        print()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("bench_kernels", parser(), measure, argv)


if __name__ == "__main__":
    sys.exit(main())
