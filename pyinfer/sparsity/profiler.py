"""Profile FFN activations: run the model over calibration chunks and keep, per layer, every token's FFN
input x and hidden activation h, and the inputs of its attention projections (float16, one npz per chunk in a
resumable cache), from which thresholds, per-neuron activation counts and masses follow exactly.

"Active" is h != 0 for ReLU-family FFNs (sparsity kind "relu", t_l = 0) and |h| > t_l for SwiGLU/GeGLU
(kind "threshold"), t_l being the per-layer quantile of |h| that zeroes the target fraction.
Cache: <cache>/profiles/<sha of model file + corpus + ctx>/chunk-<i>-<sha of its tokens>.npz.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pyinfer.console import run_cli
from pyinfer.errors import InvalidArgumentError, UnsupportedError
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.hub.pull import cache_dir

KIND_OF_FFN = {"relu": "relu", "reglu": "relu", "drelu": "relu", "swiglu": "threshold", "geglu": "threshold"}
F16_MAX = float(np.finfo(np.float16).max)
HOT_MASS = 0.8  # "hot" neurons: the fewest carrying this share of a layer's activation mass


# ----------------------------------------------------------------------------
# collecting


def file_sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class Profile:
    """FFN inputs and activations of every profiled token, read one layer at a time from the cache."""

    files: list[Path]  # one npz per chunk, in corpus order
    chunk_sizes: list[int]
    n_layer: int
    n_embd: int
    n_ff: int
    ffn_kind: str

    @property
    def kind(self) -> str:
        return KIND_OF_FFN[self.ffn_kind]

    @property
    def n_tokens(self) -> int:
        return sum(self.chunk_sizes)

    def chunk_of_token(self) -> np.ndarray:
        """(n_tokens,) index of the chunk each token came from."""
        return np.repeat(np.arange(len(self.chunk_sizes)), self.chunk_sizes)

    def layer(self, il: int) -> tuple[np.ndarray, np.ndarray]:
        """x (n_tokens, n_embd) and h (n_tokens, n_ff) of layer il, float32."""
        xs, hs = [], []
        for path in self.files:
            with np.load(path) as z:
                xs.append(z[f"x{il}"])
                hs.append(z[f"h{il}"])
        return np.concatenate(xs).astype(np.float32), np.concatenate(hs).astype(np.float32)

    def attention(self, il: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The inputs of layer il's attention projections, float32: of q, k and v (n_tokens, n_embd) and of the
        output projection (n_tokens, n_head * head_dim); None for a layer without them (linear attention)."""
        xs, outs = [], []
        for path in self.files:
            with np.load(path) as z:
                if f"a{il}" not in z.files:
                    return None
                xs.append(z[f"a{il}"])
                outs.append(z[f"o{il}"])
        return np.concatenate(xs).astype(np.float32), np.concatenate(outs).astype(np.float32)


def collect(model_path: str, chunks: list[np.ndarray], corpus: str, *, cache: Path | None = None,
            n_threads: int | None = None, progress: bool = True) -> Profile:
    """Run the model over `chunks` (int32 token arrays of at most one context each) and return their
    profile; chunks already in the cache are not run again, so an interrupted run resumes."""
    from pyinfer.engine.driver import Model

    if not chunks:
        raise InvalidArgumentError("nothing to profile: no token chunks")
    g = GGUFFile(model_path)
    cfg = g.config
    ctx = max(len(c) for c in chunks)
    # "attention": profiles since the attention projections' inputs were kept too
    key = hashlib.sha256(f"{file_sha256(model_path)}|{corpus}|{ctx}|attention".encode()).hexdigest()[:16]
    folder = Path(cache or cache_dir()) / "profiles" / key
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "profile.json").write_text(json.dumps(
        {"model": os.path.abspath(model_path), "corpus": corpus, "ctx": ctx, "n_layer": cfg.n_layer,
         "n_embd": cfg.n_embd, "n_ff": cfg.n_ff, "ffn_kind": cfg.ffn_kind}, indent=1))
    files = [folder / f"chunk-{i:05d}-{hashlib.sha256(c.tobytes()).hexdigest()[:12]}.npz"
             for i, c in enumerate(chunks)]
    todo = [i for i, f in enumerate(files) if not f.is_file()]
    if todo:
        model = Model(model_path, n_ctx=ctx, n_batch=ctx, n_threads=n_threads)
        total = sum(len(chunks[i]) for i in todo)
        with tqdm(total=total, unit="tok", desc="profiling", file=sys.stderr, disable=not progress or None) as bar:
            for i in todo:
                _, acts = model.ffn_activations(chunks[i])
                arrays = {}
                for il in range(cfg.n_layer):
                    arrays[f"x{il}"] = _f16(acts[f"ffn_inp.{il}"])  # (n, n_embd)
                    arrays[f"h{il}"] = _f16(acts[f"ffn_act.{il}"])  # (n, n_ff)
                    if f"attn_inp.{il}" in acts:
                        arrays[f"a{il}"] = _f16(acts[f"attn_inp.{il}"])  # (n, n_embd)
                        arrays[f"o{il}"] = _f16(acts[f"attn_out.{il}"])  # (n, n_head * head_dim)
                part = files[i].with_suffix(".part")
                with open(part, "wb") as f:
                    np.savez(f, **arrays)
                os.replace(part, files[i])
                bar.update(len(chunks[i]))
    return Profile(files, [len(c) for c in chunks], cfg.n_layer, cfg.n_embd, cfg.n_ff, cfg.ffn_kind)


def _f16(a: np.ndarray) -> np.ndarray:
    """float16 copy, saturating instead of overflowing to inf."""
    return np.clip(a, -F16_MAX, F16_MAX).astype(np.float16)


# ----------------------------------------------------------------------------
# statistics


def layer_threshold(a: np.ndarray, sparsity: float, kind: str) -> float:
    """t_l: 0 for kind relu; else the smallest |h| value v with fraction(|h| <= v) >= sparsity."""
    if kind == "relu":
        return 0.0
    if not 0.0 < sparsity < 1.0:
        raise InvalidArgumentError(f"sparsity must be in (0, 1), not {sparsity}")
    return float(np.quantile(a, sparsity, method="inverted_cdf"))


def neuron_stats(a: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray]:
    """Per neuron of a = |h| (n_tokens, n_ff): activation count (|h| > t) and mass (sum of the active |h|)."""
    active = a > t  # (n_tokens, n_ff)
    count = active.sum(axis=0, dtype=np.int64)  # (n_ff,)
    mass = np.where(active, a, 0.0).sum(axis=0, dtype=np.float64)  # (n_ff,)
    return count, mass


def hot_fraction(mass: np.ndarray, share: float = HOT_MASS) -> float:
    """Fraction of neurons that, taken heaviest first, carry `share` of the total mass."""
    total = mass.sum()
    if total <= 0:
        return 0.0
    cum = np.cumsum(np.sort(mass)[::-1])
    return float((np.searchsorted(cum, share * total) + 1) / len(mass))


@dataclass
class LayerStats:
    threshold: float  # t_l
    count: np.ndarray  # (n_ff,) int64 tokens with the neuron active
    mass: np.ndarray  # (n_ff,) float64 sum of its active |h|
    n_tokens: int

    @property
    def freq(self) -> np.ndarray:
        """(n_ff,) activation frequency."""
        return self.count / max(self.n_tokens, 1)

    @property
    def sparsity(self) -> float:
        """Fraction of (token, neuron) pairs inactive."""
        return 1.0 - float(self.count.sum()) / max(self.n_tokens * len(self.count), 1)


def stats_of(a: np.ndarray, sparsity: float, kind: str) -> LayerStats:
    t = layer_threshold(a, sparsity, kind)
    count, mass = neuron_stats(a, t)
    return LayerStats(t, count, mass, a.shape[0])


# ----------------------------------------------------------------------------
# command line (shared by train_predictors and sparsify)


def ensure_powergguf(path: str) -> str:
    """`path` if it is a PowerGGUF, else its PowerGGUF conversion (made once, kept in the cache); a mixture of
    experts is refused: its neurons are not sparsified yet (its experts are placed by `pyinfer profile`)."""
    g = GGUFFile(path)
    if g.config.is_moe:
        raise UnsupportedError(f"{path}: a mixture of experts ({g.config.arch}): its neurons are not made sparse yet; "
                               "`pyinfer profile -o FILE.gguf` records its experts' routings for the placement")
    if g.ffn_layout == "down_t":
        return path
    from pyinfer.converters.convert_hf_to_powergguf import convert

    st = os.stat(path)
    stamp = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "converted" / f"{Path(path).stem}-{stamp}.powergguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(path, str(out))
    return str(out)


def add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="GGUF / PowerGGUF file or HF folder (default: the pulled default model)")
    p.add_argument("--corpus", action="append", metavar="NAME|FILE",
                   help="calibration text: builtin (default), shakespeare, bible, self (sampled from the model), "
                        "or a text file; repeatable")
    p.add_argument("--tokens", type=int, default=8192, help="tokens to profile (default 8192)")
    p.add_argument("--ctx", type=int, default=256, help="tokens per chunk (default 256)")
    p.add_argument("--sparsity", type=float, default=0.5,
                   help="SwiGLU/GeGLU: target fraction of zeroed activations per layer (default 0.5)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: pyinfer run's)")


def calibration_chunks(path: str, corpus: list[str] | None, n_tokens: int, ctx: int,
                       progress: bool = True) -> tuple[list[np.ndarray], str]:
    """(token chunks, description) of a corpus spec for the model at path (see pyinfer.sparsity.corpus)."""
    from pyinfer.formats.tokenizer import Tokenizer
    from pyinfer.sparsity.corpus import documents, sampled_documents, token_chunks

    docs, desc = documents(corpus, progress, sample=lambda: sampled_documents(path, n_tokens, ctx, progress))
    tok = Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)
    bos = tok.bos_id if tok.add_bos else None
    chunks = token_chunks(lambda s: tok.encode(s, add_special=False), docs, n_tokens, ctx, bos)
    return chunks, f"{desc}: {len(chunks)} chunks of {ctx} tokens = {sum(map(len, chunks))} tokens"


def profile_from_args(args: argparse.Namespace) -> tuple[str, Profile, str]:
    """(PowerGGUF path, profile, calibration description) for the shared arguments."""
    from pyinfer.hub.model_files import resolve_model

    path = ensure_powergguf(resolve_model(args.model))
    chunks, calibration = calibration_chunks(path, args.corpus, args.tokens, args.ctx)
    return path, collect(path, chunks, calibration, n_threads=args.threads), calibration


def layer_table(rows: list[dict]) -> str:
    """Rows of equal keys as an aligned text table."""
    keys = list(rows[0])
    cells = [[f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.rjust(w) for k, w in zip(keys, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _profile(args: argparse.Namespace) -> int:
    from pyinfer.hub.model_files import resolve_model

    path = resolve_model(args.model)
    if GGUFFile(path).config.is_moe:
        return _profile_experts(args, path)
    _, profile, calibration = profile_from_args(args)
    rows, out = [], {}
    for il in tqdm(range(profile.n_layer), desc="statistics", file=sys.stderr, disable=None):
        s = stats_of(np.abs(profile.layer(il)[1]), args.sparsity, profile.kind)
        rows.append({"layer": il, "threshold": s.threshold, "sparsity": s.sparsity,
                     "dead": int((s.count == 0).sum()), "hot80%": hot_fraction(s.mass)})
        out |= {f"count.{il}": s.count, f"mass.{il}": s.mass, f"threshold.{il}": np.float32(s.threshold)}
    print(f"profile of {profile.n_tokens} tokens ({calibration}), kind {profile.kind}")
    print(layer_table(rows))
    if args.output:
        part = args.output + ".part"
        with open(part, "wb") as f:
            np.savez(f, n_tokens=profile.n_tokens, **out)
        os.replace(part, args.output)
        print(f"wrote {args.output}")
    return 0


def _profile_experts(args: argparse.Namespace, path: str) -> int:
    """A mixture of experts: each layer's routings, a table, and with -o FILE.gguf the model with them stored."""
    from pyinfer.sparsity.expert_profile import routing_freq, top_share, write_profiled

    if args.output and not args.output.endswith(".gguf"):
        raise InvalidArgumentError(f"{args.output}: a mixture of experts' profile is written into a copy of the "
                                   "model: give -o FILE.gguf")
    chunks, calibration = calibration_chunks(path, args.corpus, args.tokens, args.ctx)
    freq = routing_freq(path, chunks, args.threads)
    n_tokens = sum(map(len, chunks))
    rows = [{"layer": il, "top 20% share": top_share(f), "most routed": float(f.max()),
             "never routed": int((f == 0).sum())} for il, f in enumerate(freq)]
    print(f"routings of {n_tokens} tokens ({calibration}): the share the most routed 20 % of experts take")
    print(layer_table(rows))
    if args.output:
        write_profiled(path, args.output, freq)
        print(f"wrote {args.output} (the same weights; pyinfer places its most routed experts on the GPU first)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pyinfer profile", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_profile_args(p)
    p.add_argument("-o", "--output", help="also save per-layer counts, masses and thresholds to this .npz (a mixture "
                   "of experts: the model with its experts' routings, FILE.gguf)")
    return run_cli("pyinfer profile", p, _profile, argv)


if __name__ == "__main__":
    sys.exit(main())
