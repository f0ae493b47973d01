"""Gemma 3 graph: embeddings scaled by sqrt(d), q/k RMS norms, a norm after attention and after the FFN as well
as before, GeGLU, sliding-window layers interleaved with global ones (ModelConfig.windowed), tied output."""

from __future__ import annotations

from pyinfer.models.common import GraphInputs, attention_block, ffn_block, output_logits


def build(b, inputs: GraphInputs):
    """Logits [n_out, n_vocab] for the tokens of `inputs`; b is a models.common.Builder."""
    ctx, cfg = b.ctx, b.cfg
    x = ctx.scale(ctx.get_rows(b.w("token_embd"), inputs.tokens), cfg.embed_scale)  # (n_tokens, n_embd)
    for il in range(cfg.n_layer):
        h = attention_block(b, il, b.norm(x, f"blk.{il}.attn_norm"), inputs)
        x = ctx.add(x, b.norm(h, f"blk.{il}.post_attention_norm"))  # residual
        h = ffn_block(b, il, b.norm(x, f"blk.{il}.ffn_norm"))
        x = ctx.add(x, b.norm(h, f"blk.{il}.post_ffw_norm"))  # residual
    return output_logits(b, x, inputs)
