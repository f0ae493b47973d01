"""One graph builder per architecture; `builder_for(arch)` picks it."""

from __future__ import annotations

from pyinfer.errors import UnsupportedError

from . import falcon, gemma3, gemma4, llama, opt, qwen35

BUILDERS = {"falcon": falcon.build, "gemma3": gemma3.build, "gemma4": gemma4.build, "gpt-oss": llama.build,
            "llama": llama.build,
            "olmoe": llama.build,
            "opt": opt.build, "qwen2": llama.build, "qwen3": llama.build, "qwen35": qwen35.build,
            "qwen35moe": qwen35.build, "qwen3moe": llama.build}


def reads_fused_qkv(cfg) -> bool:
    """Whether cfg's graph reads a layer's q, k and v from one `attn_qkv` matrix where offload fused them, per-head q
    and k norms included (models.common.attention_block; not OLMoE's norms over the whole projection, and not Gemma 4
    or Qwen3.5, whose builders read their own)."""
    return BUILDERS.get(cfg.arch) in (falcon.build, gemma3.build, llama.build, opt.build) and not cfg.qk_norm_whole


def builder_for(arch: str):
    try:
        return BUILDERS[arch]
    except KeyError:
        raise UnsupportedError(
            f"unsupported architecture {arch!r}; supported: {', '.join(sorted(BUILDERS))}"
        ) from None
