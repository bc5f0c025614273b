"""`specdec loadtest` against `specdec up` on tiny models (the CI smoke load test), and the
threads regression: with the CPUs divided between the replicas, throughput at
concurrency 8 does not fall below concurrency 1."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdec.replica.cpus import usable_cpus

pytestmark = pytest.mark.integration

VLLM_FIELDS = [
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
] + [
    f"{stat}_{name}_ms"
    for name in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "p90", "p99")
]


@pytest.fixture(scope="module")
def up(test_models, tmp_path_factory):
    """`specdec up` with no thread flags: it divides the usable CPUs itself."""
    logs = tmp_path_factory.mktemp("up-logs")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("REDIS_URL", "OMP_NUM_THREADS", "SPECDEC_THREADS")
    }
    argv = [
        "up",
        "--dtype",
        "float32",
        "--port",
        "0",
        "--log-dir",
        str(logs),
        "--draft-model",
        str(test_models.draft_noisy),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec", *argv, "--target-model", str(test_models.target)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )  # fmt: skip
    lines, address = [], None
    try:
        deadline = time.monotonic() + 300
        while address is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if m := re.match(r"gateway\s+(\S+)", line):
                address = m.group(1)
        assert address, "".join(lines)
        yield {"address": address, "logs": logs, "lines": lines}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def loadtest(address: str, out: Path, *argv: str) -> tuple[dict, str]:
    run = subprocess.run(
        [sys.executable, "-m", "specdec", "loadtest", "--gateway", address, "--out", str(out),
         "--no-progress", *argv],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads((out / "loadtest.json").read_text()), run.stdout + run.stderr


def test_loadtest_smoke_fields_and_exactness(up, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"kind": "code", "prompt": "def fibonacci(n):"})
        + "\n"
        + json.dumps({"kind": "chat", "turns": ["The quick brown fox", " jumps over"]})
        + "\n"
        + json.dumps({"kind": "prose", "prompt": "Once upon a time, in a land far away,"})
        + "\n"
    )
    doc, table = loadtest(
        up["address"],
        tmp_path / "out",
        *("--concurrency", "1,3", "--modes", "k0,k3,ssd2,adaptive,k3@ngram"),
        *("--num-requests", "6"),
        *("--max-new-tokens", "10", "--prompts", str(prompts), "--check-exact"),
    )
    assert [(r["level"], r["mode"]) for r in doc["results"]] == [
        (level, mode)
        for level in ("c=1", "c=3")
        for mode in ("k0", "k3", "ssd2", "adaptive", "k3@ngram")
    ]
    for r in doc["results"]:
        for name in VLLM_FIELDS:
            assert isinstance(r[name], (int, float)), name
        assert r["completed"] == 6 and r["failed"] == 0 and r["errors"] == {}
        assert 6 <= r["total_output_tokens"] <= 60
        assert r["request_throughput"] > 0 and r["output_throughput"] > 0
        # All users busy (the steady state) for part of the cell, never longer than it
        assert r["steady_output_throughput"] > 0 and 0 < r["steady_duration"] <= r["duration"]
        assert 0 < r["median_ttft_ms"] <= r["p99_ttft_ms"] <= r["p99_e2el_ms"]
        # Every response under load equals the same request alone at k=0 (the first
        # conversation's second turn included).
        assert r["exact_checked"] == 6 and r["exact_mismatches"] == 0
    by_mode = {r["mode"]: r for r in doc["results"] if r["level"] == "c=3"}
    assert by_mode["k0"]["tokens_per_round"] == 1.0 and by_mode["k0"]["acceptance_rate"] == 0
    assert 0 < by_mode["k3"]["acceptance_rate"] <= 1 and by_mode["k3"]["tokens_per_round"] > 1
    assert by_mode["ssd2"]["ssd_hit_rate"] > 0
    # The adaptive mode ran under k_policy adaptive with k at most 4 (the policy's own
    # choices are checked in test_adaptive.py), exactly like the fixed modes.
    assert 0 <= by_mode["adaptive"]["mean_k"] <= 4 and 0 < by_mode["k3"]["mean_k"] <= 3
    # A mode's @METHOD reaches the gateway; the others run its default (hybrid)
    assert by_mode["k3@ngram"]["served_methods"] == ["ngram"]
    assert by_mode["k3"]["served_methods"] == ["hybrid"] and by_mode["k3"]["method"] is None
    assert doc["exact"] == {"checked": 60, "mismatches": 0}
    assert doc["config"]["modes"][2] == {
        "name": "ssd2",
        "k": 2,
        "ssd": True,
        "k_policy": "fixed",
        "method": None,
        "tree_width": None,
    }
    assert doc["config"]["modes"][3] == {
        "name": "adaptive",
        "k": 4,
        "ssd": True,
        "k_policy": "adaptive",
        "method": None,
        "tree_width": None,
    }
    assert doc["config"]["modes"][4] == {
        "name": "k3@ngram",
        "k": 3,
        "ssd": False,
        "k_policy": "fixed",
        "method": "ngram",
        "tree_width": None,
    }
    assert (tmp_path / "out" / "loadtest.png").stat().st_size > 0
    assert "| c=3 | ssd2 | 6 | 0 |" in table and "| c=1 | k0 | TTFT |" in table
    # Every cell sends the same prompts, and `specdec up` shares recent outputs: warned.
    assert doc["config"]["suffix_cache_scope"] == "global"
    assert "--suffix-cache-scope global" in table and "--suffix-cache-scope off" in table


def test_loadtest_tree_modes_beside_their_chains(up, tmp_path):
    """--tree-width runs each speculating mode's tree twin interleaved with it; the trees
    reach the gateway (rounds verified trees) and every response equals k=0's."""
    doc, _ = loadtest(
        up["address"],
        tmp_path / "out",
        *("--modes", "k4@ngram,k4", "--tree-width", "3", "--num-requests", "3"),
        *("--num-prompts", "3", "--max-new-tokens", "16", "--check-exact"),
        *("--output-len-range", "0.5"),  # each prompt its own length: its reference's too
    )
    assert doc["config"]["output_len_range"] == 0.5
    modes = ["k4@ngram", "k4@ngram tree3", "k4", "k4 tree3"]
    assert [r["mode"] for r in doc["results"]] == modes
    by_mode = {r["mode"]: r for r in doc["results"]}
    assert by_mode["k4 tree3"]["tree_width"] == 3 and by_mode["k4"]["tree_width"] is None
    assert by_mode["k4 tree3"]["tree_rounds"] > 0 and by_mode["k4"]["tree_rounds"] == 0
    for r in doc["results"]:
        assert r["failed"] == 0 and r["exact_mismatches"] == 0, r["mode"]


def _logged_threads(logs: Path) -> dict[str, int]:
    threads = {}
    for role in ("drafter", "verifier"):
        for line in (logs / f"{role}.log").read_text().splitlines():
            if '"torch threads"' in line:
                threads[role] = json.loads(line)["threads"]
    return threads


def test_threads_fit_the_cores(up, tmp_path):
    """Each replica runs at most its share of the CPUs, and 8 concurrent users get at least
    the throughput of one (the same run, interleaved; a ratio, not a time limit)."""
    cpus = usable_cpus().threads
    threads = _logged_threads(up["logs"])
    assert set(threads) == {"drafter", "verifier"}
    assert sum(threads.values()) <= max(2, cpus)
    doc, _ = loadtest(
        up["address"],
        tmp_path / "out",
        *("--concurrency", "1,8", "--modes", "k0", "--num-requests", "80", "--slices", "4"),
        *("--max-new-tokens", "2"),
    )
    rate = {r["level"]: r["request_throughput"] for r in doc["results"]}
    assert all(r["failed"] == 0 for r in doc["results"])
    assert rate["c=8"] >= rate["c=1"], rate


def test_poisson_rate_levels_bounded_by_duration(up, tmp_path):
    doc, _ = loadtest(
        up["address"],
        tmp_path / "out",
        *("--rate", "4,16", "--max-concurrency", "4", "--duration", "2", "--num-requests", "12"),
        *("--modes", "k2", "--max-new-tokens", "4", "--seed", "7", "--temperature", "0.8"),
    )
    assert [(r["level"], r["request_rate"], r["max_concurrency"]) for r in doc["results"]] == [
        ("rate=4/s", 4.0, 4),
        ("rate=16/s", 16.0, 4),
    ]
    for r in doc["results"]:
        assert 0 < r["completed"] <= 12 and r["failed"] == 0
        assert "exact_checked" not in r  # no --check-exact
    assert doc["config"]["temperature"] == 0.8 and doc["config"]["seed"] == 7
