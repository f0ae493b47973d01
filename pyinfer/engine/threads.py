"""How many CPU threads the engine runs by default: one a core this process may use (SMT siblings counted once),
one fewer from SPARE_CORE_FROM cores, and no more than a CPU quota's whole CPUs."""
from __future__ import annotations

import os
from pathlib import Path

SPARE_CORE_FROM = 8  # cores from which the default thread count leaves one free
CGROUP = Path("/sys/fs/cgroup")  # the control groups' mount: a container sees its own there


def physical_cores() -> int:
    """Cores this process may run on, SMT siblings counted once (the CPU's topology in /sys)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topology.joinpath("physical_package_id").read_text().strip(),
                       topology.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def cpu_quota(root: Path = CGROUP) -> float | None:
    """CPUs' worth of time this process's control group may use (a container's --cpus), None if unlimited:
    cgroup v2's cpu.max, else v1's cpu.cfs_quota_us over cpu.cfs_period_us."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def threads_for(cores: int) -> int:
    """The default thread count for this many cores: one per core, less one from SPARE_CORE_FROM cores. A
    decode step is a chain of barriers, so one thread that shares its core with another process holds all
    the others: on a shared 16-core host ours decoded at 17-26 t/s with 16 threads beside one busy process
    and at 34-37 with 15, as fast as 16 on the quiet host (docs/BENCHMARKS.md, "CPU steadiness")."""
    return cores - 1 if cores >= SPARE_CORE_FROM else max(1, cores)


def default_threads() -> int:
    """One thread a core this process may use, less one from SPARE_CORE_FROM cores. Under a CPU quota, only its
    whole CPUs count: a thread more would be throttled in every period, and the barriers would wait for it."""
    cores, quota = physical_cores(), cpu_quota()
    return threads_for(min(cores, max(1, int(quota))) if quota else cores)
