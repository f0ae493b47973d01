"""The FFN of a mixture of experts: the router's logits, its top k, and the chosen experts' FFNs, weighted and
summed (ggml's top_k and moe_ffn). A layer whose experts are split between the devices holds two sets,
`blk.N.ffn_*_exps.gpu` and `.cpu`, each with the slot of every expert in it (`blk.N.ffn_exps_slots.gpu` and
`.cpu`: its matrix there, or -1); both run at once, each over the experts it holds, and are added."""

from __future__ import annotations

from pyinfer.native import ggml

SIDES = (".gpu", ".cpu")


def moe_ffn_block(b, il: int, h: ggml.Tensor) -> ggml.Tensor:
    """(n_tokens, n_embd) -> (n_tokens, n_embd)."""
    cfg, ctx = b.cfg, b.ctx
    p = f"blk.{il}."
    # the router precise on both devices (no 8-bit activations, no TF32): a rounded logit can choose another expert
    logits = ctx.mul_mat(b.w(p + "ffn_gate_inp"), h, True)  # (n, n_expert)
    ids = ctx.top_k(logits, cfg.n_expert_used)  # (n, k)
    if b.capture is not None:
        b.capture[f"moe_ids.{il}"] = ids
    sides = [s for s in SIDES if b.has(p + "ffn_gate_exps" + s)] or [""]
    y = None
    for side in sides:
        slots = b.get(p + "ffn_exps_slots" + side)
        part = ctx.moe_ffn(b.w(p + "ffn_gate_exps" + side), b.w(p + "ffn_up_exps" + side),
                           b.w(p + "ffn_down_exps" + side), h, ids, logits, slots, cfg.ffn_kind, cfg.expert_norm)
        y = part if y is None else ctx.add(y, part)
    return y
