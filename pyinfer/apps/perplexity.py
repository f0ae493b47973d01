"""`pyinfer perplexity`: llama.cpp's chunked perplexity and KL divergence against a base model.

The text is tokenized once (with BOS); chunk i is tokens [i*n_ctx, (i+1)*n_ctx), its first token replaced
by BOS when the vocabulary adds one, evaluated from an empty cache; only the second half of each chunk is
scored (every scored token then has at least n_ctx/2 tokens of context). Output as llama.cpp prints it:
`[1]12.3456,[2]...` (running PPL after each chunk) and `Final estimate: PPL = x +/- y`.

`--kl-divergence-base FILE` saves the scored tokens' log-probabilities (float16, like llama.cpp's
compressed base file) with the tokens; `--kl-divergence FILE_OR_MODEL` compares against such a file or
against a second model evaluated on the fly: mean KL(base || model), top-1 agreement, both PPLs.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

from pyinfer.console import one_line
from pyinfer.engine.scoring import Stats, chunk_tokens, scored_logprobs
from pyinfer.errors import InvalidArgumentError, PyInferError

PROG = "pyinfer perplexity"


def _open_base(spec: str, n_ctx: int, model_kwargs: dict):
    """A saved base file (np.load) or a Model to evaluate on the fly."""
    from pyinfer.engine.driver import Model

    if spec.endswith(".npz"):
        data = np.load(spec)
        if int(data["n_ctx"]) != n_ctx:
            raise InvalidArgumentError(f"{spec} was saved with -c {int(data['n_ctx'])}, not {n_ctx}")
        return data
    return Model(spec, n_ctx=n_ctx, **model_kwargs)


def perplexity(model, tokens: list[int], n_ctx: int, n_chunks: int = -1, base=None,
               save_base: str | None = None, out=None) -> Stats:
    """Runs the chunks, printing llama.cpp's lines (to out, default stdout); base: a Model or a loaded
    base file for KL."""
    out = out or sys.stdout
    chunks = chunk_tokens(tokens, n_ctx, model.tokenizer.bos_id if model.tokenizer.add_bos else None, n_chunks)
    first = n_ctx // 2
    if isinstance(base, np.lib.npyio.NpzFile) and not np.array_equal(base["tokens"], np.concatenate(chunks)):
        raise InvalidArgumentError("the base file was computed on different tokens (text, tokenizer or -c)")
    stats, saved = Stats(), []
    t0 = time.perf_counter()
    for i, chunk in enumerate(chunks):
        t1 = time.perf_counter()
        logp = scored_logprobs(model, chunk)
        model.timings.prompt_ms += 1e3 * (time.perf_counter() - t1)
        model.timings.prompt_tokens += len(chunk)
        if base is None:
            base_logp = None
        elif isinstance(base, np.lib.npyio.NpzFile):
            base_logp = base["logprobs"][i * (n_ctx - first - 1):(i + 1) * (n_ctx - first - 1)]
        else:
            base_logp = scored_logprobs(base, chunk)
        stats.add(logp, chunk[first + 1:], base_logp)
        if save_base:
            saved.append(logp.astype(np.float16))
        if i == 0:
            per = time.perf_counter() - t0
            print(f"{PROG}: {per:.2f} seconds per pass - ETA {per * len(chunks) / 60:.2f} minutes", file=out)
        print(f"[{i + 1}]{Stats.ppl(stats.nll)[0]:.4f},", end="", file=out, flush=True)
    print(file=out)
    ppl, err = Stats.ppl(stats.nll)
    print(f"Final estimate: PPL = {ppl:.4f} +/- {err:.5f}", file=out)
    if stats.kl:
        kl = np.asarray(stats.kl)
        bppl, berr = Stats.ppl(stats.base_nll)
        print(f"Base PPL        : {bppl:.4f} +/- {berr:.5f}", file=out)
        print(f"Mean    KLD     : {kl.mean():10.6f} +/- {kl.std() / math.sqrt(max(len(kl) - 1, 1)):10.6f}",
              file=out)
        print(f"Same top p      : {100.0 * stats.same_top / len(kl):.3f} %", file=out)
    if save_base:
        tmp = save_base + ".part.npz"
        np.savez(tmp, tokens=np.concatenate(chunks), n_ctx=np.int64(n_ctx), logprobs=np.concatenate(saved))
        os.replace(tmp, save_base)
        print(f"{PROG}: saved base log-probabilities to {save_base}", file=out)
    return stats


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _parser() -> argparse.ArgumentParser:
    from pyinfer.apps.flags import add_placement_args, add_precise_arg

    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-f", "--file", required=True, help="text file")
    p.add_argument("-c", "--ctx-size", type=int, default=512)
    p.add_argument("-b", "--batch-size", type=int, default=512)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--chunks", type=int, default=-1, help="at most this many chunks")
    add_precise_arg(p)
    add_placement_args(p)
    p.add_argument("--sparse", choices=("on", "off", "auto"), default="auto")
    p.add_argument("--sparsity-threshold", type=float, default=0.0)
    p.add_argument("--kl-divergence", metavar="BASE", help="a saved .npz base file or a model to compare with")
    p.add_argument("--kl-divergence-base", metavar="FILE", help="save this model's log-probabilities (.npz)")
    return p


def main(argv: list[str] | None = None) -> int:
    from pyinfer.apps.flags import placement_options, precise_option
    from pyinfer.engine.driver import Model

    a = _parser().parse_args(argv)
    if a.kl_divergence_base and not a.kl_divergence_base.endswith(".npz"):
        print(f"{PROG}: error: --kl-divergence-base must name a .npz file", file=sys.stderr)
        return 1
    sparse = {"on": True, "off": False, "auto": None}[a.sparse]
    common = dict(n_batch=min(a.batch_size, a.ctx_size), n_threads=a.threads, precise=precise_option(a))
    try:
        model = Model(a.model, n_ctx=a.ctx_size, sparse=sparse, sparsity_threshold=a.sparsity_threshold,
                      **placement_options(a), **common)
        base = _open_base(a.kl_divergence, a.ctx_size, {**common, "sparse": False}) if a.kl_divergence else None
        tokens = model.tokenize(_read_text(a.file))
        print(f"{PROG}: tokenizing the input: {len(tokens)} tokens, n_ctx = {a.ctx_size}", file=sys.stderr)
        perplexity(model, tokens, a.ctx_size, a.chunks, base, a.kl_divergence_base)
    except (PyInferError, OSError) as exc:
        print(f"{PROG}: error: {one_line(exc)}", file=sys.stderr)
        return 1
    print(model.timings.report(), file=sys.stderr)
    return 0
