"""How many CPUs this process may really use: its affinity mask and its cgroup CPU quota.

torch sizes its thread pool from the machine's cores. A replica pinned to a core, or a pod
under a CPU limit, then runs more threads than it has CPUs, and two busy replicas on two
cores thrash (issue 14: 3.5 requests/s at concurrency 8 against about 42 at concurrency 1).
``usable_cpus`` gives the count a replica should size its threads to. Torch-free.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class CpuBudget:
    """threads: what to size torch's pool to; source: why, for the log."""

    threads: int
    source: str


def _v2_paths(root: Path, proc_cgroup: Path) -> list[Path]:
    """cpu.max files from this process's cgroup v2 group up to the root (deepest first)."""
    group = "/"
    try:
        for line in proc_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                group = line[3:] or "/"
    except OSError:
        pass
    paths = []
    here = root / group.strip("/") if group.strip("/") else root
    while True:
        paths.append(here / "cpu.max")
        if here == root or root not in here.parents:
            break
        here = here.parent
    return paths


def _read_v2(path: Path) -> float | None:
    """'max 100000' -> None; '200000 100000' -> 2.0; missing file -> None."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period)


def _read_v1(root: Path) -> tuple[float, Path] | None:
    """cpu.cfs_quota_us / cpu.cfs_period_us (quota -1: no limit)."""
    for folder in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu", root):
        try:
            quota = int((folder / "cpu.cfs_quota_us").read_text())
            period = int((folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        if quota > 0 and period > 0:
            return quota / period, folder / "cpu.cfs_quota_us"
        return None
    return None


def cgroup_quota(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP
) -> tuple[float, str] | None:
    """The tightest CPU quota of this process's cgroups, in CPUs, and the file it came from;
    None when no quota applies."""
    best: tuple[float, str] | None = None
    for path in _v2_paths(root, proc_cgroup):
        cpus = _read_v2(path)
        if cpus is not None and (best is None or cpus < best[0]):
            best = (cpus, str(path))
    if best is None and (v1 := _read_v1(root)) is not None:
        best = (v1[0], str(v1[1]))
    return best


def usable_cpus(
    affinity: set[int] | None = None,
    root: Path = CGROUP_ROOT,
    proc_cgroup: Path = PROC_SELF_CGROUP,
) -> CpuBudget:
    """threads = max(1, min(CPUs in the affinity mask, ceil(cgroup quota)))."""
    cpus = len(os.sched_getaffinity(0) if affinity is None else affinity)
    quota = cgroup_quota(root, proc_cgroup)
    if quota is not None and math.ceil(quota[0]) < cpus:
        return CpuBudget(
            max(1, math.ceil(quota[0])), f"cgroup quota of {quota[0]:g} CPUs ({quota[1]})"
        )
    return CpuBudget(max(1, cpus), f"affinity mask of {cpus} CPU{'' if cpus == 1 else 's'}")


def thread_budget(requested: int) -> CpuBudget:
    """The replica's torch thread count: `requested` when > 0 (--threads), else usable_cpus."""
    if requested > 0:
        return CpuBudget(requested, "--threads")
    return usable_cpus()
