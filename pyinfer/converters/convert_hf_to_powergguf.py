"""Convert a HF checkpoint folder or a llama.cpp GGUF into a PowerGGUF (and optionally a dense GGUF).

PowerGGUF = llama.cpp's GGUF layout (keys, tensor names) except that each layer's down projection is
stored transposed as `blk.N.ffn_down_t` (ne = [n_embd, n_ff]: one contiguous row of n_embd values per
FFN neuron), plus `pyinfer.*` keys. LLaMA q/k rows get llama.cpp's permutation so that rope mode
"normal" (adjacent pairs) applies; Qwen2 keeps HF order and uses "neox".

dReLU convention: a LlamaForCausalLM whose config.json says `"hidden_act": "drelu"` computes
relu(gate) * relu(up) (transformers has no such activation; set it by hand in config.json).

From a GGUF input every tensor keeps its bytes and type, except ffn_down -> ffn_down_t, which is
dequantized, transposed and requantized: to the same type when gguf-py can quantize it and its block
divides n_embd, else to Q8_0 (F16 when n_embd is not a multiple of 32). Sources below 8 bits get Q8_0 by
default (`--down-type auto`), because a second 4-bit rounding costs quality (SmolLM2-135M Q4_1: mean KL
0.33 nats/token vs the source file with Q4_1 ffn_down_t, 0.01 with Q8_0); `--down-type same|q8_0|f16`
overrides. `--outtype` does not apply to GGUF input.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFValueType

from pyinfer.console import run_cli
from pyinfer.converters.hf_json import CONFIG
from pyinfer.converters.hf_vocab import KV, read_json, vocab_metadata
from pyinfer.converters.safetensors_source import SafetensorsSource
from pyinfer.errors import ModelFormatError, UnsupportedError
from pyinfer.formats import gguf_schema
from pyinfer.formats.gguf_file import EXPERT_FREQ_KEY, GGUFFile, expected_tensor_shapes
from pyinfer.formats.gguf_writer import (
    FLOAT_TYPES,
    QUANTIZABLE,
    OutFile,
    OutTensor,
    Q,
    encode,
    file_type,
    pick_type,
    write_atomically,
)
from pyinfer.formats.model_config import ModelConfig, default_ffn_kind

PROG = "convert-hf-to-powergguf"
OUTTYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1}
HF_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
            "MistralForCausalLM": "llama", "Gemma3ForCausalLM": "gemma3", "FalconForCausalLM": "falcon",
            "OPTForCausalLM": "opt", "MixtralForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3moe",
            "OlmoeForCausalLM": "olmoe", "GptOssForCausalLM": "gpt-oss", "Gemma4ForCausalLM": "gemma4",
            "Qwen3_5ForCausalLM": "qwen35", "Qwen3_5MoeForCausalLM": "qwen35moe",
            "Qwen3_5ForConditionalGeneration": "qwen35", "Qwen3_5MoeForConditionalGeneration": "qwen35moe",
            "Gemma4ForConditionalGeneration": "gemma4"}
# checkpoints of a multimodal model (what Qwen3.5's and Gemma 4's repositories hold): its text model is converted,
# read from config.json's text_config and the tensors under model.language_model (the vision and audio towers and
# MTP layers are left)
MULTIMODAL_HF = {"Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                 "Gemma4ForConditionalGeneration"}
# the shapes of HF tensors whose transform reshapes them: gpt-oss' experts (gate and up interleaved in one
# (n_expert, d, 2 n_ff) tensor, x @ W; down (n_expert, n_ff, d)); Gemma 4's (gate then up in one (n_expert, 2 n_ff,
# d) tensor); Qwen3.5's convolution (channels, 1, taps)
RESHAPED = {"oai_gate": lambda s: (s[0], s[2] // 2, s[1]), "oai_up": lambda s: (s[0], s[2] // 2, s[1]),
            "oai_down": lambda s: (s[0], s[2], s[1]), "oai_gate_b": lambda s: (s[0], s[1] // 2),
            "oai_up_b": lambda s: (s[0], s[1] // 2), "conv1d": lambda s: (s[0], s[2]),
            "gate_half": lambda s: (s[0], s[1] // 2, s[2]), "up_half": lambda s: (s[0], s[1] // 2, s[2]),
            "row": lambda s: (s[-1],)}  # Qwen3.5-MoE's shared expert gate (1, d)
# Falcon's "gelu" is exact (nn.GELU) in transformers; llama.cpp's files run it in the tanh form ("gelu")
FALCON_ACTS = {"gelu": "gelu_erf", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu", "relu": "relu"}
LLAMA_ACTS = {"silu": "swiglu", "relu": "reglu", "drelu": "drelu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}
FORMAT_VERSION = 1

# ----------------------------------------------------------------------------
# HF config -> hyperparameters


def _need(config: dict[str, Any], key: str) -> Any:
    """config[key] (checked by hf_json.CONFIG), or a one-line error naming the key."""
    if config.get(key) is None:
        raise ModelFormatError(f"config.json lacks {key}")
    return config[key]


def _rope_params(config: dict[str, Any]) -> dict[str, Any]:
    """rope_parameters / rope_scaling (of Gemma 3's one set per kind of layer: the global layers'); {} for none."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return params.get("full_attention") or params


def _rope(config: dict[str, Any], theta: float = 10000.0) -> tuple[float, dict[str, Any]]:
    """(rope base, the {arch}.rope.scaling.* metadata: {} for none), theta the base when config.json has none;
    Llama 3's scaling is frequency factors instead (_llama3_factors)."""
    params = _rope_params(config)
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta") or config.get("rope_theta") or theta)
    if kind in ("default", "llama3"):
        return theta, {}
    if kind == "linear":
        return theta, {"type": "linear", "factor": float(_need(params, "factor"))}
    if kind == "yarn":
        return theta, _yarn(config, params)
    raise UnsupportedError(f"unsupported rope type {kind!r}; supported: default, linear, llama3, yarn")


def _yarn(config: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """YaRN in llama.cpp's keys, with transformers' defaults; yarn_attn_factor is what cos and sin are multiplied
    by (transformers' attention_factor, from the factor and mscale / mscale_all_dim when not given)."""
    if params.get("truncate", True) is not True and config.get("model_type") != "gpt_oss":
        # (gpt-oss' is run truncated, as llama.cpp runs it: the converter says so)
        raise UnsupportedError("YaRN with truncate false is not supported (the ramp's ends are whole pairs)")
    orig = int(params.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
               or _need(config, "max_position_embeddings"))
    factor = float(params.get("factor") or _need(config, "max_position_embeddings") / orig)
    if factor < 1.0:
        raise ModelFormatError(f"rope_scaling: YaRN factor {factor:g} is below 1")

    def mscale(m: float = 1.0) -> float:
        return 0.1 * m * np.log(factor) + 1.0

    attn = params.get("attention_factor")
    if attn is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = mscale(m) / mscale(m_all) if m and m_all else mscale()
    return {"type": "yarn", "factor": factor, "original_context_length": orig, "yarn_attn_factor": float(attn),
            "yarn_beta_fast": float(params.get("beta_fast") or 32.0),
            "yarn_beta_slow": float(params.get("beta_slow") or 1.0)}


def _llama3_factors(config: dict[str, Any], head_dim: int, theta: float) -> np.ndarray | None:
    """Llama 3.x's long-context scaling as llama.cpp stores it (rope_freqs.weight, (head_dim/2,) F32): the
    number each RoPE frequency is divided by, from transformers' llama3 rule (high frequencies kept, low ones
    divided by `factor`, a smooth blend between); None for other models."""
    params = _rope_params(config)
    if (params.get("rope_type") or params.get("type")) != "llama3":
        return None
    factor, low, high = (float(_need(params, k)) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old_ctx = float(_need(params, "original_max_position_embeddings"))
    if not high > low:
        raise ModelFormatError("rope_scaling: high_freq_factor must be above low_freq_factor")
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # (head_dim/2,)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, blended))


def _hparams(config: dict[str, Any], arch: str) -> dict[str, Any]:
    """The sizes and switches the tensor map and metadata need, from config.json."""
    if arch == "opt":
        checks = {"do_layer_norm_before": True, "activation_function": "relu", "enable_bias": True,
                  "layer_norm_elementwise_affine": True, "_remove_final_layer_norm": False}
        for key, want in checks.items():
            if config.get(key, want) != want:
                raise UnsupportedError(f"OPT with {key} = {config[key]!r} is not supported (only {want!r})")
        if config.get("word_embed_proj_dim", _need(config, "hidden_size")) != config["hidden_size"]:
            raise UnsupportedError("OPT with word_embed_proj_dim != hidden_size (project_in/out) is not supported")
        n_head = int(_need(config, "num_attention_heads"))
        return {"n_embd": int(_need(config, "hidden_size")), "n_ff": int(_need(config, "ffn_dim")),
                "n_layer": int(_need(config, "num_hidden_layers")), "n_head": n_head, "n_head_kv": n_head,
                "n_ctx": int(_need(config, "max_position_embeddings")), "n_vocab": int(_need(config, "vocab_size")),
                "eps": 1e-5, "tied": bool(config.get("tie_word_embeddings", True)), "ffn_kind": "relu",
                "qkv_bias": True, "out_bias": True, "ffn_bias": True}
    if arch == "falcon":
        return _falcon(config)
    if arch == "gemma4":
        return _gemma4(config)
    if arch in ("qwen35", "qwen35moe"):
        # Qwen3's layer sizes (a mixture's dense width is its shared expert's, as llama.cpp's default), then the
        # linear attention's and the experts'
        shared = config.get("shared_expert_intermediate_size")
        routed = {k: v for k, v in config.items() if k != "shared_expert_intermediate_size"}
        dense = {**routed, "num_experts": None, "intermediate_size": shared or config.get("intermediate_size")}
        hp = {**_hparams(dense, "qwen3"), **_qwen35(config)}
        if arch == "qwen35moe":
            hp |= {**_experts(routed, arch), "expert_norm": True,
                   "n_ff_shexp": int(_need(config, "shared_expert_intermediate_size"))}
        return hp
    if config.get("use_sliding_window"):
        raise UnsupportedError("sliding-window attention (use_sliding_window) is not supported")
    if config.get("attn_logit_softcapping") is not None:
        raise UnsupportedError("attn_logit_softcapping is not supported")
    if config.get("final_logit_softcapping") is not None and arch != "gemma3":
        raise UnsupportedError("final_logit_softcapping is not supported")
    act = config.get("hidden_activation") or config.get("hidden_act", "silu")
    acts = LLAMA_ACTS if arch in ("llama", "gemma3") else {"silu": "swiglu_oai" if arch == "gpt-oss" else "swiglu"}
    if arch == "gpt-oss" and (config.get("swiglu_limit", 7.0), config.get("swiglu_alpha", 1.702)) != (7.0, 1.702):
        raise UnsupportedError("gpt-oss with swiglu_limit or swiglu_alpha other than 7 and 1.702 (llama.cpp's) is "
                               "not supported")
    if act not in acts:
        raise UnsupportedError(f"{arch} with hidden_act {act!r} is not supported; supported: {', '.join(acts)}")
    n_embd, n_head = int(_need(config, "hidden_size")), int(_need(config, "num_attention_heads"))
    gemma = arch == "gemma3"  # transformers' Gemma3TextConfig defaults: global base 1e6, head_dim 256
    theta, scaling = _rope(config, 1e6 if gemma else 10000.0)
    head_dim = int(config.get("head_dim") or (256 if gemma else n_embd // max(n_head, 1)))
    return {"rope_freqs": _llama3_factors(config, head_dim, theta),
            "n_embd": n_embd, "n_ff": int(_need(config, "intermediate_size")),
            "n_layer": int(_need(config, "num_hidden_layers")), "n_head": n_head,
            "n_head_kv": int(config.get("num_key_value_heads") or n_head),
            "head_dim": head_dim,
            "n_ctx": int(_need(config, "max_position_embeddings")), "n_vocab": int(_need(config, "vocab_size")),
            "eps": float(_need(config, "rms_norm_eps")), "tied": bool(config.get("tie_word_embeddings", False)),
            "rope_theta": theta, "rope_scaling": scaling, "ffn_kind": acts[act],
            "qkv_bias": arch == "qwen2" or bool(config.get("attention_bias")),
            "out_bias": bool(config.get("attention_bias")), "ffn_bias": bool(config.get("mlp_bias")),
            "qk_norm": arch in ("qwen3", "gemma3", "qwen3moe", "olmoe"),
            "sliding_window": int(config.get("sliding_window") or 0),
            "softcap": float(config.get("final_logit_softcapping") or 0.0),
            **(_gemma3(config, head_dim) if gemma else {}), **_experts(config, arch),
            **({"swa_pattern": _swa_pattern(config, 2)} if arch == "gpt-oss" else {})}


def _qwen35(config: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's text model (transformers' qwen3_5_text, defaults as its Qwen3_5TextConfig has them): which layers
    are linear attention, their sizes, and the part of each full-attention head that RoPE rotates."""
    n_layer = int(_need(config, "num_hidden_layers"))
    every = int(config.get("full_attention_interval") or 4)
    kinds = config.get("layer_types") or ["linear_attention" if (il + 1) % every else "full_attention"
                                          for il in range(n_layer)]
    if len(kinds) != n_layer or set(kinds) - {"linear_attention", "full_attention"}:
        raise ModelFormatError(f"config.json layer_types must be {n_layer} of linear_attention and full_attention")
    k_dim, v_dim = int(config.get("linear_key_head_dim") or 128), int(config.get("linear_value_head_dim") or 128)
    if k_dim != v_dim:
        raise UnsupportedError(f"linear attention with key heads of {k_dim} and value heads of {v_dim} is not "
                               "supported (llama.cpp's qwen35 has one ssm.state_size for both)")
    n_k, n_v = int(config.get("linear_num_key_heads") or 16), int(config.get("linear_num_value_heads") or 32)
    if n_v % n_k:
        raise ModelFormatError(f"linear_num_value_heads {n_v} is not a multiple of linear_num_key_heads {n_k}")
    params = _rope_params(config)
    head_dim = int(config.get("head_dim") or 256)
    rotated = int(head_dim * float(params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 0.25))
    sections = [int(x) for x in params.get("mrope_section") or (11, 11, 10)]  # transformers' default
    return {"rope_sections": (sections + [0] * 4)[:4],
            "recurrent": [kind == "linear_attention" for kind in kinds], "ssm_head_dim": k_dim, "ssm_k_heads": n_k,
            "ssm_v_heads": n_v, "ssm_conv_kernel": int(config.get("linear_conv_kernel_dim") or 4), "n_rot": rotated,
            "head_dim": head_dim, "qk_norm": True}


def grouped_to_tiled(w: np.ndarray, n_k: int, head_dim: int, axis: int = 0) -> np.ndarray:
    """Qwen3.5's value heads along `axis` (n_k groups of n_v / n_k heads of head_dim, each group reading one key
    head: transformers' repeat_interleave) in llama.cpp's order, where value head h reads key head h % n_k."""
    w = np.moveaxis(w, axis, 0)
    tiled = w.reshape(n_k, -1, head_dim, *w.shape[1:]).swapaxes(0, 1).reshape(w.shape)
    return np.moveaxis(tiled, 0, axis)


def _swa_pattern(config: dict[str, Any], every: int) -> int | list[bool]:
    """Which layers are windowed, from layer_types, as llama.cpp's key holds it: `every` where every every-th
    layer is global (its default), else one flag per layer."""
    n_layer = int(_need(config, "num_hidden_layers"))
    flags = [t == "sliding_attention" for t in config.get("layer_types") or []] or [
        il % every < every - 1 for il in range(n_layer)]
    if len(flags) != n_layer:
        raise ModelFormatError(f"config.json has {len(flags)} layer_types for {n_layer} layers")
    return every if flags == [il % every < every - 1 for il in range(n_layer)] else flags


def _experts(config: dict[str, Any], arch: str) -> dict[str, Any]:
    """A mixture of experts' sizes (none for a dense model): every layer routes to its experts, as
    llama.cpp's qwen3moe, olmoe and llama (Mixtral) graphs have them."""
    n_expert = config.get("num_local_experts") or config.get("num_experts")
    if not n_expert:
        return {}
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedError("a mixture of experts with dense layers (mlp_only_layers, decoder_sparse_step) is not "
                               "supported")
    if config.get("shared_expert_intermediate_size"):
        raise UnsupportedError("shared experts (shared_expert_intermediate_size) are not supported")
    if config.get("clip_qkv") is not None:
        raise UnsupportedError("clip_qkv is not supported")
    return {"n_expert": int(n_expert), "n_expert_used": int(_need(config, "num_experts_per_tok")),
            "n_ff_exp": int(config.get("moe_intermediate_size") or _need(config, "intermediate_size")),
            # Mixtral always normalises; Qwen3-MoE and OLMoE say so, false when absent as transformers reads them
            # (llama.cpp's qwen3moe always normalises: the file's expert_weights_norm key says which applies)
            "expert_norm": arch in ("llama", "gpt-oss") or bool(config.get("norm_topk_prob", False))}


def _falcon(config: dict[str, Any]) -> dict[str, Any]:
    """Falcon-7B (multi-query) and Falcon-40B (new_decoder_architecture: grouped KV, two LayerNorms) as
    llama.cpp runs them: rotary positions, parallel attention and MLP, GELU (tanh form, as ggml's) or ReLU."""
    for key, want in (("alibi", False), ("parallel_attn", True)):
        if bool(config.get(key, want)) != want:
            raise UnsupportedError(f"Falcon with {key} = {config[key]!r} is not supported (only {want!r})")
    new_arch = bool(config.get("new_decoder_architecture"))
    if not new_arch and not config.get("multi_query", True):
        raise UnsupportedError("Falcon with one KV head per query head (multi_query false) is not supported")
    act = config.get("activation", "gelu")
    if act not in FALCON_ACTS:
        raise UnsupportedError(f"Falcon with activation {act!r} is not supported; supported: {', '.join(FALCON_ACTS)}")
    n_embd, n_head = int(_need(config, "hidden_size")), int(_need(config, "num_attention_heads"))
    bias, (theta, scaling) = bool(config.get("bias")), _rope(config)
    return {"n_embd": n_embd, "n_ff": int(config.get("ffn_hidden_size") or 4 * n_embd),
            "n_layer": int(_need(config, "num_hidden_layers")), "n_head": n_head,
            "n_head_kv": int(config.get("num_kv_heads") or n_head) if new_arch else 1,
            "head_dim": n_embd // max(n_head, 1), "n_ctx": int(config.get("max_position_embeddings") or 2048),
            "n_vocab": int(_need(config, "vocab_size")), "eps": float(config.get("layer_norm_epsilon") or 1e-5),
            "tied": bool(config.get("tie_word_embeddings", True)), "rope_theta": theta,
            "rope_scaling": scaling, "rope_freqs": None, "ffn_kind": FALCON_ACTS[act], "qkv_bias": bias,
            "out_bias": bias, "ffn_bias": bias, "qk_norm": False, "sliding_window": 0, "two_norms": new_arch}


def _gemma3(config: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Gemma 3's extras: the sliding window and which layers have it, the local RoPE base, the softmax scale
    (defaults as transformers' Gemma3TextConfig has them)."""
    if config.get("use_bidirectional_attention"):
        raise UnsupportedError("Gemma 3 with use_bidirectional_attention (an embedding model) is not supported")
    n_layer = int(_need(config, "num_hidden_layers"))
    every = int(config.get("sliding_window_pattern") or 6)  # older configs: every n-th layer global
    kinds = config.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                          for i in range(n_layer)]
    if len(kinds) != n_layer or set(kinds) - {"sliding_attention", "full_attention"}:
        raise UnsupportedError("layer_types must name sliding_attention or full_attention for every layer")
    full = [k == "full_attention" for k in kinds]
    # llama.cpp's short form when it fits (every n-th layer global, or 0: none), else one flag per layer
    pattern = next((n for n in range(1, n_layer + 1) if full == [i % n == n - 1 for i in range(n_layer)]),
                   0 if not any(full) else [not f for f in full])
    local = (config.get("rope_parameters") or {}).get("sliding_attention") or {}
    if (local.get("rope_type") or "default") != "default":
        raise UnsupportedError(f"Gemma 3 with rope_type {local['rope_type']!r} on its sliding-window layers is not "
                               "supported (only default)")
    local_theta = float(local.get("rope_theta") or config.get("rope_local_base_freq") or 10000.0)
    window = int(config.get("sliding_window") or 4096)
    return {"sliding_window": window if any(not f for f in full) else 0, "swa_pattern": pattern,
            "rope_theta_swa": local_theta, "attn_scale": float(config.get("query_pre_attn_scalar") or 256) ** -0.5}


def _gemma4(config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's text model (transformers' gemma4_text, defaults as its Gemma4TextConfig has them) in llama.cpp's
    gemma4 terms: the windowed and the global layers' head sizes, KV heads and RoPE, the shared KV layers, the
    per-layer embeddings, the double-wide FFN of the shared layers, the final softcap."""
    for key, what in (("use_bidirectional_attention", "bidirectional attention (use_bidirectional_attention)"),
                      ("attention_bias", "attention biases (attention_bias)")):
        if config.get(key):
            raise UnsupportedError(f"Gemma 4 with {what} is not supported")
    act = config.get("hidden_activation") or "gelu_pytorch_tanh"
    if LLAMA_ACTS.get(act) != "geglu":
        raise UnsupportedError(f"Gemma 4 with hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
    n_layer, n_head = int(_need(config, "num_hidden_layers")), int(_need(config, "num_attention_heads"))
    n_vocab, n_ff = int(_need(config, "vocab_size")), int(_need(config, "intermediate_size"))
    kinds = config.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                          for i in range(n_layer)]
    if len(kinds) != n_layer or set(kinds) - {"sliding_attention", "full_attention"}:
        raise UnsupportedError("layer_types must name sliding_attention or full_attention for every layer")
    kinds[-1] = "full_attention"  # transformers forces the last layer global
    windowed = [k == "sliding_attention" for k in kinds]
    # the layers' head sizes and KV heads: transformers' per-layer overrides, else the older global_* keys
    head_swa, n_kv = int(config.get("head_dim") or 256), int(config.get("num_key_value_heads") or 4)
    overrides = {int(k): v for k, v in (config.get("per_layer_config") or {}).items() if k.isdigit()}
    if not overrides:
        glob = {"head_dim": int(config.get("global_head_dim") or 512)}
        if config.get("num_global_key_value_heads") and config.get("attention_k_eq_v", True):
            glob["num_key_value_heads"] = int(config["num_global_key_value_heads"])
        overrides = {il: glob for il in range(n_layer) if not windowed[il]}
    head = [int(overrides.get(il, {}).get("head_dim") or head_swa) for il in range(n_layer)]
    kv_heads = [int(overrides.get(il, {}).get("num_key_value_heads") or n_kv) for il in range(n_layer)]
    head_global = {h for h, w in zip(head, windowed, strict=True) if not w}
    if len(head_global) != 1 or {h for h, w in zip(head, windowed, strict=True) if w} - {head_swa}:
        raise UnsupportedError("Gemma 4 whose layers of one kind differ in head size is not supported")
    shared = int(config.get("num_kv_shared_layers") or 0)
    per_layer_rows = int(config.get("vocab_size_per_layer_input") or n_vocab)
    if config.get("hidden_size_per_layer_input") and per_layer_rows != n_vocab:
        raise UnsupportedError("Gemma 4 whose per-layer embedding table has other rows than vocab_size is not "
                               "supported")
    double = bool(config.get("use_double_wide_mlp"))
    params = config.get("rope_parameters") or {}
    local, glob_rope = params.get("sliding_attention") or {}, params.get("full_attention") or {}
    if (local.get("rope_type") or "default") != "default":
        raise UnsupportedError(f"Gemma 4 with rope_type {local['rope_type']!r} on its windowed layers is not "
                               "supported (only default)")
    kind = glob_rope.get("rope_type") or "default"
    if kind not in ("default", "proportional"):
        raise UnsupportedError(f"Gemma 4 with rope_type {kind!r} on its global layers is not supported (only "
                               "default, proportional)")
    (hd,) = head_global
    # proportional RoPE rotates the first pairs of each half of a head (their frequencies computed over the whole
    # head) and leaves the rest: llama.cpp's rope_freqs divides the others' frequencies by 1e30
    rotated = int(float(glob_rope.get("partial_rotary_factor", 1.0)) * hd // 2) if kind == "proportional" else hd // 2
    factor = float(glob_rope.get("factor") or 1.0) if kind == "proportional" else 1.0
    # the 26B-A4B: every layer's experts beside its dense FFN, the router normalising its top k (llama.cpp's keys)
    experts = {"n_expert": int(_need(config, "num_experts")), "n_expert_used": int(_need(config, "top_k_experts")),
               "n_ff_exp": int(_need(config, "moe_intermediate_size"))} if config.get("enable_moe_block") else {}
    return experts | {
            "n_embd": int(_need(config, "hidden_size")), "n_ff": n_ff, "n_layer": n_layer, "n_head": n_head,
            "n_head_kv": kv_heads, "head_dim": hd, "head_dim_swa": head_swa,
            "n_ctx": int(config.get("max_position_embeddings") or 131072), "n_vocab": n_vocab,
            "eps": float(config.get("rms_norm_eps") or 1e-6), "tied": bool(config.get("tie_word_embeddings", True)),
            "rope_theta": float(glob_rope.get("rope_theta") or 1e6),
            "rope_theta_swa": float(local.get("rope_theta") or 10000.0),
            "rope_scaling": {"type": "linear", "factor": factor} if factor != 1.0 else {},
            "rope_freqs": np.array([1.0] * rotated + [1e30] * (hd // 2 - rotated), np.float32),
            "ffn_kind": "geglu", "qkv_bias": False, "out_bias": False, "ffn_bias": False, "qk_norm": True,
            "sliding_window": int(config.get("sliding_window") or 512), "swa_pattern": windowed,
            "n_kv_shared": shared, "v_from_k": bool(config.get("attention_k_eq_v")),
            "n_embd_per_layer": int(config.get("hidden_size_per_layer_input") or 0),
            "n_ff_layers": [n_ff * 2 if double and il >= n_layer - shared else n_ff for il in range(n_layer)],
            "softcap": float(config.get("final_logit_softcapping") or 0.0)}


# ----------------------------------------------------------------------------
# tensor names: GGUF name <- HF name, with the transform each needs


def tensor_map(arch: str, hp: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(gguf name, HF name, transform) with transform in '', 'perm_q', 'perm_k', 'down'."""
    wb = (".weight", ".bias")
    out: list[tuple[str, str, str]] = []
    if arch == "opt":
        p = "model.decoder."
        out += [("token_embd.weight", p + "embed_tokens.weight", ""),
                ("position_embd.weight", p + "embed_positions.weight", "")]
        for il in range(hp["n_layer"]):
            b, h = f"blk.{il}.", f"{p}layers.{il}."
            pairs = [("attn_norm", "self_attn_layer_norm"), ("attn_q", "self_attn.q_proj"),
                     ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                     ("attn_output", "self_attn.out_proj"), ("ffn_norm", "final_layer_norm"),
                     ("ffn_up", "fc1"), ("ffn_down", "fc2")]
            out += [(b + g + s, h + n + s, "down" if g == "ffn_down" else "") for g, n in pairs for s in wb]
        out += [("output_norm" + s, p + "final_layer_norm" + s, "") for s in wb]
    elif arch == "falcon":
        p = "transformer."
        out.append(("token_embd.weight", p + "word_embeddings.weight", ""))
        for il in range(hp["n_layer"]):
            b, h = f"blk.{il}.", f"{p}h.{il}."
            norms = [("attn_norm", "ln_attn"), ("attn_norm_2", "ln_mlp")] if hp["two_norms"] else [
                ("attn_norm", "input_layernorm")]
            out += [(b + g + s, h + n + s, "") for g, n in norms for s in wb]
            proj = [("attn_qkv", "self_attention.query_key_value", "qkv_groups" if hp["two_norms"] else ""),
                    ("attn_output", "self_attention.dense", ""), ("ffn_up", "mlp.dense_h_to_4h", ""),
                    ("ffn_down", "mlp.dense_4h_to_h", "down")]
            out += [(b + g + s, h + n + s, tr) for g, n, tr in proj for s in (wb if hp["qkv_bias"] else wb[:1])]
        out += [("output_norm" + s, p + "ln_f" + s, "") for s in wb]
    elif arch == "gemma4":
        out += _gemma4_map(hp)
    elif arch in ("qwen35", "qwen35moe"):
        out += _qwen35_map(hp)
    else:
        p = "model."
        out.append(("token_embd.weight", p + "embed_tokens.weight", ""))
        perm = arch == "llama"
        norm = "norm1" if arch == "gemma3" else ""  # Gemma's RMSNorm scales by 1 + w; llama.cpp stores 1 + w
        for il in range(hp["n_layer"]):
            b, h = f"blk.{il}.", f"{p}layers.{il}."
            proj = [("attn_q", "self_attn.q_proj", "perm_q" if perm else "", hp["qkv_bias"]),
                    ("attn_k", "self_attn.k_proj", "perm_k" if perm else "", hp["qkv_bias"]),
                    ("attn_v", "self_attn.v_proj", "", hp["qkv_bias"]),
                    ("attn_output", "self_attn.o_proj", "", hp["out_bias"])]
            if "n_expert" in hp:
                out += _expert_map(b, h, hp["n_expert"], arch)
            else:
                proj += [("ffn_gate", "mlp.gate_proj", "", hp["ffn_bias"]),
                         ("ffn_up", "mlp.up_proj", "", hp["ffn_bias"]),
                         ("ffn_down", "mlp.down_proj", "down", hp["ffn_bias"])]
            if arch == "gpt-oss":
                out += [(b + "attn_norm.weight", h + "input_layernorm.weight", ""),
                        (b + "post_attention_norm.weight", h + "post_attention_layernorm.weight", ""),
                        (b + "attn_sinks.weight", h + "self_attn.sinks", "")]
            elif arch == "gemma3":
                out += [(b + "attn_norm.weight", h + "input_layernorm.weight", norm),
                        (b + "post_attention_norm.weight", h + "post_attention_layernorm.weight", norm),
                        (b + "ffn_norm.weight", h + "pre_feedforward_layernorm.weight", norm),
                        (b + "post_ffw_norm.weight", h + "post_feedforward_layernorm.weight", norm)]
            else:
                out += [(b + "attn_norm.weight", h + "input_layernorm.weight", ""),
                        (b + "ffn_norm.weight", h + "post_attention_layernorm.weight", "")]
            if hp["qk_norm"]:
                out += [(b + "attn_q_norm.weight", h + "self_attn.q_norm.weight", norm),
                        (b + "attn_k_norm.weight", h + "self_attn.k_norm.weight", norm)]
            for g, n, tr, bias in proj:
                out += [(b + g + s, h + n + s, tr) for s in (wb if bias else wb[:1])]
        out.append(("output_norm.weight", p + "norm.weight", norm))
    if not hp["tied"]:
        out.append(("output.weight", "lm_head.weight", ""))
    return out

# a Gemma 4 mixture's layer beside its dense FFN (GGUF name, HF name after model.layers.N., transform): llama.cpp's
# names (its converter renames the router's two scales itself); gate and up come as one tensor, GATE_UP's halves
GEMMA4_EXPERTS = [("ffn_gate_inp.weight", "router.proj.weight", ""), ("ffn_gate_inp.scale", "router.scale", ""),
                  ("ffn_down_exps.scale", "router.per_expert_scale", ""),
                  ("ffn_gate_exps.weight", "experts.gate_up_proj", "gate_half"),
                  ("ffn_up_exps.weight", "experts.gate_up_proj", "up_half"),
                  ("ffn_down_exps.weight", "experts.down_proj", ""),
                  *((f"{g}.weight", f"{n}.weight", "") for g, n in (
                      ("pre_ffw_norm_2", "pre_feedforward_layernorm_2"),
                      ("post_ffw_norm_1", "post_feedforward_layernorm_1"),
                      ("post_ffw_norm_2", "post_feedforward_layernorm_2")))]


def _gemma4_map(hp: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Gemma 4's tensors as llama.cpp names them; its norms scale by w (not Gemma 3's 1 + w): stored as they are.
    The shared KV layers have no k (or v) projection, the global layers of attention_k_eq_v no v."""
    p = "model."
    out = [("token_embd.weight", p + "embed_tokens.weight", "")]
    if hp["n_embd_per_layer"]:
        out += [("per_layer_token_embd.weight", p + "embed_tokens_per_layer.weight", ""),
                ("per_layer_model_proj.weight", p + "per_layer_model_projection.weight", ""),
                ("per_layer_proj_norm.weight", p + "per_layer_projection_norm.weight", "")]
    n_layer, shared = hp["n_layer"], hp["n_kv_shared"]
    for il in range(n_layer):
        b, h = f"blk.{il}.", f"{p}layers.{il}."
        pairs = [("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                 ("ffn_norm", "pre_feedforward_layernorm"), ("post_ffw_norm", "post_feedforward_layernorm"),
                 ("attn_q", "self_attn.q_proj"), ("attn_q_norm", "self_attn.q_norm"),
                 ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj")]
        if il < n_layer - shared:
            pairs += [("attn_k", "self_attn.k_proj"), ("attn_k_norm", "self_attn.k_norm")]
            if not (hp["v_from_k"] and not hp["swa_pattern"][il]):
                pairs.append(("attn_v", "self_attn.v_proj"))
        if hp["n_embd_per_layer"]:
            pairs += [("inp_gate", "per_layer_input_gate"), ("proj", "per_layer_projection"),
                      ("post_norm", "post_per_layer_input_norm")]
        out += [(b + g + ".weight", h + n + ".weight", "") for g, n in pairs]
        # (a mixture's file keeps llama.cpp's layout, its dense FFN's down untransposed too)
        out += [(b + "ffn_down.weight", h + "mlp.down_proj.weight", "" if "n_expert" in hp else "down"),
                (b + "layer_output_scale.weight", h + "layer_scalar", "")]
        if "n_expert" in hp:  # the 26B-A4B's router, experts and norms
            out += [(b + g, h + n, tr) for g, n, tr in GEMMA4_EXPERTS]
    return out + [("output_norm.weight", p + "norm.weight", "")]



def _qwen35_map(hp: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Qwen3.5's tensors as llama.cpp's convert_hf_to_gguf.py writes them: the norms that scale by 1 + w store 1 + w
    (all but the linear attention's gated norm); the value heads of the linear attention in llama.cpp's order
    (grouped_to_tiled: rows of z, of in_proj_qkv's values, of the convolution's value channels, of b, a, dt_bias and
    A_log, columns of out_proj); A_log as ssm_a = -exp(A_log); the convolution's taps as a matrix."""
    p = "model."
    out = [("token_embd.weight", p + "embed_tokens.weight", "")]
    for il in range(hp["n_layer"]):
        b, h = f"blk.{il}.", f"{p}layers.{il}."
        pairs = [("attn_norm.weight", "input_layernorm.weight", "norm1"),
                 ("post_attention_norm.weight", "post_attention_layernorm.weight", "norm1")]
        if "n_expert" in hp:  # the router, the experts (stacked as Qwen3-MoE's), the gated shared expert
            m = "mlp."
            out += _expert_map(b, h, hp["n_expert"], "qwen35moe")
            pairs += [("ffn_gate_inp_shexp.weight", m + "shared_expert_gate.weight", "row"),
                      ("ffn_gate_shexp.weight", m + "shared_expert.gate_proj.weight", ""),
                      ("ffn_up_shexp.weight", m + "shared_expert.up_proj.weight", ""),
                      ("ffn_down_shexp.weight", m + "shared_expert.down_proj.weight", "")]
        else:
            pairs += [("ffn_gate.weight", "mlp.gate_proj.weight", ""), ("ffn_up.weight", "mlp.up_proj.weight", ""),
                      ("ffn_down.weight", "mlp.down_proj.weight", "down")]
        if hp["recurrent"][il]:
            a = "linear_attn."
            pairs += [("attn_qkv.weight", a + "in_proj_qkv.weight", "vheads_qkv"),
                      ("attn_gate.weight", a + "in_proj_z.weight", "vheads"),
                      ("ssm_beta.weight", a + "in_proj_b.weight", "vheads1"),
                      ("ssm_alpha.weight", a + "in_proj_a.weight", "vheads1"),
                      ("ssm_dt.bias", a + "dt_bias", "vheads1"), ("ssm_a", a + "A_log", "ssm_a"),
                      ("ssm_conv1d.weight", a + "conv1d.weight", "conv1d"),
                      ("ssm_norm.weight", a + "norm.weight", ""), ("ssm_out.weight", a + "out_proj.weight", "vcols")]
        else:
            pairs += [("attn_q.weight", "self_attn.q_proj.weight", ""),
                      ("attn_k.weight", "self_attn.k_proj.weight", ""),
                      ("attn_v.weight", "self_attn.v_proj.weight", ""),
                      ("attn_output.weight", "self_attn.o_proj.weight", ""),
                      ("attn_q_norm.weight", "self_attn.q_norm.weight", "norm1"),
                      ("attn_k_norm.weight", "self_attn.k_norm.weight", "norm1")]
        out += [(b + g, h + n, tr) for g, n, tr in pairs]
    return out + [("output_norm.weight", p + "norm.weight", "norm1")]


def _expert_map(b: str, h: str, n_expert: int, arch: str) -> list[tuple[str, str, str]]:
    """A layer's router and its experts' matrices, each stacked from n_expert HF tensors (HF name with {e});
    gpt-oss' come stacked, gate and up interleaved, with biases (RESHAPED's transforms)."""
    if arch == "gpt-oss":
        m = h + "mlp."
        return [(b + "ffn_gate_inp.weight", m + "router.weight", ""), (b + "ffn_gate_inp.bias", m + "router.bias", ""),
                (b + "ffn_gate_exps.weight", m + "experts.gate_up_proj", "oai_gate"),
                (b + "ffn_up_exps.weight", m + "experts.gate_up_proj", "oai_up"),
                (b + "ffn_down_exps.weight", m + "experts.down_proj", "oai_down"),
                (b + "ffn_gate_exps.bias", m + "experts.gate_up_proj_bias", "oai_gate_b"),
                (b + "ffn_up_exps.bias", m + "experts.gate_up_proj_bias", "oai_up_b"),
                (b + "ffn_down_exps.bias", m + "experts.down_proj_bias", "")]
    moe, (gate, up, down) = (("block_sparse_moe.", ("w1", "w3", "w2")) if arch == "llama" else
                             ("mlp.", ("gate_proj", "up_proj", "down_proj")))
    stack = f"experts:{n_expert}"
    return [(b + "ffn_gate_inp.weight", h + moe + "gate.weight", ""),
            (b + "ffn_gate_exps.weight", h + moe + "experts.{e}." + gate + ".weight", stack),
            (b + "ffn_up_exps.weight", h + moe + "experts.{e}." + up + ".weight", stack),
            (b + "ffn_down_exps.weight", h + moe + "experts.{e}." + down + ".weight", stack)]


def _resolve(src: SafetensorsSource, hf_name: str) -> str:
    """The stored name of `hf_name`, which some checkpoints keep without the 'model.' prefix, and a multimodal one's
    text model under 'model.language_model.'."""
    if hf_name not in src.tensors and hf_name.startswith("model."):
        for stored in (hf_name[6:], "model.language_model." + hf_name[6:]):
            if stored in src.tensors:
                return src.require(stored).name
    src.require(hf_name)
    return hf_name


def _rope_pair_order(n_rows: int, n_heads: int) -> np.ndarray:
    """Row i of the GGUF layout is HF row order[i]: each head's halves (j, j + hd/2) become pairs (2j, 2j+1)."""
    hd = n_rows // n_heads
    order = np.arange(hd).reshape(2, hd // 2).T.reshape(-1)  # (hd,): 0, hd/2, 1, hd/2+1, ...
    return (np.arange(n_heads)[:, None] * hd + order[None, :]).reshape(-1)  # (n_heads * hd,)


def rope_pair_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF q/k rows -> llama.cpp's order, so that rope mode 'normal' rotates adjacent pairs."""
    return w[_rope_pair_order(w.shape[0], n_heads)]


def falcon_qkv_rows(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """Falcon-40B's fused QKV rows (per KV group: its query heads, then its key head, then its value head) ->
    all query heads, all key heads, all value heads, as llama.cpp stores attn_qkv. w: (rows, ...) or (rows,)."""
    per_group = n_head // n_head_kv + 2
    g = w.reshape(n_head_kv, per_group, -1, *w.shape[1:])  # (n_kv, q heads + k + v, head_dim, ...)
    return np.concatenate([g[:, :-2].reshape(-1, *w.shape[1:]), g[:, -2].reshape(-1, *w.shape[1:]),
                           g[:, -1].reshape(-1, *w.shape[1:])])


def rope_half_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of rope_pair_rows: llama.cpp q/k rows -> HF's order."""
    out = np.empty_like(w)
    out[_rope_pair_order(w.shape[0], n_heads)] = w
    return out


# ----------------------------------------------------------------------------
# metadata


def _arch_kv(arch: str, hp: dict[str, Any], name: str, outtype: Q) -> list[KV]:
    """general.* and {arch}.* keys as llama.cpp writes them."""
    u32, f32, s = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
    head_dim = hp.get("head_dim", hp["n_embd"] // hp["n_head"])
    kv: list[KV] = [
        ("general.name", name, s, None), ("general.file_type", file_type(outtype), u32, None),
        ("general.quantization_version", 2, u32, None),
        (f"{arch}.vocab_size", hp["n_vocab"], u32, None), (f"{arch}.context_length", hp["n_ctx"], u32, None),
        (f"{arch}.embedding_length", hp["n_embd"], u32, None), (f"{arch}.block_count", hp["n_layer"], u32, None),
        (f"{arch}.feed_forward_length", hp["n_ff"], u32, None),
        (f"{arch}.attention.head_count", hp["n_head"], u32, None),
        (f"{arch}.attention.head_count_kv", hp["n_head_kv"], u32, None),
        (f"{arch}.attention.key_length", head_dim, u32, None),
        (f"{arch}.attention.value_length", head_dim, u32, None),
    ]
    if arch == "opt":
        kv.append((f"{arch}.attention.layer_norm_epsilon", hp["eps"], f32, None))
        return kv
    kv.append((f"{arch}.rope.freq_base", hp["rope_theta"], f32, None))
    for name, value in hp["rope_scaling"].items():  # type, factor; YaRN's trained context, betas, attn_factor
        kind = s if name == "type" else u32 if name == "original_context_length" else f32
        kv.append((f"{arch}.rope.scaling.{name}", value, kind, None))
    if arch == "falcon":
        return kv + [(f"{arch}.attention.layer_norm_epsilon", hp["eps"], f32, None)]
    if arch == "gemma4":
        return _gemma4_kv(kv, hp)
    kv += [(f"{arch}.attention.layer_norm_rms_epsilon", hp["eps"], f32, None),
           (f"{arch}.rope.dimension_count", hp.get("n_rot", head_dim), u32, None)]
    if arch in ("qwen35", "qwen35moe"):
        kv += _qwen35_kv(arch, hp)
    if arch in ("llama", "gpt-oss") and hp["sliding_window"]:  # Mistral, gpt-oss
        kv.append((f"{arch}.attention.sliding_window", hp["sliding_window"], u32, None))
    if arch == "gpt-oss" and hp["swa_pattern"] != 2:  # llama.cpp's default for gpt-oss: every other layer
        kv.append((f"{arch}.attention.sliding_window_pattern", hp["swa_pattern"], GGUFValueType.ARRAY,
                   GGUFValueType.BOOL))
    if "n_expert" in hp:
        kv += [(f"{arch}.expert_count", hp["n_expert"], u32, None),
               (f"{arch}.expert_used_count", hp["n_expert_used"], u32, None),
               (f"{arch}.expert_feed_forward_length", hp["n_ff_exp"], u32, None),
               (f"{arch}.expert_weights_norm", hp["expert_norm"], GGUFValueType.BOOL, None)]
    if arch == "gemma3":
        kv += [(f"{arch}.attention.sliding_window", hp["sliding_window"], u32, None),
               (f"{arch}.rope.freq_base_swa", hp["rope_theta_swa"], f32, None)]
        pattern = hp["swa_pattern"]
        if isinstance(pattern, list):
            kv.append((f"{arch}.attention.sliding_window_pattern", pattern, GGUFValueType.ARRAY, GGUFValueType.BOOL))
        elif pattern != 6:  # llama.cpp's rule for Gemma 3 files without the key
            kv.append((f"{arch}.attention.sliding_window_pattern", pattern, u32, None))
        # always: a reader's default depends on the layer count (llama.cpp's rule for the 27B)
        kv.append((f"{arch}.attention.scale", hp["attn_scale"], f32, None))
        if hp["softcap"]:
            kv.append((f"{arch}.final_logit_softcapping", hp["softcap"], f32, None))
    return kv


def _qwen35_kv(arch: str, hp: dict[str, Any]) -> list[KV]:
    """Qwen3.5's linear-attention keys as llama.cpp writes them; its RoPE's sections (config.json's mrope_section,
    padded to four; text positions make them one)."""
    u32, arr = GGUFValueType.UINT32, GGUFValueType.ARRAY
    n_layer, flags = hp["n_layer"], hp["recurrent"]
    every = next((n for n in range(1, n_layer + 1) if flags == [(il + 1) % n != 0 for il in range(n_layer)]), None)
    layers = ((f"{arch}.full_attention_interval", every, u32, None) if every else
              (f"{arch}.attention.recurrent_layers", flags, arr, GGUFValueType.BOOL))
    shared = [(f"{arch}.expert_shared_feed_forward_length", hp["n_ff_shexp"], u32, None)] if "n_ff_shexp" in hp else []
    return [(f"{arch}.ssm.conv_kernel", hp["ssm_conv_kernel"], u32, None),
            (f"{arch}.ssm.state_size", hp["ssm_head_dim"], u32, None),
            (f"{arch}.ssm.group_count", hp["ssm_k_heads"], u32, None),
            (f"{arch}.ssm.time_step_rank", hp["ssm_v_heads"], u32, None),
            (f"{arch}.ssm.inner_size", hp["ssm_v_heads"] * hp["ssm_head_dim"], u32, None),
            (f"{arch}.rope.dimension_sections", hp["rope_sections"], arr, u32), layers, *shared]


def _gemma4_kv(kv: list[KV], hp: dict[str, Any]) -> list[KV]:
    """kv (the keys every architecture has) with Gemma 4's, as llama.cpp's convert_hf_to_gguf.py writes them:
    key_length is the global layers' head size, *_swa the windowed layers'; head_count_kv and feed_forward_length
    one value per layer where the layers differ."""
    u32, f32, arr, boolean = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.ARRAY, GGUFValueType.BOOL

    def one_or_per_layer(values: list[int]) -> tuple[Any, GGUFValueType, GGUFValueType | None]:
        return (values[0], u32, None) if len(set(values)) == 1 else (values, arr, u32)

    per_layer = {"gemma4.attention.head_count_kv": one_or_per_layer(hp["n_head_kv"]),
                 "gemma4.feed_forward_length": one_or_per_layer(hp["n_ff_layers"])}
    kv = [(k, *per_layer[k]) if k in per_layer else (k, v, t, e) for k, v, t, e in kv]
    kv += [("gemma4.attention.layer_norm_rms_epsilon", hp["eps"], f32, None),
           ("gemma4.rope.dimension_count", hp["head_dim"], u32, None),
           ("gemma4.attention.key_length_swa", hp["head_dim_swa"], u32, None),
           ("gemma4.attention.value_length_swa", hp["head_dim_swa"], u32, None),
           ("gemma4.rope.dimension_count_swa", hp["head_dim_swa"], u32, None),
           ("gemma4.rope.freq_base_swa", hp["rope_theta_swa"], f32, None),
           ("gemma4.attention.sliding_window", hp["sliding_window"], u32, None),
           ("gemma4.attention.sliding_window_pattern", hp["swa_pattern"], arr, boolean),
           ("gemma4.attention.shared_kv_layers", hp["n_kv_shared"], u32, None),
           ("gemma4.embedding_length_per_layer_input", hp["n_embd_per_layer"], u32, None)]
    if hp["softcap"]:
        kv.append(("gemma4.final_logit_softcapping", hp["softcap"], f32, None))
    if "n_expert" in hp:
        kv += [("gemma4.expert_count", hp["n_expert"], u32, None),
               ("gemma4.expert_used_count", hp["n_expert_used"], u32, None),
               ("gemma4.expert_feed_forward_length", hp["n_ff_exp"], u32, None)]
    return kv


def _pyinfer_kv(ffn_kind: str, layout: str = "down_t") -> list[KV]:
    """The PowerGGUF keys of a freshly converted (not yet profiled) model; a mixture of experts keeps its
    experts as llama.cpp stores them (layout "down")."""
    s = GGUFValueType.STRING
    return [("pyinfer.format_version", FORMAT_VERSION, GGUFValueType.UINT32, None),
            ("pyinfer.ffn_layout", layout, s, None), ("pyinfer.neuron_order", "original", s, None),
            ("pyinfer.ffn_kind", ffn_kind, s, None)]


def _check_plan(arch: str, kv: list[KV], tensors: list[OutTensor], layout: str, what: str) -> None:
    """The planned file must load: the same check GGUFFile runs, done before anything is written."""
    meta = {"general.architecture": arch} | {k: v for k, v, *_ in kv}
    try:
        cfg = ModelConfig.from_metadata(meta, [t.name for t in tensors])
    except (ModelFormatError, UnsupportedError) as exc:
        raise type(exc)(f"{what}: {exc}") from None
    planned = {}
    for t in tensors:
        ne = tuple(reversed(t.shape))
        if t.name.endswith("ffn_gate_up_exps.weight"):  # read as the two it holds (gguf_file.split_gate_up)
            planned |= {t.name.replace("gate_up", half): (ne[0], ne[1] // 2, *ne[2:]) for half in ("gate", "up")}
        else:
            planned[t.name] = ne
    for name, ne in expected_tensor_shapes(cfg, layout).items():
        if planned.get(name) != ne:
            raise ModelFormatError(f"{what}: {name} has shape {list(planned.get(name, ()))}, expected {list(ne)}")


# ----------------------------------------------------------------------------
# plans


def read_config(folder: str) -> dict[str, Any]:
    """config.json of a checkpoint of an architecture the converter knows (a multimodal one's text_config, the
    architectures and tied embeddings its top level says)."""
    config = read_json(os.path.join(folder, "config.json"), CONFIG)
    if config is None:
        raise ModelFormatError(f"{folder}: missing config.json")
    archs = config.get("architectures") or [None]
    if archs[0] not in HF_ARCHS:
        raise UnsupportedError(f"unsupported architecture {archs[0]!r}; supported: {', '.join(HF_ARCHS)}")
    if archs[0] in MULTIMODAL_HF:
        text = config.get("text_config")
        if not text:
            raise ModelFormatError(f"{folder}: config.json of a {archs[0]} lacks text_config (its text model's)")
        # transformers ties the head by the top level's flag
        config = {**text, "tie_word_embeddings": config.get("tie_word_embeddings", text.get("tie_word_embeddings"))}
    return config | {"architectures": archs}


def _plan_hf(folder: str, outtype: Q, out_path: str, dense_path: str | None) -> tuple[list[OutFile], list[str]]:
    """Outputs for a HF checkpoint folder."""
    config = read_config(folder)
    archs = config["architectures"]
    arch = HF_ARCHS[archs[0]]
    windowed = ("MistralForCausalLM", "Gemma3ForCausalLM", "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration",
                "GptOssForCausalLM")
    if archs[0] not in windowed:  # Qwen2 carries one unused
        config = {k: v for k, v in config.items() if k != "sliding_window"}
    if dense_path is not None and arch == "opt":
        raise UnsupportedError("--dense-gguf: llama.cpp has no OPT architecture, so no dense GGUF can be written")
    hp = _hparams(config, arch)
    src = SafetensorsSource(folder)
    _check_checkpoint(src, arch, hp)
    notes: list[str] = []
    if _rope_params(config).get("truncate", True) is not True:  # gpt-oss' (others are refused)
        notes.append("YaRN without truncation (truncate false) runs with its ramp's ends truncated to whole pairs, "
                     "as llama.cpp runs gpt-oss")
    base_kv = _arch_kv(arch, hp, os.path.basename(os.path.abspath(folder)), outtype)
    base_kv += vocab_metadata(folder, arch, hp["n_vocab"], config)

    def plan(transposed: bool) -> list[OutTensor]:
        tensors = []
        if hp.get("rope_freqs") is not None:
            factors = hp["rope_freqs"]
            tensors.append(OutTensor("rope_freqs.weight", factors.shape, Q.F32, lambda: encode(factors, Q.F32)))
        for gname, hname, transform in tensor_map(arch, hp):
            if transform in ("gate_half", "up_half") and not transposed:  # llama.cpp's file: the two as one
                if transform == "up_half":
                    continue
                gname, transform = gname.replace("ffn_gate_exps", "ffn_gate_up_exps"), ""
            if transform.startswith("experts:"):
                hnames = [_resolve(src, hname.format(e=e)) for e in range(int(transform[8:]))]
                shapes = {src.tensors[n].shape for n in hnames}
                if len(shapes) != 1:
                    raise ModelFormatError(f"{hname}: the experts' matrices differ in shape ({sorted(shapes)})")
                shape = (len(hnames), *shapes.pop())
                qtype = pick_type(gname, shape[1:], outtype, notes)
                tensors.append(OutTensor(gname, shape, qtype, _stacked(src, hnames, qtype)))
                continue
            hname = _resolve(src, hname)
            shape = src.tensors[hname].shape
            if transform in ("conv1d", "row") and (len(shape) != (3 if transform == "conv1d" else 2) or shape[-2] != 1):
                raise ModelFormatError(f"{hname} has shape {list(shape)}, expected [n, 1, taps] or [1, n]")
            if transform in RESHAPED:
                shape = RESHAPED[transform](shape)
            if transform == "down" and transposed:
                gname = gname.replace("ffn_down", "ffn_down_t")
                shape = shape[::-1]
            qtype = pick_type(gname, shape, outtype, notes)
            tensors.append(OutTensor(gname, shape, qtype, _producer(src, hname, transform, transposed, qtype, hp)))
        return tensors

    power = plan(transposed=True)
    layout = "down" if "n_expert" in hp else "down_t"
    kv = base_kv + _pyinfer_kv(hp["ffn_kind"], layout)
    _check_plan(arch, kv, power, layout, folder)
    outputs = [OutFile(out_path, arch, kv, power)]
    if dense_path is not None:
        dense = plan(transposed=False)
        _check_plan(arch, base_kv, dense, "down", folder)
        llama_cpp_kind = default_ffn_kind(arch)  # dense GGUFs carry no activation key
        if hp["ffn_kind"] != llama_cpp_kind:
            notes.append(f"{dense_path}: llama.cpp will run this {hp['ffn_kind']} model's FFN as {llama_cpp_kind}: "
                         "use it for speed comparisons only")
        outputs.append(OutFile(dense_path, arch, base_kv, dense))
    return outputs, notes


def _check_checkpoint(src: SafetensorsSource, arch: str, hp: dict[str, Any]) -> None:
    """The checkpoint holds num_hidden_layers layers and vocab_size embedding rows: checked before the
    tensor map and the vocabulary are sized from them; gpt-oss' experts in floats, not OpenAI's MXFP4 blocks."""
    if arch == "gpt-oss" and any(n.endswith("gate_up_proj_blocks") for n in src.tensors):
        raise UnsupportedError("this gpt-oss checkpoint keeps its experts as MXFP4 blocks (*_blocks, *_scales), which "
                               "the converter does not read: run its GGUF (llama.cpp's convert_hf_to_gguf.py writes "
                               "one), or convert a dequantized checkpoint")
    names = [n.removeprefix("model.").removeprefix("language_model.").removeprefix("decoder.")
             .removeprefix("transformer.") for n in src.tensors]
    gguf_schema.check_layer_names(hp["n_layer"], names, "config.json num_hidden_layers",
                                  prefix="h." if arch == "falcon" else "layers.")
    emb = src.require(_resolve(src, tensor_map(arch, hp)[0][1]))
    if emb.shape != (hp["n_vocab"], hp["n_embd"]):
        raise ModelFormatError(f"{emb.name} has shape {list(emb.shape)} but config.json says vocab_size "
                               f"{hp['n_vocab']} and hidden size {hp['n_embd']}")


def _stacked(src: SafetensorsSource, hnames: list[str], qtype: Q) -> Callable[[], np.ndarray]:
    """The experts' matrices (HF tensors hnames, in expert order) as one (n_expert, rows, cols) tensor."""
    return lambda: encode(np.stack([src.load(n) for n in hnames]), qtype)


def _producer(src: SafetensorsSource, hname: str, transform: str, transposed: bool,
              qtype: Q, hp: dict[str, Any]) -> Callable[[], np.ndarray]:
    """A function loading one HF tensor, applying its transform and encoding it as `qtype`."""
    def produce() -> np.ndarray:
        w = src.load(hname)
        if transform == "perm_q":
            w = rope_pair_rows(w, hp["n_head"])
        elif transform == "perm_k":
            w = rope_pair_rows(w, hp["n_head_kv"])
        elif transform == "down" and transposed:
            w = w.T
        elif transform == "norm1":
            w = w.astype(np.float32) + np.float32(1.0)
        elif transform == "qkv_groups":
            w = falcon_qkv_rows(w, hp["n_head"], hp["n_head_kv"])
        elif transform in ("oai_gate", "oai_up"):  # (n_expert, d, 2 n_ff), gate in the even columns
            w = np.ascontiguousarray(w[..., transform == "oai_up"::2].transpose(0, 2, 1))
        elif transform == "oai_down":
            w = np.ascontiguousarray(w.transpose(0, 2, 1))
        elif transform in ("gate_half", "up_half"):  # (n_expert, 2 n_ff, d): gate's rows, then up's
            w = np.ascontiguousarray(np.split(w, 2, axis=1)[transform == "up_half"])
        elif transform in ("oai_gate_b", "oai_up_b"):
            w = np.ascontiguousarray(w[..., transform == "oai_up_b"::2])
        elif transform == "row":
            w = w.reshape(-1)
        elif transform.startswith(("vheads", "vcols", "ssm_a", "conv1d")):
            w = _qwen35_value_heads(w, transform, hp)
        return encode(w, qtype)
    return produce


def _qwen35_value_heads(w: np.ndarray, transform: str, hp: dict[str, Any]) -> np.ndarray:
    """A Qwen3.5 linear-attention tensor with its value heads in llama.cpp's order (_qwen35_map's transforms)."""
    n_k, d = hp["ssm_k_heads"], hp["ssm_head_dim"]
    keys = 2 * n_k * d  # in_proj_qkv's and the convolution's q and k channels come first, unchanged
    if transform == "conv1d":
        w = w[:, 0, :]  # (channels, 1, taps) -> (channels, taps)
    if transform in ("vheads_qkv", "conv1d"):
        return np.concatenate([w[:keys], grouped_to_tiled(w[keys:], n_k, d)])
    if transform == "vcols":
        return grouped_to_tiled(w, n_k, d, axis=1)
    if transform == "ssm_a":
        return grouped_to_tiled(-np.exp(w.astype(np.float64)), n_k, 1).astype(np.float32)
    return grouped_to_tiled(w, n_k, 1 if transform == "vheads1" else d)


def _down_t_type(qtype: Q, n_embd: int, name: str, notes: list[str], down_type: str) -> Q:
    """Type of a requantized ffn_down_t: the source type when possible (down_type 'same'), else Q8_0, else F16.
    'auto' is 'same' for float and 8-bit sources and 'q8_0' for lower bit widths."""
    if down_type == "auto":
        down_type = "same" if qtype in FLOAT_TYPES or qtype == Q.Q8_0 else "q8_0"
    if down_type == "f16":
        return Q.F16
    fits = qtype in FLOAT_TYPES or (qtype in QUANTIZABLE and n_embd % GGML_QUANT_SIZES[qtype][0] == 0)
    if down_type == "same" and fits:
        return qtype
    fallback = Q.Q8_0 if n_embd % 32 == 0 else Q.F16
    if down_type == "same":
        notes.append(f"{name}: {qtype.name} cannot be requantized along rows of {n_embd}; stored as {fallback.name}")
    return fallback


def _plan_gguf(path: str, out_path: str, dense_path: str | None,
               down_type: str) -> tuple[list[OutFile], list[str]]:
    """Outputs for a plain llama.cpp GGUF: same bytes, ffn_down transposed into ffn_down_t."""
    g = GGUFFile(path)
    if g.ffn_layout == "down_t":
        raise ModelFormatError(f"{path}: already a PowerGGUF (has ffn_down_t)")
    if g.config.arch == "opt" and dense_path is not None:
        raise UnsupportedError("--dense-gguf: llama.cpp has no OPT architecture, so no dense GGUF can be written")
    notes: list[str] = []
    skip = ("general.architecture", "general.alignment")
    copied = [kv for kv in g.typed_metadata() if kv[0] not in skip
              and (not kv[0].startswith("pyinfer.") or kv[0] == EXPERT_FREQ_KEY)]  # a profile stays

    def raw(name: str) -> Callable[[], np.ndarray]:
        return lambda: g.tensors[name].data

    def down_t(name: str, qtype: Q) -> Callable[[], np.ndarray]:
        return lambda: encode(g.dequantize(name).T, qtype)

    power, dense = [], []
    layout = "down" if g.config.is_moe else "down_t"  # experts (and Gemma 4's FFN beside them) stay as llama.cpp's
    for info in g.tensors.values():
        shape = tuple(reversed(info.ne))
        dense.append(OutTensor(info.name, shape, Q(info.type), raw(info.name)))
        if layout == "down":
            power.append(OutTensor(info.name, shape, Q(info.type), raw(info.name)))
        elif re.fullmatch(r"blk\.\d+\.ffn_down\.weight", info.name):
            name = info.name.replace("ffn_down", "ffn_down_t")
            qtype = _down_t_type(Q(info.type), g.config.n_embd, name, notes, down_type)
            power.append(OutTensor(name, shape[::-1], qtype, down_t(info.name, qtype)))
        else:
            name = info.name.replace("ffn_down.", "ffn_down_t.")
            power.append(OutTensor(name, shape, Q(info.type), raw(info.name)))
    kv = copied + _pyinfer_kv(g.config.ffn_kind, layout)
    _check_plan(g.config.arch, kv, power, layout, path)
    outputs = [OutFile(out_path, g.config.arch, kv, power)]
    if dense_path is not None:
        outputs.append(OutFile(dense_path, g.config.arch, copied, dense))
    return outputs, notes


# ----------------------------------------------------------------------------
# command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Convert a HF checkpoint folder (LlamaForCausalLM, Qwen2ForCausalLM, "
        "OPTForCausalLM; safetensors) or a llama.cpp GGUF into a PowerGGUF (ffn_down stored transposed).",
        epilog='dReLU LLaMA models: set "hidden_act": "drelu" in config.json (relu on gate and up).')
    p.add_argument("input", help="HF model folder or .gguf file")
    p.add_argument("-o", "--outfile", help="output PowerGGUF path (default: next to the input)")
    p.add_argument("--outtype", choices=list(OUTTYPES), default=None,
                   help="weight type for HF input (default f16); norms and biases stay F32")
    p.add_argument("--down-type", choices=["auto", "same", "q8_0", "f16"], default="auto",
                   help="GGUF input only: type of the requantized ffn_down_t (default auto: the source type for "
                   "float and 8-bit sources, Q8_0 below 8 bits, which avoids a second 4-bit rounding)")
    p.add_argument("--dense-gguf", metavar="PATH",
                   help="also write a plain llama.cpp-loadable GGUF (ffn_down, no pyinfer keys) of the same weights")
    return p


def _default_out(inp: str, outtype: str) -> str:
    """<folder>/<name>-<type>-power.gguf for a folder, <stem>-power.gguf next to a GGUF."""
    inp = os.path.abspath(inp)
    if os.path.isdir(inp):
        return os.path.join(inp, f"{os.path.basename(inp)}-{outtype}-power.gguf")
    return os.path.splitext(inp)[0] + "-power.gguf"


def convert(inp: str, outfile: str | None = None, outtype: str | None = None,
            dense_gguf: str | None = None, down_type: str = "auto") -> list[str]:
    """Convert; returns notes for the user. Raises PyInferError/OSError with one-line messages."""
    if not os.path.exists(inp):
        raise ModelFormatError(f"{inp}: no such file or directory")
    is_gguf = os.path.isfile(inp)
    out = outfile or _default_out(inp, outtype or "f16")
    if is_gguf:
        outputs, notes = _plan_gguf(inp, out, dense_gguf, down_type)
        if outtype is not None:
            notes.insert(0, "--outtype is ignored for GGUF input: tensors keep their types")
    else:
        outputs, notes = _plan_hf(inp, OUTTYPES[outtype or "f16"], out, dense_gguf)
    for note in dict.fromkeys(notes):  # the dense plan repeats the PowerGGUF's notes
        print(f"{PROG}: note: {note}", file=sys.stderr)
    write_atomically(outputs)
    return [o.path for o in outputs]


def main(argv: list[str] | None = None) -> int:
    """Console entry point: 0 on success, 1 with one line on stderr on error, 130 on Ctrl-C."""
    return run_cli(PROG, _parser(), _convert, argv)


def _convert(args: argparse.Namespace) -> int:
    for path in convert(args.input, args.outfile, args.outtype, args.dense_gguf, args.down_type):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
