"""The lm-eval peer test (`make test-lm-eval`): lm-eval's own client against the stack.

Builds the tiny fp32 test models, starts `specdec up --http-port` on them, and runs the
loglikelihood task of this folder (specdec_tiny_choice.yaml, eight local docs) twice with
lm-eval (installed in its own virtualenv, given as --lm-eval): with its `local-completions`
model type against the stack's /v1/completions (echo + logprobs), and with its own `hf`
model type on the same target directory. The scores must be equal, and so must every
choice's log-likelihood (within 1e-3: a sum of a few fp32 log-probabilities computed by
two forwards of different shapes). Exit status 0 when they are; the figures are printed.

Run with the project's interpreter: python tests/peers/lm_eval/run.py --lm-eval PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from specdec.tools.tinymodels import build_test_models

HERE = Path(__file__).resolve().parent
TASK = "specdec_tiny_choice"
TOLERANCE = 1e-3
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, seconds: float = 600) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"specdec up exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise SystemExit(f"specdec up not ready after {seconds}s ({url})")


def lm_eval(exe: str, model: str, model_args: str, out: Path, env: dict) -> tuple[dict, dict]:
    """Run the task; its results and {(doc_id, choice): log-likelihood}."""
    cmd = [
        exe, "run", "--model", model, "--model_args", model_args, "--tasks", TASK,
        "--include_path", str(HERE), "--output_path", str(out), "--log_samples",
        "--batch_size", "1", "--device", "cpu",
    ]  # fmt: skip
    started = time.monotonic()
    subprocess.run(cmd, check=True, env=env, cwd=HERE.parents[2])
    print(f"lm-eval {model}: {time.monotonic() - started:.1f}s")
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    scores = {}
    for line in next(out.rglob(f"samples_{TASK}_*.jsonl")).read_text().splitlines():
        sample = json.loads(line)
        for i, (ll, _greedy) in enumerate(sample["filtered_resps"]):
            scores[(sample["doc_id"], i)] = float(ll)
    return results["results"][TASK], scores


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-eval", required=True, help="the lm-eval (lm_eval) executable")
    args = parser.parse_args()
    env = {**os.environ, **OFFLINE}
    with tempfile.TemporaryDirectory(prefix="specdec-lm-eval-") as tmp:
        root = Path(tmp)
        env["HF_HOME"] = str(root / "hf")  # datasets' cache of the local JSONL, nothing else
        models = build_test_models(root / "models")
        target = str(models.target)
        port, http = free_port(), free_port()
        specdec = Path(sys.executable).parent / "specdec"
        command = [
            str(specdec), "up", "--dtype", "float32", "--draft-model", str(models.draft_noisy),
            "--target-model", target, "--host", "127.0.0.1", "--port", str(port),
            "--http-port", str(http), "--default-k", "3", "--log-dir", str(root / "logs"),
        ]  # fmt: skip
        up = subprocess.Popen(command, env=env, start_new_session=True)
        try:
            wait_healthy(f"http://127.0.0.1:{http}/health", up)
            api_args = (
                f"model={target},base_url=http://127.0.0.1:{http}/v1/completions,"
                f"tokenizer={target},tokenizer_backend=huggingface,num_concurrent=1,"
                "max_retries=1,tokenized_requests=True"
            )
            api, api_scores = lm_eval(
                args.lm_eval, "local-completions", api_args, root / "api", env
            )
        finally:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()
        hf_args = f"pretrained={target},dtype=float32"
        hf, hf_scores = lm_eval(args.lm_eval, "hf", hf_args, root / "hf-run", env)
    metrics = {k: v for k, v in api.items() if k.startswith("acc")}
    print(f"local-completions (specdec): {metrics}")
    print(f"hf (transformers):           { {k: hf[k] for k in metrics} }")
    worst = max(abs(api_scores[key] - hf_scores[key]) for key in hf_scores)
    print(f"{len(hf_scores)} choices scored; largest log-likelihood difference {worst:.2e}")
    ok = (
        api_scores.keys() == hf_scores.keys()
        and all(api[k] == hf[k] for k in metrics)
        and worst <= TOLERANCE
    )
    print("lm-eval:", "1 passed, 0 failed" if ok else "0 passed, 1 failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
