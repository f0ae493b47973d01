"""OPT graph: learned positions, pre-LayerNorm with biases, ReLU FFN with biases, tied output."""

from __future__ import annotations

from pyinfer.models.common import GraphInputs, attention_block, ffn_block, output_logits


def build(b, inputs: GraphInputs):
    """Logits [n_out, n_vocab]; inputs.pos already carries OPT's position offset (models.position_ids)."""
    ctx, cfg = b.ctx, b.cfg
    tok = ctx.get_rows(b.w("token_embd"), inputs.tokens)  # (n_tokens, n_embd)
    x = ctx.add(tok, ctx.get_rows(b.w("position_embd"), inputs.pos_ids))  # (n_tokens, n_embd)
    for il in range(cfg.n_layer):
        h = b.norm(x, f"blk.{il}.attn_norm")
        x = ctx.add(x, attention_block(b, il, h, inputs))
        h = b.norm(x, f"blk.{il}.ffn_norm")
        x = ctx.add(x, ffn_block(b, il, h))
    return output_logits(b, x, inputs)
