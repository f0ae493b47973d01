"""Falcon graph: attention and FFN in parallel on the same residual input (each from its own LayerNorm in the
40B layout, `attn_norm_2`), fused QKV with multi-query or grouped KV heads, an ungated GELU or ReLU FFN."""

from __future__ import annotations

from pyinfer.models.common import GraphInputs, attention_block, ffn_block, output_logits


def build(b, inputs: GraphInputs):
    """Logits [n_out, n_vocab] for the tokens of `inputs`; b is a models.common.Builder."""
    ctx, cfg = b.ctx, b.cfg
    x = ctx.get_rows(b.w("token_embd"), inputs.tokens)  # (n_tokens, n_embd)
    for il in range(cfg.n_layer):
        h = b.norm(x, f"blk.{il}.attn_norm")
        h_ffn = b.norm(x, f"blk.{il}.attn_norm_2") if b.has(f"blk.{il}.attn_norm_2") else h
        x = ctx.add(x, ctx.add(attention_block(b, il, h, inputs), ffn_block(b, il, h_ffn)))  # residual
    return output_logits(b, x, inputs)
