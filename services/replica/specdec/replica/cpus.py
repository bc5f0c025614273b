"""How many CPUs this process may really use: its affinity mask and its cgroup CPU quota.

torch sizes its thread pool from the machine's cores. A replica pinned to a core, or a pod
under a CPU limit, then runs more threads than it has CPUs, and two busy replicas on two
cores thrash (issue 14: 3.5 requests/s at concurrency 8 against about 42 at concurrency 1).
``usable_cpus`` gives the count a replica should size its threads to. ``cpu_info`` names
the CPU and the flags that decide what a bf16 matmul costs (--dtype fastest, the bench's
machine line). Torch-free.
"""

from __future__ import annotations

import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
CPUINFO = Path("/proc/cpuinfo")
# The CPU flags that decide what a bf16 matmul costs (x86: AVX2, AVX-512, its BF16
# extension, AMX; Arm: the BF16 and SVE features).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "bf16", "sve")


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


# -- what the CPU is ---------------------------------------------------------------------


@dataclass(frozen=True)
class Cpu:
    name: str
    flags: tuple[str, ...]  # those of CPU_FLAGS it has

    def describe(self) -> str:
        return f"{self.name} ({' '.join(self.flags) or 'none of ' + '/'.join(CPU_FLAGS[:3])})"

    def bf16_note(self) -> str:
        """What the CPU has for bf16 matmuls, for the reason."""
        units = [f for f in ("amx_bf16", "avx512_bf16", "bf16") if f in self.flags]
        if units:
            return f"{'/'.join(units)} on this CPU"
        widest = next((f for f in ("avx512f", "avx2", "sve") if f in self.flags), None)
        return "no avx512_bf16/amx on this CPU" + (f", {widest} at best" if widest else "")


def cpu_info(path: Path = CPUINFO) -> Cpu:
    """The CPU's model name and the CPU_FLAGS it has, from /proc/cpuinfo (Linux)."""
    name, flags = "", set[str]()
    try:
        text = path.read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and not name:
            name = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return Cpu(
        name or platform.processor() or platform.machine() or "unknown CPU",
        tuple(f for f in CPU_FLAGS if f in flags),
    )
