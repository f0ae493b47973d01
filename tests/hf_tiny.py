"""Tiny random HF checkpoints (with a tiny trained BPE tokenizer) and their float64 transformers oracles."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from unittest import mock

import numpy as np
import torch

N_VOCAB = 300  # embedding rows; the tokenizer has fewer tokens, the rest become [PAD] entries
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Sphinx of black quartz, judge my vow!",
    "A tiny model with a tiny vocabulary: 12345 67890.",
    "Pack my box with five dozen liquor jugs; how vexingly quick daft zebras jump.",
] * 4

# variant -> (architecture, extra config); "drelu" is our config.json convention (see the converter)
VARIANTS = {
    "llama_silu": ("llama", {"hidden_act": "silu"}),
    "llama_relu": ("llama", {"hidden_act": "relu"}),
    "llama_drelu": ("llama", {"hidden_act": "drelu"}),
    "llama_geglu": ("llama", {"hidden_act": "gelu_pytorch_tanh"}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {"sliding_window": 8}),
    # Llama 3.1's long-context RoPE, shrunk: frequencies with wavelengths past 16 / 1 positions divided by 8
    "llama3_rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    # YaRN: trained on 1024 positions, extended 4x; pairs 0-1 keep their angles, 5-7 are interpolated, 2-4 blend
    "llama_yarn": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 1024}}),
    # layers 1 and 2 see the last 8 positions, layer 0 all (no every-n-th pattern: one flag per layer in the
    # file); a softmax scale other than 1/sqrt(head_dim); linear RoPE scaling (as Gemma 3 4B+ have) on the
    # global layer only
    "gemma3": ("gemma3", {"sliding_window": 8, "query_pre_attn_scalar": 24,
                          "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
                          "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "opt": ("opt", {}),
    # mixtures of experts: 4 experts, 2 a token, one routing the way each family does it
    "qwen3moe": ("qwen3moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                              "norm_topk_prob": True}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "olmoe": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False}),
    "qwen3moe_top1": ("qwen3moe", {"num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 48,
                                   "norm_topk_prob": True}),  # one expert a token: its weight is 1
    # gpt-oss: attention sinks and biases, every other layer windowed (8 positions), YaRN (trained on 16, 4x),
    # the router's bias and softmax over its top 2, experts with biases and the clamped SwiGLU
    "gpt_oss": ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                            "layer_types": ["sliding_attention", "full_attention"],
                            "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                "original_max_position_embeddings": 16, "beta_fast": 32.0,
                                                "beta_slow": 1.0, "truncate": True}}),
    # Falcon-7B's layout (multi-query, one LayerNorm, exact GELU) and Falcon-40B's (grouped KV, two, GELU's tanh
    # form); ReLU-Falcon
    "falcon_7b": ("falcon", {"multi_query": True, "new_decoder_architecture": False, "activation": "gelu"}),
    "falcon_40b": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2, "activation": "gelu_pytorch_tanh"}),
    "falcon_relu": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2, "activation": "relu"}),
}
# Gemma 4's text model (tests/test_gemma4.py; not in VARIANTS, whose suites also split, sparsify and offload, which
# Gemma 4 has not been tried with): 5 layers, windowed ones of head size 16 and global ones (1 and 4) of 32 with
# one KV head, proportional RoPE on a quarter of their heads, a window of 8 positions
_GEMMA4_LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
_GEMMA4 = {"layer_types": _GEMMA4_LAYERS, "rope_parameters": _GEMMA4_ROPE, "sliding_window": 8,
           "global_head_dim": 32, "num_global_key_value_heads": 1}
GEMMA4_VARIANTS = {
    "gemma4": ("gemma4", _GEMMA4),  # no per-layer embeddings, no shared KV, no softcap, untied output
    # E2B's features: per-layer embeddings, the last two layers (windowed, global) attend over layer 1's and 2's KV
    # (the last unshared layers: global, the one before windowed, as in E2B and as llama.cpp assumes) with a
    # double-wide FFN, the final softcap
    "gemma4_ple": ("gemma4", {**_GEMMA4, "hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2,
                              "use_double_wide_mlp": True, "final_logit_softcapping": 3.0,
                              "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                                              "sliding_attention", "full_attention"]}),
    # the 31B's: global layers whose values are their keys' projection, whole heads rotated by the default RoPE
    "gemma4_k_eq_v": ("gemma4", {**_GEMMA4, "attention_k_eq_v": True, "final_logit_softcapping": 30.0,
                                 "rope_parameters": {**_GEMMA4_ROPE,
                                                     "full_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    # the 26B-A4B's: every layer's dense FFN beside 4 experts of 48 neurons, 2 a token (the loop over experts: the
    # grouped GEMM takes no float64)
    "gemma4_moe": ("gemma4", {**_GEMMA4, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                              "moe_intermediate_size": 48, "experts_implementation": "eager",
                              "hidden_size_per_layer_input": 0}),
    # the mixture as its repositories hold it: the text model of a Gemma4ForConditionalGeneration (a vision tower
    # beside it, which the converter leaves)
    "gemma4_mm": ("gemma4_mm", {**_GEMMA4, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                                "moe_intermediate_size": 48, "experts_implementation": "eager",
                                "hidden_size_per_layer_input": 0}),
}
# Qwen3.5's text model (tests/test_qwen35.py): layers 0-2 and 4 linear attention (a gated delta net: 2 key heads,
# 4 value heads, so that the value heads' order matters), layer 3 full attention with its output gate, RoPE on a
# quarter of each head
QWEN35_VARIANTS = {
    "qwen35": ("qwen3_5", {"layer_types": ["linear_attention"] * 3 + ["full_attention", "linear_attention"]}),
    # the mixture: 4 experts, 2 a token, and the shared expert every token takes, gated
    "qwen35moe": ("qwen3_5_moe", {"layer_types": ["linear_attention"] * 3 + ["full_attention", "linear_attention"],
                                  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                  "shared_expert_intermediate_size": 64}),
    # the dense model as its repositories hold it: the text model of a Qwen3_5ForConditionalGeneration (a vision
    # tower beside it, which the converter leaves)
    "qwen35_mm": ("qwen3_5_mm", {"layer_types": ["linear_attention"] * 3 + ["full_attention", "linear_attention"]}),
}
# mixtures of experts: no neurons to reorder or predict
MOE_VARIANTS = ("qwen3moe", "mixtral", "olmoe", "qwen3moe_top1", "gpt_oss")
DENSE_VARIANTS = tuple(v for v in VARIANTS if v not in MOE_VARIANTS)


@dataclass
class TinyModel:
    """A saved checkpoint folder and the in-memory float64 model that is its oracle."""

    folder: str
    model: torch.nn.Module

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Oracle logits (n_tokens, n_vocab), all in float64 (transformers upcasts softmax to float32 only)."""
        softmax = torch.nn.functional.softmax

        def softmax_f64(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None, **_: object):
            return softmax(x, dim=dim)

        with torch.no_grad(), mock.patch.object(torch.nn.functional, "softmax", softmax_f64):
            return self.model(torch.tensor([tokens])).logits[0].numpy()

    def assert_greedy(self, prompt: list[int], tokens: list[int], label: str) -> None:
        """tokens, greedily decoded after prompt, are the argmax of these logits recomputed from scratch each step;
        a difference is allowed only where the top two logits tie within float32 rounding (then the rest may
        differ too)."""
        seq = list(prompt)
        for step, token in enumerate(tokens):
            logits = self.logits(seq)[-1]
            if token != int(np.argmax(logits)):
                top2 = np.sort(logits)[-2:]
                assert top2[1] - top2[0] < 1e-4 * np.abs(logits).max(), (label, step)
                return
            seq.append(token)


def save_tokenizer(folder: str) -> None:
    """Train a ~280-token byte-level BPE and save it with transformers (tokenizer.json, config, template)."""
    from transformers import PreTrainedTokenizerFast

    from tools.fuzz.seeds import train_bpe

    fast = PreTrainedTokenizerFast(tokenizer_object=train_bpe(TEXT, SPECIALS), bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(folder)


def _config(arch: str, extra: dict):
    import transformers as T

    if arch == "opt":
        return T.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                           vocab_size=N_VOCAB, max_position_embeddings=64, word_embed_proj_dim=64,
                           attn_implementation="eager", **extra)
    if arch == "falcon":
        return T.FalconConfig(hidden_size=64, ffn_hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                              vocab_size=N_VOCAB, max_position_embeddings=4096, bias=False, alibi=False,
                              parallel_attn=True, attn_implementation="eager", **extra)
    if arch == "gpt_oss":
        return T.GptOssConfig(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=N_VOCAB, max_position_embeddings=64,
                              rms_norm_eps=1e-5, attn_implementation="eager", experts_implementation="eager",
                              **extra)
    if arch == "gemma4":
        return T.Gemma4TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, vocab_size=N_VOCAB,
                                  vocab_size_per_layer_input=N_VOCAB, max_position_embeddings=4096,
                                  rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="eager", **extra)
    if arch == "gemma4_mm":
        vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4}
        return T.Gemma4Config(text_config=_config("gemma4", extra).to_dict(), vision_config=vision,
                              tie_word_embeddings=False, attn_implementation="eager", experts_implementation="eager")
    if arch == "qwen3_5_mm":
        vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                  "patch_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16}
        return T.Qwen3_5Config(text_config=_config("qwen3_5", extra).to_dict(), vision_config=vision,
                               tie_word_embeddings=False)
    if arch in ("qwen3_5", "qwen3_5_moe"):
        sizes = ({"intermediate_size": 128} if arch == "qwen3_5" else {"experts_implementation": "eager"})
        return (T.Qwen3_5TextConfig if arch == "qwen3_5" else T.Qwen3_5MoeTextConfig)(
            hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=N_VOCAB, max_position_embeddings=4096, linear_conv_kernel_dim=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, rms_norm_eps=1e-6,
            tie_word_embeddings=False, attn_implementation="eager", **sizes, **extra)
    if arch == "gemma3":
        return T.Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, vocab_size=N_VOCAB, max_position_embeddings=4096,
                                  rms_norm_eps=1e-6, attn_implementation="eager", **extra)
    cls = {"llama": T.LlamaConfig, "qwen2": T.Qwen2Config, "qwen3": T.Qwen3Config, "mistral": T.MistralConfig,
           "qwen3moe": T.Qwen3MoeConfig, "mixtral": T.MixtralConfig, "olmoe": T.OlmoeConfig}[arch]
    extra = dict(extra)
    act = extra.pop("hidden_act", "silu")
    if "num_experts_per_tok" in extra:  # the loop over experts: the grouped GEMM takes no float64
        extra["experts_implementation"] = "eager"
    return cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=N_VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5,
               hidden_act="relu" if act == "drelu" else act, attn_implementation="eager", **extra)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norm scales near 1), so any misplaced weight changes the logits; Gemma 4's layer
    scalars (buffers, saved with the weights) too."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            is_norm = "norm" in name or "layer_norm" in name
            scale = 0.3 if p.ndim == 1 else 0.15
            p.copy_(1.0 + 0.1 * noise if is_norm and name.endswith("weight") else scale * noise)
        for name, buf in model.named_buffers():
            if name.endswith("layer_scalar"):
                buf.copy_(1.0 + 0.3 * torch.randn(buf.shape, generator=gen, dtype=torch.float32))


def _patch_drelu(model: torch.nn.Module) -> None:
    """transformers has no dReLU: make every MLP compute down(relu(gate(x)) * relu(up(x)))."""
    for layer in model.model.layers:
        mlp = layer.mlp
        mlp.forward = (lambda m: lambda x: m.down_proj(torch.relu(m.gate_proj(x)) * torch.relu(m.up_proj(x))))(mlp)


def _rmsnorm_f64(model: torch.nn.Module) -> None:
    """Keep RMSNorm in float64 (transformers upcasts to float32 only); Gemma 3's and Qwen3.5's scale by 1 + weight,
    Gemma 4's by its weight or (its value norm) by nothing; Qwen3.5's gated norm by its weight and silu(gate)."""
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNormGated"):
            module.forward = (lambda m: lambda x, gate: m.weight * x * torch.rsqrt(
                x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon) * torch.nn.functional.silu(gate))(module)
        if name.endswith("RMSNorm"):
            eps = getattr(module, "variance_epsilon", None) or module.eps
            offset = 1.0 if (name.startswith("Gemma") and not name.startswith("Gemma4")) or name.startswith(
                "Qwen3_5") else 0.0
            scaled = getattr(module, "with_scale", True)
            module.forward = (lambda m, e, o, w: lambda x: ((m.weight + o) if w else 1.0) * x * torch.rsqrt(
                x.pow(2).mean(-1, keepdim=True) + e))(module, eps, offset, scaled)


def _rotary_f64(model: torch.nn.Module) -> None:
    """Compute HF's rope angles in float64 (transformers computes them in float32)."""
    base = getattr(model, "model", None) or model.transformer
    base = getattr(base, "language_model", base)  # a multimodal model's text model
    rot = getattr(base, "rotary_emb", None)
    if rot is None:
        return
    cfg = getattr(model.config, "text_config", None) or model.config
    # Gemma 4's kinds of layer differ in head size (inv_freq takes each kind's)
    gemma4 = cfg.model_type == "gemma4_text"
    head_dim = None if gemma4 else getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def inv_freq(params: dict, layer_type: str | None) -> torch.Tensor:
        kind = params.get("rope_type", "default")
        if kind not in ("default", "linear", "proportional"):  # scaled (Llama 3): transformers' own, float32-rounded
            return rot.inv_freq.double()
        hd = 2 * len(getattr(rot, f"{layer_type}_inv_freq")) if gemma4 else head_dim
        rotated = int(params.get("partial_rotary_factor", 1.0) * hd // 2)  # proportional: the first pairs only
        freq = torch.zeros(hd // 2, dtype=torch.float64)  # (hd/2,)
        freq[:rotated] = params["rope_theta"] ** (-torch.arange(0, 2 * rotated, 2, dtype=torch.float64) / hd)
        return freq / params.get("factor", 1.0) if kind != "default" else freq

    def forward(x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        params = cfg.rope_parameters[layer_type] if layer_type else cfg.rope_parameters  # Gemma 3: per kind
        if cfg.model_type.startswith("qwen3_5"):  # its sections see one text position; cos, sin of the rotated part
            rotated = int(params["partial_rotary_factor"] * head_dim)
            inv = params["rope_theta"] ** (-torch.arange(0, rotated, 2, dtype=torch.float64) / rotated)
            positions = position_ids[0] if position_ids.ndim == 3 else position_ids
            emb = torch.cat([positions[..., None].double() * inv] * 2, dim=-1)  # (batch, T, rotated)
            return emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        freqs = position_ids[..., None].double() * inv_freq(params, layer_type)  # (batch, T, head_dim/2)
        # (batch, T, head_dim): both halves' angles (gpt-oss rotates by the halves' one set)
        emb = freqs if cfg.model_type == "gpt_oss" else torch.cat((freqs, freqs), dim=-1)
        # YaRN's cos/sin multiplier (1 for the others); Gemma 3 keeps one per kind of layer
        scale = getattr(rot, f"{layer_type}_attention_scaling" if layer_type else "attention_scaling")
        return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)

    rot.forward = forward


def build(variant: str, folder: str, seed: int = 0, dtype: torch.dtype = torch.float32,
          max_shard_size: str | None = None) -> TinyModel:
    """Create, randomize and save a tiny checkpoint of `variant` into `folder` (weights stored as `dtype`)."""
    import transformers as T

    arch, extra = {**VARIANTS, **GEMMA4_VARIANTS, **QWEN35_VARIANTS}[variant]
    cfg = _config(arch, extra)
    cls = {"llama": T.LlamaForCausalLM, "qwen2": T.Qwen2ForCausalLM, "qwen3": T.Qwen3ForCausalLM,
           "mistral": T.MistralForCausalLM, "qwen3moe": T.Qwen3MoeForCausalLM, "mixtral": T.MixtralForCausalLM,
           "olmoe": T.OlmoeForCausalLM, "gpt_oss": T.GptOssForCausalLM,
           "gemma3": T.Gemma3ForCausalLM, "gemma4": T.Gemma4ForCausalLM, "falcon": T.FalconForCausalLM,
           "qwen3_5": T.Qwen3_5ForCausalLM, "qwen3_5_moe": T.Qwen3_5MoeForCausalLM,
           "qwen3_5_mm": T.Qwen3_5ForConditionalGeneration, "gemma4_mm": T.Gemma4ForConditionalGeneration,
           "opt": T.OPTForCausalLM}[arch]
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    _randomize(model, seed)
    model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    save_tokenizer(folder)
    if extra.get("hidden_act") == "drelu":
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            config = json.load(f)
        config["hidden_act"] = "drelu"
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
        _patch_drelu(model)
    _rotary_f64(model)
    _rmsnorm_f64(model)
    return TinyModel(folder, model.double())


def roundtrip_weights(tiny: TinyModel, qtype) -> TinyModel:
    """The oracle with every 2-D weight passed through `qtype` along its ggml rows, as the converter stores it.

    Rows are the input axis for projections and embeddings; the down projection is stored transposed
    (ffn_down_t), so its rows are the output axis. Learned positions and 1-D tensors stay exact.
    """
    from gguf.quants import dequantize, quantize

    def rt(w: np.ndarray) -> np.ndarray:
        return dequantize(quantize(w.astype(np.float32), qtype), qtype).astype(np.float64)

    with torch.no_grad():
        for name, p in tiny.model.named_parameters():
            if p.ndim != 2 or "embed_positions" in name:
                continue
            w = p.detach().numpy()
            down = "down_proj" in name or "fc2" in name
            p.copy_(torch.from_numpy(rt(w.T).T if down else rt(w)))
    return tiny
