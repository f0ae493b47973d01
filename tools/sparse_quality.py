"""Quality of a sparsified PowerGGUF at several predictor recalls, against its own dense FFN, in one process:
perplexity (llama.cpp's chunked method, second half of each chunk scored), KL(dense || sparse), same top-1,
and the realised rows: gate rows (or up rows without a gate) where the predictor fires, and up/down rows
where it fires and the neuron is active. For each recall R the predictors' biases are recalibrated
(tools.train_predictors.calibrate) on calibration text, never on the evaluated text.

    python -m tools.sparse_quality MODEL.gguf -f eval.txt --chunks 8 --recall 0.99 0.995 0.998

FFN rows skipped = 1 - mean over the FFN's matrices of the rows each reads: ReGLU reads gate rows where the
predictor fires and up rows only where relu(gate) > 0 as well; SwiGLU/GeGLU read gate and up rows where the
predictor fires; all read down rows where the output is kept.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from tqdm import tqdm

from pyinfer import arguments
from pyinfer.console import run_cli
from pyinfer.engine.driver import Model
from pyinfer.engine.scoring import chunk_tokens, log_softmax
from pyinfer.errors import PyInferError, UnsupportedError
from pyinfer.models.sparse_ffn import metadata_spec
from pyinfer.native import ggml
from pyinfer.sparsity.profiler import calibration_chunks
from pyinfer.sparsity.train_predictors import Predictor, calibrate


def stored_predictors(model: Model) -> list[Predictor]:
    t, d, n_ff = model.file.tensors, model.config.n_embd, model.config.n_ff
    return [Predictor(np.frombuffer(t[f"blk.{il}.fc1.weight"].data, np.float16).reshape(-1, d),
                      np.frombuffer(t[f"blk.{il}.fc2.weight"].data, np.float16).reshape(n_ff, -1),
                      np.frombuffer(t[f"blk.{il}.fc2.bias"].data, np.float32).copy())
            for il in range(model.config.n_layer)]


def calibration_activations(model: Model, chunks: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer (FFN input, |FFN activation|) over the chunks, in the file's neuron order."""
    xs, acts = [[] for _ in range(model.config.n_layer)], [[] for _ in range(model.config.n_layer)]
    for c in chunks:
        _, a = model.ffn_activations(c)
        for il in range(model.config.n_layer):
            xs[il].append(a[f"ffn_inp.{il}"])
            acts[il].append(np.abs(a[f"ffn_act.{il}"]))
    return [(np.concatenate(x), np.concatenate(a)) for x, a in zip(xs, acts, strict=True)]


def with_biases(path: str, preds: list[Predictor], ctx: int, threads: int) -> Model:
    """A sparse model of the file whose predictors use these biases."""
    model = Model(path, n_ctx=ctx, n_batch=ctx, n_threads=threads, sparse=True)
    owner = ggml.Context(4 << 20)  # each tensor keeps its context alive
    model.sparse_spec.pred_bias.clear()
    model.sparse_spec.pred_bias.update({il: owner.tensor_from_numpy(p.bias.astype(np.float32))
                                        for il, p in enumerate(preds)})
    return model


def rows_read(kind: str, fired: float, kept: float) -> float:
    """Mean share of rows read over the FFN's matrices (see the module docstring)."""
    if kind == "reglu":
        return (fired + 2 * kept) / 3
    if kind in ("swiglu", "geglu"):
        return (2 * fired + kept) / 3
    return (fired + kept) / 2  # relu: up and down only


def score(model: Model, chunks, base, preds, thresholds, desc: str) -> tuple[dict, list[np.ndarray]]:
    """(report row, float32 log-probabilities of the scored positions per chunk when base is None);
    base: the dense run's."""
    nll, kl, same, logprobs, fired, kept = [], [], 0, [], [], []
    first = chunks[0].size // 2
    for i, c in enumerate(tqdm(chunks, desc=desc, unit="chunk", file=sys.stderr, disable=None)):
        if preds is None:
            logits = model.logits(c)
        else:
            logits, acts = model.ffn_activations(c)
            for il, p in enumerate(preds):
                hit = p.logits(acts[f"ffn_inp.{il}"]) > 0
                fired.append(hit.mean())
                kept.append((hit & (np.abs(acts[f"ffn_act.{il}"]) > thresholds[il])).mean())
        lp = log_softmax(logits[first:-1])
        target = c[first + 1:]
        nll.extend(-lp[np.arange(len(target)), target])
        if base is None:
            logprobs.append(lp.astype(np.float32))  # only the dense run's are kept: (tokens, n_vocab) each
        else:
            ref = base[i].astype(np.float64)
            kl.extend((np.exp(ref) * (ref - lp)).sum(-1))
            same += int((ref.argmax(-1) == lp.argmax(-1)).sum())
    row = {"ppl": float(np.exp(np.mean(nll))), "tokens": len(nll)}
    if base is not None:
        row |= {"kld": float(np.mean(kl)), "same_top1": same / len(kl)}
    if preds is not None:
        kind = model.config.ffn_kind
        row |= {"fired": float(np.mean(fired)), "kept": float(np.mean(kept)),
                "rows_skipped": 1 - rows_read(kind, float(np.mean(fired)), float(np.mean(kept)))}
    return row, logprobs


def _sweep(args: argparse.Namespace) -> int:
    dense = Model(args.model, n_ctx=args.ctx, n_batch=args.ctx, n_threads=args.threads, sparse=False)
    if not dense.file.has_predictors:
        raise PyInferError(f"{args.model}: no predictors; run `pyinfer sparsify` first")
    if dense.config.ffn_kind == "drelu":
        raise UnsupportedError("dReLU rows are not counted here (up rows depend on the gate)")
    bos = dense.tokenizer.bos_id if dense.tokenizer.add_bos else None
    with open(args.file, "rb") as f:
        chunks = chunk_tokens(dense.tokenize(arguments.utf8(args.file, f.read())), args.ctx, bos, args.chunks)
    # the tail of a longer draw: sparsify calibrated on its head
    calib, _ = calibration_chunks(args.model, args.corpus, 2 * args.calibration_tokens, min(256, args.ctx),
                                  progress=False)
    data = calibration_activations(dense, calib[len(calib) // 2:])
    _, thresholds = metadata_spec(dense.file.metadata, dense.config.n_layer)
    t0 = time.time()
    row, base = score(dense, chunks, None, None, thresholds, "dense")
    print(json.dumps({"config": "dense"} | row | {"s": round(time.time() - t0)}), flush=True)
    preds = stored_predictors(dense)
    for r in args.recall:
        t0 = time.time()
        recal = [calibrate(pr, x, a, thresholds[il], r)
                 for il, (pr, (x, a)) in enumerate(zip(preds, data, strict=True))]
        row, _ = score(with_biases(args.model, recal, args.ctx, args.threads), chunks, base, recal, thresholds,
                       f"recall {r}")
        print(json.dumps({"config": f"recall {r}"} | row | {"s": round(time.time() - t0)}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("model", help="PowerGGUF written by `pyinfer sparsify`")
    p.add_argument("-f", "--file", required=True, help="text to evaluate (not calibration text)")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--recall", type=float, nargs="+", default=[0.99, 0.995, 0.998])
    p.add_argument("--corpus", action="append", help="calibration text: builtin (default), self or a file; repeatable")
    p.add_argument("--calibration-tokens", type=int, default=3072, help="calibration tokens to recalibrate on")
    p.add_argument("-c", "--ctx", type=int, default=512, help="tokens per evaluated chunk")
    p.add_argument("-t", "--threads", type=int, default=2)
    return run_cli("sparse_quality", p, _sweep, argv)


if __name__ == "__main__":
    sys.exit(main())
