"""Gemma 4 graph (the text model): Gemma 3's layer (embeddings scaled by sqrt(d), q/k RMS norms, norms before and
after attention and FFN, GeGLU, windowed layers among global ones) with Gemma 4's changes, as transformers'
gemma4_text and llama.cpp's gemma4 compute them:
- the global layers have their own head size (ModelConfig.layer_head_dim) and KV heads, and rotate only part of
  each head ("proportional" RoPE: rope_freqs.weight holds 1 for the rotated pairs and 1e30 for the others);
- values are RMS-normed without a weight; a global layer without attn_v takes its values from the keys'
  projection (before the key norm);
- the softmax scale is 1 (ModelConfig.attn_scale);
- the last layers may compute no K and V and attend over an earlier layer's (ModelConfig.kv_layer);
- per-layer embeddings (E2B, E4B): a second table gives every token one small vector per layer, mixed with a
  projection of its embedding; each layer gates it by its output and adds it back (add_per_layer_input);
- each layer's output may be scaled (blk.N.layer_output_scale), the logits softcapped (models.common);
- the 26B-A4B's layers run a dense FFN and a mixture of experts side by side (dense_and_experts).
"""

from __future__ import annotations

import math

from pyinfer.models import moe
from pyinfer.models.common import GraphInputs, ffn_block, output_logits, plain_ffn
from pyinfer.native import ggml


def build(b, inputs: GraphInputs):
    """Logits [n_out, n_vocab] for the tokens of `inputs`; b is a models.common.Builder."""
    ctx, cfg = b.ctx, b.cfg
    x = ctx.scale(ctx.get_rows(b.w("token_embd"), inputs.tokens), cfg.embed_scale)  # (n_tokens, n_embd)
    per_layer = per_layer_inputs(b, x, inputs) if cfg.n_embd_per_layer else None  # (n, n_layer, n_embd_per_layer)
    caches: dict[int, tuple[ggml.Tensor, ggml.Tensor]] = {}  # layer -> its kv_store nodes, for the layers sharing them
    for il in range(cfg.n_layer):
        h = attention(b, il, b.norm(x, f"blk.{il}.attn_norm"), inputs, caches)
        x = ctx.add(x, b.norm(h, f"blk.{il}.post_attention_norm"))  # residual
        h = dense_and_experts(b, il, x) if cfg.is_moe else ffn_block(b, il, b.norm(x, f"blk.{il}.ffn_norm"))
        x = ctx.add(x, b.norm(h, f"blk.{il}.post_ffw_norm"))  # residual
        if per_layer is not None:
            x = add_per_layer_input(b, il, x, per_layer)
        scale = b.get(f"blk.{il}.layer_output_scale.weight")
        if scale is not None:  # one F32 (gguf_file checks it): read when the graph is built
            x = ctx.scale(x, float(scale.numpy()[0]))
    return output_logits(b, x, inputs)


def attention(b, il: int, h: ggml.Tensor, inputs: GraphInputs,
              caches: dict[int, tuple[ggml.Tensor, ggml.Tensor]]) -> ggml.Tensor:
    """Self-attention of layer il: (n_tokens, n_embd) -> (n_tokens, n_embd). A layer that computes its K and V
    enters its kv_store nodes in `caches`; a shared layer attends over its source layer's nodes."""
    cfg, ctx = b.cfg, b.ctx
    n = h.shape[0] if len(h.shape) == 2 else 1
    hd, n_kv, p = cfg.layer_head_dim(il), cfg.layer_n_head_kv(il), f"blk.{il}."
    # the global layers' partial rotation; the windowed layers rotate whole heads
    factors = None if cfg.windowed(il) else b.get("rope_freqs.weight")

    def rope(t: ggml.Tensor) -> ggml.Tensor:
        return ctx.rope(t, inputs.pos, cfg.layer_n_rot(il), ggml.ROPE_NEOX, freq_factors=factors,
                        **cfg.rope_args(il))

    q = ctx.reshape(b.linear(h, p + "attn_q"), (n, cfg.n_head, hd))  # (n, n_head, hd)
    q = rope(b.norm(q, p + "attn_q_norm"))
    source = cfg.kv_layer(il)
    if source == il:
        k_proj = b.linear(h, p + "attn_k")  # (n, n_kv * hd)
        v_proj = b.linear(h, p + "attn_v") if b.has(p + "attn_v") else k_proj  # attention_k_eq_v: v is k's projection
        k = rope(b.norm(ctx.reshape(k_proj, (n, n_kv, hd)), p + "attn_k_norm"))  # (n, n_kv, hd)
        v = ctx.rms_norm(ctx.reshape(v_proj, (n, n_kv, hd)), cfg.norm_eps)  # (n, n_kv, hd), no weight
        caches[il] = (ctx.kv_store(b.kv_cache.k[il], k, inputs.pos), ctx.kv_store(b.kv_cache.v[il], v, inputs.pos))
    k_cache, v_cache = caches[source]  # (n_ctx, n_kv, hd) each
    a = ctx.attention(q, k_cache, v_cache, inputs.pos, cfg.softmax_scale, cfg.layer_window(il))  # (n, n_head * hd)
    return b.linear(a, p + "attn_output")


def dense_and_experts(b, il: int, x: ggml.Tensor) -> ggml.Tensor:
    """The 26B-A4B's FFN of the residual x (n_tokens, n_embd): its dense FFN and its experts, each between norms of
    its own, added. The router reads x RMS-normed without a weight, times a learned vector and 1/sqrt(n_embd); each
    chosen expert's weight (softmax over the k chosen) is times its own scale (moe.SCALES)."""
    cfg, ctx, p = b.cfg, b.ctx, f"blk.{il}."
    router_in = ctx.mul(ctx.scale(ctx.rms_norm(x, cfg.norm_eps), cfg.n_embd ** -0.5), b.get(p + "ffn_gate_inp.scale"))
    experts = b.norm(moe.moe_ffn_block(b, il, b.norm(x, p + "pre_ffw_norm_2"), router_in), p + "post_ffw_norm_2")
    dense = b.norm(plain_ffn(b, il, b.norm(x, p + "ffn_norm")), p + "post_ffw_norm_1")
    # the experts first in the graph: the router's choice reaches the CPU's experts before the GPU runs the dense FFN,
    # which it then runs beside them
    return ctx.add(experts, dense)


def per_layer_inputs(b, x: ggml.Tensor, inputs: GraphInputs) -> ggml.Tensor:
    """Every layer's per-layer input (n_tokens, n_layer, n_embd_per_layer): the token's row of the per-layer table
    (times sqrt(n_embd_per_layer)) plus the RMS-normed projection of its scaled embedding x (n_tokens, n_embd)
    (times 1/sqrt(n_embd)), the sum times 1/sqrt(2)."""
    cfg, ctx = b.cfg, b.ctx
    n, pl = x.shape[0] if len(x.shape) == 2 else 1, cfg.n_embd_per_layer
    table = ctx.get_rows(b.w("per_layer_token_embd"), inputs.tokens)  # (n, n_layer * pl)
    table = ctx.reshape(ctx.scale(table, math.sqrt(pl)), (n, cfg.n_layer, pl))
    proj = ctx.scale(b.matmul(b.w("per_layer_model_proj"), x), 1.0 / math.sqrt(cfg.n_embd))  # (n, n_layer * pl)
    proj = b.norm(ctx.reshape(proj, (n, cfg.n_layer, pl)), "per_layer_proj_norm")  # (n, n_layer, pl)
    return ctx.scale(ctx.add(proj, table), 1.0 / math.sqrt(2.0))


def add_per_layer_input(b, il: int, x: ggml.Tensor, per_layer: ggml.Tensor) -> ggml.Tensor:
    """x + norm(proj(gelu(inp_gate(x)) * layer il's per-layer input)): (n_tokens, n_embd) -> (n_tokens, n_embd)."""
    cfg, ctx = b.cfg, b.ctx
    n, pl = per_layer.shape[0] if len(per_layer.shape) == 3 else 1, cfg.n_embd_per_layer
    mine = ctx.view(per_layer, (n, pl), (4 * cfg.n_layer * pl, 4), offset=4 * il * pl)  # (n, pl), strided
    gated = ctx.mul(mine, ctx.gelu(b.linear(x, f"blk.{il}.inp_gate")))  # (n, pl)
    return ctx.add(x, b.norm(b.linear(gated, f"blk.{il}.proj"), f"blk.{il}.post_norm"))
