"""Open a GGUF / PowerGGUF file (mmap via gguf-py), validate it, and expose metadata, config and raw tensors."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize as gguf_dequantize

from pyinfer.errors import ModelFormatError, UnsupportedError
from pyinfer.formats.gguf_reader import GGUFHeader, open_gguf
from pyinfer.formats.model_config import ModelConfig

EXPERT_FREQ_KEY = "pyinfer.experts.freq"  # a mixture's routings per token, layer after layer (pyinfer profile)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: ne in ggml order (ne[0] innermost), data the raw bytes inside the mmap."""

    name: str
    type: int
    ne: tuple[int, ...]
    data: np.ndarray  # (n_bytes,) uint8, read-only view of the file


def expected_tensor_shapes(cfg: ModelConfig, ffn_layout: str) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward pass reads, name -> ne (ggml order); ffn_layout is 'down_t' or 'down'."""
    d = cfg.n_embd
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (d, cfg.n_vocab), "output_norm.weight": (d,)}
    if cfg.n_embd_per_layer:  # Gemma 4's per-layer embeddings: one table for all layers, and its projection
        pl = cfg.n_embd_per_layer
        shapes |= {"per_layer_token_embd.weight": (pl * cfg.n_layer, cfg.n_vocab),
                   "per_layer_model_proj.weight": (d, pl * cfg.n_layer), "per_layer_proj_norm.weight": (pl,)}
    norm_bias = cfg.norm_kind == "layer"
    if norm_bias:
        shapes["output_norm.bias"] = (d,)
    if not cfg.tied_embeddings:
        shapes["output.weight"] = (d, cfg.n_vocab)
    if cfg.pos_offset or cfg.rope_mode is None:
        shapes["position_embd.weight"] = (d, cfg.n_ctx_train + cfg.pos_offset)
    for il in range(cfg.n_layer):
        b, hd, n_ff = f"blk.{il}.", cfg.layer_head_dim(il), cfg.layer_n_ff(il)
        q_dim, kv_dim = cfg.n_head * hd, cfg.layer_n_head_kv(il) * hd
        layer = {"attn_norm.weight": (d,), "attn_output.weight": (q_dim, d), "ffn_up.weight": (d, n_ff)}
        if cfg.is_moe:  # the router and every expert's matrices in one tensor each, as llama.cpp stores them
            f, e = cfg.n_ff_exp, cfg.n_expert
            layer = {"attn_norm.weight": (d,), "attn_output.weight": (q_dim, d), "ffn_gate_inp.weight": (d, e),
                     "ffn_gate_exps.weight": (d, f, e), "ffn_up_exps.weight": (d, f, e),
                     "ffn_down_exps.weight": (f, d, e)}
        if cfg.arch == "falcon":  # q, k and v in one matrix; attention and FFN read the same input (its norm)
            layer["attn_qkv.weight"] = (d, q_dim + 2 * kv_dim)
            if cfg.qkv_bias:
                layer["attn_qkv.bias"] = (q_dim + 2 * kv_dim,)
        else:
            layer |= {"attn_q.weight": (d, q_dim), "attn_k.weight": (d, kv_dim), "attn_v.weight": (d, kv_dim),
                      f"{cfg.ffn_norm_name}.weight": (d,)}
        if cfg.v_from_k and not cfg.windowed(il):  # Gemma 4's global layers: the keys' projection is the values'
            del layer["attn_v.weight"]
            if cfg.qkv_bias:
                layer |= {"attn_q.bias": (q_dim,), "attn_k.bias": (kv_dim,), "attn_v.bias": (kv_dim,)}
        if norm_bias:
            layer |= {"attn_norm.bias": (d,)} | ({} if cfg.arch == "falcon" else {"ffn_norm.bias": (d,)})
        if cfg.attn_out_bias:
            layer["attn_output.bias"] = (d,)
        if cfg.qk_norm:
            per_head = not cfg.qk_norm_whole
            layer |= {"attn_q_norm.weight": (hd if per_head else q_dim,),
                      "attn_k_norm.weight": (hd if per_head else kv_dim,)}
        if cfg.kv_layer(il) != il:  # Gemma 4's shared KV layers compute no keys or values
            for name in ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight"):
                layer.pop(name, None)
        if cfg.n_embd_per_layer:
            pl = cfg.n_embd_per_layer
            layer |= {"inp_gate.weight": (d, pl), "proj.weight": (pl, d), "post_norm.weight": (d,)}
        if cfg.post_norms:
            layer |= {"post_attention_norm.weight": (d,), "post_ffw_norm.weight": (d,)}
        if cfg.attn_sinks:
            layer["attn_sinks.weight"] = (cfg.n_head,)
        if cfg.expert_bias:
            f, e = cfg.n_ff_exp, cfg.n_expert
            layer |= {"ffn_gate_inp.bias": (e,), "ffn_gate_exps.bias": (f, e), "ffn_up_exps.bias": (f, e),
                      "ffn_down_exps.bias": (d, e)}
        if cfg.arch in ("qwen35", "qwen35moe"):
            layer = _qwen35_layer(cfg, il, layer)
        if cfg.arch == "gemma4" and cfg.is_moe:  # the 26B-A4B: its dense FFN beside the experts, each normed apart
            e = cfg.n_expert
            layer |= {"ffn_gate.weight": (d, n_ff), "ffn_up.weight": (d, n_ff), "ffn_down.weight": (n_ff, d),
                      "pre_ffw_norm_2.weight": (d,), "post_ffw_norm_1.weight": (d,), "post_ffw_norm_2.weight": (d,),
                      "ffn_gate_inp.scale": (d,), "ffn_down_exps.scale": (e,)}
        if cfg.is_moe:
            shapes |= {b + k: v for k, v in layer.items()}
            continue
        if cfg.gated:
            layer["ffn_gate.weight"] = (d, n_ff)
        down = "ffn_down_t" if ffn_layout == "down_t" else "ffn_down"
        layer[f"{down}.weight"] = (d, n_ff) if ffn_layout == "down_t" else (n_ff, d)
        if cfg.ffn_bias:
            layer |= {"ffn_up.bias": (n_ff,), f"{down}.bias": (d,)}
            if cfg.gated:
                layer["ffn_gate.bias"] = (n_ff,)
        shapes |= {b + k: v for k, v in layer.items()}
    return shapes


def _qwen35_layer(cfg: ModelConfig, il: int, layer: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Layer il's tensors as llama.cpp's qwen35 stores them: a full-attention layer's q with its output gate (twice
    as wide) and its per-head q and k norms; a linear-attention layer's, in the place of attention's, its projections
    (q, k and v in attn_qkv, the output gate z in attn_gate, the write strength's and decay's inputs in ssm_beta and
    ssm_alpha), its convolution's taps, decay parameters, output norm and projection; a mixture's shared expert."""
    d, hd, f = cfg.n_embd, cfg.head_dim, cfg.n_ff_shexp
    if f:  # the mixture's shared expert and its gate
        layer = layer | {"ffn_gate_inp_shexp.weight": (d,), "ffn_gate_shexp.weight": (d, f),
                         "ffn_up_shexp.weight": (d, f), "ffn_down_shexp.weight": (f, d)}
    if not cfg.recurrent(il):
        return layer | {"attn_q.weight": (d, 2 * cfg.n_head * hd), "attn_q_norm.weight": (hd,),
                        "attn_k_norm.weight": (hd,)}
    attention = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm")
    layer = {name: ne for name, ne in layer.items() if name.rsplit(".", 1)[0] not in attention}
    v_dim, n_v = cfg.ssm_n_v_heads * cfg.ssm_head_dim, cfg.ssm_n_v_heads
    return layer | {"attn_qkv.weight": (d, cfg.ssm_conv_channels), "attn_gate.weight": (d, v_dim),
                    "ssm_conv1d.weight": (cfg.ssm_conv_kernel, cfg.ssm_conv_channels), "ssm_dt.bias": (n_v,),
                    "ssm_a": (n_v,), "ssm_beta.weight": (d, n_v), "ssm_alpha.weight": (d, n_v),
                    "ssm_norm.weight": (cfg.ssm_head_dim,), "ssm_out.weight": (v_dim, d)}


class GGUFFile:
    """A validated GGUF file. `ffn_layout` is 'down_t' (PowerGGUF) or 'down' (plain llama.cpp GGUF)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise ModelFormatError(f"{self.path}: no such file")
        if not os.path.isfile(self.path):
            raise ModelFormatError(f"{self.path}: not a regular file")
        try:
            self._mmap, header = open_gguf(self.path)
        except ModelFormatError as exc:
            raise ModelFormatError(f"{self.path}: not a valid GGUF file ({exc})") from None
        self._header = header
        self.version = header.version
        self.alignment = header.alignment
        self.metadata: dict[str, Any] = header.metadata
        self.tensors: dict[str, TensorInfo] = self._read_tensors(header)
        try:
            self.config = ModelConfig.from_metadata(self.metadata, self.tensors.keys())
        except (ModelFormatError, UnsupportedError) as exc:
            raise type(exc)(f"{self.path}: {exc}") from None
        self.ffn_layout = "down_t" if "blk.0.ffn_down_t.weight" in self.tensors else "down"
        if self.metadata.get("pyinfer.ffn_layout", self.ffn_layout) != self.ffn_layout:
            raise ModelFormatError(f"{self.path}: pyinfer.ffn_layout says "
                                   f"{self.metadata['pyinfer.ffn_layout']!r} but the tensors are {self.ffn_layout!r}")
        self._check_shapes()
        freq = self.metadata.get(EXPERT_FREQ_KEY)
        if freq is not None and len(freq) != self.config.n_layer * self.config.n_expert:
            raise ModelFormatError(f"{self.path}: {EXPERT_FREQ_KEY} has {len(freq)} values for "
                                   f"{self.config.n_layer} layers of {self.config.n_expert} experts")

    @functools.cached_property
    def expert_freq(self) -> np.ndarray | None:
        """(n_layer, n_expert): how often `pyinfer profile` saw each expert routed a token; None: not profiled."""
        freq = self.metadata.get(EXPERT_FREQ_KEY)
        if freq is None:
            return None
        return np.asarray(freq, np.float64).reshape(self.config.n_layer, self.config.n_expert)

    def _read_tensors(self, header: GGUFHeader) -> dict[str, TensorInfo]:
        """Tensor infos with their bytes; the reader has checked that each lies in the file, in order. The experts'
        gate and up in one tensor (ffn_gate_up_exps, as llama.cpp writes Gemma 4's) become the two the engine
        reads (split_gate_up)."""
        data = np.frombuffer(self._mmap, dtype=np.uint8)  # (file_size,) read-only
        tensors = {t.name: TensorInfo(t.name, t.type, t.ne, data[header.data_offset + t.offset:][:t.nbytes])
                   for t in header.tensors}
        for name in [n for n in tensors if n.endswith(".ffn_gate_up_exps.weight")]:
            for part in split_gate_up(tensors.pop(name), self.path):
                if part.name in tensors:
                    raise ModelFormatError(f"{self.path}: {part.name} is both a tensor and half of {name}")
                tensors[part.name] = part
        return tensors

    def _check_shapes(self) -> None:
        """Every tensor the model needs is present with the shape its config implies."""
        freqs = self.tensors.get("rope_freqs.weight")
        if freqs is not None and (freqs.type != 0 or freqs.ne != (self.config.n_rot // 2,)):  # 0: F32
            raise ModelFormatError(f"{self.path}: rope_freqs must be F32 [{self.config.n_rot // 2}] (Llama 3's "
                                   f"per-frequency factors), not type {freqs.type} {list(freqs.ne)}")
        for il in range(self.config.n_layer):  # Gemma 4's optional scalar on each layer's output
            scale = self.tensors.get(f"blk.{il}.layer_output_scale.weight")
            if scale is not None and (scale.type != 0 or scale.ne != (1,)):
                raise ModelFormatError(f"{self.path}: blk.{il}.layer_output_scale must be F32 [1], not type "
                                       f"{scale.type} {list(scale.ne)}")
        for name, ne in expected_tensor_shapes(self.config, self.ffn_layout).items():
            info = self.tensors.get(name)
            if info is None:
                raise ModelFormatError(f"{self.path}: missing tensor {name}")
            if info.ne != ne:
                raise ModelFormatError(f"{self.path}: tensor {name} has shape {list(info.ne)}, expected {list(ne)}")
            if len(ne) == 1 and info.type != GGMLQuantizationType.F32:  # the engine adds and multiplies F32 by F32
                raise UnsupportedError(f"{self.path}: tensor {name} has type {GGMLQuantizationType(info.type).name}; "
                                       "norms and biases must be F32")

    @property
    def tensor_bytes(self) -> int:
        """The bytes of all tensors' data (a model's weights)."""
        return sum(int(info.data.nbytes) for info in self.tensors.values())

    @property
    def has_predictors(self) -> bool:
        return "blk.0.fc1.weight" in self.tensors

    @property
    def has_input_sparsity(self) -> bool:
        """A file of pyinfer.sparsity.input_sparsity: thresholds and channel-major gate and up, no predictors."""
        return self.metadata.get("pyinfer.sparsity.kind") == "input"

    @property
    def sparse_by_default(self) -> bool:
        """What `--sparse auto` runs: the sparse FFN wherever the file carries what it needs."""
        return self.has_predictors or self.has_input_sparsity

    @property
    def mmap_buffer(self):
        """The whole file's read-only mapping (for registering it with the GPU)."""
        return self._mmap

    def typed_metadata(self) -> list[tuple[str, Any, GGUFValueType, GGUFValueType | None]]:
        """(key, value, value type, array element type) of every metadata field, for copying to a writer."""
        out = []
        for key, (vtype, etype) in self._header.value_types.items():
            out.append((key, self.metadata[key], GGUFValueType(vtype), None if etype is None else GGUFValueType(etype)))
        return out

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor `name` as float64 in numpy order (shape = reversed ne)."""
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(name)
        qtype = GGMLQuantizationType(info.type)
        shape = tuple(reversed(info.ne))
        block, type_size = GGML_QUANT_SIZES[qtype]
        rows = info.data.reshape(-1, info.ne[0] // block * type_size)
        try:
            values = gguf_dequantize(rows, qtype)
        except NotImplementedError:
            raise UnsupportedError(f"{self.path}: cannot dequantize {qtype.name} tensor {name}") from None
        return np.asarray(values, dtype=np.float64).reshape(shape)


def split_gate_up(fused: TensorInfo, path: str) -> tuple[TensorInfo, TensorInfo]:
    """blk.N.ffn_gate_up_exps (d, 2 n_ff, n_expert in ggml order: each expert's gate rows, then its up rows) as
    blk.N.ffn_gate_exps and ffn_up_exps, each (d, n_ff, n_expert). The halves interleave by expert in the file, so
    each is copied out once, when the file is opened: the engine's expert kernels, placement and streaming read one
    matrix an expert, contiguous."""
    if len(fused.ne) != 3 or fused.ne[1] % 2:
        raise ModelFormatError(f"{path}: tensor {fused.name} has shape {list(fused.ne)}, expected [d, 2 n_ff, "
                               "n_expert]")
    d, two_ff, n_expert = fused.ne
    experts = fused.data.reshape(n_expert, 2, -1)  # (n_expert, gate or up, the half's bytes)
    base = fused.name.removesuffix("ffn_gate_up_exps.weight")
    return tuple(TensorInfo(f"{base}ffn_{half}_exps.weight", fused.type, (d, two_ff // 2, n_expert),
                            np.ascontiguousarray(experts[:, i]).reshape(-1)) for i, half in enumerate(("gate", "up")))


def _one_line(exc: BaseException) -> str:
    """An exception as a short single line."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:200]
