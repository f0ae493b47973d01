"""Qwen3.5 graph (the text model), as transformers' qwen3_5_text and llama.cpp's qwen35 compute it: three of every
four layers are linear attention, a gated delta net (models.common's norms and SwiGLU FFN around it):
- q, k and v come out of one projection through a causal convolution over the tokens (ssm_conv; its last inputs
  carried between graphs in a state), then silu; q and k are L2-normed per head (inside delta_net);
- the gated delta rule keeps a D x D matrix per value head (delta_net, its state carried likewise): each token
  decays it by exp(g), g = ssm_a * softplus(alpha + dt_bias) (ssm_a = -exp(A_log)), writes v with strength
  sigmoid(beta) and reads it with q; value head h reads key head h % H_k (llama.cpp's files reorder the value heads
  so; the converter does the same);
- its output is RMS-normed per head and gated by silu(z), z a projection of the layer's input.
The fourth layer is full attention with per-head q/k norms whose output is gated by sigmoid(gate), gate the second
half of each head's row of attn_q. Its RoPE has sections (multimodal positions); text gives every section the same
position, which makes it plain NEOX RoPE over the first n_rot dimensions. The norms' weights are stored as 1 + w
(the converter adds 1, as llama.cpp's does), so they multiply as the other families' do.
"""

from __future__ import annotations

import math

from pyinfer.models.common import GraphInputs, ffn_block, output_logits
from pyinfer.native import ggml

L2_EPS = 1e-6  # transformers' l2norm of q and k (llama.cpp takes the model's RMS epsilon, 1e-6 in every release)


def build(b, inputs: GraphInputs):
    """Logits [n_out, n_vocab] for the tokens of `inputs`; b is a models.common.Builder."""
    ctx, cfg = b.ctx, b.cfg
    x = ctx.get_rows(b.w("token_embd"), inputs.tokens)  # (n_tokens, n_embd)
    for il in range(cfg.n_layer):
        h = b.norm(x, f"blk.{il}.attn_norm")
        mixer = linear_attention if cfg.recurrent(il) else gated_attention
        x = ctx.add(x, mixer(b, il, h, inputs))  # residual
        x = ctx.add(x, ffn_block(b, il, b.norm(x, f"blk.{il}.post_attention_norm")))  # residual
    return output_logits(b, x, inputs)


def gated_attention(b, il: int, h: ggml.Tensor, inputs: GraphInputs) -> ggml.Tensor:
    """Full attention of layer il with its output gate: (n_tokens, n_embd) -> (n_tokens, n_embd)."""
    cfg, ctx, p = b.cfg, b.ctx, f"blk.{il}."
    n = h.shape[0] if len(h.shape) == 2 else 1
    hd, nh, nkv = cfg.head_dim, cfg.n_head, cfg.n_head_kv
    q_gate = b.linear(h, p + "attn_q")  # (n, nh * 2 hd): per head its q, then its gate

    def half(second: bool) -> ggml.Tensor:
        return ctx.view(q_gate, (n, nh, hd), (8 * nh * hd, 8 * hd, 4), offset=4 * hd * second)

    gate = ctx.reshape(ctx.sigmoid(half(True)), (n, nh * hd))  # (n, nh * hd): sigmoid reads the strided rows

    def rope(t: ggml.Tensor) -> ggml.Tensor:
        return ctx.rope(t, inputs.pos, cfg.n_rot, ggml.ROPE_NEOX, **cfg.rope_args(il))

    q = rope(b.norm(half(False), p + "attn_q_norm"))  # (n, nh, hd)
    k = rope(b.norm(ctx.reshape(b.linear(h, p + "attn_k"), (n, nkv, hd)), p + "attn_k_norm"))  # (n, nkv, hd)
    v = ctx.reshape(b.linear(h, p + "attn_v"), (n, nkv, hd))
    k_cache = ctx.kv_store(b.kv_cache.k[il], k, inputs.pos)
    v_cache = ctx.kv_store(b.kv_cache.v[il], v, inputs.pos)
    a = ctx.attention(q, k_cache, v_cache, inputs.pos, cfg.softmax_scale)  # (n, nh * hd)
    return b.linear(ctx.mul(a, gate), p + "attn_output")


def linear_attention(b, il: int, h: ggml.Tensor, inputs: GraphInputs) -> ggml.Tensor:
    """The gated delta net of layer il: (n_tokens, n_embd) -> (n_tokens, n_embd), its states carried in
    b.kv_cache.conv[il] and b.kv_cache.ssm[il]."""
    cfg, ctx, p = b.cfg, b.ctx, f"blk.{il}."
    n = h.shape[0] if len(h.shape) == 2 else 1
    d, hk, hv, channels = cfg.ssm_head_dim, cfg.ssm_n_k_heads, cfg.ssm_n_v_heads, cfg.ssm_conv_channels
    mixed = ctx.ssm_conv(b.kv_cache.conv[il], b.linear(h, p + "attn_qkv"), b.w(p + "ssm_conv1d"), inputs.pos)
    mixed = ctx.silu(mixed)  # (n, channels): q's heads, k's, v's

    def heads(first: int, count: int) -> ggml.Tensor:  # (n, count, d) of the channels from head `first`
        return ctx.view(mixed, (n, count, d), (4 * channels, 4 * d, 4), offset=4 * d * first)

    beta = ctx.sigmoid(b.linear(h, p + "ssm_beta"))  # (n, hv)
    decay = ctx.softplus(ctx.add(b.linear(h, p + "ssm_alpha"), b.get(p + "ssm_dt.bias")))
    g = ctx.mul(decay, b.get(p + "ssm_a"))  # (n, hv) log decays, <= 0
    core = ctx.delta_net(b.kv_cache.ssm[il], heads(0, hk), heads(hk, hk), heads(2 * hk, hv), g, beta, inputs.pos,
                         1.0 / math.sqrt(d), L2_EPS)  # q and k L2-normed in the op
    z = ctx.silu(ctx.reshape(b.linear(h, p + "attn_gate"), (n, hv, d)))
    out = ctx.mul(b.norm(core, p + "ssm_norm"), z)  # (n, hv, d)
    return b.linear(ctx.reshape(out, (n, hv * d)), p + "ssm_out")
