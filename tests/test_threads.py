"""The default thread count: one a core (SMT siblings once), one fewer from machine.SPARE_CORE_FROM cores."""
from __future__ import annotations

import os
import re
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from pyinfer.machine import SPARE_CORE_FROM, default_threads, physical_cores, threads_for


@given(st.integers(1, 1024))
def test_threads_leave_a_core_free_on_large_machines(cores):
    threads = threads_for(cores)
    assert 1 <= threads <= cores
    assert threads == (cores - 1 if cores >= SPARE_CORE_FROM else cores)
    assert threads_for(cores + 1) >= threads


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
    assert default_threads() == threads_for(len(cores))
