"""CUDA kernel benchmark: dense GEMV per weight type against the device copy bandwidth, and the sparse
ops (mul_mat_rows, axpy_rows) at several densities against the dense GEMV of the same matrix, and one
token's whole sparse FFN (the fused group of sparse_ffn.cu: gate and up rows, act, down_t rows) against
the three dense GEMVs of the same FFN.

Kernels are timed without the graph executor: each op's node gets device buffers directly and N calls
of ggml_cuda_forward are captured into one CUDA graph, which is replayed; time per call = wall time of
the replays / (replays * N). The copy bandwidth is a captured 1 GiB device-to-device memcpy, counted as
bytes read + written. Prints markdown tables (for docs/BENCHMARKS.md).

    python -m tools.bench_cuda_kernels [--calls 50] [--replays 20]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import cffi
import numpy as np

from pyinfer import _pyinfer_native, arguments
from pyinfer.console import run_cli
from pyinfer.converters.synthetic import power_law_freqs
from pyinfer.errors import UnsupportedError
from pyinfer.native import ggml
from pyinfer.native.binding import check

ROOT = Path(__file__).resolve().parents[1]  # the checkout: its C headers are read

SHAPES = [(4096, 11008), (5120, 13824), (576, 1536)]  # (k, n): LLaMA-13B/7B FFN and SmolLM2-135M
DENSITIES = [0.01, 0.05, 0.10, 0.25, 0.50, 1.00]
SPARSE_TYPES = (ggml.F16, ggml.Q4_0, ggml.Q8_0, ggml.Q4_K)
L2_COPIES = 8  # weight copies the sparse ops rotate through: 10 % of 8 x 25-141 MB is more than the 50 MB L2



def _cuda_api() -> str:
    """The prototypes of cuda.h (between its extern "C" braces), so the two never drift apart."""
    text = (ROOT / "ggml" / "src" / "cuda" / "cuda.h").read_text()
    body = re.search(r'extern "C" \{\n#endif\n(.*?)\n#ifdef __cplusplus\n\}', text, re.S).group(1)
    return "\n".join(line.split("//")[0] for line in body.splitlines())


def _tensor_struct() -> str:
    """struct ggml_tensor as ggml-impl.h declares it, in cffi's dialect (kept in sync by reading it)."""
    text = (ROOT / "ggml" / "src" / "ggml-impl.h").read_text()
    body = re.search(r"struct ggml_tensor \{.*?\n\};", text, re.S).group(0)
    header = (ROOT / "ggml" / "include" / "ggml.h").read_text() + text  # the sizes' #defines, read, not copied
    for name in ("GGML_MAX_DIMS", "GGML_MAX_SRC", "GGML_MAX_OP_PARAMS", "GGML_MAX_NAME"):
        body = body.replace(name, re.search(rf"#define {name} (\d+)", header).group(1))
    body = re.sub(r"enum ggml_\w+ ", "int ", body)
    return re.sub(r"struct ggml_context \*", "void *", body)


class Cuda:
    """The internal CUDA API (cuda.h) of the built module, opened a second time in cffi's ABI mode."""

    def __init__(self):
        self.ffi = cffi.FFI()
        self.ffi.cdef(_tensor_struct() + _cuda_api())
        self.lib = self.ffi.dlopen(_pyinfer_native.__file__)
        check(self.lib.ggml_cuda_init())
        box = self.ffi.new("void **")
        check(self.lib.ggml_cuda_stream_new(box))
        self.stream = box[0]
        self._keep = []

    def malloc(self, n: int):
        box = self.ffi.new("void **")
        check(self.lib.ggml_cuda_malloc(box, max(n, 1)))
        self._keep.append(box[0])
        return box[0]

    def node(self, t: ggml.Tensor):
        return self.ffi.cast("struct ggml_tensor *", int(ggml.ffi.cast("uintptr_t", t.ptr)))

    def time_calls(self, call, n_calls: int, replays: int) -> float:
        """Seconds per call of call() (which enqueues work on self.stream), from a replayed CUDA graph."""
        check(self.lib.ggml_cuda_graph_capture_begin(self.stream))
        for _ in range(n_calls):
            check(call())
        box = self.ffi.new("void **")
        check(self.lib.ggml_cuda_graph_capture_end(self.stream, box))
        exec_ = box[0]
        check(self.lib.ggml_cuda_graph_launch(exec_, self.stream))  # warm up
        check(self.lib.ggml_cuda_stream_sync(self.stream))
        t0 = time.perf_counter()
        for _ in range(replays):
            check(self.lib.ggml_cuda_graph_launch(exec_, self.stream))
        check(self.lib.ggml_cuda_stream_sync(self.stream))
        dt = time.perf_counter() - t0
        self.lib.ggml_cuda_graph_free(exec_)
        return dt / (replays * n_calls)

    def forward_timer(self, outs, n_calls: int, replays: int) -> float:
        """Gives each op node of `outs` (one, or copies of an op over different weights, taken in turn so
        that their rows come from device memory rather than L2) device memory for its result and scratch,
        then times it."""
        nodes = []
        for out in outs if isinstance(outs, list) else [outs]:
            node = self.node(out)
            node.data = self.malloc(out.nbytes)
            wsize = self.lib.ggml_cuda_op_wsize(node)
            nodes.append((node, self.malloc(wsize) if wsize else self.ffi.NULL))
        turn = iter(range(1 << 30))

        def call():
            node, wdata = nodes[next(turn) % len(nodes)]
            return self.lib.ggml_cuda_forward(node, wdata, self.stream)

        return self.time_calls(call, n_calls, replays)

    def sparse_ffn_timer(self, runs, n_calls: int, replays: int) -> float:
        """Times fused sparse FFN groups: each run is its five nodes (gate rows, act, up rows, mul, axpy of
        down_t), the runs over different weights taken in turn, as forward_timer's copies are."""
        groups = []
        for run in runs:
            nodes = self.ffi.new("struct ggml_tensor *[]", [self.node(t) for t in run])
            for t, node in zip(run, nodes, strict=True):
                node.data = self.malloc(t.nbytes)
            group = self.ffi.new("struct ggml_cuda_group *", {"kind": self.lib.GGML_CUDA_FUSE_SPARSE_FFN, "len": 5})
            groups.append((group, nodes, self.malloc(max(self.lib.ggml_cuda_op_wsize(n) for n in nodes))))
        turn = iter(range(1 << 30))

        def call():
            group, nodes, wdata = groups[next(turn) % len(groups)]
            return self.lib.ggml_cuda_forward_group(group, nodes, wdata, self.stream)

        return self.time_calls(call, n_calls, replays)


def copy_bandwidth(cu: Cuda, calls: int, replays: int) -> float:
    n = 1 << 30
    src, dst = cu.malloc(n), cu.malloc(n)
    sec = cu.time_calls(lambda: cu.lib.ggml_cuda_memcpy_d2d(dst, src, n, cu.stream), max(2, calls // 10), replays)
    return 2 * n / sec


def weight(ctx: ggml.Context, type_: int, n: int, k: int, rng) -> ggml.Tensor:
    return ctx.tensor_from_numpy(rng.standard_normal((n, k)).astype(np.float32), type_).to_device()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_cuda_kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50, help="forward calls captured per CUDA graph")
    ap.add_argument("--replays", type=int, default=20, help="replays of the graph timed")
    ap.add_argument("--only", help="one weight type (e.g. q4_0), and no sparse table unless --shapes is given")
    ap.add_argument("--masks", choices=("random", "power-law"), default="random",
                    help="sparse table: uniform random masks, or hot-first power-law ones as a PowerGGUF's "
                         "neurons fire (make_synthetic_model's frequencies, 17 %% of neurons carrying 80 %%)")
    ap.add_argument("--shapes", help="k x n shapes to time, e.g. 5120x13824 (default: all)")
    return ap


def measure(args: argparse.Namespace) -> int:
    shapes = arguments.shapes("--shapes", args.shapes) if args.shapes else SHAPES
    if not ggml.cuda_available():
        raise UnsupportedError("no CUDA device here: this benchmark times the GPU's kernels")
    cu = Cuda()
    rng = np.random.default_rng(0)
    bw = copy_bandwidth(cu, args.calls, args.replays)
    print(f"device: {ggml.ffi.string(ggml.lib.ggml_cuda_device_name()).decode()}; "
          f"copy bandwidth (D2D 1 GiB, read + write): {bw / 1e9:.0f} GB/s\n")

    print("## Dense GEMV (mul_mat, m = 1)\n")
    print("| type | k x n | weight MB | us | GB/s | % of copy |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    dense_us = {}
    for k, n in shapes:
        for type_ in ggml.WEIGHT_TYPES:
            if k % ggml.block_size(type_) or (args.only and ggml.type_name(type_) != args.only):
                continue
            ctx = ggml.Context(ggml.row_size(type_, k) * n + (16 << 20))
            w = weight(ctx, type_, n, k, rng)
            x = ctx.tensor_from_numpy(rng.standard_normal((1, k)).astype(np.float32)[0]).to_device()
            sec = cu.forward_timer(ctx.mul_mat(w, x), args.calls, args.replays)
            dense_us[(type_, k, n)] = sec * 1e6
            print(f"| {ggml.type_name(type_)} | {k} x {n} | {w.nbytes / 1e6:.1f} | {sec * 1e6:.1f} | "
                  f"{w.nbytes / sec / 1e9:.0f} | {100 * w.nbytes / sec / bw:.0f} |")

    if args.only and not args.shapes:
        return 0
    print(f"\n## Sparse ops vs the dense GEMV of the same matrix ({args.masks} F32 masks, m = 1)\n")
    print("| type | k x n | density | mul_mat_rows us | speed-up | axpy_rows us | speed-up | sparse FFN us "
          "| vs 3 dense GEMVs |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for k, n in shapes if args.shapes else SHAPES[:2]:
        for type_ in SPARSE_TYPES:
            if args.only and ggml.type_name(type_) != args.only:
                continue
            ctx = ggml.Context(3 * L2_COPIES * ggml.row_size(type_, k) * n + (16 << 20))
            # mul_mat_rows: n rows of k; axpy_rows: n rows of d = k. Copies: a selection's rows would stay in
            # L2 from one call to the next, unlike a decode step's, which reads every layer in between
            ws = [weight(ctx, type_, n, k, rng) for _ in range(L2_COPIES)]
            ffns = [(ws[i], weight(ctx, type_, n, k, rng), weight(ctx, type_, n, k, rng)) for i in range(L2_COPIES)]
            x = ctx.tensor_from_numpy(rng.standard_normal(k).astype(np.float32)).to_device()
            h = ctx.tensor_from_numpy(rng.standard_normal(n).astype(np.float32)).to_device()
            for dens in DENSITIES:
                p = power_law_freqs(n, dens) if args.masks == "power-law" and dens < 1 else np.full(n, dens)
                mask = ctx.tensor_from_numpy(np.where(rng.random(n) < p, 1.0, -1.0).astype(np.float32)).to_device()
                t_mmr = cu.forward_timer([ctx.mul_mat_rows(w, x, mask) for w in ws], args.calls, args.replays) * 1e6
                t_axpy = cu.forward_timer([ctx.axpy_rows(w, h, mask) for w in ws], args.calls, args.replays) * 1e6
                runs = []
                for wg, wu, wd in ffns:
                    gate = ctx.mul_mat_rows(wg, x, mask)
                    act = ctx.silu(gate)
                    up = ctx.mul_mat_rows(wu, x, mask)
                    mul = ctx.mul(act, up)
                    runs.append([gate, act, up, mul, ctx.axpy_rows(wd, mul, mask)])
                t_ffn = cu.sparse_ffn_timer(runs, args.calls, args.replays) * 1e6
                base = dense_us[(type_, k, n)]
                print(f"| {ggml.type_name(type_)} | {k} x {n} | {dens:.0%} | {t_mmr:.1f} | {base / t_mmr:.1f}x | "
                      f"{t_axpy:.1f} | {base / t_axpy:.1f}x | {t_ffn:.1f} | {3 * base / t_ffn:.1f}x |")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("bench_cuda_kernels", parser(), measure, argv)


if __name__ == "__main__":
    sys.exit(main())
