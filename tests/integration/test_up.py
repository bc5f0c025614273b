"""`specdec up` runs the local stack; `specdec generate` talks to it; SIGTERM stops it all."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.integration


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_up_generate_and_clean_stop(test_models, tokenizer, reference, tmp_path):
    # As a user runs it: every service exec'd, none forked from the tests' fork server.
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SPECDEC_FORK_SERVER")}
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specdec",
            "up",
            "--dtype",
            "float32",
            "--draft-model",
            str(test_models.draft_noisy),
            "--target-model",
            str(test_models.target),
            "--port",
            "0",
            "--log-dir",
            str(tmp_path / "logs"),
            "--draft-threads",
            "1",
            "--target-threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines, pids, gateway = [], [], None
    try:
        deadline = time.monotonic() + 300
        while gateway is None and time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            lines.append(line)
            if m := re.search(r"\(pid (\d+)\)", line):
                pids.append(int(m.group(1)))
            if m := re.match(r"gateway\s+(\S+)", line):
                gateway = m.group(1)
        assert gateway, "".join(lines)
        assert len(pids) == 4  # redis, drafter, verifier, gateway

        prompt = "def fibonacci(n):"

        def generate(*extra: str) -> subprocess.CompletedProcess:
            argv = ["generate", "--gateway", gateway, "--prompt", prompt, "--max-new-tokens", "16"]
            return subprocess.run(
                [sys.executable, "-m", "specdec", *argv, *extra],
                capture_output=True,
                text=True,
                timeout=120,
            )

        out = generate("--k", "4", "--json")
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        ids = tokenizer(prompt).input_ids
        assert result["tokens"] == reference(ids, 16)
        assert result["finish_reason"] == "length"
        assert result["usage"]["completion_tokens"] == 16
        for key in ("rounds", "draft_tokens", "accepted_tokens", "acceptance_rate"):
            assert key in result["stats"]
        assert result["text"] == tokenizer.decode(result["tokens"], skip_special_tokens=True)

        streamed = generate()
        assert streamed.returncode == 0 and streamed.stdout.rstrip("\n") == result["text"]

        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        assert "stopped" in up.stdout.read()
        time.sleep(0.5)
        assert not [p for p in pids if _pid_alive(p)]
        assert (tmp_path / "logs" / "verifier.log").read_text().count('"serving"') == 1
    finally:
        if up.poll() is None:
            up.kill()


@pytest.mark.parametrize("when", ["starting", "ready"])
def test_sigterm_leaves_no_temp_folder(test_models, tmp_path, when):
    """SIGTERM to `specdec up --tls --http-port` (TLS on the HTTP API is what once wrote PEM
    copies to a temp folder) leaves nothing in the temp dir, whether it arrives while the
    gateway is starting or once the stack is ready. The stack gets a TMPDIR of its own, so
    the test reads only what it owns."""
    from specdec.tools.redisproc import free_port

    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    logs = tmp_path / "logs"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["TMPDIR"] = str(own_tmp)
    up = subprocess.Popen(
        [
            sys.executable, "-m", "specdec", "up", "--dtype", "float32",
            "--draft-model", str(test_models.draft_noisy),
            "--target-model", str(test_models.target),
            "--port", "0", "--http-port", str(free_port()), "--tls",
            "--log-dir", str(logs), "--draft-threads", "1", "--target-threads", "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )  # fmt: skip
    lines: list[str] = []
    try:
        if when == "starting":  # as soon as the gateway process exists
            deadline = time.monotonic() + 300
            while not (logs / "gateway.log").exists():
                assert up.poll() is None and time.monotonic() < deadline, up.stdout.read()
                time.sleep(0.02)
        else:
            for line in up.stdout:
                lines.append(line)
                if line.startswith("ready:"):
                    break
            assert lines and lines[-1].startswith("ready:"), "".join(lines)
            assert any(p.name.startswith("specdec-pki-") for p in own_tmp.iterdir())
            assert not list(own_tmp.glob("specdec-http-*"))
        up.send_signal(signal.SIGTERM)
        assert up.wait(120) == 0, up.stdout.read()
        assert not list(own_tmp.iterdir()), sorted(p.name for p in own_tmp.iterdir())
    finally:
        if up.poll() is None:
            up.kill()


def test_up_passes_settings_to_the_services(test_models, tmp_path):
    """`up`'s own options for the services (--served-model-name, --quantize) and any other
    setting through --drafter-arg / --verifier-arg / --gateway-arg reach the services it
    starts: metrics on the ports given, the HTTP API's model name, int8 draft weights."""
    import urllib.request

    from specdec.tools.redisproc import free_port

    http, gateway_metrics, drafter_metrics, verifier_metrics = (free_port() for _ in range(4))
    logs = tmp_path / "logs"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    up = subprocess.Popen(
        [
            sys.executable, "-m", "specdec", "up", "--dtype", "float32",
            "--draft-model", str(test_models.draft_noisy),
            "--target-model", str(test_models.target),
            "--port", "0", "--log-dir", str(logs),
            "--draft-threads", "1", "--target-threads", "1",
            "--http-port", str(http), "--served-model-name", "tiny-target",
            "--quantize", "int8",
            f"--gateway-arg=--metrics-port={gateway_metrics}",
            "--drafter-arg", f"--metrics-port {drafter_metrics}",
            f"--verifier-arg=--metrics-port={verifier_metrics}",
            "--verifier-arg=--max-queue 7",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )  # fmt: skip
    lines: list[str] = []
    try:
        for line in up.stdout:
            lines.append(line)
            if line.startswith("ready:"):
                break
        assert lines and lines[-1].startswith("ready:"), "".join(lines)

        def get(port: int, path: str) -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
                assert r.status == 200
                return r.read().decode()

        models = json.loads(get(http, "/v1/models"))
        assert [m["id"] for m in models["data"]] == ["tiny-target"]
        assert "specdec_gateway" in get(gateway_metrics, "/metrics")
        assert "specdec_drafter" in get(drafter_metrics, "/metrics")
        assert "specdec_verifier" in get(verifier_metrics, "/metrics")
        drafter_log = (logs / "drafter.log").read_text()
        assert any(
            json.loads(line).get("quantize") == "int8"
            for line in drafter_log.splitlines()
            if "drafter weights quantized" in line
        ), drafter_log[-2000:]
        up.send_signal(signal.SIGTERM)
        assert up.wait(120) == 0
    finally:
        if up.poll() is None:
            up.kill()
