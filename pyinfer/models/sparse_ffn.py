"""PowerInfer's sparse FFN: predictor -> mask -> selected rows of up (and gate) -> activation -> (threshold)
-> AXPY over the same rows of ffn_down_t. Files of kind "input" (pyinfer.sparsity.input_sparsity) need no
predictor: gate and up sum the rows of their channel-major copies whose input |x| passes t_x, down the rows of
ffn_down_t whose |h| passes t_h (`input_ffn`).

A mask is an F32 tensor (n_tokens, n_ff) whose positive entries select a neuron for that token, so the
predictor's logits are a mask as they are. Neurons outside the mask contribute nothing, which makes the
result independent of whether up/gate were computed row by row (`mul_mat_rows`) or densely (`mul_mat`):
batches larger than `SparseSpec.dense_above` on the CPU, or than GPU_DENSE_ABOVE on the GPU, take the
dense up/gate (faster there, see docs) and the same down-projection mask, so perplexity measured in batches
is the perplexity of the sparse decoder.

Shapes in comments are numpy order, (outer, ..., inner).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pyinfer.errors import ModelFormatError
from pyinfer.formats.model_config import UNGATED_KINDS
from pyinfer.native import ggml

KINDS = ("relu", "threshold", "input")
# prompts of more tokens than this compute up/gate densely under the same mask. tools/bench_sparse.py --pp
# measured selected rows faster than dense mul_mat at every size from 1 to 512 tokens (SmolLM2, 51%
# density, docs/BENCHMARKS.md), so by default no prompt takes the dense path; re-measure when mul_mat
# gets a tiled GEMM.
DENSE_ABOVE = 1 << 30
# on the GPU, beyond GEMV_MAX_COLS (8) columns mul_mat is a GEMM that reads each row once, while mul_mat_rows
# reads the rows that any of a group of 8 columns selects once per group (a 512-token prompt: 64 times)
GPU_DENSE_ABOVE = 8
# kind "input" on the CPU: batches of more tokens than this take gate and up as a GEMM (reads_row_major)
GEMM_ABOVE = 1


@dataclass
class SparseSpec:
    """What the sparse FFN of a model needs besides its weights.

    kind: "relu" (active = output != 0), "threshold" (|act(gate)*up| <= thresholds[il] zeroed too) or "input"
    (no predictor: input_ffn).
    pred_bias: per layer the predictor's output bias minus the run-time logit threshold, (n_ff,) F32.
    neg_thresholds: per layer (n_ff,) F32 filled with -t_l, for layers whose t_l > 0.
    neg_input_thresholds: kind "input", per layer (n_embd,) F32 filled with -t_x.
    oracle: the mask is the true active set, computed densely (tests: sparse == dense).
    dense_above, gemm_above: batches of more tokens than these compute gate and up densely (predicted kinds;
    kind "input": a GEMM over the file's row-major originals, reads_row_major).
    masks: filled while building a graph, layer -> (n_tokens, rows) down-projection mask of the neurons the
    CPU computes, which the runtime keeps as a graph output to count the realised density.
    cold_thresholds: kind "input", per split layer (n_ff - k,) F32 filled with -t_h in host memory, for the CPU's
    neurons (engine.offload).
    channel_masks: kind "input", filled as masks: layer -> (n_tokens, n_embd) the input channels gate and up read,
    for the layers the CPU computes whole.
    attn_input, attn_output: kind "input" with sparse attention projections (models.sparse_attention), per layer
    (n_embd,) F32 filled with -t_in, the threshold on q's, k's and v's input, and (n_head * head_dim,) with -t_out,
    on the output projection's.
    attn_masks: filled as masks: "{layer}.input" / "{layer}.output" -> (n_tokens, channels) the channels those read,
    for the layers whose attention the CPU computes.
    """

    kind: str
    thresholds: list[float]
    pred_bias: dict[int, ggml.Tensor]
    neg_thresholds: dict[int, ggml.Tensor]
    oracle: bool = False
    dense_above: int = DENSE_ABOVE
    gemm_above: int = GEMM_ABOVE
    masks: dict[int, ggml.Tensor] = field(default_factory=dict)
    neg_input_thresholds: dict[int, ggml.Tensor] = field(default_factory=dict)
    cold_thresholds: dict[int, ggml.Tensor] = field(default_factory=dict)
    channel_masks: dict[int, ggml.Tensor] = field(default_factory=dict)
    attn_input: dict[int, ggml.Tensor] = field(default_factory=dict)
    attn_output: dict[int, ggml.Tensor] = field(default_factory=dict)
    attn_masks: dict[str, ggml.Tensor] = field(default_factory=dict)


def metadata_spec(meta: dict, n_layer: int) -> tuple[str, list[float]]:
    """(kind, per-layer thresholds) from a PowerGGUF's `pyinfer.sparsity.*` metadata."""
    kind = str(meta.get("pyinfer.sparsity.kind", "relu"))
    if kind not in KINDS:
        raise ModelFormatError(f"unknown pyinfer.sparsity.kind {kind!r}; known: {', '.join(KINDS)}")
    thresholds = [float(t) for t in meta.get("pyinfer.sparsity.thresholds", [0.0] * n_layer)]
    if len(thresholds) != n_layer:
        raise ModelFormatError(f"pyinfer.sparsity.thresholds has {len(thresholds)} values for {n_layer} layers")
    if kind == "relu":
        thresholds = [0.0] * n_layer
    return kind, thresholds


def make_spec(ctx: ggml.Context, file_tensors, meta: dict, cfg, *, logit_threshold: float = 0.0,
              oracle: bool = False) -> SparseSpec:
    """The spec for a loaded PowerGGUF; its small tensors are allocated in ctx (which must outlive it)."""
    kind, thresholds = metadata_spec(meta, cfg.n_layer)
    if kind == "input":
        return _input_spec(ctx, file_tensors, meta, cfg, thresholds)
    pred_bias, neg_t = {}, {}
    for il in range(cfg.n_layer):
        if not oracle:
            info = file_tensors.get(f"blk.{il}.fc2.bias")
            if info is None:
                raise ModelFormatError(f"model has no predictor tensor blk.{il}.fc2.bias")
            if info.type != ggml.F32 or info.ne != (cfg.layer_n_ff(il),):
                raise ModelFormatError(f"blk.{il}.fc2.bias must be F32 [{cfg.layer_n_ff(il)}]")
            bias = np.frombuffer(info.data, dtype=np.float32)  # (n_ff,)
            pred_bias[il] = ctx.tensor_from_numpy(bias - np.float32(logit_threshold))
        if thresholds[il] > 0:
            neg_t[il] = ctx.tensor_from_numpy(np.full(cfg.layer_n_ff(il), -thresholds[il], dtype=np.float32))
    return SparseSpec(kind, thresholds, pred_bias, neg_t, oracle=oracle)


def _input_spec(ctx: ggml.Context, file_tensors, meta: dict, cfg, thresholds: list[float]) -> SparseSpec:
    """Kind "input": the channel-major gate and up of every layer and its two thresholds."""
    t_x = [float(t) for t in meta.get("pyinfer.sparsity.input_thresholds", [])]
    if len(t_x) != cfg.n_layer:
        raise ModelFormatError(f"pyinfer.sparsity.input_thresholds has {len(t_x)} values for {cfg.n_layer} layers")
    if cfg.ffn_kind not in ("swiglu", "geglu") or cfg.ffn_bias:
        raise ModelFormatError(f"sparsity kind 'input' needs a gated FFN without biases, not {cfg.ffn_kind}")
    for il in range(cfg.n_layer):
        for name in ("ffn_gate_t", "ffn_up_t"):
            info = file_tensors.get(f"blk.{il}.{name}.weight")
            if info is None or info.ne != (cfg.layer_n_ff(il), cfg.n_embd):
                raise ModelFormatError(f"sparsity kind 'input' needs blk.{il}.{name}.weight of shape "
                                       f"[{cfg.layer_n_ff(il)}, {cfg.n_embd}]")
        _check_centring(file_tensors, il, cfg)
    neg_t = {il: ctx.tensor_from_numpy(np.full(cfg.layer_n_ff(il), -t, dtype=np.float32))
             for il, t in enumerate(thresholds)}
    neg_x = {il: ctx.tensor_from_numpy(np.full(cfg.n_embd, -t, dtype=np.float32)) for il, t in enumerate(t_x)}
    from pyinfer.models import sparse_attention  # imports this module

    attn_input, attn_output = sparse_attention.thresholds(ctx, file_tensors, meta, cfg)
    return SparseSpec("input", thresholds, {}, neg_t, neg_input_thresholds=neg_x, attn_input=attn_input,
                      attn_output=attn_output)


def shifted(b, name: str, x: ggml.Tensor) -> ggml.Tensor:
    """x plus the file's shift `name` (a centred file's minus the calibrated mean), x itself where there is none."""
    shift = b.get(name)
    return b.ctx.add(x, shift) if shift is not None else x


def centred_input(b, il: int, h: ggml.Tensor) -> tuple[ggml.Tensor, ggml.Tensor]:
    """Kind "input": (the FFN's input as its channel-major copies read it (n, n_embd): h, or h minus its calibrated
    mean in a centred file; positive where a channel passes t_x)."""
    x = shifted(b, f"blk.{il}.ffn_inp.shift", h)
    return x, over_threshold(b.ctx, x, b.sparse.neg_input_thresholds[il])


CENTRING = ("ffn_inp.shift", "ffn_down_t.shift", "ffn_gate_t.bias", "ffn_up_t.bias", "ffn_down_t.bias")


def _check_centring(file_tensors, il: int, cfg) -> None:
    """A centred file's layer has all five of CENTRING, F32 vectors of n_embd or n_ff; other files none."""
    here = [name for name in CENTRING if f"blk.{il}.{name}" in file_tensors]
    if here and len(here) < len(CENTRING):
        missing = sorted(set(CENTRING) - set(here))
        raise ModelFormatError(f"a centred layer {il} lacks blk.{il}.{', '.join(missing)}")
    for name in here:
        info = file_tensors[f"blk.{il}.{name}"]
        n = cfg.n_embd if name in ("ffn_inp.shift", "ffn_down_t.bias") else cfg.layer_n_ff(il)
        if info.type != ggml.F32 or info.ne != (n,):
            raise ModelFormatError(f"blk.{il}.{name} must be F32 [{n}]")


def input_ffn(b, il: int, h: ggml.Tensor, part: str = "", centred: tuple[ggml.Tensor, ggml.Tensor] | None = None,
              neg_t: ggml.Tensor | None = None) -> tuple[ggml.Tensor, ggml.Tensor, ggml.Tensor]:
    """Kind "input": gate and up from the rows of their channel-major copies whose |x| passes t_x (centred: x and
    its channel mask, centred_input(h) when None), down from the rows of ffn_down_t whose |act| passes t_h (neg_t:
    -t_h per neuron, the layer's when None); a centred file's x and act are taken around their means, and biases
    (W times the mean) give back what the shifts took away, but down's, which the caller adds once. part
    ".hot"/".cold" takes that share of a split layer's neurons. Returns (output (n, n_embd), the down mask
    (n, rows), the activations before it)."""
    ctx, cfg, spec = b.ctx, b.cfg, b.sparse
    x, sel_x = centred_input(b, il, h) if centred is None else centred  # (n, n_embd), positive: channel read
    kept = ctx.mul(x, ctx.step(sel_x)) if reads_row_major(b, il, h, part) else None  # x where a channel is read

    def gathered(name: str) -> ggml.Tensor:  # (n, rows)
        if kept is not None:
            y = b.matmul(b.w(f"blk.{il}.{name.removesuffix('_t')}"), kept)
        else:
            y = b.axpy_rows(b.w(f"blk.{il}.{name}{part}"), x, sel_x)
        bias = b.get(f"blk.{il}.{name}{part}.bias")
        return ctx.add(y, bias) if bias is not None else y

    up, gate = gathered("ffn_up_t"), gathered("ffn_gate_t")
    # up first: the graph then holds act(gate) right before the mul, one kernel on CUDA (fusion.cu)
    act = ctx.mul(up, ctx.silu(gate) if cfg.ffn_kind == "swiglu" else ctx.gelu(gate))  # (n, rows)
    act_c = shifted(b, f"blk.{il}.ffn_down_t{part}.shift", act)
    sel_h = over_threshold(ctx, act_c, spec.neg_thresholds[il] if neg_t is None else neg_t)  # positive: neuron read
    return b.axpy_rows(b.w(f"blk.{il}.ffn_down_t{part}"), act_c, sel_h), sel_h, act


def reads_row_major(b, il: int, h: ggml.Tensor, part: str) -> bool:
    """Kind "input": whether a batch of more than spec.gemm_above tokens in a whole CPU layer takes gate and up
    from the file's row-major originals, a GEMM over x with its unread channels zeroed, instead of summing the
    channel-major rows into every token (Qwen2.5-Coder-0.5B, 2 threads: pp128 143 -> 272 t/s). The masks are the
    same; the weights are the originals, not the copies the decoder reads (each requantized along its other
    axis), so sparsify's held-out report sets gemm_above past its batches to measure the decoder itself. One
    token, and the GPU's layers (which hold only the copies), sum rows."""
    n = h.shape[0] if len(h.shape) == 2 else 1
    up_t, up = b.get(f"blk.{il}.ffn_up_t.weight"), b.get(f"blk.{il}.ffn_up.weight")
    return (n > b.sparse.gemm_above and not part and up is not None and up_t is not None and not up_t.on_device
            and not up.on_device)


def split_input_ffn(b, il: int, h: ggml.Tensor, k: int) -> ggml.Tensor:
    """Kind "input", a split layer: the GPU's neurons [0, k) and the CPU's rest at the same time, under one
    channel mask (computed where h is, on the GPU, and copied to the CPU once)."""
    ctx, spec = b.ctx, b.sparse
    centred = centred_input(b, il, h)  # (n, n_embd) twice
    hot, _, _ = input_ffn(b, il, h, ".hot", centred, ctx.view(spec.neg_thresholds[il], (k,)))
    cold, spec.masks[il], _ = input_ffn(b, il, h, ".cold", centred, spec.cold_thresholds[il])
    return ctx.add(hot, cold)


def over_threshold(ctx: ggml.Context, x: ggml.Tensor, neg_t: ggml.Tensor) -> ggml.Tensor:
    """|x| - t, positive where an entry passes its threshold; neg_t holds -t per column."""
    return ctx.add(ctx.abs(x), neg_t)


def _active(b, il: int, act: ggml.Tensor) -> ggml.Tensor:
    """Positive where a neuron's output survives: act itself for non-negative activations without a
    threshold, else |act| - t_l."""
    ctx = b.ctx
    neg_t = b.sparse.neg_thresholds.get(il)
    if neg_t is None and b.cfg.ffn_kind in ("relu", "drelu"):
        return act
    return over_threshold(ctx, act, neg_t) if neg_t is not None else ctx.abs(act)


def predict(b, il: int, h: ggml.Tensor) -> ggml.Tensor:
    """The predictor's logits (n, n_ff): fc2 @ relu(fc1 @ h) + bias; positive = predicted active."""
    from pyinfer.models.common import ffn_activation

    spec, ctx = b.sparse, b.ctx
    if spec.oracle:
        return _active(b, il, ffn_activation(b, il, h))
    z = ctx.relu(ctx.mul_mat(b.w(f"blk.{il}.fc1"), h))  # (n, r_l)
    return ctx.add(ctx.mul_mat(b.w(f"blk.{il}.fc2"), z), spec.pred_bias[il])  # (n, n_ff)


def fused_ffn(b, il: int, h: ggml.Tensor, pred: ggml.Tensor) -> tuple[ggml.Tensor, ggml.Tensor]:
    """The sparse FFN as one sparse_ffn op over the layer's bundled rows (driver.Model._bundle_ffns), which
    are the CPU's neurons of a split layer: (output (n, n_embd), mask (n, rows) of the neurons summed)."""
    ctx, cfg, spec = b.ctx, b.cfg, b.sparse
    n = h.shape[0] if len(h.shape) == 2 else 1
    rows = pred.shape[-1]
    out = ctx.sparse_ffn(b.w(f"blk.{il}.ffn_bundle"), h, pred, cfg.ffn_kind, spec.thresholds[il])  # (n, d + rows)
    row = 4 * (cfg.n_embd + rows)  # bytes per token of out
    mask = ctx.view(out, (n, rows), (row, 4), offset=4 * cfg.n_embd)
    return ctx.view(out, (n, cfg.n_embd), (row, 4)), mask


def rows_ffn(b, il: int, h: ggml.Tensor, pred: ggml.Tensor, part: str = "", dense: bool = False):
    """The sparse FFN as row ops: the rows of up (and gate) that pred (n, rows) selects, the activation, and
    down as an AXPY over the same rows; part ".hot"/".cold" takes that half of a split layer. dense: up and
    gate computed whole (large batches), under the same mask. Returns (output (n, n_embd) without the down
    bias, the down mask, the activations)."""
    ctx, kind, spec = b.ctx, b.cfg.ffn_kind, b.sparse

    def proj(name: str, sel: ggml.Tensor) -> ggml.Tensor:
        w = b.w(f"blk.{il}.{name}{part}")
        y = ctx.mul_mat(w, h) if dense else ctx.mul_mat_rows(w, h, sel)  # (n, rows)
        bias = b.get(f"blk.{il}.{name}{part}.bias")
        return ctx.add(y, bias) if bias is not None else y

    computed = pred  # (n, rows) positive on the rows computed (when not dense)
    if kind in UNGATED_KINDS:
        from pyinfer.models.common import ungated_act  # imports this module

        act = ungated_act(ctx, kind)(proj("ffn_up", pred))
    else:
        gate = proj("ffn_gate", pred)
        if kind in ("reglu", "drelu"):
            g = computed = ctx.relu(gate)
            up = proj("ffn_up", g)  # rows whose gate is off are not needed: relu(gate) is a finer mask
            act = ctx.mul(g, ctx.relu(up) if kind == "drelu" else up)
        elif kind == "swiglu":
            act = ctx.mul(ctx.silu(gate), proj("ffn_up", pred))
        elif kind == "geglu":
            act = ctx.mul(ctx.gelu(gate), proj("ffn_up", pred))
        else:
            raise ModelFormatError(f"unknown FFN kind {kind!r}")
    if dense or b.cfg.ffn_bias:
        # rows outside the prediction were computed (dense) or carry a bias: the mask must exclude them
        sel = ctx.mul(ctx.relu(pred), ctx.relu(_active(b, il, act)))
    elif il in spec.neg_thresholds or kind in ("relu", "drelu"):
        sel = _active(b, il, act)  # zero outside the computed rows
    else:
        sel = computed  # every computed row of a gated FFN is nonzero (but for exact zeros)
    return b.axpy_rows(b.w(f"blk.{il}.ffn_down_t{part}"), act, sel), sel, act  # (n, n_embd)


def ffn_block(b, il: int, h: ggml.Tensor) -> ggml.Tensor:
    """Sparse FFN of layer il: (n_tokens, n_embd) -> (n_tokens, n_embd)."""
    ctx, spec = b.ctx, b.sparse
    if spec.kind != "input":
        return _predicted_ffn(b, il, h)
    if b.hot_rows.get(il):
        y = split_input_ffn(b, il, h, b.hot_rows[il])
    else:
        centred = centred_input(b, il, h)
        y, mask, act = input_ffn(b, il, h, centred=centred)
        up = b.weights.get(f"blk.{il}.ffn_up_t.weight")
        if up is None or not up.on_device:  # the realised density counts the CPU's layers, as for predictors
            spec.masks[il], spec.channel_masks[il] = mask, centred[1]
        if b.capture is not None:
            b.capture[f"ffn_inp.{il}"] = h  # (n, n_embd)
            b.capture[f"ffn_act.{il}"] = act  # (n, n_ff), before the down mask
    bias = b.get(f"blk.{il}.ffn_down_t.bias")  # a centred file's
    return ctx.add(y, bias) if bias is not None else y


def _predicted_ffn(b, il: int, h: ggml.Tensor) -> ggml.Tensor:
    """ffn_block of a file with predictors."""
    from pyinfer.models.common import host_ffn, streamed_ffn

    ctx, cfg, spec = b.ctx, b.cfg, b.sparse
    n = h.shape[0] if len(h.shape) == 2 else 1
    pred = predict(b, il, h)  # (n, n_ff)
    if b.stream and host_ffn(b, il) is not None:
        return streamed_ffn(b, il, h, pred)
    bundled = b.capture is None and b.has(f"blk.{il}.ffn_bundle")
    k = b.hot_rows.get(il)
    if k:  # split: the GPU's rows [0, k) and the CPU's rest at the same time, each under its part of pred
        n_ff = cfg.layer_n_ff(il)
        hot, _, _ = rows_ffn(b, il, h, ctx.view(pred, (n, k), (4 * n_ff, 4)), ".hot", dense=n > GPU_DENSE_ABOVE)
        cold_pred = ctx.view(pred, (n, n_ff - k), (4 * n_ff, 4), offset=4 * k)
        cold, spec.masks[il] = fused_ffn(b, il, h, cold_pred) if bundled else rows_ffn(b, il, h, cold_pred, ".cold")[:2]
        y = ctx.add(hot, cold)
    elif n <= spec.dense_above and bundled:
        y, spec.masks[il] = fused_ffn(b, il, h, pred)
    else:
        up = b.weights.get(f"blk.{il}.ffn_up.weight")
        on_gpu = up is not None and up.on_device
        y, mask, act = rows_ffn(b, il, h, pred, dense=n > (GPU_DENSE_ABOVE if on_gpu else spec.dense_above))
        if not on_gpu:  # a GPU layer's mask would cost a copy to the host a token (and block the FFN's fusion)
            spec.masks[il] = mask
        if b.capture is not None:
            b.capture[f"ffn_inp.{il}"] = h  # (n, n_embd)
            b.capture[f"ffn_act.{il}"] = act  # (n, n_ff), before the down mask
    bias = b.get(f"blk.{il}.ffn_down_t.bias")
    return ctx.add(y, bias) if bias is not None else y
