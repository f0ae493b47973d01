"""Sparsify a model in one command: profile it on calibration text, pick per-layer thresholds, store the
FFN neurons hot-first, train activation predictors, and write the PowerGGUF with all of it. With `--method
centred` (SwiGLU/GeGLU, no training): thresholds on the FFN's input and activations for a target share of its
weight bytes skipped, each taken around the channel's or neuron's mean on the calibration text, and channel-major
gate and up (pyinfer.sparsity.input_sparsity); `--method input` is the same around zero (TEAL's baseline). Which
of the two loses less is the model's (centring won on Qwen2.5-Coder-0.5B and lost on the 1.5B, SmolLM2 and
Gemma-3): the default, `--method auto`, calibrates both on three quarters of the calibration chunks and keeps the
one with the lower perplexity on the last quarter (a ReLU-family FFN gets predictors).

Written: blk.N.fc1.weight F16 ne [n_embd, r_l], blk.N.fc2.weight F16 ne
[r_l, n_ff], blk.N.fc2.bias F32 [n_ff] (a neuron is predicted active where fc2 @ relu(fc1 @ x) + bias > 0),
blk.N.ffn_act_freq F32 [n_ff] (non-increasing), and the keys pyinfer.neuron_order, pyinfer.sparsity.kind,
.thresholds, .target, .calibration, pyinfer.predictor.ranks, .recall. A JSON report goes next to the output.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from gguf import GGUFValueType
from tqdm import tqdm

from pyinfer.console import run_cli
from pyinfer.errors import InvalidArgumentError, PyInferError
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.formats.gguf_writer import OutTensor, Q
from pyinfer.hub.pull import cache_dir
from pyinfer.models.sparse_attention import PROJECTIONS
from pyinfer.sparsity import input_sparsity
from pyinfer.sparsity.profiler import (
    add_profile_args,
    calibration_chunks,
    collect,
    ensure_powergguf,
    layer_table,
    profile_from_args,
    stats_of,
)
from pyinfer.sparsity.reorder import hot_first_order, reorder_file
from pyinfer.sparsity.train_predictors import (
    Predictor,
    add_training_args,
    cost_model,
    parse_ranks,
    report_row,
    split,
    train_layer,
    write_json,
)

PROG = "pyinfer sparsify"
HELD_OUT_CTX = 512  # llama.cpp's perplexity scores the second half of each chunk


def predictor_tensors(il: int, pred: Predictor, freq: np.ndarray) -> list[OutTensor]:
    """Layer il's predictor and activation-frequency tensors (numpy shapes: fc1 (r, d), fc2 (n_ff, r))."""
    b = f"blk.{il}."
    fc1 = pred.fc1.astype(np.float16)
    fc2 = pred.fc2.astype(np.float16)
    bias = pred.bias.astype(np.float32)
    freq = freq.astype(np.float32)
    return [OutTensor(b + "fc1.weight", fc1.shape, Q.F16, lambda: fc1),
            OutTensor(b + "fc2.weight", fc2.shape, Q.F16, lambda: fc2),
            OutTensor(b + "fc2.bias", bias.shape, Q.F32, lambda: bias),
            OutTensor(b + "ffn_act_freq", freq.shape, Q.F32, lambda: freq)]


def sparsity_kv(kind: str, target: float, thresholds: list[float], ranks: list[int], recalls: list[float],
                calibration: str) -> list[tuple]:
    arr, f32, i32 = GGUFValueType.ARRAY, GGUFValueType.FLOAT32, GGUFValueType.INT32
    return [("pyinfer.sparsity.kind", kind, GGUFValueType.STRING, None),
            ("pyinfer.sparsity.thresholds", [float(t) for t in thresholds], arr, f32),
            ("pyinfer.sparsity.target", float(target), f32, None),
            ("pyinfer.sparsity.calibration", calibration, GGUFValueType.STRING, None),
            ("pyinfer.predictor.ranks", [int(r) for r in ranks], arr, i32),
            ("pyinfer.predictor.recall", [float(r) for r in recalls], arr, f32)]


def default_output(model: str, sparsity: float, method: str = "predictors") -> str:
    """<cache>/sparse/<model stem>-s<percent>.gguf (--method input: -in<percent>, centred: -ce<percent>, auto
    between them: -au<percent>)"""
    stem = os.path.splitext(os.path.basename(model))[0].removesuffix("-power")
    tag = {"input": "in", "centred": "ce", "auto": "au"}.get(method, "s")
    return str(cache_dir() / "sparse" / f"{stem}-{tag}{round(100 * sparsity)}.gguf")


def fetch_held_out() -> str:
    """corpus.held_out_text, fetched before any work: a machine that cannot download it learns so at once, with
    the way around it."""
    from pyinfer.sparsity.corpus import held_out_text

    try:
        return held_out_text()
    except PyInferError as e:
        raise PyInferError(f"the held-out text for the perplexity report: {e}; --eval-tokens 0 skips the report") from e


def bytes_skipped(path: str, channels: float, neurons: float) -> float:
    """The share of the FFN's weight bytes (channel-major gate and up, ffn_down_t, as stored in path) not read when
    gate and up read a share `channels` of their rows and down `neurons` of its."""
    tensors = GGUFFile(path).tensors
    size = {m: sum(int(info.data.nbytes) for name, info in tensors.items() if name.endswith(f".{m}.weight"))
            for m in ("ffn_gate_t", "ffn_up_t", "ffn_down_t")}
    read = channels * (size["ffn_gate_t"] + size["ffn_up_t"]) + neurons * size["ffn_down_t"]
    return 1 - read / sum(size.values())


def chunks_perplexity(path: str, chunks, threads: int | None) -> tuple[float, dict]:
    """The perplexity of the model at path over token chunks, second halves scored (llama.cpp's), a sparse file's
    batches computed as its decoder computes each token (reads_row_major); and the model's counters after."""
    from pyinfer.engine.driver import Model
    from pyinfer.engine.scoring import Stats, scored_logprobs

    n_ctx = max(len(c) for c in chunks)
    model = Model(path, n_ctx=n_ctx, n_threads=threads)
    if model.sparse_spec is not None:
        model.sparse_spec.gemm_above = n_ctx
    stats = Stats()
    for chunk in chunks:
        stats.add(scored_logprobs(model, chunk), chunk[len(chunk) // 2 + 1:])
    return Stats.ppl(stats.nll)[0], model.timings.extra


def held_out_report(src: str, out: str, text: str, n_tokens: int, threads: int | None) -> str:
    """The perplexity of src and out on n_tokens of held-out text (fetch_held_out: no calibration corpus holds
    it) in chunks of HELD_OUT_CTX, and the shares of gate's and up's channels and of down's neurons out read there."""
    from pyinfer.engine.scoring import chunk_tokens
    from pyinfer.formats.tokenizer import Tokenizer

    n_chunks = max(1, n_tokens // HELD_OUT_CTX)
    tok = Tokenizer.from_gguf_metadata(GGUFFile(src).metadata)
    tokens = tok.encode(text)
    if len(tokens) < n_chunks * HELD_OUT_CTX:
        raise InvalidArgumentError(f"the held-out text has {len(tokens)} tokens, fewer than --eval-tokens")
    chunks = chunk_tokens(tokens, HELD_OUT_CTX, tok.bos_id if tok.add_bos else None, n_chunks)
    ppl = []
    for path in tqdm((src, out), desc="held-out perplexity", file=sys.stderr, disable=None):
        value, extra = chunks_perplexity(path, chunks, threads)
        ppl.append(value)
    read = ""
    if extra.get("ffn_rows_total") and extra.get("ffn_channels_total"):
        channels = extra["ffn_channels_active"] / extra["ffn_channels_total"]
        neurons = extra["ffn_rows_active"] / extra["ffn_rows_total"]
        read = (f"; read there, as the kernels counted: {100 * channels:.1f} % of gate's and up's input channels, "
                f"{100 * neurons:.1f} % of down's neurons: {100 * bytes_skipped(out, channels, neurons):.1f} % of "
                "the FFN's weight bytes skipped")
    if extra.get("attn_channels_total"):
        read += (f"; {100 * extra['attn_channels_active'] / extra['attn_channels_total']:.1f} % of the attention "
                 "projections' input channels")
    return (f"held-out perplexity (Britannica, {n_chunks} x {HELD_OUT_CTX} tokens, second halves scored): "
            f"{ppl[0]:.3f} dense, {ppl[1]:.3f} sparse: {100 * (ppl[1] / ppl[0] - 1):+.1f} %{read}")


INPUT_METHODS = ("input", "centred")  # what --method auto chooses between for a gated FFN
VALIDATION_SHARE = 4  # --method auto: one calibration chunk in this many (the last ones) validates, the rest calibrate


def _input_sparsify(args: argparse.Namespace) -> int:
    """--method input or centred (or auto, the better of the two on calibration text set apart): calibration
    thresholds and channel-major gate and up, no predictors."""
    from pyinfer.hub.model_files import resolve_model

    t0 = time.perf_counter()
    s_x, s_h = input_sparsity.split(args.sparsity, args.down_skip)  # a bad target fails before anything runs
    if args.attn_skip and not 0.0 < args.attn_skip < 1.0:
        raise InvalidArgumentError(f"--attn-skip must be in [0, 1), not {args.attn_skip}")
    if args.eval_tokens < 0:
        raise InvalidArgumentError(f"--eval-tokens must be >= 0, not {args.eval_tokens}")
    path = ensure_powergguf(resolve_model(args.model))
    g = GGUFFile(path)
    input_sparsity.check_source(g)
    held_out = fetch_held_out() if args.eval_tokens else ""  # before calibration, after the checks of the input
    out = args.output or default_output(path, args.sparsity, args.method)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    chunks, calibration = calibration_chunks(path, args.corpus, args.tokens, args.ctx)
    methods = INPUT_METHODS if args.method == "auto" else (args.method,)
    validation = chunks[len(chunks) - len(chunks) // VALIDATION_SHARE:] if len(methods) > 1 else []
    if len(methods) > 1 and not validation:
        raise InvalidArgumentError(f"--method auto sets a quarter of the calibration chunks apart to choose the "
                                   f"method: {len(chunks)} chunks are too few (raise --tokens)")
    fit = chunks[:len(chunks) - len(validation)]
    if validation:
        calibration += f", of which the last {len(validation)} chose the method"
    profile = collect(path, fit, calibration, n_threads=args.threads)
    narrow = not args.keep_down_type and input_sparsity.narrows_down_by_default(g)
    attention = _attention_calibration(g, profile, args.attn_skip) if args.attn_skip else None
    written = {}
    for method in methods:
        layers = (profile.layer(il) for il in tqdm(range(profile.n_layer), desc=f"{method} thresholds",
                                                   file=sys.stderr, disable=None))
        calibrated = input_sparsity.calibrate(layers, args.sparsity, args.down_skip, centred=method == "centred")
        target = out if len(methods) == 1 else f"{out}.{method}.part"
        input_sparsity.write(path, target, calibrated, args.sparsity, calibration, narrow_down=narrow,
                             attention=attention)
        GGUFFile(target)  # the written file must load
        written[method] = target, calibrated
    if len(methods) > 1:
        method, line = _choose(written, validation, args.threads)
        os.replace(written[method][0], out)
        calibrated = written[method][1]
        print(line)
    else:
        method = methods[0]
    rows = [{"layer": il, "t_x": c.t_x, "t_h": c.t_h, "channels read %": 100 * c.x_density,
             "neurons read %": 100 * float(c.freq.mean()),
             "bytes skipped %": 100 * (1 - (2 * c.x_density + float(c.freq.mean())) / 3)}
            for il, c in enumerate(calibrated)]
    skipped = float(np.mean([r["bytes skipped %"] for r in rows]))
    print(f"{method} input sparsity, target {args.sparsity:.3f} of the FFN's weight bytes: per layer "
          f"{100 * s_x:.1f} % of gate's and up's input channels and {100 * s_h:.1f} % of down's neurons skipped; "
          "measured on the "
          f"calibration text ({calibration}): {skipped:.1f} % of the FFN's bytes")
    print(layer_table(rows))
    if attention is not None:
        print(_attention_line(out, attention, args.attn_skip))
    if args.eval_tokens:
        print(held_out_report(path, out, held_out, args.eval_tokens, args.threads))
    print(f"time: {time.perf_counter() - t0:.0f} s\nwrote {out}")
    return 0


def _attention_calibration(g: GGUFFile, profile, skip: float) -> list:
    """--attn-skip: per layer the thresholds on its attention projections' inputs (None for a layer without q, k,
    v and output projections of its own)."""
    def samples(il: int):
        if not all(f"blk.{il}.{m}.weight" in g.tensors for m in PROJECTIONS):
            return None
        return profile.attention(il)

    layers = (samples(il) for il in tqdm(range(profile.n_layer), desc="attention thresholds", file=sys.stderr,
                                         disable=None))
    attention = input_sparsity.calibrate_attention(layers, skip)
    if all(c is None for c in attention):
        raise InvalidArgumentError(f"{g.path}: --attn-skip needs layers with q, k, v and output projections; "
                                   "this model has none")
    return attention


def attention_bytes_skipped(path: str, in_density: float, out_density: float) -> float:
    """The share of the attention projections' weight bytes (their channel-major copies in path) a token skips when
    q, k and v read a share in_density of their input channels and the output projection out_density of its."""
    tensors = GGUFFile(path).tensors
    size = {m: sum(int(info.data.nbytes) for name, info in tensors.items() if name.endswith(f".{m}_t.weight"))
            for m in PROJECTIONS}
    read = in_density * (size["attn_q"] + size["attn_k"] + size["attn_v"]) + out_density * size["attn_output"]
    return 1 - read / sum(size.values())


def _attention_line(out: str, attention: list, skip: float) -> str:
    """The report's line for --attn-skip: the channels read on the calibration text and the bytes skipped."""
    layers = [c for c in attention if c is not None]
    d_in, d_out = (float(np.mean([getattr(c, f) for c in layers])) for f in ("in_density", "out_density"))
    return (f"attention projections of {len(layers)} of {len(attention)} layers, {100 * skip:.1f} % of each input's "
            f"channels skipped: measured on the calibration text {100 * d_in:.1f} % of q's, k's and v's input "
            f"channels read and {100 * d_out:.1f} % of the output projection's, "
            f"{100 * attention_bytes_skipped(out, d_in, d_out):.1f} % of their bytes skipped")


def _choose(written: dict, validation, threads: int | None) -> tuple[str, str]:
    """(the method whose file has the lower perplexity on the validation chunks, the line that says so); the other
    files are removed, and all of them if the measurement fails."""
    try:
        ppl = {m: chunks_perplexity(target, validation, threads)[0]
               for m, (target, _) in tqdm(written.items(), desc="choosing the method", file=sys.stderr, disable=None)}
    except BaseException:
        for target, _ in written.values():
            os.remove(target)
        raise
    best = min(ppl, key=ppl.get)
    for m, (target, _) in written.items():
        if m != best:
            os.remove(target)
    said = ", ".join(f"{m} {p:.3f}" for m, p in ppl.items())
    return best, (f"method auto: perplexity on {len(validation)} calibration chunks set apart from the thresholds: "
                  f"{said}: {best}")


def _sparsify(args: argparse.Namespace) -> int:
    if args.method == "auto":
        from pyinfer.hub.model_files import resolve_model

        gated = GGUFFile(resolve_model(args.model)).config.ffn_kind in input_sparsity.GATED_KINDS
        args.method = "auto" if gated else "predictors"
    if args.method in ("input", "centred", "auto"):
        return _input_sparsify(args)
    if args.attn_skip:
        raise InvalidArgumentError("--attn-skip goes with --method input, centred or auto (a gated FFN), "
                                   "not predictors")
    t0 = time.perf_counter()
    if not 0.0 < args.sparsity < 1.0:
        raise InvalidArgumentError(f"--sparsity must be in (0, 1), not {args.sparsity}")
    if not 0.0 < args.recall <= 1.0:
        raise InvalidArgumentError(f"--recall must be in (0, 1], not {args.recall}")
    ranks = parse_ranks(args.ranks)
    path, profile, calibration = profile_from_args(args)
    t_profile = time.perf_counter() - t0
    g = GGUFFile(path)
    out = args.output or default_output(path, args.sparsity)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    masks = split(profile.chunk_of_token())
    perms, thresholds, sparsities, results, extra = [], [], [], [], []
    for il in tqdm(range(profile.n_layer), desc="training predictors", file=sys.stderr, disable=None):
        x, h = profile.layer(il)
        a = np.abs(h)  # (n_tokens, n_ff)
        stats = stats_of(a, args.sparsity, profile.kind)
        perm = hot_first_order(stats.freq, stats.mass)
        res = train_layer(x, a[:, perm], stats.threshold, masks, cost_model(g, il), ranks=ranks,
                          recall=args.recall, epochs=args.epochs)
        perms.append(perm)
        thresholds.append(stats.threshold)
        sparsities.append(stats.sparsity)
        results.append(res)
        extra += predictor_tensors(il, res.predictor, stats.freq[perm])
    # relu models skip what they naturally skip; threshold models the asked fraction
    target = float(np.mean(sparsities)) if profile.kind == "relu" else args.sparsity
    kv = sparsity_kv(profile.kind, target, thresholds, [r.predictor.rank for r in results],
                     [r.metrics.recall for r in results], calibration)
    reorder_file(path, out, perms, kv, extra)
    GGUFFile(out)  # the written file must load
    rows = [report_row(il, t, r) for il, (t, r) in enumerate(zip(thresholds, results, strict=True))]
    elapsed = time.perf_counter() - t0
    print(f"{profile.kind} sparsity, target {target:.3f}; calibration: {calibration}")
    print(layer_table(rows))
    dense = sum(cost_model(g, il)(0, 1.0) for il in range(profile.n_layer))
    sparse = sum(cost_model(g, il)(r.predictor.rank, r.metrics.density) for il, r in enumerate(results))
    print(f"FFN bytes per token: sparse {sparse / 1e6:.2f} MB (predictors included) vs dense {dense / 1e6:.2f} MB; "
          f"mean predicted density {np.mean([r.metrics.density for r in results]):.3f}")
    print(f"time: profile {t_profile:.0f} s, total {elapsed:.0f} s")
    report = os.path.splitext(out)[0] + ".json"
    write_json(report, {"model": path, "output": out, "kind": profile.kind, "target": target,
                        "recall_target": args.recall, "calibration": calibration, "seconds": elapsed,
                        "ffn_bytes_per_token": {"sparse": sparse, "dense": dense},
                        "layers": [row | {"tried": r.tried} for row, r in zip(rows, results, strict=True)]})
    print(f"wrote {out}\nwrote {report}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_profile_args(p)
    add_training_args(p)
    p.add_argument("--method", choices=["auto", "predictors", "centred", "input"], default="auto",
                   help="predictors: trained per-layer predictors (ReLU-family models); centred: no training, "
                        "thresholds on the FFN's input and activations around their calibrated means (SwiGLU/GeGLU); "
                        "input: the same around zero, TEAL's baseline; auto (default): predictors for a ReLU-family "
                        "FFN, else the better of input and centred on a quarter of the calibration text set apart")
    p.add_argument("--target", dest="sparsity", type=float, metavar="B",
                   help="input, centred, auto: the share of the FFN's weight bytes a decoded token skips (as "
                        "--sparsity)")
    p.add_argument("--down-skip", type=float, default=None, metavar="S",
                   help="input, centred, auto: the share of down's neurons skipped (gate and up skip input channels "
                        "for the rest of the target; default min(0.95, 1.4 B))")
    p.add_argument("--attn-skip", type=float, default=0.0, metavar="S",
                   help="input, centred, auto: also skip this share of the input channels of every layer's attention "
                        "projections (q, k and v on |x|, the output projection on the attention's output; "
                        "channel-major copies the CPU decoder reads; default 0: none)")
    p.add_argument("--keep-down-type", action="store_true",
                   help="input, centred, auto: keep ffn_down_t's stored type (Q8_0 for sources below 8 bits) "
                        "instead of requantizing it to the type of gate's and up's channel-major copies (kept by "
                        "default for models of at most 256 MiB)")
    p.add_argument("--eval-tokens", type=int, default=2 * HELD_OUT_CTX,
                   help="input, centred, auto: held-out tokens on which to report the perplexity change (0: none; "
                        f"default {2 * HELD_OUT_CTX})")
    p.add_argument("-o", "--output", help="output PowerGGUF (default: <cache>/sparse/<model>-s<percent>.gguf, "
                                          "with --method input -in<percent>.gguf, centred -ce<percent>.gguf, auto "
                                          "between them -au<percent>.gguf)")
    return run_cli(PROG, p, _sparsify, argv)


if __name__ == "__main__":
    sys.exit(main())
