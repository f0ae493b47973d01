"""Blocks the architecture files share: the graph builder, attention over the KV cache, the FFN, logits.

Shapes in comments are numpy order, (outer, ..., inner).
"""

from __future__ import annotations

from dataclasses import dataclass

from pyinfer.errors import ModelFormatError
from pyinfer.formats.model_config import UNGATED_KINDS
from pyinfer.models import moe, sparse_attention
from pyinfer.native import ggml

STREAM_ROWS = 2048  # a prompt batch copies host FFN weights to the GPU this many neurons at a time


@dataclass
class GraphInputs:
    tokens: ggml.Tensor  # (n_tokens,) I32 token ids
    pos: ggml.Tensor  # (n_tokens,) I32 position of each token in the sequence
    n_out: int  # logits for the last n_out tokens (1 while generating, n_tokens for perplexity)
    pos_ids: ggml.Tensor | None = None  # (n_tokens,) I32 rows of a learned position table (OPT)


class Builder:
    """What an architecture's graph needs: a context for op nodes, the config, weights and KV cache."""

    def __init__(self, ctx: ggml.Context, cfg, weights: dict[str, ggml.Tensor], kv_cache, capture: dict | None = None,
                 sparse=None, hot_rows: dict[int, int] | None = None, stream: bool = False, precise: bool = False):
        self.ctx = ctx
        self.cfg = cfg
        self.weights = weights
        self.kv_cache = kv_cache
        self.capture = capture  # name -> tensor, filled with intermediates a profiler asks for
        self.sparse = sparse  # models.sparse_ffn.SparseSpec: FFNs take the predicted rows only
        # layer -> k for FFNs split between devices: neurons [0, k) are blk.N.ffn_*.hot (on the GPU), the rest
        # blk.N.ffn_*.cold or blk.N.ffn_bundle (on the CPU); both halves run at once and are added
        self.hot_rows = hot_rows or {}
        self.stream = stream  # a prompt graph whose host FFN weights are streamed to the GPU in row chunks
        self.precise = precise  # CPU matmuls without the activations' 8-bit rounding (ggml_mul_mat_precise)
        self.local: dict[str, ggml.Tensor] = {}  # views made for this graph (the chunks)

    def get(self, key: str) -> ggml.Tensor | None:
        """A model tensor or one of this graph's views, by its full name; None if there is none."""
        t = self.local.get(key)
        return t if t is not None else self.weights.get(key)

    def w(self, name: str) -> ggml.Tensor:
        t = self.get(name + ".weight")
        if t is None:
            raise ModelFormatError(f"model has no tensor {name}.weight")
        return t

    def has(self, name: str) -> bool:
        return self.get(name + ".weight") is not None

    def rows(self, name: str, r0: int, r1: int, tag: str) -> None:
        """name + tag: rows [r0, r1) of the matrix `name` (and entries of its per-row bias), as views."""
        w = self.w(name)
        row = w.nbytes // w.ne[1]
        self.local[f"{name}{tag}.weight"] = self.ctx.view(w, (r1 - r0, w.ne[0]), (row, 1), offset=r0 * row)
        bias = self.get(name + ".bias")
        if bias is not None and bias.ne[0] == w.ne[1]:  # a bias per row (not down's, per output)
            self.local[f"{name}{tag}.bias"] = self.ctx.view(bias, (r1 - r0,), (4,), offset=4 * r0)

    def matmul(self, w: ggml.Tensor, x: ggml.Tensor) -> ggml.Tensor:
        """x @ w.T: (n, k) -> (n, rows of w), precise when the model asks for it."""
        return self.ctx.mul_mat(w, x, self.precise)

    def axpy_rows(self, wt: ggml.Tensor, h: ggml.Tensor, sel: ggml.Tensor | None = None) -> ggml.Tensor:
        """sum of h[i] * wt[i] over the selected rows: (n, rows of wt) -> (n, row length), precise as matmul."""
        return self.ctx.axpy_rows(wt, h, sel, precise=self.precise)

    def linear(self, x: ggml.Tensor, name: str) -> ggml.Tensor:
        """x @ W.T (+ bias): (n, k) -> (n, rows of W)."""
        y = self.matmul(self.w(name), x)
        bias = self.get(name + ".bias")
        return self.ctx.add(y, bias) if bias is not None else y

    def norm(self, x: ggml.Tensor, name: str) -> ggml.Tensor:
        """RMSNorm or LayerNorm per row, times the weight (+ bias)."""
        cfg = self.cfg
        if cfg.norm_kind == "rms":
            y = self.ctx.rms_norm(x, cfg.norm_eps)
        else:
            y = self.ctx.layer_norm(x, cfg.norm_eps)
        y = self.ctx.mul(y, self.w(name))
        bias = self.get(name + ".bias")
        return self.ctx.add(y, bias) if bias is not None else y


def attention_block(b: Builder, il: int, h: ggml.Tensor, inputs: GraphInputs) -> ggml.Tensor:
    """Self-attention of layer il over the KV cache: (n_tokens, n_embd) -> (n_tokens, n_embd)."""
    cfg, ctx = b.cfg, b.ctx
    n = h.shape[0] if len(h.shape) == 2 else 1
    sparse = sparse_attention.covers(b, il)
    profiled = b.capture is not None and not cfg.is_moe  # (a mixture's capture holds its routes: a step's outputs)
    if profiled:  # what input sparsity calibrates the projections' thresholds on
        b.capture[f"attn_inp.{il}"] = h  # (n, n_embd)
    linear = sparse_attention.linear(b, il, h, "input") if sparse else lambda name: b.linear(h, name)
    if b.has(f"blk.{il}.attn_qkv"):  # Falcon: one matrix, q then k then v
        q, k, v = fused_qkv(b, linear(f"blk.{il}.attn_qkv"), n)
    else:
        q, k = linear(f"blk.{il}.attn_q"), linear(f"blk.{il}.attn_k")  # (n, q_dim), (n, kv_dim)
        if cfg.qk_norm_whole:  # OLMoE: RMSNorm over all of q and of k
            q, k = b.norm(q, f"blk.{il}.attn_q_norm"), b.norm(k, f"blk.{il}.attn_k_norm")
        q = ctx.reshape(q, (n, cfg.n_head, cfg.head_dim))  # (n, n_head, head_dim)
        k = ctx.reshape(k, (n, cfg.n_head_kv, cfg.head_dim))  # (n, n_kv, head_dim)
        v = ctx.reshape(linear(f"blk.{il}.attn_v"), (n, cfg.n_head_kv, cfg.head_dim))  # (n, n_kv, head_dim)
    if b.has(f"blk.{il}.attn_q_norm") and not cfg.qk_norm_whole:  # Qwen3, Gemma 3: RMSNorm of every head's q and k
        q = b.norm(q, f"blk.{il}.attn_q_norm")
        k = b.norm(k, f"blk.{il}.attn_k_norm")
    if cfg.rope_mode is not None:
        mode = ggml.ROPE_NEOX if cfg.rope_mode == "neox" else ggml.ROPE_NORMAL
        factors = b.get("rope_freqs.weight")  # Llama 3's scaling
        q = ctx.rope(q, inputs.pos, cfg.n_rot, mode, freq_factors=factors, **cfg.rope_args(il))
        k = ctx.rope(k, inputs.pos, cfg.n_rot, mode, freq_factors=factors, **cfg.rope_args(il))
    k_cache = ctx.kv_store(b.kv_cache.k[il], k, inputs.pos)  # (n_ctx, n_head_kv, head_dim)
    v_cache = ctx.kv_store(b.kv_cache.v[il], v, inputs.pos)
    a = ctx.attention(q, k_cache, v_cache, inputs.pos, cfg.softmax_scale, cfg.layer_window(il),
                      b.get(f"blk.{il}.attn_sinks.weight"))  # (n, q_dim)
    if profiled:
        b.capture[f"attn_out.{il}"] = a  # (n, q_dim)
    if sparse:
        return sparse_attention.linear(b, il, a, "output")(f"blk.{il}.attn_output")
    return b.linear(a, f"blk.{il}.attn_output")


def fused_qkv(b: Builder, qkv: ggml.Tensor, n: int) -> tuple[ggml.Tensor, ggml.Tensor, ggml.Tensor]:
    """q (n, n_head, head_dim), k and v (n, n_head_kv, head_dim) as views into the output of a fused projection
    (n, q_dim + 2 kv_dim): rope, kv_store and attention read rows through their strides, so nothing is copied."""
    cfg, ctx = b.cfg, b.ctx
    hd, q_dim, kv_dim = cfg.head_dim, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    row = 4 * (q_dim + 2 * kv_dim)

    def heads(c0: int, n_heads: int) -> ggml.Tensor:
        return ctx.view(qkv, (n, n_heads, hd), (row, 4 * hd, 4), offset=4 * c0)

    return heads(0, cfg.n_head), heads(q_dim, cfg.n_head_kv), heads(q_dim + kv_dim, cfg.n_head_kv)


def ungated_act(ctx: ggml.Context, kind: str):
    """The activation op of an FFN without a gate (model_config.UNGATED_KINDS)."""
    return {"relu": ctx.relu, "gelu": ctx.gelu, "gelu_erf": ctx.gelu_erf}[kind]


def ffn_activation(b: Builder, il: int, h: ggml.Tensor, part: str = "") -> ggml.Tensor:
    """The FFN's hidden activations (n_tokens, n_ff): act(gate) * up, or act(up) without a gate; part ".hot"
    or ".cold" takes that half of a split layer's neurons."""
    ctx, kind = b.ctx, b.cfg.ffn_kind
    up = b.linear(h, f"blk.{il}.ffn_up{part}")
    if kind in UNGATED_KINDS:
        return ungated_act(ctx, kind)(up)
    gate = b.linear(h, f"blk.{il}.ffn_gate{part}")
    if kind == "swiglu":
        return ctx.mul(ctx.silu(gate), up)
    if kind == "reglu":
        return ctx.mul(ctx.relu(gate), up)
    if kind == "drelu":
        return ctx.mul(ctx.relu(gate), ctx.relu(up))
    if kind == "geglu":
        return ctx.mul(ctx.gelu(gate), up)
    raise ModelFormatError(f"unknown FFN kind {kind!r}")


def ffn_block(b: Builder, il: int, h: ggml.Tensor) -> ggml.Tensor:
    """Dense FFN: (n_tokens, n_embd) -> (n_tokens, n_embd); PowerGGUF's down_t is summed row by row; a
    mixture of experts' routed FFNs (models.moe)."""
    if b.cfg.is_moe:
        y = moe.moe_ffn_block(b, il, h)
        return add_shared_expert(b, il, h, y) if b.has(f"blk.{il}.ffn_up_shexp") else y
    if b.sparse is not None:
        from pyinfer.models import sparse_ffn  # imports this module

        return sparse_ffn.ffn_block(b, il, h)
    if b.stream and host_ffn(b, il) is not None:
        return streamed_ffn(b, il, h)
    if il in b.hot_rows:
        return split_dense_ffn(b, il, h)
    return plain_ffn(b, il, h)


def plain_ffn(b: Builder, il: int, h: ggml.Tensor) -> ggml.Tensor:
    """Layer il's dense FFN, every neuron, wherever its weights are: (n_tokens, n_embd) -> (n_tokens, n_embd)."""
    act = ffn_activation(b, il, h)  # (n, n_ff)
    if b.capture is not None:
        b.capture[f"ffn_inp.{il}"] = h  # (n, n_embd)
        b.capture[f"ffn_act.{il}"] = act  # (n, n_ff)
    down = f"blk.{il}.ffn_down_t"
    if b.has(down):
        y = b.axpy_rows(b.w(down), act)
    else:
        down = f"blk.{il}.ffn_down"
        y = b.matmul(b.w(down), act)
    bias = b.get(down + ".bias")
    return b.ctx.add(y, bias) if bias is not None else y


def add_shared_expert(b: Builder, il: int, h: ggml.Tensor, y: ggml.Tensor) -> ggml.Tensor:
    """y plus layer il's shared expert (Qwen3.5-MoE: every token's), its output gated by sigmoid(w . h), one value a
    token: (n_tokens, n_embd) -> (n_tokens, n_embd)."""
    ctx, p = b.ctx, f"blk.{il}."
    gate_w = b.w(p + "ffn_gate_inp_shexp")
    gate = ctx.sigmoid(b.matmul(ctx.reshape(gate_w, (1, gate_w.ne[0])), h))  # (n, 1)
    return ctx.add(y, ctx.mul(b.linear(ffn_activation(b, il, h, "_shexp"), p + "ffn_down_shexp"), gate))


def split_dense_ffn(b: Builder, il: int, h: ggml.Tensor) -> ggml.Tensor:
    """A dense FFN split by neurons: the GPU sums rows [0, k), the CPU the rest (through its bundle when it
    has one), at the same time; (n_tokens, n_embd) -> (n_tokens, n_embd)."""
    ctx, cfg = b.ctx, b.cfg
    hot = b.axpy_rows(b.w(f"blk.{il}.ffn_down_t.hot"), ffn_activation(b, il, h, ".hot"))  # (n, n_embd)
    if b.has(f"blk.{il}.ffn_bundle"):
        n = h.shape[0] if len(h.shape) == 2 else 1
        n_cold = cfg.layer_n_ff(il) - b.hot_rows[il]
        out = ctx.sparse_ffn(b.w(f"blk.{il}.ffn_bundle"), h, None, cfg.ffn_kind)  # (n, n_embd + n_cold)
        cold = ctx.view(out, (n, cfg.n_embd), (4 * (cfg.n_embd + n_cold), 4))
    else:
        cold = b.axpy_rows(b.w(f"blk.{il}.ffn_down_t.cold"), ffn_activation(b, il, h, ".cold"))
    y = ctx.add(hot, cold)
    bias = b.get(f"blk.{il}.ffn_down_t.bias")
    return ctx.add(y, bias) if bias is not None else y


def host_ffn(b: Builder, il: int) -> tuple[str, int] | None:
    """(part, rows) of layer il's FFN neurons whose weights are in host memory, None if all are on the GPU."""
    if il in b.hot_rows:
        return ".cold", b.cfg.layer_n_ff(il) - b.hot_rows[il]
    up = b.weights.get(f"blk.{il}.ffn_up.weight")
    if up is not None and not up.on_device and b.has(f"blk.{il}.ffn_down_t"):
        return "", b.cfg.layer_n_ff(il)
    return None


def streamed_ffn(b: Builder, il: int, h: ggml.Tensor, pred: ggml.Tensor | None = None) -> ggml.Tensor:
    """The FFN of a prompt batch on the GPU, its host neurons copied in chunk by chunk (STREAM_ROWS rows
    of each matrix at a time, so the copies need little device memory), the GPU's own hot rows as they
    are. pred: the sparse model's predictor logits (n, n_ff); the host neurons are then computed whole under
    the same mask, as sparse_ffn.rows_ffn does for large batches. -> (n_tokens, n_embd), down bias added."""
    from pyinfer.models import sparse_ffn

    ctx, cfg = b.ctx, b.cfg
    n = h.shape[0] if len(h.shape) == 2 else 1
    part, n_rows = host_ffn(b, il)
    n_ff = cfg.layer_n_ff(il)  # Gemma 4's shared-KV layers may be twice as wide
    first = n_ff - n_rows  # the host's rows are the last ones
    y = None
    for r0 in range(0, n_rows, STREAM_ROWS):
        r1 = min(n_rows, r0 + STREAM_ROWS)
        tag = f"{part}.rows{r0}"
        for name in ("ffn_gate", "ffn_up", "ffn_down_t"):
            if b.has(f"blk.{il}.{name}{part}"):
                b.rows(f"blk.{il}.{name}{part}", r0, r1, f".rows{r0}")
        if pred is None:
            chunk = b.axpy_rows(b.w(f"blk.{il}.ffn_down_t{tag}"), ffn_activation(b, il, h, tag))
        else:
            sel = ctx.view(pred, (n, r1 - r0), (4 * n_ff, 4), offset=4 * (first + r0))
            chunk = sparse_ffn.rows_ffn(b, il, h, sel, tag, dense=True)[0]
        y = chunk if y is None else ctx.add(y, chunk)
    if first:  # the GPU's rows
        if pred is None:
            y = ctx.add(y, b.axpy_rows(b.w(f"blk.{il}.ffn_down_t.hot"), ffn_activation(b, il, h, ".hot")))
        else:
            hot_sel = ctx.view(pred, (n, first), (4 * n_ff, 4))
            y = ctx.add(y, sparse_ffn.rows_ffn(b, il, h, hot_sel, ".hot", dense=True)[0])
    bias = b.get(f"blk.{il}.ffn_down_t.bias")
    return ctx.add(y, bias) if bias is not None else y


def output_logits(b: Builder, x: ggml.Tensor, inputs: GraphInputs) -> ggml.Tensor:
    """Final norm and the vocabulary projection of the last n_out tokens, softcapped where the model says so
    (c tanh(logits / c), Gemma): (n_out, n_vocab)."""
    ctx = b.ctx
    n, d = x.shape if len(x.shape) == 2 else (1, x.shape[0])
    if inputs.n_out < n:  # only the rows we need go through the large output matrix
        x = ctx.view(x, (inputs.n_out, d), (d * 4, 4), offset=(n - inputs.n_out) * d * 4)
    x = b.norm(x, "output_norm")
    head = "output" if b.has("output") else "token_embd"
    logits = b.matmul(b.w(head), x)
    cap = b.cfg.final_logit_softcap
    return ctx.scale(ctx.tanh(ctx.scale(logits, 1.0 / cap)), cap) if cap else logits
