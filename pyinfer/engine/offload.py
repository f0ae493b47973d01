"""Putting a loaded model's parts on the GPU: whole layers (-ngl, llama.cpp's layer offload), or a placement
plan (--vram-budget): per layer its attention, KV cache and predictor, and its hot-first FFN neurons [0, k)
on the GPU while the CPU keeps the rest. The split is a view: the rows of each part are slices of the
mmap'd file, and only the GPU's rows are copied to the device."""
from __future__ import annotations

import numpy as np

from pyinfer.engine.placement import ATTENTION_PARTS, FFN_MATRICES, NEURON_MATRICES, QKV_PARTS, Plan, fusable_qkv
from pyinfer.errors import UnsupportedError
from pyinfer.native import ggml


def _require_gpu(what: str) -> None:
    if not ggml.cuda_available():
        raise UnsupportedError(f"{what} needs a CUDA build and a GPU; none is available here")


def _to_device(model, names) -> None:
    for name in names:
        t = model.weights.get(name)
        if t is not None:
            t.to_device()


def _layer_parts(il: int, parts) -> list[str]:
    return [f"blk.{il}.{part}.{suffix}" for part in parts for suffix in ("weight", "bias")]


def _head_to_device(model) -> None:
    if "output.weight" not in model.weights:  # tied: the head gets a GPU copy of the embeddings
        emb = model.file.tensors["token_embd.weight"]
        head = model.weights_ctx.new_tensor(emb.type, tuple(reversed(emb.ne)))
        head.set_data(emb.data)
        head.name = "output.weight"
        model.weights["output.weight"] = head
    _to_device(model, ["output.weight", "output_norm.weight", "output_norm.bias"])


def fuse_qkv(model, il: int) -> bool:
    """Layer il's q, k and v projections as one matrix `attn_qkv` (the rows of q, then k, then v; their biases
    likewise), which the graph reads through views (models.common.fused_qkv): on the GPU one GEMV instead of
    three, each of which costs a launch and a latency-bound tail in a decode step. Where
    placement.fusable_qkv allows it; whether it fused them."""
    parts = fusable_qkv(model.file.tensors, il)
    if parts is None:
        return False
    for suffix, infos in parts.items():
        if infos[0] is None:
            continue
        shape = (sum(i.ne[-1] for i in infos), *reversed(infos[0].ne[:-1]))
        fused = model.weights_ctx.new_tensor(infos[0].type, shape)
        fused.set_data(np.concatenate([np.frombuffer(i.data, np.uint8) for i in infos]))
        fused.name = f"blk.{il}.attn_qkv.{suffix}"
        model.weights[fused.name] = fused
        for part in QKV_PARTS:
            del model.weights[f"blk.{il}.{part}.{suffix}"]
    return True


def _attention_to_device(model, il: int) -> None:
    fuse_qkv(model, il)
    _to_device(model, _layer_parts(il, ATTENTION_PARTS) + _layer_parts(il, ("fc1", "fc2")) + ["rope_freqs.weight"])
    model.kv_cache.k[il].to_device()
    model.kv_cache.v[il].to_device()
    spec = model.sparse_spec
    if spec is not None:
        for tensors in (spec.pred_bias, spec.neg_thresholds, spec.neg_input_thresholds):
            if il in tensors:
                tensors[il].to_device()


def offload_layers(model, n_gpu_layers: int) -> int:
    """The weights and KV cache of the last n_gpu_layers layers (above n_layer the output head too) on the
    GPU, as llama.cpp's -ngl; returns how many."""
    n_layer = model.config.n_layer
    n = max(0, min(n_gpu_layers, n_layer + 1))
    if n == 0:
        return 0
    _require_gpu("-ngl/--device cuda")
    for il in range(n_layer - min(n, n_layer), n_layer):
        _attention_to_device(model, il)
        _to_device(model, _layer_parts(il, (*FFN_MATRICES, "ffn_down")))
    if n > n_layer:
        _head_to_device(model)
    return n


def _rows(model, name: str, r0: int, r1: int, tag: str) -> None:
    """weights[name + tag] = rows [r0, r1) of a matrix, or entries of a per-row bias, viewing the file."""
    info = model.file.tensors.get(name)
    if info is None:
        return
    base, suffix = name.rsplit(".", 1)
    if suffix == "bias" and base.endswith(("ffn_down_t", "ffn_down")):
        return  # the output's bias: added once, with the GPU's half
    row = info.data.nbytes // info.ne[-1]
    shape = (r1 - r0, *reversed(info.ne[:-1]))
    t = model.weights_ctx.new_tensor(info.type, shape)
    t.set_data(info.data[r0 * row:r1 * row])
    t.name = f"{base}{tag}.{suffix}"
    model.weights[t.name] = t


def apply_plan(model, plan: Plan) -> dict[int, int]:
    """Moves what the plan puts on the GPU there; returns {layer: k} for the layers split inside their FFN
    (0 < k < n_ff), whose rows [0, k) are `blk.N.ffn_*.hot` on the GPU and [k, n_ff) `blk.N.ffn_*.cold`."""
    cfg = model.config
    if plan.uses_gpu:
        _require_gpu("--vram-budget")
    split = {}
    for il in range(cfg.n_layer):
        if plan.attn_gpu[il]:
            _attention_to_device(model, il)
        k = plan.hot_rows[il]
        ffn = _layer_parts(il, (*NEURON_MATRICES, "ffn_down"))
        if k == cfg.n_ff:
            _to_device(model, _layer_parts(il, (*FFN_MATRICES, "ffn_down")))
        elif k > 0:
            for name in ffn:
                _rows(model, name, 0, k, ".hot")
                _rows(model, name, k, cfg.n_ff, ".cold")
            _to_device(model, [n for n in model.weights if n.startswith(f"blk.{il}.") and ".hot." in n])
            _to_device(model, [f"blk.{il}.ffn_down_t.bias"])
            split[il] = k
    if plan.head_gpu:
        _head_to_device(model)
    return split
