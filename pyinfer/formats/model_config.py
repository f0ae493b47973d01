"""Model hyperparameters read from GGUF metadata (llama.cpp keys plus `pyinfer.*` keys)."""
from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from pyinfer.errors import ModelFormatError, UnsupportedError
from pyinfer.formats import gguf_schema

SUPPORTED_ARCHS = ("falcon", "gemma3", "gemma4", "gpt-oss", "llama", "olmoe", "opt", "qwen2", "qwen3", "qwen35",
                   "qwen35moe", "qwen3moe")
FFN_KINDS = ("swiglu", "reglu", "drelu", "relu", "geglu", "gelu", "gelu_erf", "swiglu_oai")
UNGATED_KINDS = ("relu", "gelu", "gelu_erf")  # act(up), no gate: OPT, Falcon

# arch -> (norm kind, rope mode, default ffn kind, learned-position offset)
_ARCH_TRAITS: dict[str, tuple[str, str | None, str, int]] = {
    "llama": ("rms", "normal", "swiglu", 0),
    "qwen2": ("rms", "neox", "swiglu", 0),
    "qwen3": ("rms", "neox", "swiglu", 0),
    "qwen3moe": ("rms", "neox", "swiglu", 0),
    "qwen35": ("rms", "neox", "swiglu", 0),
    "qwen35moe": ("rms", "neox", "swiglu", 0),
    "olmoe": ("rms", "neox", "swiglu", 0),
    "gpt-oss": ("rms", "neox", "swiglu_oai", 0),
    "gemma3": ("rms", "neox", "geglu", 0),
    "gemma4": ("rms", "neox", "geglu", 0),
    "falcon": ("layer", "neox", "gelu", 0),
    # OPT's learned position table has 2 leading rows that no position uses
    "opt": ("layer", None, "relu", 2),
}


def default_ffn_kind(arch: str) -> str:
    """The FFN kind of `arch` when the file names none (llama.cpp's, whose files carry no activation key)."""
    return _ARCH_TRAITS[arch][2]


@dataclass(frozen=True)
class ModelConfig:
    """What a forward pass needs to know besides the weights.

    ffn_kind: swiglu = silu(gate)*up, reglu = relu(gate)*up, drelu = relu(gate)*relu(up),
    geglu = gelu_tanh(gate)*up, relu = relu(up), gelu = gelu_tanh(up) and gelu_erf = exact gelu(up) with no
    gate (OPT, Falcon; llama.cpp computes Falcon's GELU in the tanh form, transformers exactly); swiglu_oai =
    gpt-oss' experts: min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1).
    rope_scale: position scaling; positions are divided by it (1.0 = none); with yarn_ext_factor > 0 it is YaRN's
    factor (see rope_args).
    sliding_window: > 0: windowed layers see the last sliding_window positions only (Mistral, Gemma 3);
    swa_layers: which layers are windowed (Gemma 3: all but every 6th; empty: all). rope_base_swa,
    rope_scale_swa: the windowed layers' RoPE
    base and linear scaling (Gemma 3's local layers are never scaled: llama.cpp's rope_freq_scale_train_swa).
    attn_scale: the softmax scale of q.k; embed_scale: token embeddings are multiplied by it (Gemma).
    n_expert > 0: a mixture of experts (Mixtral as llama, qwen3moe, olmoe; Gemma 4's 26B-A4B beside its dense
    FFN): every layer routes a token to n_expert_used of n_expert FFNs of n_ff_exp neurons; expert_norm: the chosen
    experts' weights are the router's softmax over them (they add up to 1), else over all experts (OLMoE).
    qk_norm_whole: the q and k norms span the whole projection, not each head (OLMoE).
    attn_sinks: every head's softmax counts a learned logit beside its keys' (gpt-oss, blk.N.attn_sinks);
    expert_bias: the router and the experts' matrices have biases (gpt-oss).
    final_logit_softcap > 0: logits become c tanh(logits / c) (Gemma 3 and 4 files that say so).
    Gemma 4: head_dim is the global layers' head size, head_dim_swa and n_rot_swa the windowed layers';
    n_head_kv_layers and n_ff_layers hold llama.cpp's per-layer forms of head_count_kv and feed_forward_length
    (empty: the scalar for every layer); the last n_kv_shared layers compute no K and V but attend over the cache of
    the last earlier layer of their kind (kv_layer); v_from_k: the global layers' values are their keys' projection
    (no attn_v); n_embd_per_layer > 0: per-layer embeddings of that width feed every layer (E2B, E4B).
    """

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    norm_kind: str
    norm_eps: float
    rope_mode: str | None
    rope_base: float
    rope_scale: float
    n_rot: int
    ffn_kind: str
    tied_embeddings: bool
    qkv_bias: bool
    attn_out_bias: bool
    ffn_bias: bool
    pos_offset: int
    qk_norm: bool = False  # RMSNorm of each head's q and k (Qwen3, Gemma 3)
    post_norms: bool = False  # norms after attention and after the FFN too (Gemma 3)
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()
    rope_base_swa: float = 10000.0
    rope_scale_swa: float = 1.0
    attn_scale: float = 0.0  # 0: 1 / sqrt(head_dim)
    embed_scale: float = 1.0
    # YaRN (rope.scaling.type yarn): ext_factor > 0, the trained context, the ramp's betas, and attn_factor, the
    # total multiplier of cos and sin (llama.cpp's rope.scaling.yarn_attn_factor, transformers' attention_factor)
    yarn_ext_factor: float = 0.0
    yarn_orig_ctx: int = 0
    yarn_attn_factor: float = 1.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    expert_norm: bool = False
    qk_norm_whole: bool = False
    attn_sinks: bool = False
    expert_bias: bool = False
    final_logit_softcap: float = 0.0
    head_dim_swa: int = 0
    n_rot_swa: int = 0
    n_head_kv_layers: tuple[int, ...] = ()
    n_ff_layers: tuple[int, ...] = ()
    n_kv_shared: int = 0
    v_from_k: bool = False
    n_embd_per_layer: int = 0
    recurrent_layers: tuple[bool, ...] = ()
    ssm_conv_kernel: int = 0
    ssm_head_dim: int = 0
    ssm_n_k_heads: int = 0
    ssm_n_v_heads: int = 0
    n_ff_shexp: int = 0

    @property
    def ffn_norm_name(self) -> str:
        """The FFN input's norm (gpt-oss' files call it post_attention_norm)."""
        return "post_attention_norm" if self.arch in ("gpt-oss", "qwen35", "qwen35moe") else "ffn_norm"

    def recurrent(self, il: int) -> bool:
        """Whether layer il is linear attention (a recurrent state, no KV cache)."""
        return bool(self.recurrent_layers) and self.recurrent_layers[il]

    @property
    def ssm_conv_channels(self) -> int:
        """The convolved channels of a linear-attention layer: its queries, keys and values."""
        return (2 * self.ssm_n_k_heads + self.ssm_n_v_heads) * self.ssm_head_dim

    @property
    def ssm_state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """A linear-attention layer's two F32 states (numpy order): its convolution's last inputs (K-1, channels)
        and its delta rule's matrices (H_v, D, D)."""
        d = self.ssm_head_dim
        return (self.ssm_conv_kernel - 1, self.ssm_conv_channels), (self.ssm_n_v_heads, d, d)

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    def windowed(self, il: int) -> bool:
        """Whether layer il attends over the sliding window (else over the whole context)."""
        return self.sliding_window > 0 and (not self.swa_layers or self.swa_layers[il])

    def layer_window(self, il: int) -> int:
        return self.sliding_window if self.windowed(il) else 0

    def layer_head_dim(self, il: int) -> int:
        return self.head_dim_swa if self.head_dim_swa and self.windowed(il) else self.head_dim

    def layer_n_rot(self, il: int) -> int:
        return self.n_rot_swa if self.n_rot_swa and self.windowed(il) else self.n_rot

    def layer_n_head_kv(self, il: int) -> int:
        return self.n_head_kv_layers[il] if self.n_head_kv_layers else self.n_head_kv

    def layer_n_ff(self, il: int) -> int:
        return self.n_ff_layers[il] if self.n_ff_layers else self.n_ff

    @property
    def widest_ff(self) -> int:
        """The most FFN neurons of any layer (Gemma 4's shared-KV layers may have twice n_ff)."""
        return max(self.n_ff_layers) if self.n_ff_layers else self.n_ff

    def kv_layer(self, il: int) -> int:
        """The layer whose K and V layer il attends over: its own, or for the last n_kv_shared layers the last
        layer before them of the same kind (windowed or global), as transformers' Gemma 4 shares them."""
        first_shared = self.n_layer - self.n_kv_shared
        if il < first_shared:
            return il
        return max(j for j in range(first_shared) if self.windowed(j) == self.windowed(il))

    def layer_rope(self, il: int) -> tuple[float, float]:
        """Layer il's RoPE base and linear scale (positions are divided by it)."""
        return (self.rope_base_swa, self.rope_scale_swa) if self.windowed(il) else (self.rope_base, self.rope_scale)

    def rope_args(self, il: int) -> dict[str, Any]:
        """Layer il's rope op arguments: base, frequency scale and YaRN's (ggml.Context.rope's keywords)."""
        base, scale = self.layer_rope(il)
        args = {"freq_base": base, "freq_scale": 1.0 / scale}
        if self.yarn_ext_factor and scale == self.rope_scale:
            # ggml's YaRN multiplies attn_factor by 1 + 0.1 ln(factor); the file's attn_factor is the total
            args.update(n_ctx_orig=self.yarn_orig_ctx, ext_factor=self.yarn_ext_factor,
                        attn_factor=self.yarn_attn_factor / (1.0 + 0.1 * math.log(self.rope_scale)),
                        beta_fast=self.yarn_beta_fast, beta_slow=self.yarn_beta_slow)
        return args

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    @property
    def gated(self) -> bool:
        """True when the FFN has a gate projection (everything except OPT's and Falcon's)."""
        return self.ffn_kind not in UNGATED_KINDS

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any],
                      tensor_names: Collection[str] | None = None) -> ModelConfig:
        """Read the config; tensor_names (when given) decide tied embeddings and biases as llama.cpp does,
        and must hold exactly block_count layers."""
        arch = gguf_schema.architecture(meta)
        if arch not in _ARCH_TRAITS:
            raise UnsupportedError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        gguf_schema.check_metadata(meta)  # after: another architecture's keys follow rows pyinfer does not have
        norm_kind, rope_mode, default_ffn, pos_offset = _ARCH_TRAITS[arch]

        def key(name: str, default: Any = ...) -> Any:
            full = gguf_schema.arch_key(arch, name)
            if full in meta:
                return meta[full]
            if default is ...:
                raise ModelFormatError(f"GGUF metadata lacks required key {full}")
            return default

        n_blocks = key("block_count")
        if tensor_names is not None:  # before anything is sized from it
            gguf_schema.check_layer_names(n_blocks, tensor_names, f"{arch}.block_count")
        # llama.cpp's Qwen3.5 files may end with multi-token-prediction blocks, which a forward pass skips (as
        # llama.cpp's does)
        n_mtp = int(key("nextn_predict_layers", 0))
        if n_mtp >= n_blocks:
            raise UnsupportedError(f"{arch}.nextn_predict_layers {n_mtp} of {arch}.block_count {n_blocks}: a file of "
                                   "multi-token-prediction blocks alone has no model to run")
        if n_mtp and arch not in ("qwen35", "qwen35moe"):
            raise UnsupportedError(f"{arch}.nextn_predict_layers: multi-token-prediction blocks are not supported")
        n_layer = n_blocks - n_mtp
        n_embd = int(key("embedding_length"))
        n_head = int(key("attention.head_count"))
        if f"{arch}.attention.key_length" not in meta and n_embd % n_head:
            raise ModelFormatError(f"{arch}.embedding_length {n_embd} is not a multiple of {arch}.attention.head_count "
                                   f"{n_head} (and no {arch}.attention.key_length gives the head size)")
        head_dim = int(key("attention.key_length", n_embd // n_head))
        if int(key("attention.value_length", head_dim)) != head_dim:
            raise UnsupportedError(f"{arch}.attention.value_length differs from the key length {head_dim}")
        n_vocab = key("vocab_size", None)
        if n_vocab is None:
            tokens = meta.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise ModelFormatError(f"GGUF metadata lacks {arch}.vocab_size and tokenizer.ggml.tokens")
            n_vocab = len(tokens)
        eps_key = "attention.layer_norm_rms_epsilon" if norm_kind == "rms" else "attention.layer_norm_epsilon"
        scaling = key("rope.scaling.type", "none")
        if scaling not in ("none", "linear", "yarn"):
            raise UnsupportedError(f"unsupported rope scaling {scaling!r}; supported: none, linear, yarn")
        rope_scale = float(key("rope.scaling.factor", 1.0) or 1.0) if scaling != "none" else 1.0
        yarn = scaling == "yarn"
        if arch not in ("gemma3", "gemma4") and key("final_logit_softcapping", 0.0):
            raise UnsupportedError(f"{arch}.final_logit_softcapping is not supported")

        def per_layer(name: str, default: Any = ...) -> tuple[int, tuple[int, ...]]:
            """A key llama.cpp reads as one value or one per layer: (the first layer's, all of them or ())."""
            value = key(name, default)
            if value is None:
                return 0, ()
            if not isinstance(value, list):
                return int(value), ()
            if arch != "gemma4":
                raise UnsupportedError(f"{arch}.{name} with one value per layer is not supported")
            if len(value) != n_layer:
                raise ModelFormatError(f"{arch}.{name} has {len(value)} values for {n_layer} layers")
            return int(value[0]), tuple(int(v) for v in value)
        n_layer_27b = 62  # llama.cpp's Gemma 3 27B (by its layer count) scales q by 1/sqrt(n_embd / n_head)
        attn_scale = 1.0 / math.sqrt(n_embd / n_head) if arch == "gemma3" and n_layer == n_layer_27b else 0.0
        if arch == "gemma4":  # q and k are RMS-normed: llama.cpp's gemma4 scales q.k by 1, whatever the file says
            attn_scale = 1.0
        names = set(tensor_names) if tensor_names is not None else None

        def has(name: str, default: bool) -> bool:
            return default if names is None else name in names

        cfg = cls(
            arch=arch,
            n_vocab=int(n_vocab),
            n_ctx_train=int(key("context_length")),
            n_embd=n_embd,
            n_layer=n_layer,
            n_ff=per_layer("feed_forward_length", None)[0] or int(key("expert_feed_forward_length")),
            n_head=n_head,
            n_head_kv=per_layer("attention.head_count_kv", n_head)[0],
            head_dim=head_dim,
            norm_kind=norm_kind,
            norm_eps=float(key(eps_key)),
            rope_mode=rope_mode,
            rope_base=float(key("rope.freq_base", 10000.0)),
            rope_scale=rope_scale,
            n_rot=int(key("rope.dimension_count", head_dim)) if rope_mode else 0,
            ffn_kind=str(meta.get("pyinfer.ffn_kind", default_ffn)),
            tied_embeddings=not has("output.weight", arch != "opt"),
            qkv_bias=has("blk.0.attn_qkv.bias" if arch == "falcon" else "blk.0.attn_q.bias",
                         arch in ("qwen2", "opt", "gpt-oss")),
            attn_out_bias=has("blk.0.attn_output.bias", arch in ("opt", "gpt-oss")),
            ffn_bias=has("blk.0.ffn_up.bias", arch == "opt"),
            pos_offset=pos_offset,
            qk_norm=has("blk.0.attn_q_norm.weight", arch in ("qwen3", "gemma3", "gemma4", "qwen3moe", "olmoe")),
            post_norms=arch in ("gemma3", "gemma4"),
            sliding_window=int(key("attention.sliding_window", 0)),
            swa_layers=_swa_layers(key("attention.sliding_window_pattern", SWA_PATTERNS.get(arch, 0)), n_layer,
                                   f"{arch}.attention.sliding_window_pattern"),
            # llama.cpp's Gemma 3 files carry no local base: it is 10000 there
            rope_base_swa=float(key("rope.freq_base_swa", 10000.0 if arch in ("gemma3", "gemma4") else
                                    key("rope.freq_base", 10000.0))),
            rope_scale_swa=1.0 if arch in ("gemma3", "gemma4") else rope_scale,
            attn_scale=float(key("attention.scale", attn_scale)),
            embed_scale=math.sqrt(n_embd) if arch in ("gemma3", "gemma4") else 1.0,
            yarn_ext_factor=float(key("rope.scaling.yarn_ext_factor", 1.0)) if yarn else 0.0,
            yarn_orig_ctx=int(key("rope.scaling.original_context_length", key("context_length"))) if yarn else 0,
            # transformers' default: 1 + 0.1 ln(factor) (1 for factors <= 1)
            yarn_attn_factor=float(key("rope.scaling.yarn_attn_factor", 1.0 + 0.1 * math.log(max(rope_scale, 1.0)))),
            yarn_beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0)),
            yarn_beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0)),
            attn_sinks=has("blk.0.attn_sinks.weight", arch == "gpt-oss"),
            expert_bias=has("blk.0.ffn_gate_exps.bias", arch == "gpt-oss"),
            final_logit_softcap=float(key("final_logit_softcapping", 0.0)),
            **_experts(key, arch),
            **(_gemma4(key, per_layer, n_layer, names) if arch == "gemma4" else {}),
            **(_qwen35(key, n_layer, n_blocks, arch) if arch in ("qwen35", "qwen35moe") else {}),
        )
        cfg._check()
        return cfg

    def _check(self) -> None:
        """Reject values no forward pass can run with, naming the first bad one."""
        sizes = ("n_vocab", "n_ctx_train", "n_embd", "n_layer", "n_ff", "n_head", "n_head_kv", "head_dim")
        for name in sizes:
            if getattr(self, name) <= 0:
                raise ModelFormatError(f"bad model size {name} = {getattr(self, name)}")
        if self.n_head % self.n_head_kv:
            raise ModelFormatError(f"head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}")
        if self.rope_mode and (self.n_rot % 2 or not 0 < self.n_rot <= self.head_dim):
            raise ModelFormatError(f"bad rope.dimension_count {self.n_rot} for head size {self.head_dim}")
        if self.head_dim_swa and (self.n_rot_swa % 2 or not 0 < self.n_rot_swa <= self.head_dim_swa):
            raise ModelFormatError(f"bad rope.dimension_count_swa {self.n_rot_swa} for head size {self.head_dim_swa}")
        for n_kv in self.n_head_kv_layers:
            if not 0 < n_kv <= self.n_head or self.n_head % n_kv:
                raise ModelFormatError(f"head_count {self.n_head} is not a multiple of a layer's head_count_kv {n_kv}")
        if any(n_ff <= 0 for n_ff in self.n_ff_layers):
            raise ModelFormatError(f"bad feed_forward_length {list(self.n_ff_layers)}")
        first_shared = self.n_layer - self.n_kv_shared
        for kind in {self.windowed(il) for il in range(first_shared, self.n_layer)}:
            if not any(self.windowed(il) == kind for il in range(first_shared)):
                raise ModelFormatError(f"the shared KV layers include {'windowed' if kind else 'global'} ones, but no "
                                       "earlier layer of that kind computes a KV cache for them")
        if self.yarn_ext_factor and self.rope_scale < 1.0:
            raise ModelFormatError(f"bad YaRN rope.scaling.factor {self.rope_scale:g} (below 1)")
        if self.ffn_kind not in FFN_KINDS:
            raise UnsupportedError(f"unsupported pyinfer.ffn_kind {self.ffn_kind!r}; supported: {', '.join(FFN_KINDS)}")
        if (self.ffn_kind in UNGATED_KINDS) != (self.arch in ("opt", "falcon")) or (
                self.arch == "opt" and self.ffn_kind != "relu"):
            raise UnsupportedError(f"ffn kind {self.ffn_kind!r} does not fit architecture {self.arch}")
        if self.norm_eps <= 0:
            raise ModelFormatError(f"bad norm epsilon {self.norm_eps}")
        if self.recurrent_layers and self.ssm_n_v_heads % self.ssm_n_k_heads:
            raise ModelFormatError(f"{self.arch}.ssm.time_step_rank {self.ssm_n_v_heads} (value heads) is not a "
                                   f"multiple of {self.arch}.ssm.group_count {self.ssm_n_k_heads} (key heads)")
        if self.arch in MOE_ARCHS and not self.is_moe:
            raise ModelFormatError(f"{self.arch}.expert_count is missing: {self.arch} is a mixture of experts")
        if self.is_moe and not 0 < self.n_expert_used <= self.n_expert:
            raise ModelFormatError(f"{self.arch}.expert_used_count {self.n_expert_used} is not in [1, "
                                   f"{self.arch}.expert_count {self.n_expert}]")
        if self.is_moe and self.ffn_kind not in ("swiglu", "swiglu_oai", "geglu"):
            raise UnsupportedError(f"experts with ffn kind {self.ffn_kind!r} are not supported (only swiglu, geglu)")
        if (self.ffn_kind == "swiglu_oai") != (self.arch == "gpt-oss"):
            raise UnsupportedError(f"ffn kind {self.ffn_kind!r} does not fit architecture {self.arch}")


# always mixtures; llama is one when its file has experts (Mixtral)
MOE_ARCHS = ("qwen3moe", "olmoe", "gpt-oss", "qwen35moe")
SWA_PATTERNS = {"gemma3": 6, "gpt-oss": 2}  # llama.cpp's sliding-window patterns for files without the key


def _experts(key, arch: str) -> dict[str, Any]:
    """The mixture-of-experts fields from {arch}.expert_* (none for a dense model). llama.cpp normalises the
    chosen experts' weights for llama (Mixtral) and qwen3moe, not for olmoe; expert_weights_norm overrides."""
    n_expert = int(key("expert_count", 0))
    if not n_expert:
        return {}
    if key("expert_gating_func", 1) != 1:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise UnsupportedError(f"{arch}.expert_gating_func {key('expert_gating_func')} is not supported (only 1, "
                               "softmax)")
    if key("expert_weights_scale", 0.0) not in (0.0, 1.0):
        raise UnsupportedError(f"{arch}.expert_weights_scale {key('expert_weights_scale')} is not supported")
    if key("expert_shared_count", 0) > (1 if arch == "qwen35moe" else 0):  # Qwen3.5-MoE's one, gated
        raise UnsupportedError(f"{arch}.expert_shared_count {key('expert_shared_count')}: shared experts are not "
                               "supported" + (" (but Qwen3.5-MoE's one)" if arch == "qwen35moe" else ""))
    return {"n_expert": n_expert, "n_expert_used": int(key("expert_used_count", 0)),
            "n_ff_exp": int(key("expert_feed_forward_length", key("feed_forward_length"))),
            # gpt-oss: the softmax of the k chosen logits (llama.cpp's SOFTMAX_WEIGHT), which is normalising; Gemma
            # 4's router normalises its top k whatever the file says (llama.cpp's gemma4)
            "expert_norm": arch in ("gpt-oss", "gemma4") or bool(key("expert_weights_norm", arch != "olmoe")),
            "qk_norm_whole": arch == "olmoe"}


def _gemma4(key, per_layer, n_layer: int, names: set[str] | None) -> dict[str, Any]:
    """Gemma 4's fields, read as llama.cpp's gemma4 reads them: the windowed layers' head size and rotated
    dimensions, the per-layer forms of the KV heads and FFN widths, the shared KV layers, the per-layer
    embeddings' width."""
    shared = int(key("attention.shared_kv_layers", 0))
    if not 0 <= shared < n_layer:
        raise ModelFormatError(f"gemma4.attention.shared_kv_layers {shared} is not below the {n_layer} layers")
    head_swa = int(key("attention.key_length_swa", key("attention.key_length")))
    if int(key("attention.value_length_swa", head_swa)) != head_swa:
        raise UnsupportedError("gemma4.attention.value_length_swa differs from the key length")
    pattern = _swa_layers(key("attention.sliding_window_pattern"), n_layer, "gemma4.attention.sliding_window_pattern")
    # the global layers without attn_v take their values from the keys' projection (attention_k_eq_v)
    global_layers = [il for il in range(n_layer - shared) if not pattern[il]]
    v_from_k = names is not None and any(f"blk.{il}.attn_v.weight" not in names for il in global_layers)
    return {"head_dim_swa": head_swa, "n_rot_swa": int(key("rope.dimension_count_swa", head_swa)),
            "n_head_kv_layers": per_layer("attention.head_count_kv")[1],
            "n_ff_layers": per_layer("feed_forward_length")[1], "n_kv_shared": shared, "v_from_k": v_from_k,
            "n_embd_per_layer": int(key("embedding_length_per_layer_input", 0))}


def _qwen35(key, n_layer: int, n_blocks: int, arch: str) -> dict[str, Any]:
    """Qwen3.5's linear-attention fields, read as llama.cpp's qwen35 and qwen35moe read them: the recurrent layers
    from attention.recurrent_layers (a flag per block, the multi-token-prediction ones included) or, without it, all
    but every full_attention_interval-th; the ssm.* sizes; the mixture's shared expert (its width
    feed_forward_length where the file does not say)."""
    flags = key("attention.recurrent_layers", None)
    if flags is None:
        every = int(key("full_attention_interval", 4))
        flags = [(il + 1) % every != 0 for il in range(n_layer)]
    elif len(flags) != n_blocks:
        raise ModelFormatError(f"{arch}.attention.recurrent_layers has {len(flags)} flags for {n_blocks} blocks")
    flags = flags[:n_layer]
    head, n_v = int(key("ssm.state_size")), int(key("ssm.time_step_rank"))
    if int(key("ssm.inner_size")) != head * n_v:
        raise ModelFormatError(f"{arch}.ssm.inner_size {key('ssm.inner_size')} is not ssm.state_size {head} times "
                               f"ssm.time_step_rank {n_v}")
    shared = int(key("expert_shared_feed_forward_length", key("feed_forward_length", 0))) if arch == "qwen35moe" else 0
    return {"recurrent_layers": tuple(bool(f) for f in flags), "ssm_conv_kernel": int(key("ssm.conv_kernel")),
            "ssm_head_dim": head, "ssm_n_k_heads": int(key("ssm.group_count")), "ssm_n_v_heads": n_v,
            "n_ff_shexp": shared}


def _swa_layers(pattern: int | list[bool], n_layer: int, name: str) -> tuple[bool, ...]:
    """Which layers are windowed, from llama.cpp's two forms of the key: every n-th layer global (as its
    set_swa_pattern: layer il windowed where il % n < n - 1; 0: all windowed), or one flag per layer."""
    if isinstance(pattern, list):
        if len(pattern) != n_layer:
            raise ModelFormatError(f"{name} has {len(pattern)} flags for {n_layer} layers")
        return tuple(pattern)
    return tuple(not pattern or il % pattern < pattern - 1 for il in range(n_layer))
