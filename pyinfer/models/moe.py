"""The FFN of a mixture of experts: the router's logits, its top k, and the chosen experts' FFNs, weighted and
summed (ggml's top_k and moe_ffn). A layer whose experts are split between the devices holds two sets,
`blk.N.ffn_*_exps.gpu` and `.cpu`, each with the slot of every expert in it (`blk.N.ffn_exps_slots.gpu` and
`.cpu`: its matrix there, or -1); both run at once, each over the experts it holds, and are added. gpt-oss' experts
have biases, which the driver gathers per layer into one tensor by expert (`blk.N.ffn_exps_biases`, a copy of
it on each side of a split, expert_biases); Gemma 4's a scale each (`blk.N.ffn_down_exps.scale`, copied likewise)."""

from __future__ import annotations

import numpy as np

from pyinfer.native import ggml

SIDES = (".gpu", ".cpu")
# a prompt batch copies a layer's host experts to the GPU at most this many at a time, and at most this many bytes
# (one expert where it is larger: Mixtral-8x7B's are 99 MB at Q4_0, 16 of them had made the reserve 1.6 GB)
STREAM_EXPERTS = 16
STREAM_CHUNK_BYTES = 64 << 20
BIASES = "ffn_exps_biases"  # gpt-oss: a layer's expert biases as moe_ffn takes them (expert_biases)
SCALES = "ffn_down_exps.scale"  # Gemma 4: each expert's weight multiplied by its own, as llama.cpp names them
BY_EXPERT = (BIASES, SCALES)  # tensors indexed by expert, not by matrix: each side of a split holds all of them


def stream_experts(expert_bytes: int) -> int:
    """Experts one streamed chunk holds, of expert_bytes (its three matrices) each."""
    return max(1, min(STREAM_EXPERTS, STREAM_CHUNK_BYTES // max(expert_bytes, 1)))


def expert_biases(file, il: int) -> np.ndarray:
    """Layer il's expert biases as moe_ffn takes them: (n_expert, 2 n_ff + d) F32, each expert's gate, up and down
    biases side by side (the file's ffn_{gate,up,down}_exps.bias)."""
    parts = [file.tensors[f"blk.{il}.ffn_{m}_exps.bias"] for m in ("gate", "up", "down")]
    return np.concatenate([np.frombuffer(p.data, np.float32).reshape(p.ne[1], p.ne[0]) for p in parts], axis=1)


def moe_ffn_block(b, il: int, h: ggml.Tensor, router_in: ggml.Tensor | None = None) -> ggml.Tensor:
    """(n_tokens, n_embd) -> (n_tokens, n_embd); the router reads router_in where given (Gemma 4's), else h."""
    cfg, ctx = b.cfg, b.ctx
    p = f"blk.{il}."
    # the router precise on both devices (no 8-bit activations, no TF32): a rounded logit can choose another expert
    logits = ctx.mul_mat(b.w(p + "ffn_gate_inp"), h if router_in is None else router_in, True)  # (n, n_expert)
    router_bias = b.get(p + "ffn_gate_inp.bias")
    if router_bias is not None:  # gpt-oss
        logits = ctx.add(logits, router_bias)
    ids = ctx.top_k(logits, cfg.n_expert_used)  # (n, k)
    if b.capture is not None:
        b.capture[f"moe_ids.{il}"] = ids
    sides = [s for s in SIDES if b.has(p + "ffn_gate_exps" + s)] or [""]
    y = None
    for side in sides:
        mats = [b.w(p + f"ffn_{m}_exps" + side) for m in ("gate", "up", "down")]
        slots = b.get(p + "ffn_exps_slots" + side)
        biases, scales = (b.get(p + name + side) for name in BY_EXPERT)
        if b.stream and not mats[0].on_device:
            parts = _streamed(b, mats, slots, biases, scales, h, ids, logits)
        else:
            parts = [ctx.moe_ffn(*mats, h, ids, logits, slots, cfg.ffn_kind, cfg.expert_norm, biases, scales)]
        for part in parts:
            y = part if y is None else ctx.add(y, part)
    return y


def _streamed(b, mats: list[ggml.Tensor], slots: ggml.Tensor | None, biases: ggml.Tensor | None,
              scales: ggml.Tensor | None, h, ids, logits) -> list[ggml.Tensor]:
    """A prompt batch's host experts on the GPU: each run of consecutive matrices this side holds (a profiled
    split leaves gaps where the GPU's experts sit), stream_experts at a time (each chunk's matrices copied in just
    before it runs, into memory the next chunk reuses), each chunk with the slots of its own experts."""
    cfg, ctx = b.cfg, b.ctx
    n_local = mats[0].ne[2]
    held = slots.numpy().astype(np.int64) if slots is not None else np.arange(cfg.n_expert)
    parts = []
    size = stream_experts(sum(w.nbytes // n_local for w in mats))
    for c0, c1 in _chunks(np.unique(held[held >= 0]), size):
        chunk = []
        for w in mats:
            expert = w.nbytes // n_local  # bytes of one expert's matrix
            chunk.append(ctx.view(w, (c1 - c0, w.ne[1], w.ne[0]), (expert, expert // w.ne[1], 1), offset=c0 * expert))
        local = np.where((held >= c0) & (held < c1), held - c0, -1).astype(np.int32)
        parts.append(ctx.moe_ffn(*chunk, h, ids, logits, ctx.tensor_from_numpy(local), cfg.ffn_kind, cfg.expert_norm,
                                 biases, scales))
    return parts


def _chunks(matrices: np.ndarray, size: int) -> list[tuple[int, int]]:
    """[c0, c1) ranges covering the sorted matrix indices exactly: their runs of consecutive indices, cut to at
    most `size` each."""
    if not len(matrices):
        return []
    out = []
    breaks = np.flatnonzero(np.diff(matrices) != 1) + 1
    for run in np.split(matrices, breaks):
        for c0 in range(int(run[0]), int(run[-1]) + 1, size):
            out.append((c0, min(c0 + size, int(run[-1]) + 1)))
    return out
