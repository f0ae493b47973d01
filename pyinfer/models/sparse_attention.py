"""Training-free input sparsity of the attention projections, TEAL's other half: in a file of input sparsity that
holds `pyinfer.sparsity.attn_input_thresholds`, q, k and v read only the channels of their input whose |x| passes
the layer's t_in, and the output projection only those of the attention's output whose |a| passes t_out.

As for gate and up, a skipped channel saves bytes only where a channel is a row: the file holds channel-major
copies `blk.N.attn_{q,k,v,output}_t` (pyinfer.sparsity.input_sparsity), which one decoded token on the CPU sums
row by row. Everywhere else (prompt batches, and layers whose attention is on the GPU, which holds only the
originals and reads every byte of them faster than the host reads half) the originals run as a dense matmul over
the input with its unread channels zeroed: the same masks, so a placement does not change what the model computes
beyond the copies' second rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pyinfer.errors import ModelFormatError
from pyinfer.models.sparse_ffn import over_threshold
from pyinfer.native import ggml

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output")  # the matrices that get channel-major copies


def covers(b, il: int) -> bool:
    """Whether layer il's attention projections read sparsely."""
    return b.sparse is not None and il in b.sparse.attn_input


def linear(b, il: int, x: ggml.Tensor, side: str) -> Callable[[str], ggml.Tensor]:
    """For the projections that read x (n, channels) in layer il, side "input" (q, k, v) or "output": a function
    from a matrix's full name to x @ W.T + bias over the channels of x that pass the side's threshold."""
    ctx, spec = b.ctx, b.sparse
    sel = over_threshold(ctx, x, (spec.attn_input if side == "input" else spec.attn_output)[il])  # positive: read
    n = x.shape[0] if len(x.shape) == 2 else 1
    kept = []  # x with its unread channels zeroed, made once for the projections that read the originals

    def project(name: str) -> ggml.Tensor:
        original, copy = b.get(name + ".weight"), b.get(name + "_t.weight")
        on_gpu = original is not None and original.on_device
        if n <= spec.gemm_above and copy is not None and not copy.on_device and not on_gpu:
            y = b.axpy_rows(copy, x, sel)
            bias = b.get(name + ".bias")
            return ctx.add(y, bias) if bias is not None else y
        if not kept:
            kept.append(ctx.mul(x, ctx.step(sel)))
        return b.linear(kept[0], name)

    q = b.get(f"blk.{il}.attn_q.weight")
    q = b.get(f"blk.{il}.attn_qkv.weight") if q is None else q  # fused on the GPU (offload.fuse_qkv)
    if q is None or not q.on_device:  # the host's masks are counted (a GPU layer's would cost a copy a token)
        spec.attn_masks[f"{il}.{side}"] = sel
    return project


def thresholds(ctx: ggml.Context, file_tensors, meta: dict, cfg) -> tuple[dict, dict]:
    """A file of input sparsity's thresholds on its attention projections' inputs: per layer that has them (a
    threshold >= 0; a linear-attention layer's is -1) -t_in over n_embd and -t_out over the output projection's
    input; both empty in a file without them."""
    t_in = meta.get("pyinfer.sparsity.attn_input_thresholds")
    t_out = meta.get("pyinfer.sparsity.attn_output_thresholds")
    if t_in is None and t_out is None:
        return {}, {}
    t_in, t_out = [float(t) for t in t_in or []], [float(t) for t in t_out or []]
    if len(t_in) != cfg.n_layer or len(t_out) != cfg.n_layer:
        raise ModelFormatError(f"pyinfer.sparsity.attn_input_thresholds and attn_output_thresholds need "
                               f"{cfg.n_layer} values each, not {len(t_in)} and {len(t_out)}")
    attn_input, attn_output = {}, {}
    for il in range(cfg.n_layer):
        if t_in[il] < 0:
            continue
        for name in PROJECTIONS:
            info, copy = file_tensors.get(f"blk.{il}.{name}.weight"), file_tensors.get(f"blk.{il}.{name}_t.weight")
            if info is None or copy is None or copy.ne != tuple(reversed(info.ne)):
                raise ModelFormatError(f"sparse attention needs blk.{il}.{name}_t.weight, the channel-major copy of "
                                       f"blk.{il}.{name}.weight")
        width = file_tensors[f"blk.{il}.attn_output.weight"].ne[0]
        attn_input[il] = ctx.tensor_from_numpy(np.full(cfg.n_embd, -t_in[il], dtype=np.float32))
        attn_output[il] = ctx.tensor_from_numpy(np.full(width, -t_out[il], dtype=np.float32))
    return attn_input, attn_output
