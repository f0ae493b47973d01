"""One graph builder per architecture; `builder_for(arch)` picks it."""

from __future__ import annotations

from pyinfer.errors import UnsupportedError

from . import llama, opt

BUILDERS = {"llama": llama.build, "qwen2": llama.build, "opt": opt.build}


def builder_for(arch: str):
    try:
        return BUILDERS[arch]
    except KeyError:
        raise UnsupportedError(
            f"unsupported architecture {arch!r}; supported: {', '.join(sorted(BUILDERS))}"
        ) from None
