"""tg N (and optionally pp N) of one PowerGGUF with predictors, dense and sparse FFN, in one run.

    python -m tools.bench_sparse MODEL [--tg 128] [-t THREADS] [--pp 2,4,8,32] [--ffn] [--ops]

Prints tokens/s of both, the realised FFN density, the predictors' time, the achieved speed-up and the
bytes-per-token bound on it (decoding reads every weight once per token: the sparse decoder reads the
non-FFN weights, the predictors and density x the FFN weights). --pp times prompts of each size with
up/gate as selected rows (`mul_mat_rows`) and as a dense `mul_mat` under the same mask, which is how
models.sparse_ffn.DENSE_ABOVE was chosen. --ffn times the FFNs of all layers alone, dense and sparse (the
predictors included), and the predictors alone, on graphs of just those nodes with a random input
(realistic for SYNTHETIC predictors, whose neurons fire at their set frequency for any input); all layers
at once, so that, as in decoding, the selected rows are not still in the CPU caches from the previous run.
--ops splits that into the first FFN matrix (GEMV vs selected rows, and vs as many rows taken from the
start: the cost of scattering) and down_t (axpy dense vs masked).
The issue's target is sparse <= 1.3 rho dense + predictor. Label results of tools/make_synthetic_model.py
files SYNTHETIC.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from pyinfer.engine.driver import Model
from pyinfer.models.common import Builder, ffn_block
from pyinfer.models.sparse_ffn import input_ffn, over_threshold, predict
from pyinfer.native import ggml

FFN_PARTS = ("ffn_up.", "ffn_gate.", "ffn_down_t.")
PRED_PARTS = (".fc1.", ".fc2.")


def weight_bytes(model: Model) -> tuple[int, int, int]:
    """(FFN, predictor, other) bytes read per decoded token; of the embedding table only one row."""
    ffn = pred = other = 0
    for name, info in model.file.tensors.items():
        n = info.data.nbytes
        if any(p in name for p in FFN_PARTS):
            ffn += n
        elif any(p in name for p in PRED_PARTS):
            pred += n
        elif name == "token_embd.weight" and "output.weight" in model.file.tensors:
            other += n // info.ne[1]
        elif "ffn_act_freq" not in name:
            other += n
    return ffn, pred, other


def tg(model: Model, n: int, reps: int, rng: np.random.Generator) -> float:
    """Median tokens/s of n single-token steps from an empty cache (after one warm-up run)."""
    rates = []
    for rep in range(reps + 1):
        model.reset()
        model.timings.reset()
        tokens = rng.integers(0, model.config.n_vocab, size=n)
        t0 = time.perf_counter()
        for tok in tokens:
            model.eval([tok])
        if rep:
            rates.append(n / (time.perf_counter() - t0))
    return float(np.median(rates))


def pp_sweep(model: Model, sizes: list[int], rng: np.random.Generator) -> list[str]:
    """ms per prompt of each size, up/gate as selected rows vs dense under the same mask."""
    lines = ["| prompt tokens | rows (ms) | dense (ms) |", "| ---: | ---: | ---: |"]
    for n in sizes:
        times = []
        for dense_above in (10**9, 0):
            model.sparse_spec.dense_above = dense_above
            model._graphs.clear()
            best = float("inf")
            for _ in range(3):
                model.reset()
                t0 = time.perf_counter()
                model.eval(rng.integers(0, model.config.n_vocab, size=n))
                best = min(best, time.perf_counter() - t0)
            times.append(1e3 * best)
        lines.append(f"| {n} | {times[0]:.1f} | {times[1]:.1f} |")
    return lines


def interleaved_min_ms(graphs: list[ggml.Graph], pool: ggml.ThreadPool, reps: int) -> list[float]:
    """Each graph's fastest compute of reps rounds that run every graph once in turn (after a warm-up round):
    a burst of other load on a shared machine then slows one round of all graphs, not one graph's series."""
    times = [[] for _ in graphs]
    for _ in range(reps + 1):
        for g, t in zip(graphs, times, strict=True):
            t0 = time.perf_counter()
            g.compute(pool)
            t.append(1e3 * (time.perf_counter() - t0))
    return [min(t[1:]) for t in times]


def ffn_costs(model: Model, rng: np.random.Generator, reps: int) -> list[str]:
    """Lines of a report: every layer's FFN dense, sparse (with its predictor: the fused op over the bundled
    rows where the model has them, and the three separate row ops) and the predictors alone."""
    spec = dataclasses.replace(model.sparse_spec, masks={})
    cfg = model.config
    ctx = ggml.Context(64 << 20)
    h = ctx.tensor_from_numpy(rng.standard_normal(cfg.n_embd).astype(np.float32))  # (n_embd,)
    unbundled = {name: t for name, t in model.weights.items() if ".ffn_bundle." not in name}
    variants = {"dense": [], "sparse": [], "separate": [], "predictor": []}
    for il in range(cfg.n_layer):
        variants["dense"].append(ffn_block(Builder(ctx, cfg, model.weights, None), il, h))
        b = Builder(ctx, cfg, model.weights, None, sparse=spec)
        variants["sparse"].append(ffn_block(b, il, h))
        separate = Builder(ctx, cfg, unbundled, None, sparse=dataclasses.replace(spec, masks={}))
        variants["separate"].append(ffn_block(separate, il, h))
        variants["predictor"].append(predict(b, il, h))
    masks = list(spec.masks.values())
    graphs = [ggml.Graph(ctx, nodes + (masks if name == "sparse" else [])).plan() for name, nodes in variants.items()]
    t_dense, t_sparse, t_sep, t_pred = (t / cfg.n_layer for t in interleaved_min_ms(graphs, model.pool, reps))
    rho = sum(float(np.count_nonzero(m.numpy() > 0)) for m in masks) / (cfg.n_ff * cfg.n_layer)
    bundled = any(".ffn_bundle." in name for name in model.weights)
    return [f"FFN per layer (mean of {cfg.n_layer}): dense {t_dense:.3f} ms, sparse + predictor {t_sparse:.3f} ms "
            f"({'fused op over bundled rows' if bundled else 'separate row ops'}; separate row ops {t_sep:.3f} ms), "
            f"predictor {t_pred:.3f} ms, density rho {100 * rho:.1f} %",
            f"(sparse - predictor) / dense = {(t_sparse - t_pred) / t_dense:.3f} (separate row ops "
            f"{(t_sep - t_pred) / t_dense:.3f}); target 1.3 rho = {1.3 * rho:.3f}: "
            f"{'met' if t_sparse <= 1.3 * rho * t_dense + t_pred else 'missed'}"]


def input_ffn_costs(model: Model, rng: np.random.Generator, reps: int) -> list[str]:
    """Lines of a report for a file of input sparsity: per layer the dense FFN and input_ffn on one real FFN
    input per layer (the last of 32 random tokens: the thresholds need the model's own scale), and its parts:
    the channel-major gate and up under the input mask, down_t under the activation mask, the masks."""
    cfg, spec = model.config, dataclasses.replace(model.sparse_spec, masks={})
    _, acts = model.ffn_activations(list(rng.integers(0, cfg.n_vocab, min(32, model.n_ctx, model.n_batch))))
    ctx = ggml.Context(64 << 20)
    xs = [ctx.tensor_from_numpy(acts[f"ffn_inp.{il}"][-1].copy()) for il in range(cfg.n_layer)]  # (n_embd,)
    hs = [ctx.tensor_from_numpy(acts[f"ffn_act.{il}"][-1].copy()) for il in range(cfg.n_layer)]  # (n_ff,)
    b = Builder(ctx, cfg, model.weights, None, sparse=spec)
    sel_x = [over_threshold(ctx, x, spec.neg_input_thresholds[il]) for il, x in enumerate(xs)]
    sel_h = [over_threshold(ctx, h, spec.neg_thresholds[il]) for il, h in enumerate(hs)]
    variants = {
        "dense FFN": [ffn_block(Builder(ctx, cfg, model.weights, None), il, x) for il, x in enumerate(xs)],
        "input_ffn": [input_ffn(b, il, x)[0] for il, x in enumerate(xs)],
        "masks": sel_x + sel_h,
        "gate_t + up_t": [ctx.axpy_rows(b.w(f"blk.{il}.{m}"), xs[il], sel_x[il]) for il in range(cfg.n_layer)
                          for m in ("ffn_gate_t", "ffn_up_t")],
        "gate + up dense": [ctx.mul_mat(b.w(f"blk.{il}.{m}"), xs[il]) for il in range(cfg.n_layer)
                            for m in ("ffn_gate", "ffn_up")],
        "down_t masked": [ctx.axpy_rows(b.w(f"blk.{il}.ffn_down_t"), hs[il], sel_h[il]) for il in range(cfg.n_layer)],
        "down_t dense": [ctx.axpy_rows(b.w(f"blk.{il}.ffn_down_t"), h) for il, h in enumerate(hs)],
    }
    times = interleaved_min_ms([ggml.Graph(ctx, nodes).plan() for nodes in variants.values()], model.pool, reps)
    t_x = model.file.metadata["pyinfer.sparsity.input_thresholds"]
    kept_x = np.mean([np.mean(np.abs(acts[f"ffn_inp.{il}"][-1]) > t_x[il]) for il in range(cfg.n_layer)])
    kept_h = np.mean([np.mean(np.abs(acts[f"ffn_act.{il}"][-1]) > spec.thresholds[il]) for il in range(cfg.n_layer)])
    return [f"per layer (mean of {cfg.n_layer}), input channels read {100 * kept_x:.1f} %, neurons read "
            f"{100 * kept_h:.1f} %: " + ", ".join(f"{name} {ms / cfg.n_layer:.3f} ms" for name, ms in
                                                  zip(variants, times, strict=True))]


def op_costs(model: Model, rng: np.random.Generator, reps: int) -> list[str]:
    """Lines of a report: per layer, the gate GEMV and the down_t axpy dense and over the predicted rows."""
    cfg, ctx = model.config, ggml.Context(64 << 20)
    h = ctx.tensor_from_numpy(rng.standard_normal(cfg.n_embd).astype(np.float32))  # (n_embd,)
    act = ctx.tensor_from_numpy(rng.standard_normal(cfg.n_ff).astype(np.float32))  # (n_ff,)
    b = Builder(ctx, cfg, model.weights, None, sparse=dataclasses.replace(model.sparse_spec, masks={}))
    preds = [predict(b, il, h) for il in range(cfg.n_layer)]
    ggml.Graph(ctx, preds).plan().compute(model.pool)
    masks = [ctx.tensor_from_numpy((p.numpy() > 0).astype(np.float32)) for p in preds]
    rho = float(np.mean([m.numpy().mean() for m in masks]))
    # as many rows, but the first ones: what the same density costs when the rows are contiguous
    firsts = [ctx.tensor_from_numpy((np.arange(cfg.n_ff) < np.count_nonzero(m.numpy())).astype(np.float32))
              for m in masks]
    first = "ffn_gate" if cfg.gated else "ffn_up"
    ops = {f"{first} mul_mat": [ctx.mul_mat(b.w(f"blk.{il}.{first}"), h) for il in range(cfg.n_layer)],
           f"{first} mul_mat_rows": [ctx.mul_mat_rows(b.w(f"blk.{il}.{first}"), h, m) for il, m in enumerate(masks)],
           f"{first} mul_mat_rows contiguous": [ctx.mul_mat_rows(b.w(f"blk.{il}.{first}"), h, m)
                                                for il, m in enumerate(firsts)],
           "ffn_down_t axpy_rows dense": [ctx.axpy_rows(b.w(f"blk.{il}.ffn_down_t"), act) for il in range(cfg.n_layer)],
           "ffn_down_t axpy_rows masked": [ctx.axpy_rows(b.w(f"blk.{il}.ffn_down_t"), act, m)
                                           for il, m in enumerate(masks)]}
    times = interleaved_min_ms([ggml.Graph(ctx, nodes).plan() for nodes in ops.values()], model.pool, reps)
    t = dict(zip(ops, (x / cfg.n_layer for x in times), strict=True))
    return [f"per layer at the predicted density rho {100 * rho:.1f} %: " +
            ", ".join(f"{name} {ms:.3f} ms" for name, ms in t.items()),
            f"rows / dense: {first} {t[first + ' mul_mat_rows'] / t[first + ' mul_mat']:.3f} "
            f"(contiguous: {t[first + ' mul_mat_rows contiguous'] / t[first + ' mul_mat']:.3f}), "
            f"ffn_down_t {t['ffn_down_t axpy_rows masked'] / t['ffn_down_t axpy_rows dense']:.3f}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_sparse", description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--tg", type=int, default=128)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--sparsity-threshold", type=float, default=0.0)
    p.add_argument("--pp", default="", help="comma-separated prompt sizes for the rows-vs-dense sweep")
    p.add_argument("--ffn", action="store_true", help="also time the FFNs alone, dense vs sparse")
    p.add_argument("--ops", action="store_true", help="also time the first FFN matrix and down_t alone, dense vs rows")
    p.add_argument("--ffn-reps", type=int, default=10, help="interleaved rounds for --ffn/--ops (fastest of each)")
    a = p.parse_args(argv)
    rng = np.random.default_rng(1234)
    kw = dict(n_ctx=max(a.tg, *[int(s) for s in a.pp.split(",") if s], 1) + 16, n_threads=a.threads)
    sparse = Model(a.model, sparse=True, sparsity_threshold=a.sparsity_threshold, **kw)
    if a.ffn:
        costs = input_ffn_costs if sparse.sparse_spec.kind == "input" else ffn_costs
        print("\n".join(costs(sparse, rng, a.ffn_reps)))
    if a.ops:
        print("\n".join(op_costs(sparse, rng, a.ffn_reps)))
    if a.ffn or a.ops:
        if not a.tg:
            return 0
    dense = Model(a.model, sparse=False, **kw)
    synthetic = bool(dense.file.metadata.get("pyinfer.synthetic", False))
    t_dense = tg(dense, a.tg, a.reps, rng)
    t_sparse = tg(sparse, a.tg, a.reps, rng)
    x = sparse.timings.extra
    rho = x["ffn_rows_active"] / x["ffn_rows_total"]
    ffn, pred, other = weight_bytes(sparse)
    bound = (ffn + other) / (rho * ffn + pred + other)
    label = f" (SYNTHETIC: {dense.file.metadata.get('general.name', '')})" if synthetic else ""
    print(f"model: {a.model}{label}, threads {sparse.n_threads}, tg{a.tg}")
    print(f"bytes/token: FFN {ffn / 1e6:.1f} MB, predictors {pred / 1e6:.1f} MB, other {other / 1e6:.1f} MB")
    print(f"dense : {t_dense:8.2f} tokens/s ({(ffn + other) * t_dense / 1e9:.1f} GB/s)")
    print(f"sparse: {t_sparse:8.2f} tokens/s, FFN density {100 * rho:.1f} %, predictors "
          f"{x['predictor_ms']:.2f} ms/token ({100 * x['predictor_ms'] * t_sparse / 1e3:.1f} % of the time)")
    print(f"speed-up {t_sparse / t_dense:.2f}x; bytes-per-token bound {bound:.2f}x "
          f"({100 * (t_sparse / t_dense) / bound:.0f} % of it)")
    if a.pp:
        print("\n".join(pp_sweep(sparse, [int(s) for s in a.pp.split(",")], rng)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
