"""LLaMA-family graph (LLaMA-2/3, Mistral, SmolLM2, Qwen2 with its QKV bias, Qwen3 with q/k norms; SwiGLU,
ReGLU, dReLU FFNs; the mixtures of experts Mixtral, Qwen3-MoE, OLMoE and gpt-oss (attention sinks, biases, its
clamped SwiGLU), whose FFN is models.moe's)."""

from __future__ import annotations

from pyinfer.models.common import GraphInputs, attention_block, ffn_block, output_logits


def build(b, inputs: GraphInputs):
    """Logits [n_out, n_vocab] for the tokens of `inputs`; b is a models.common.Builder."""
    cfg = b.cfg
    x = b.ctx.get_rows(b.w("token_embd"), inputs.tokens)  # (n_tokens, n_embd)
    for il in range(cfg.n_layer):
        h = b.norm(x, f"blk.{il}.attn_norm")
        x = b.ctx.add(x, attention_block(b, il, h, inputs))  # residual
        h = b.norm(x, f"blk.{il}.{cfg.ffn_norm_name}")
        x = b.ctx.add(x, ffn_block(b, il, h))  # residual
    return output_logits(b, x, inputs)
