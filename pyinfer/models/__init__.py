"""One graph builder per architecture; `builder_for(arch)` picks it."""

from __future__ import annotations

from pyinfer.errors import UnsupportedError

from . import falcon, gemma3, gemma4, llama, opt, qwen35

BUILDERS = {"falcon": falcon.build, "gemma3": gemma3.build, "gemma4": gemma4.build, "gpt-oss": llama.build,
            "llama": llama.build,
            "olmoe": llama.build,
            "opt": opt.build, "qwen2": llama.build, "qwen3": llama.build, "qwen35": qwen35.build,
            "qwen35moe": qwen35.build, "qwen3moe": llama.build}


def builder_for(arch: str):
    try:
        return BUILDERS[arch]
    except KeyError:
        raise UnsupportedError(
            f"unsupported architecture {arch!r}; supported: {', '.join(sorted(BUILDERS))}"
        ) from None
