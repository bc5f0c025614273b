"""Thread sizing from the affinity mask and the cgroup CPU quota (fake cgroup trees), and
the CPU's name and flags from /proc/cpuinfo (fake files)."""

from __future__ import annotations

from pathlib import Path

from specdec.replica.cpus import Cpu, cgroup_quota, cpu_info, thread_budget, usable_cpus
from specdec.tools.stack import split_threads


def _tree(tmp_path: Path, files: dict[str, str], group: str = "/") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    root.mkdir()
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(f"0::{group}\n")
    return root, proc


def test_v2_quota_limits_the_affinity_mask(tmp_path):
    root, proc = _tree(tmp_path, {"cpu.max": "150000 100000\n"})
    budget = usable_cpus({0, 1, 2, 3}, root, proc)
    assert budget.threads == 2  # ceil(1.5)
    assert "cgroup quota of 1.5 CPUs" in budget.source and "cpu.max" in budget.source


def test_v2_no_limit_uses_the_affinity_mask(tmp_path):
    root, proc = _tree(tmp_path, {"cpu.max": "max 100000\n"})
    assert usable_cpus({0, 1, 2}, root, proc).threads == 3
    assert usable_cpus({5}, root, proc).source == "affinity mask of 1 CPU"


def test_quota_above_the_mask_keeps_the_mask(tmp_path):
    root, proc = _tree(tmp_path, {"cpu.max": "800000 100000"})
    assert usable_cpus({0, 1}, root, proc).threads == 2


def test_v2_nested_group_takes_the_tightest_quota(tmp_path):
    root, proc = _tree(
        tmp_path,
        {"kubepods/cpu.max": "400000 100000", "kubepods/pod1/cpu.max": "100000 100000"},
        group="/kubepods/pod1",
    )
    assert cgroup_quota(root, proc) == (1.0, str(root / "kubepods/pod1/cpu.max"))
    assert usable_cpus(set(range(8)), root, proc).threads == 1


def test_small_quota_still_gives_one_thread(tmp_path):
    root, proc = _tree(tmp_path, {"cpu.max": "20000 100000"})
    assert usable_cpus({0, 1}, root, proc).threads == 1


def test_v1_quota(tmp_path):
    root, proc = _tree(
        tmp_path,
        {"cpu,cpuacct/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
    )
    budget = usable_cpus(set(range(16)), root, proc)
    assert budget.threads == 2 and "cpu.cfs_quota_us" in budget.source


def test_v1_unlimited(tmp_path):
    root, proc = _tree(
        tmp_path, {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}
    )
    assert cgroup_quota(root, proc) is None
    assert usable_cpus({0, 1, 2, 3}, root, proc).threads == 4


def test_no_cgroup_files(tmp_path):
    root, proc = _tree(tmp_path, {})
    assert cgroup_quota(root, proc) is None
    assert usable_cpus({0, 1}, root, proc).threads == 2


def test_explicit_threads_win():
    assert thread_budget(3).threads == 3 and thread_budget(3).source == "--threads"
    assert thread_budget(0).threads >= 1


def test_up_divides_the_cpus_between_the_replicas():
    assert split_threads(0, 0, pinned=False, cpus=2) == (1, 1)
    assert split_threads(0, 0, pinned=False, cpus=1) == (1, 1)
    assert split_threads(0, 0, pinned=False, cpus=5) == (2, 3)
    assert split_threads(3, 0, pinned=False, cpus=8) == (3, 5)
    assert split_threads(0, 6, pinned=False, cpus=8) == (2, 6)
    assert split_threads(2, 2, pinned=False, cpus=8) == (2, 2)
    # Pinned replicas size themselves from their affinity masks.
    assert split_threads(0, 0, pinned=True, cpus=8) == (0, 0)


def test_cpu_flags_in_the_note(tmp_path):
    lines = "model name\t: Some CPU\nflags\t\t: fpu sse avx2 avx512f avx512_vnni\n"
    (tmp_path / "plain").write_text(lines * 2)
    cpu = cpu_info(tmp_path / "plain")
    assert cpu == Cpu("Some CPU", ("avx2", "avx512f"))
    assert cpu.bf16_note() == "no avx512_bf16/amx on this CPU, avx512f at best"
    (tmp_path / "amx").write_text(lines.replace("avx512f", "avx512f avx512_bf16 amx_tile amx_bf16"))
    assert cpu_info(tmp_path / "amx").bf16_note() == "amx_bf16/avx512_bf16 on this CPU"
    assert cpu_info(tmp_path / "missing").flags == ()
