"""The soak tool on tiny models, briefly: a load with cancelled streams through real
processes, no error but the client's own cancels, and every service's RSS sampled. The
10-minute run at concurrency 16 is in docs/benchmarks/2026-11-22-soak.md; this run is too short for
its growth figure to mean much, so the bound here only catches a blatant leak."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_soak_briefly(test_models, tmp_path):
    out = tmp_path / "soak.json"
    cmd = [
        sys.executable,
        "-m",
        "specdec.tools.soak",
        "--draft-model",
        str(test_models.draft_noisy),
    ]
    cmd += ["--target-model", str(test_models.target), "--duration", "20", "--warmup", "8"]
    cmd += ["--concurrency", "4", "--sample-every", "2", "--max-growth", "0.5", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] is True
    assert result["requests"] > 0 and result["cancelled_streams"] > 0 and result["tokens"] > 0
    assert set(result["errors"]) <= {"CANCELLED"}
    for name in ("drafter", "verifier", "gateway"):
        assert result["rss_mb_after_warmup"][name] > 0 and result["rss_mb_end"][name] > 0
        assert result["rss_growth"][name] < 0.5
    times = [t for t, _ in result["rss_samples"]]
    assert len(times) >= 5 and times == sorted(times) and times[-1] >= 20
