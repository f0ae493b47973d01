"""Blocks the architecture files share: the graph builder, attention over the KV cache, the FFN, logits.

Shapes in comments are numpy order, (outer, ..., inner).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pyinfer import ggml
from pyinfer.errors import ModelFormatError


@dataclass
class GraphInputs:
    tokens: ggml.Tensor  # (n_tokens,) I32 token ids
    pos: ggml.Tensor  # (n_tokens,) I32 position of each token in the sequence
    n_out: int  # logits for the last n_out tokens (1 while generating, n_tokens for perplexity)
    pos_ids: ggml.Tensor | None = None  # (n_tokens,) I32 rows of a learned position table (OPT)


class Builder:
    """What an architecture's graph needs: a context for op nodes, the config, weights and KV cache."""

    def __init__(self, ctx: ggml.Context, cfg, weights: dict[str, ggml.Tensor], kv_cache, capture: dict | None = None,
                 sparse=None, hot_rows: dict[int, int] | None = None):
        self.ctx = ctx
        self.cfg = cfg
        self.weights = weights
        self.kv_cache = kv_cache
        self.capture = capture  # name -> tensor, filled with intermediates a profiler asks for
        self.sparse = sparse  # models.sparse_ffn.SparseSpec: FFNs take the predicted rows only
        # layer -> k for FFNs split between devices: neurons [0, k) are blk.N.ffn_*.hot (on the GPU), the rest
        # blk.N.ffn_*.cold or blk.N.ffn_bundle (on the CPU); both halves run at once and are added
        self.hot_rows = hot_rows or {}

    def w(self, name: str) -> ggml.Tensor:
        t = self.weights.get(name + ".weight")
        if t is None:
            raise ModelFormatError(f"model has no tensor {name}.weight")
        return t

    def has(self, name: str) -> bool:
        return name + ".weight" in self.weights

    def linear(self, x: ggml.Tensor, name: str) -> ggml.Tensor:
        """x @ W.T (+ bias): (n, k) -> (n, rows of W)."""
        y = self.ctx.mul_mat(self.w(name), x)
        bias = self.weights.get(name + ".bias")
        return self.ctx.add(y, bias) if bias is not None else y

    def norm(self, x: ggml.Tensor, name: str) -> ggml.Tensor:
        """RMSNorm or LayerNorm per row, times the weight (+ bias)."""
        cfg = self.cfg
        if cfg.norm_kind == "rms":
            y = self.ctx.rms_norm(x, cfg.norm_eps)
        else:
            y = self.ctx.layer_norm(x, cfg.norm_eps)
        y = self.ctx.mul(y, self.w(name))
        bias = self.weights.get(name + ".bias")
        return self.ctx.add(y, bias) if bias is not None else y


def attention_block(b: Builder, il: int, h: ggml.Tensor, inputs: GraphInputs) -> ggml.Tensor:
    """Self-attention of layer il over the KV cache: (n_tokens, n_embd) -> (n_tokens, n_embd)."""
    cfg, ctx = b.cfg, b.ctx
    n = h.shape[0] if len(h.shape) == 2 else 1
    q = ctx.reshape(b.linear(h, f"blk.{il}.attn_q"), (n, cfg.n_head, cfg.head_dim))  # (n, n_head, head_dim)
    k = ctx.reshape(b.linear(h, f"blk.{il}.attn_k"), (n, cfg.n_head_kv, cfg.head_dim))  # (n, n_head_kv, head_dim)
    v = ctx.reshape(b.linear(h, f"blk.{il}.attn_v"), (n, cfg.n_head_kv, cfg.head_dim))  # (n, n_head_kv, head_dim)
    if cfg.rope_mode is not None:
        mode = ggml.ROPE_NEOX if cfg.rope_mode == "neox" else ggml.ROPE_NORMAL
        q = ctx.rope(q, inputs.pos, cfg.n_rot, mode, cfg.rope_base, 1.0 / cfg.rope_scale)
        k = ctx.rope(k, inputs.pos, cfg.n_rot, mode, cfg.rope_base, 1.0 / cfg.rope_scale)
    k_cache = ctx.kv_store(b.kv_cache.k[il], k, inputs.pos)  # (n_ctx, n_head_kv, head_dim)
    v_cache = ctx.kv_store(b.kv_cache.v[il], v, inputs.pos)
    a = ctx.attention(q, k_cache, v_cache, inputs.pos, 1.0 / math.sqrt(cfg.head_dim))  # (n, n_head * head_dim)
    return b.linear(a, f"blk.{il}.attn_output")


def ffn_activation(b: Builder, il: int, h: ggml.Tensor, part: str = "") -> ggml.Tensor:
    """The FFN's hidden activations (n_tokens, n_ff): act(gate) * up, or act(up) without a gate; part ".hot"
    or ".cold" takes that half of a split layer's neurons."""
    ctx, kind = b.ctx, b.cfg.ffn_kind
    up = b.linear(h, f"blk.{il}.ffn_up{part}")
    if kind == "relu":
        return ctx.relu(up)
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
    """Dense FFN: (n_tokens, n_embd) -> (n_tokens, n_embd); PowerGGUF's down_t is summed row by row."""
    if b.sparse is not None:
        from pyinfer.models import sparse_ffn  # imports this module

        return sparse_ffn.ffn_block(b, il, h)
    if il in b.hot_rows:
        return split_dense_ffn(b, il, h)
    act = ffn_activation(b, il, h)  # (n, n_ff)
    if b.capture is not None:
        b.capture[f"ffn_inp.{il}"] = h  # (n, n_embd)
        b.capture[f"ffn_act.{il}"] = act  # (n, n_ff)
    down = f"blk.{il}.ffn_down_t"
    if b.has(down):
        y = b.ctx.axpy_rows(b.w(down), act)
    else:
        down = f"blk.{il}.ffn_down"
        y = b.ctx.mul_mat(b.w(down), act)
    bias = b.weights.get(down + ".bias")
    return b.ctx.add(y, bias) if bias is not None else y


def split_dense_ffn(b: Builder, il: int, h: ggml.Tensor) -> ggml.Tensor:
    """A dense FFN split by neurons: the GPU sums rows [0, k), the CPU the rest (through its bundle when it
    has one), at the same time; (n_tokens, n_embd) -> (n_tokens, n_embd)."""
    ctx, cfg = b.ctx, b.cfg
    hot = ctx.axpy_rows(b.w(f"blk.{il}.ffn_down_t.hot"), ffn_activation(b, il, h, ".hot"))  # (n, n_embd)
    if b.has(f"blk.{il}.ffn_bundle"):
        n = h.shape[0] if len(h.shape) == 2 else 1
        n_cold = cfg.n_ff - b.hot_rows[il]
        out = ctx.sparse_ffn(b.w(f"blk.{il}.ffn_bundle"), h, None, cfg.ffn_kind)  # (n, n_embd + n_cold)
        cold = ctx.view(out, (n, cfg.n_embd), (4 * (cfg.n_embd + n_cold), 4))
    else:
        cold = ctx.axpy_rows(b.w(f"blk.{il}.ffn_down_t.cold"), ffn_activation(b, il, h, ".cold"))
    y = ctx.add(hot, cold)
    bias = b.weights.get(f"blk.{il}.ffn_down_t.bias")
    return ctx.add(y, bias) if bias is not None else y


def output_logits(b: Builder, x: ggml.Tensor, inputs: GraphInputs) -> ggml.Tensor:
    """Final norm and the vocabulary projection of the last n_out tokens: (n_out, n_vocab)."""
    ctx = b.ctx
    n, d = x.shape if len(x.shape) == 2 else (1, x.shape[0])
    if inputs.n_out < n:  # only the rows we need go through the large output matrix
        x = ctx.view(x, (inputs.n_out, d), (d * 4, 4), offset=(n - inputs.n_out) * d * 4)
        x = ctx.cpy(x, ggml.F32)  # norms need contiguous rows
    x = b.norm(x, "output_norm")
    head = "output" if b.has("output") else "token_embd"
    return ctx.mul_mat(b.w(head), x)
