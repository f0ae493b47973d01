"""Putting a loaded model's parts on the GPU: whole layers (-ngl, llama.cpp's layer offload), or a placement
plan (--vram-budget): per layer its attention, KV cache and predictor, and its hot-first FFN neurons [0, k)
on the GPU while the CPU keeps the rest. The split is a view: the rows of each part are slices of the
mmap'd file, and only the GPU's rows are copied to the device. A file of input sparsity splits by neuron too:
columns [0, k) of its channel-major gate and up (copied out of the file's rows) and rows [0, k) of ffn_down_t.
A mixture of experts splits by expert: its k most often routed experts copied to the GPU, the CPU computing the
rest from the file's tensors, each side with its slots (models.moe)."""
from __future__ import annotations

import numpy as np

from pyinfer.engine.placement import (
    ATTENTION_PARTS,
    EXPERT_MATRICES,
    FFN_MATRICES,
    INPUT_FFN_MATRICES,
    MOE_COMMON_PARTS,
    PART_SUFFIXES,
    QKV_PARTS,
    Plan,
    expert_order,
    fusable_qkv,
)
from pyinfer.errors import UnsupportedError
from pyinfer.models import reads_fused_qkv
from pyinfer.models.moe import BY_EXPERT
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
    return [f"blk.{il}.{part}{suffix}" for part in parts for suffix in PART_SUFFIXES]


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
    parts = fusable_qkv(model.file.tensors, il, reads_fused_qkv(model.config))
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
    common = MOE_COMMON_PARTS if model.config.is_moe else ()  # a mixture's router (and Gemma 4's dense FFN)
    _to_device(model, _layer_parts(il, (*ATTENTION_PARTS, "fc1", "fc2", *common))
               + ["rope_freqs.weight", f"blk.{il}.ssm_a"])
    kv = model.kv_cache
    for cache in (kv.k[il], kv.v[il], kv.conv[il], kv.ssm[il]):  # a linear-attention layer's states, none of K, V
        if cache is not None and not cache.on_device:  # a shared KV cache (Gemma 4) moves with its first layer
            cache.to_device()
    spec = model.sparse_spec
    if spec is not None:
        for tensors in (spec.pred_bias, spec.neg_thresholds, spec.neg_input_thresholds, spec.attn_input,
                        spec.attn_output):
            if il in tensors:
                tensors[il].to_device()


def _ffn_parts(model, il: int) -> list[str]:
    """The FFN tensors layer il's graph reads on the GPU (a file of input sparsity's row-major gate and up serve CPU
    batches only)."""
    if model.config.is_moe:  # gpt-oss' biases as moe_ffn reads them (the file's three stay in host memory)
        return [f"blk.{il}.{m}.weight" for m in EXPERT_MATRICES] + [f"blk.{il}.{name}" for name in BY_EXPERT]
    return _layer_parts(il, INPUT_FFN_MATRICES if model.reads_channel_major else FFN_MATRICES)


def _split_experts(model, il: int, k: int) -> None:
    """Layer il's k most often routed experts (placement.expert_order) on the GPU (`.gpu`: their matrices copied
    out of the file), the rest computed by the CPU from the file's tensors (`.cpu`: all of them, viewed), each side
    with the I32 slots that map an expert to its matrix there (-1: the other side's)."""
    n_expert = model.config.n_expert
    gpu = expert_order(model.file, il)[:k]
    gpu_slots = np.full(n_expert, -1, np.int32)
    gpu_slots[gpu] = np.arange(k, dtype=np.int32)
    cpu_slots = np.where(gpu_slots < 0, np.arange(n_expert, dtype=np.int32), -1).astype(np.int32)
    for name in EXPERT_MATRICES:
        info = model.file.tensors[f"blk.{il}.{name}.weight"]
        rows = np.frombuffer(info.data, np.uint8).reshape(n_expert, -1)
        for side, data, n in ((".gpu", np.ascontiguousarray(rows[gpu]), k), (".cpu", info.data, n_expert)):
            t = model.weights_ctx.new_tensor(info.type, (n, *reversed(info.ne[:-1])))
            t.set_data(data)
            t.name = f"blk.{il}.{name}{side}.weight"
            model.weights[t.name] = t
    for side, slots in ((".gpu", gpu_slots), (".cpu", cpu_slots)):
        t = model.weights_ctx.new_tensor(ggml.I32, (n_expert,))
        t.set_data(slots)
        t.name = f"blk.{il}.ffn_exps_slots{side}"
        model.weights[t.name] = t
    for name in BY_EXPERT:  # indexed by expert: each side its own copy of all of them
        whole = model.weights.get(f"blk.{il}.{name}")
        if whole is None:
            continue
        for side in (".gpu", ".cpu"):
            t = model.weights_ctx.new_tensor(ggml.F32, whole.shape)
            t.set_data(whole.numpy())
            t.name = f"blk.{il}.{name}{side}"
            model.weights[t.name] = t
    _to_device(model, [f"blk.{il}.{name}.gpu.weight" for name in EXPERT_MATRICES]
               + [f"blk.{il}.ffn_exps_slots.gpu"] + [f"blk.{il}.{name}.gpu" for name in BY_EXPERT])


def offload_layers(model, n_gpu_layers: int, n_cpu_moe: int = 0) -> int:
    """The output head and the weights and KV cache of the last n_gpu_layers - 1 layers on the GPU, as llama.cpp's
    -ngl (which counts the head as the layer after the last), less the experts of layers below n_cpu_moe (its
    --n-cpu-moe); returns how many, the head included."""
    n_layer = model.config.n_layer
    n = max(0, min(n_gpu_layers, n_layer + 1))
    if n == 0:
        return 0
    _require_gpu("-ngl/--device cuda")
    for il in range(n_layer + 1 - n, n_layer):
        _attention_to_device(model, il)
        if not (model.config.is_moe and il < n_cpu_moe):
            _to_device(model, _ffn_parts(model, il))
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


def _columns(model, name: str, c0: int, c1: int, tag: str) -> None:
    """weights[name + tag] = columns [c0, c1) of a matrix (whole quant blocks), copied out of the file."""
    info = model.file.tensors[name]
    n_cols, n_rows = info.ne
    block = ggml.block_size(info.type)
    if c0 % block or c1 % block:
        raise UnsupportedError(f"{name}: a split at column {c0 if c0 % block else c1} cuts a block of {block}")
    row = info.data.nbytes // n_rows
    rows = np.frombuffer(info.data, np.uint8).reshape(n_rows, row)
    part = np.ascontiguousarray(rows[:, row * c0 // n_cols:row * c1 // n_cols])
    base, suffix = name.rsplit(".", 1)
    t = model.weights_ctx.new_tensor(info.type, (n_rows, c1 - c0))
    t.set_data(part)
    t.name = f"{base}{tag}.{suffix}"
    model.weights[t.name] = t


def _split_input_ffn(model, il: int, k: int) -> None:
    """Layer il of a file of input sparsity split at neuron k: the GPU's columns of the channel-major gate and up
    and rows of ffn_down_t, and a host copy of the down threshold for the CPU's neurons (the layer's own moved to
    the GPU with its attention, and an elementwise op runs where any input is)."""
    n_ff = model.config.layer_n_ff(il)
    for name in ("ffn_gate_t", "ffn_up_t"):
        _columns(model, f"blk.{il}.{name}.weight", 0, k, ".hot")
        _columns(model, f"blk.{il}.{name}.weight", k, n_ff, ".cold")
    # a centred file's per-neuron vectors split with the neurons; down's bias is added once, on the GPU
    for name in ("ffn_down_t.weight", "ffn_down_t.shift", "ffn_gate_t.bias", "ffn_up_t.bias"):
        _rows(model, f"blk.{il}.{name}", 0, k, ".hot")
        _rows(model, f"blk.{il}.{name}", k, n_ff, ".cold")
    _to_device(model, [n for n in model.weights if n.startswith(f"blk.{il}.") and ".hot." in n])
    _to_device(model, [f"blk.{il}.ffn_down_t.bias"])
    spec = model.sparse_spec
    cold = model.weights_ctx.new_tensor(ggml.F32, (n_ff - k,))
    cold.set_data(np.full(n_ff - k, -spec.thresholds[il], dtype=np.float32))
    spec.cold_thresholds[il] = cold


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
        ffn = _layer_parts(il, FFN_MATRICES)
        if k == (cfg.n_expert if cfg.is_moe else cfg.layer_n_ff(il)):
            _to_device(model, _ffn_parts(model, il))
        elif k > 0 and cfg.is_moe:
            _split_experts(model, il, k)
            split[il] = k
        elif k > 0 and model.reads_channel_major:
            _split_input_ffn(model, il, k)
            split[il] = k
        elif k > 0:
            for name in ffn:
                _rows(model, name, 0, k, ".hot")
                _rows(model, name, k, cfg.layer_n_ff(il), ".cold")
            _to_device(model, [n for n in model.weights if n.startswith(f"blk.{il}.") and ".hot." in n])
            _to_device(model, [f"blk.{il}.ffn_down_t.bias"])
            split[il] = k
    if plan.head_gpu:
        _head_to_device(model)
    return split
