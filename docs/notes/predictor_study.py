"""Reproduces the tables of docs/notes/predictor_study.md: how well can any predictor of the active set
|silu(g)*u| > t_l (S = 0.5) of a SwiGLU layer do, compared with the trained predictors of `pyinfer sparsify`?

Reads a cached profile (pyinfer/sparsity/profiler.py: x and h of every token), the PowerGGUF it was taken from (for
W_gate, W_up, W_down_t in the original neuron order) and the sparsified file (its stored predictors, neurons
hot-first). Splits as tools.train_predictors.split: train on chunks 0-3, 5-8, ..., the recall cut on chunks
4, 14, ..., metrics on chunks 9, 19, ...

usage: python docs/notes/predictor_study.py forms|layers|mlp|fixed|e2e [LAYERS] [--profile DIR] [--model F]
       [--sparse F] [--text EVAL.txt] [--chunks N] [--recall R]
  forms   predictor forms at mass recall 0.99 / 0.97 (table 1)
  layers  all layers: stored MLP, exact-gate and exact-up bounds, negative-gate mass (table 2)
  mlp     the stored MLP form trained wider / longer / from the SVD of W_gate, train vs test (table 3)
  fixed   every predictor cut at density 0.5: active mass kept, FFN output error (table 4)
  e2e     perplexity of "gate first" / "up first" vs dense and oracle, numpy reference forward (table 5)
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np
from scipy.special import expit

import pyinfer.sparsity.train_predictors as tp
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.sparsity.profiler import stats_of
from pyinfer.sparsity.reorder import hot_first_order

CACHE = Path.home() / ".cache/pyinfer"
UPGATE_BYTES = 2 * 1536 * 360  # one SmolLM2 layer's ffn_up + ffn_gate, Q4_1
RECALLS = (0.99, 0.97)


def silu(z):
    return z / (1 + np.exp(-z))


class Layer:
    """One layer's profile (x, a = |h|), t_l at S = 0.5, weights and the train/cut/test token masks."""

    def __init__(self, args, il: int):
        xs, hs = [], []
        for f in sorted(Path(args.profile).glob("chunk-*.npz")):
            with np.load(f) as z:
                xs.append(z[f"x{il}"])
                hs.append(z[f"h{il}"])
        self.il, self.x, self.h = il, np.concatenate(xs).astype(np.float32), np.concatenate(hs).astype(np.float32)
        self.a = np.abs(self.h)
        self.t = float(np.quantile(self.a, 0.5, method="inverted_cdf"))  # as stats_of / pyinfer sparsify
        sizes = [len(x) for x in xs]
        self.train, self.cut, self.test = tp.split(np.repeat(np.arange(len(sizes)), sizes))
        g = GGUFFile(args.model)
        self.wg, self.wu, self.wd = (g.dequantize(f"blk.{il}.{n}.weight").astype(np.float32)
                                     for n in ("ffn_gate", "ffn_up", "ffn_down_t"))
        self.sparse = GGUFFile(args.sparse)


def cut_for_recall(s, a, t, recall):
    """Largest scalar c such that the pairs scoring > c keep `recall` of the active mass (tp.calibrate's rule)."""
    act = a > t
    order = np.argsort(s[act], kind="stable")
    sp, cum = s[act][order].astype(np.float64), np.cumsum(a[act][order].astype(np.float64))
    k = int(np.searchsorted(cum, (1 - recall) * cum[-1], side="right"))
    return sp[0] - 1 if k == 0 else (sp[k - 1] + sp[k]) / 2 if k < sp.size else sp[-1]


def measure(L: Layer, score, recall: float) -> tp.Metrics:
    c = cut_for_recall(score(L.x[L.cut]), L.a[L.cut], L.t, recall)
    hit, act = score(L.x[L.test]) > c, L.a[L.test] > L.t
    mass = np.where(act, L.a[L.test], 0)
    return tp.Metrics(float(mass[hit].sum() / mass.sum()), float((hit & act).sum() / max(hit.sum(), 1)),
                      float(hit.mean()), float(act.mean()))


def stored(L: Layer) -> tp.Predictor:
    """The sparsified file's predictor, rows put back in the profile's (original) neuron order."""
    st = stats_of(L.a, 0.5, "threshold")
    inv = np.argsort(hot_first_order(st.freq, st.mass))
    b, d = f"blk.{L.il}.", L.x.shape[1]
    fc1 = np.frombuffer(L.sparse.tensors[b + "fc1.weight"].data, np.float16).reshape(-1, d)
    fc2 = np.frombuffer(L.sparse.tensors[b + "fc2.weight"].data, np.float16).reshape(L.a.shape[1], -1)
    return tp.Predictor(fc1, fc2[inv], np.frombuffer(L.sparse.tensors[b + "fc2.bias"].data, np.float32)[inv])


def data_svd(w, x, r):
    """(A (r, d), B (n_ff, r)) minimising E||W x - B A x||^2 over x: B = top-r left singular vectors of
    W Sigma^1/2, A = B^T W (a plain SVD of W ignores that x has a few dimensions of much larger scale)."""
    lam, v = np.linalg.eigh(x.T @ x / len(x))
    u = np.linalg.svd(w @ ((v * np.sqrt(np.maximum(lam, 0))) @ v.T), full_matrices=False)[0][:, :r]
    return u.T @ w, u


def plain_svd(w, r):
    u, s, vt = np.linalg.svd(w, full_matrices=False)
    return vt[:r], u[:, :r] * s[:r]


def gate_table(L: Layer, bins: int = 32):
    """Bayes-optimal score from the exact gate alone: per neuron, the mean active mass of the training
    pairs in the same gate-value bin (quantile bins). Up to binning, the best any gate-only predictor does."""
    g = L.x[L.train] @ L.wg.T
    a = np.where(L.a[L.train] > L.t, L.a[L.train], 0)
    edges = np.quantile(g, np.linspace(0, 1, bins + 1)[1:-1], axis=0).T  # (n_ff, bins - 1)
    table = np.zeros((g.shape[1], bins))
    for i in range(g.shape[1]):
        k = np.searchsorted(edges[i], g[:, i])
        table[i] = np.bincount(k, a[:, i], bins) / np.maximum(np.bincount(k, minlength=bins), 1)

    def score(x):
        gx = x @ L.wg.T
        k = np.stack([np.searchsorted(edges[i], gx[:, i]) for i in range(gx.shape[1])], 1)
        return table[np.arange(gx.shape[1]), k]
    return score


def forms(L: Layer):
    """(name, score function, parameter count) of every predictor form compared."""
    xt = L.x[L.train]
    rms_u = np.sqrt(((xt @ L.wu.T) ** 2).mean(0))  # per-neuron scale: puts gate-only scores on one scale
    rms_sg = np.sqrt((silu(xt @ L.wg.T) ** 2).mean(0))
    p = stored(L)
    out = [(f"trained MLP r{p.rank} (stored)", p.logits, p.params),
           ("oracle |silu(g)*u|", lambda x: np.abs(silu(x @ L.wg.T) * (x @ L.wu.T)), 0),
           ("exact gate, silu(g)*rms_u", lambda x: silu(x @ L.wg.T) * rms_u, L.wg.size),
           ("exact gate, |silu(g)|*rms_u", lambda x: np.abs(silu(x @ L.wg.T)) * rms_u, L.wg.size),
           ("exact gate, Bayes table", gate_table(L), L.wg.size),
           ("exact up, |u|*rms_silu(g)", lambda x: np.abs(x @ L.wu.T) * rms_sg, L.wu.size)]
    for r in (16, 64, 256):
        (ag, bg), (au, bu) = data_svd(L.wg, xt, r), data_svd(L.wu, xt, r)
        (pg, qg), (pu, qu) = plain_svd(L.wg, r), plain_svd(L.wu, r)
        n = r * (L.x.shape[1] + L.a.shape[1])
        out += [(f"SVD r{r} gate, silu(g^)*rms_u", lambda x, ag=ag, bg=bg: silu(x @ ag.T @ bg.T) * rms_u, n),
                (f"SVD r{r} product |silu(g^)u^|",
                 lambda x, ag=ag, bg=bg, au=au, bu=bu: np.abs(silu(x @ ag.T @ bg.T) * (x @ au.T @ bu.T)), 2 * n),
                (f"plain SVD r{r} product",
                 lambda x, pg=pg, qg=qg, pu=pu, qu=qu: np.abs(silu(x @ pg.T @ qg.T) * (x @ pu.T @ qu.T)), 2 * n)]
    return out


def cmd_forms(args):
    print("| layer | predictor | bytes (F16) / up+gate | density @0.99 | precision | density @0.97 | precision |")
    for il in args.layers:
        L = Layer(args, il)
        for name, score, n in forms(L):
            m = [measure(L, score, r) for r in RECALLS]
            print(f"| {il} | {name} | {2 * n / UPGATE_BYTES:.2f} | {m[0].density:.3f} | {m[0].precision:.3f} | "
                  f"{m[1].density:.3f} | {m[1].precision:.3f} |", flush=True)


def cmd_layers(args):
    print("| layer | stored rank | trained MLP | exact gate (Bayes) | exact up | active mass with g < 0 |")
    for il in args.layers:
        L = Layer(args, il)
        named = {name: score for name, score, _ in forms(L)[:6]}
        d = [measure(L, named[k], 0.99).density for k in
             (next(iter(named)), "exact gate, Bayes table", "exact up, |u|*rms_silu(g)")]
        act, neg = L.a > L.t, L.x @ L.wg.T < 0
        print(f"| {il} | {stored(L).rank} | {d[0]:.3f} | {d[1]:.3f} | {d[2]:.3f} | "
              f"{L.a[act & neg].sum() / L.a[act].sum():.3f} |", flush=True)


def fit_from(x, a, t, w1, w2, epochs=20, lr=1e-3, batch=tp.BATCH, seed=0) -> tp.Predictor:
    """tp.fit's weighted BCE and Adam, starting from the given fc1 / fc2 instead of random ones."""
    rng = np.random.default_rng(seed)
    active = a > t
    weight = np.where(active, a / a[active].mean(), 1.0).astype(np.float32)
    target = np.where(active, weight, 0.0).astype(np.float32)
    freq = np.clip(active.mean(0), 1e-4, 1 - 1e-4)
    p = {"w1": w1.astype(np.float32), "w2": w2.astype(np.float32), "b": np.log(freq / (1 - freq)).astype(np.float32)}
    m, v = ({k: np.zeros_like(w) for k, w in p.items()} for _ in range(2))
    step = 0
    for _ in range(epochs):
        for s in rng.permutation(np.arange(0, len(x), batch)):
            xb = x[s:s + batch]
            pre = xb @ p["w1"].T
            hid = np.maximum(pre, 0)
            gz = (weight[s:s + batch] * expit(hid @ p["w2"].T + p["b"]) - target[s:s + batch]) / len(xb)
            grads = {"w1": ((gz @ p["w2"]) * (pre > 0)).T @ xb, "w2": gz.T @ hid, "b": gz.sum(0)}
            step += 1
            for k, g in grads.items():
                m[k] = 0.9 * m[k] + 0.1 * g
                v[k] = 0.999 * v[k] + 0.001 * g * g
                m_hat, v_hat = m[k] / (1 - 0.9 ** step), v[k] / (1 - 0.999 ** step)
                p[k] -= (lr * m_hat / (np.sqrt(v_hat) + 1e-8)).astype(np.float32)
    return tp.Predictor(p["w1"], p["w2"], p["b"])


def svd_init(L: Layer, hidden: int):
    """fc1 = [A; -A], fc2 = [B, -B] * 4: logits start at 4 * (rank hidden/2 approximation of g)."""
    a, b = data_svd(L.wg, L.x[L.train], hidden // 2)
    sd = np.sqrt(((L.x[L.train] @ a.T) ** 2).mean(0))  # hidden units at unit RMS
    return np.concatenate([a / sd[:, None], -a / sd[:, None]]), np.concatenate([b * sd, -b * sd], 1) * 4


def mlp_runs(L: Layer):
    """(name, training function) of every setting of table 3."""
    x, a = L.x[L.train], L.a[L.train]
    runs = [(f"tp.fit r{r}, {ep} epochs", lambda r=r, ep=ep: tp.fit(x, a, L.t, r, epochs=ep))
            for r, ep in ((16, 6), (16, 30), (64, 20), (256, 20), (1024, 20))]
    return runs + [(f"SVD-of-gate init, hidden {n}, 20 epochs", lambda n=n: fit_from(x, a, L.t, *svd_init(L, n)))
                   for n in (16, 64)]


def cmd_mlp(args):
    print("| layer | training | F16 bytes / up+gate | test density @0.99 | precision | train density @0.99 | "
          "test density @0.97 | seconds |")
    for il in args.layers:
        L = Layer(args, il)
        sub = np.flatnonzero(L.train)[::8]  # as many training tokens as test tokens
        for name, train in mlp_runs(L):
            t0 = time.perf_counter()
            raw = train()
            secs = time.perf_counter() - t0
            q = [tp.calibrate(raw, L.x[L.cut], L.a[L.cut], L.t, r) for r in RECALLS]
            te, tr = tp.evaluate(q[0], L.x[L.test], L.a[L.test], L.t), tp.evaluate(q[0], L.x[sub], L.a[sub], L.t)
            te97 = tp.evaluate(q[1], L.x[L.test], L.a[L.test], L.t)
            print(f"| {il} | {name} | {2 * raw.params / UPGATE_BYTES:.2f} | {te.density:.3f} | {te.precision:.3f} | "
                  f"{tr.density:.3f} | {te97.density:.3f} | {secs:.0f} |", flush=True)


def cmd_fixed(args):
    print("| layer | predictor | S=0.5 active mass kept | FFN output rel. error |")
    for il in args.layers:
        L = Layer(args, il)
        h = L.h[L.test]
        y = h @ L.wd
        act = np.abs(h) > L.t
        mass = np.where(act, np.abs(h), 0)
        keep = [0, 1, 4, 5, 10, 13]  # stored MLP, oracle, exact gate (Bayes), exact up, SVD r64 and r256 products
        for name, score, _ in (forms(L)[k] for k in keep):
            s = score(L.x[L.test])
            hit = s > np.quantile(s, 0.5)
            err = np.linalg.norm(np.where(hit & act, h, 0) @ L.wd - y) / np.linalg.norm(y)
            print(f"| {il} | {name} | {mass[hit].sum() / mass.sum():.3f} | {err:.3f} |", flush=True)
        # TEAL-style input sparsity instead of a predictor: zero the inputs below the layer's median |x_j| (half
        # of the up/gate columns skipped), then keep the down rows above the median |h'|: 50 % of the FFN skipped
        tx = np.quantile(np.abs(L.x[L.train]), 0.5)
        xs = np.where(np.abs(L.x[L.test]) > tx, L.x[L.test], 0)
        h2 = silu(xs @ L.wg.T) * (xs @ L.wu.T)
        h2 = np.where(np.abs(h2) > np.quantile(np.abs(h2), 0.5), h2, 0)
        err = np.linalg.norm(h2 @ L.wd - y) / np.linalg.norm(y)
        print(f"| {il} | input sparsity 50 % + down S 0.5 | — | {err:.3f} |")


def first_matrix_rules(L: Layer, recall: float):
    """(t_l, {mode: rows(gate, up) -> bool mask}) for "gate first" (the second matrix's rows where
    |silu(g)|*rms_u > c) and "up first" (where |u|*rms_silu(g) > c), c cut on the held-out profile chunks."""
    xt, held = L.x[L.train], L.cut | L.test
    rms_u = np.sqrt(((xt @ L.wu.T) ** 2).mean(0))
    rms_sg = np.sqrt((silu(xt @ L.wg.T) ** 2).mean(0))
    c_gate = cut_for_recall(np.abs(silu(L.x[held] @ L.wg.T)) * rms_u, L.a[held], L.t, recall)
    c_up = cut_for_recall(np.abs(L.x[held] @ L.wu.T) * rms_sg, L.a[held], L.t, recall)
    return L.t, {"gate": lambda g, u: np.abs(silu(g)) * rms_u > c_gate,
                 "up": lambda g, u: np.abs(u) * rms_sg > c_up,
                 "oracle": lambda g, u: np.abs(silu(g) * u) > L.t}


def cmd_e2e(args):
    """llama.cpp-style PPL (chunks of 512, second half scored), KLD and top-1 against dense, of the float64
    reference forward whose FFN activation keeps only rows(gate, up) & |h| > t_l."""
    import reference as ref

    from pyinfer.engine.scoring import chunk_tokens, log_softmax
    from pyinfer.formats.tokenizer import Tokenizer

    g = GGUFFile(args.model)
    g.dequantize = functools.lru_cache(maxsize=None)(g.dequantize)  # the reference dequantizes on every use
    n_layer = g.config.n_layer
    rules = [first_matrix_rules(Layer(args, il), args.recall) for il in range(n_layer)]
    state = {"mode": "dense", "calls": 0, "density": []}
    act_of = ref._ffn_act

    def masked(gate, up, kind):
        act = act_of(gate, up, kind)
        t, modes = rules[state["calls"] % n_layer]
        state["calls"] += 1
        if state["mode"] == "dense":
            return act
        rows, on = modes[state["mode"]](gate, up), np.abs(act) > t
        state["density"].append((rows.mean(), (rows & on).mean()))
        return np.where(rows & on, act, 0.0)

    ref._ffn_act = masked
    tok = Tokenizer.from_gguf_metadata(g.metadata)
    bos = tok.bos_id if tok.add_bos else None
    chunks = chunk_tokens(tok.encode(Path(args.text).read_text(), add_special=False), 512, bos, args.chunks)
    base = None
    for mode in ("dense", "oracle", "gate", "up"):
        state.update(mode=mode, density=[])
        nll, lps = [], []
        for c in chunks:
            lps.append(log_softmax(ref.reference_logits(g, c.tolist())[256:-1]))
            nll.extend(-lps[-1][np.arange(255), c[257:]])
        row = {"mode": mode, "recall": args.recall, "ppl": float(np.exp(np.mean(nll))), "scored": len(nll)}
        if base is None:
            base = lps
        else:
            kld = [(np.exp(b) * (b - lp)).sum(-1) for b, lp in zip(base, lps, strict=True)]
            same = [b.argmax(-1) == lp.argmax(-1) for b, lp in zip(base, lps, strict=True)]
            rows, down = np.mean(state["density"], axis=0)
            # oracle: up, gate and down rows all = the active set; gate/up first: the first matrix is whole
            skipped = 1 - down if mode == "oracle" else 1 - (1 + rows + down) / 3
            row |= {"kld": float(np.mean(kld)), "top1": float(np.mean(same)), "second_rows": float(rows),
                    "down_rows": float(down), "rows_skipped": float(skipped)}
        print(json.dumps(row), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("table", choices=("forms", "layers", "mlp", "fixed", "e2e"))
    p.add_argument("layers", nargs="?", help="comma-separated (default: all for `layers`, else 0,5,15,25,29)")
    p.add_argument("--profile", default=str(CACHE / "profiles/e8737289e29a5c0b"), help="cached profile folder")
    p.add_argument("--model", default="/tmp/sp/smol-power.gguf", help="the PowerGGUF the profile was taken from")
    p.add_argument("--sparse", default=str(CACHE / "sparse/smol-s50.gguf"), help="sparsified file (stored predictors)")
    p.add_argument("--text", default="/tmp/sp5/eval.txt",
                   help="e2e: held-out text (docs/BENCHMARKS.md: the Britannica article, first 30 000 characters)")
    p.add_argument("--chunks", type=int, default=4, help="e2e: chunks of 512 tokens (default 4)")
    p.add_argument("--recall", type=float, default=0.99, help="e2e: mass recall of the first-matrix cut")
    args = p.parse_args()
    default = ",".join(map(str, range(30))) if args.table == "layers" else "0,5,15,25,29"
    args.layers = [int(v) for v in (args.layers or default).split(",")]
    {"forms": cmd_forms, "layers": cmd_layers, "mlp": cmd_mlp, "fixed": cmd_fixed, "e2e": cmd_e2e}[args.table](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
