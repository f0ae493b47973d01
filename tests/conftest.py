"""Test-wide settings: hypothesis profiles ("ci": derandomized and bounded; "dev": longer, random),
chosen by HYPOTHESIS_PROFILE, defaulting to "ci" so a plain `pytest` is reproducible; tiny model files
that several test files share."""

import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from pyinfer.engine import machine, threads

settings.register_profile(
    "ci", max_examples=25, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def tiny_files(tmp_path_factory):
    """(variant, sparse) -> an F32 PowerGGUF of a tiny checkpoint (tests/hf_tiny.py), with synthetic predictors
    (30 % density, rank 16) when sparse; made once per session."""
    from hf_tiny import build

    import pyinfer.converters.convert_hf_to_powergguf as conv
    from pyinfer.sparsity.synthetic_predictors import add_predictors

    cache = {}

    def get(variant: str, sparse: bool) -> str:
        if (variant, False) not in cache:
            folder = tmp_path_factory.mktemp(variant)
            build(variant, str(folder / "hf"))
            cache[(variant, False)] = str(folder / "m.gguf")
            assert conv.main([str(folder / "hf"), "-o", cache[(variant, False)], "--outtype", "f32"]) == 0
        if sparse and (variant, True) not in cache:  # (a mixture of experts has no neurons to predict)
            cache[(variant, True)] = cache[(variant, False)].replace("m.gguf", "sparse.gguf")
            add_predictors(cache[(variant, False)], cache[(variant, True)], density=0.3, rank=16, n_calib=64)
        return cache[(variant, sparse)]

    return get


@pytest.fixture
def host_only(monkeypatch):
    """'Moving to the GPU' keeps tensors where they are: the split graphs run on the CPU."""
    from pyinfer.engine import offload
    from pyinfer.native import ggml

    monkeypatch.setattr(offload, "_require_gpu", lambda what: None)
    monkeypatch.setattr(ggml.Tensor, "to_device", lambda self: self)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(variant, outtype) -> (TinyModel oracle, converted PowerGGUF path, the llama.cpp-layout dense GGUF path or
    None (OPT has none)) of a tiny checkpoint (tests/hf_tiny.py VARIANTS, GEMMA4_VARIANTS or QWEN35_VARIANTS), made
    once a session."""
    from hf_tiny import GEMMA4_VARIANTS, QWEN35_VARIANTS, VARIANTS, build

    import pyinfer.converters.convert_hf_to_powergguf as conv

    cache = {}

    def get(variant: str, outtype: str = "f32"):
        if (variant, outtype) not in cache:
            folder = tmp_path_factory.mktemp(f"{variant}-{outtype}")
            oracle = build(variant, str(folder / "hf"))
            power, dense = str(folder / "m.gguf"), str(folder / "dense.gguf")
            with_dense = {**VARIANTS, **GEMMA4_VARIANTS, **QWEN35_VARIANTS}[variant][0] != "opt"
            args = [oracle.folder, "-o", power, "--outtype", outtype] + (["--dense-gguf", dense] if with_dense else [])
            assert conv.main(args) == 0
            cache[(variant, outtype)] = (oracle, power, dense if with_dense else None)
        return cache[(variant, outtype)]

    return get


def _cpu_times() -> list[int]:
    """The first line of /proc/stat: jiffies in user, nice, system, idle, iowait, irq, softirq, steal, ..."""
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return []


_SESSION_START = (time.monotonic(), _cpu_times())


def pytest_terminal_summary(terminalreporter):
    """What the machine was, at the end of the output where a CI log's tail shows it: a run that took ten
    times its usual time says whether the host was slower, shared (steal) or busy (load), or the code was."""
    t0, cpu0 = _SESSION_START
    cpu1 = _cpu_times()
    deltas = [b - a for a, b in zip(cpu0, cpu1, strict=False)]
    steal = f"{100 * deltas[7] / max(1, sum(deltas)):.1f} %" if len(deltas) > 7 else "unknown"
    from pyinfer.native.ggml import cpu_features  # the kernels the engine chose (the native library, built by now)

    loadavg = Path("/proc/loadavg")
    load = " ".join(loadavg.read_text().split()[:3]) if loadavg.exists() else "unknown"
    isa = "/".join(name for name, on in cpu_features().items() if on) or "no AVX2"
    usable = len(os.sched_getaffinity(0))
    terminalreporter.write_line(
        f"machine: {machine.cpu_name()} ({isa}); {usable} CPUs usable, {threads.physical_cores()} cores, "
        f"quota {threads.cpu_quota() or 'none'}; "
        f"steal {steal} and load {load} over {time.monotonic() - t0:.0f} s")
