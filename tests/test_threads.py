"""The default thread count: one a core (SMT siblings once, a CPU quota's whole CPUs), one fewer from
threads.SPARE_CORE_FROM cores."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pyinfer.engine import threads
from pyinfer.engine.threads import SPARE_CORE_FROM, cpu_quota, default_threads, physical_cores, threads_for


@given(st.integers(1, 1024))
def test_threads_leave_a_core_free_on_large_machines(cores):
    n = threads_for(cores)
    assert 1 <= n <= cores
    assert n == (cores - 1 if cores >= SPARE_CORE_FROM else cores)
    assert threads_for(cores + 1) >= n


def test_physical_cores_match_proc_cpuinfo():
    cpus = os.sched_getaffinity(0)
    assert 1 <= physical_cores() <= len(cpus)
    # the oracle: /proc/cpuinfo's "physical id" and "core id" of the CPUs this process may use
    blocks = Path("/proc/cpuinfo").read_text().strip().split("\n\n")
    cores = set()
    for block in blocks:
        fields = dict(re.findall(r"^(processor|physical id|core id)\s*:\s*(\d+)$", block, re.M))
        if int(fields["processor"]) in cpus:
            cores.add((fields.get("physical id"), fields.get("core id", fields["processor"])))
    assert physical_cores() == len(cores)
    quota = cpu_quota()
    assert default_threads() == threads_for(min(len(cores), int(quota)) if quota else len(cores))


@pytest.mark.parametrize("files,want", [
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "400000 100000\n"}, 4.0),
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "250000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.5),
    ({"cpu.max": "garbage\n"}, None),
    ({}, None),
])
def test_cpu_quota_of_cgroup_v1_and_v2(tmp_path, files, want):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_quota(tmp_path) == want


@pytest.mark.parametrize("quota,want", [(None, 15), (4.0, 4), (1.5, 1), (0.5, 1), (64.0, 15)])
def test_a_cpu_quota_caps_the_default_threads(monkeypatch, quota, want):
    monkeypatch.setattr(threads, "physical_cores", lambda: 16)
    monkeypatch.setattr(threads, "cpu_quota", lambda: quota)
    assert default_threads() == want
