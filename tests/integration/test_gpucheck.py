"""`make gpu-check` (specdec.tools.gpucheck) on CPU with the tiny models: every part runs,
through real drafter, verifier and gateway processes, and its table holds what the GPU
machine's run will be read for. torch.compile runs with its eager backend here (graph
capture without code generation: inductor's C++ build would take minutes on 2 CPUs)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdec.tools import gpucheck

pytestmark = pytest.mark.integration


def test_gpu_check_runs_on_cpu_with_tiny_models(tmp_path):
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--dtype", "float32", "--stack-dtype", "float32"]
    argv += ["--shapes", "tiny", "--tokens", "1,4", "--batches", "1,2", "--context", "32"]
    argv += ["--iters", "3", "--copy-mb", "16", "--compile-backend", "eager"]
    argv += ["--prompt-tokens", "8", "--new-tokens", "16", "--out", str(out)]
    run = subprocess.run(
        [sys.executable, "-m", "specdec.tools.gpucheck", *argv],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    shapes = {(f["model"], f["tokens"], f["batch"]) for f in report["forwards"]}
    assert shapes == {
        *{("target", t, b) for t in (1, 4) for b in (1, 2)},
        ("drafter", 1, 1),
    }
    for f in report["forwards"]:
        assert f["eager_ms"] > 0 and f["compiled_ms"] > 0 and f["bound_ms"] > 0
        assert f["max_logit_diff"] < 1e-3, f  # the compiled forward computes the same logits
    assert report["copy_gb_s"] > 0 and report["target_read_gb"] > report["drafter_read_gb"] > 0
    k0, self4 = report["stack"]["k0"], report["stack"]["self_k4"]
    assert k0["draft_tokens"] == 0 and k0["rounds"] == 16  # k = 0: one token a round
    # The target drafting for itself: float32 on CPU, every draft token is accepted and a
    # round gives five tokens (the last one is cut to the 16 asked for).
    assert self4["draft_tokens"] > 0 and self4["accepted_tokens"] == self4["draft_tokens"]
    assert self4["rounds"] == 4
    assert report["stack"]["in_process_ms_per_token"] > 0
    table = (out / "results.md").read_text()
    assert table == run.stdout
    assert "| target | 4 | 2 |" in table and "self-drafting at k = 4" in table
    assert "100.0% of draft tokens accepted" in table


def test_carried_wheels_are_what_the_gpu_image_lacks():
    carried = {r.split("==")[0] for r in gpucheck.carried_requirements()}
    # too old or missing there
    assert {"transformers", "protobuf", "grpcio", "grpcio-health-checking", "redis"} <= carried
    # there already, or built from this tree
    assert not carried & {"torch", "numpy", "tokenizers", "specdec-server", "specdec-sdk"}
    assert all("==" in r for r in gpucheck.carried_requirements())
