"""The quick start in README.md and docs/getting-started/quickstart.md runs as written.

Each file marks three blocks with an HTML comment: `<!-- quickstart:serve -->` (starts the
stack), `<!-- quickstart:client -->` (shell commands against it) and `<!-- quickstart:python -->`
(the SDK snippet). They run here on the tiny test models, with three substitutions only: the
`DRAFT=` and `TARGET=` lines name the tiny models instead of the pretrained pair, `.venv/bin/`
is this interpreter's bin folder, and the ports 50051 and 8000 become free ones.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specdec.tools.redisproc import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("README.md", "docs/getting-started/quickstart.md")
KINDS = ("serve", "client", "python")


def blocks(text: str) -> dict[str, str]:
    found = {}
    for kind, body in re.findall(r"<!-- quickstart:(\w+) -->\n```\w*\n(.*?)```", text, flags=re.S):
        assert kind not in found, f"two quickstart:{kind} blocks"
        found[kind] = body
    return found


def quickstarts() -> dict[tuple[str, ...], list[str]]:
    """The distinct (serve, client, python) triples, and the files that hold each."""
    out: dict[tuple[str, ...], list[str]] = {}
    for source in SOURCES:
        found = blocks((ROOT / source).read_text())
        assert set(found) == set(KINDS), f"{source}: quickstart blocks {sorted(found)}"
        out.setdefault(tuple(found[k] for k in KINDS), []).append(source)
    return out


def commands(block: str) -> list[str]:
    """Shell commands of a block: continuation lines joined, comments and blanks dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line for line in joined.splitlines() if line.strip() and not line.startswith("#")]


CASES = quickstarts()


@pytest.mark.parametrize("case", list(CASES), ids=["+".join(v) for v in CASES.values()])
def test_quickstart_runs(case, test_models, tmp_path):
    serve, client, python = case
    grpc_port, http_port = free_port(), free_port()
    bindir = str(Path(sys.executable).parent)

    def adapt(text: str) -> str:
        text = text.replace(".venv/bin/", bindir + "/")
        text = re.sub(r"\b50051\b", str(grpc_port), text)
        return re.sub(r"\b8000\b", str(http_port), text)

    script = []
    for line in commands(serve):
        if line.startswith("DRAFT="):
            line = f"DRAFT={shlex.quote(str(test_models.draft_noisy))}"
        elif line.startswith("TARGET="):
            line = f"TARGET={shlex.quote(str(test_models.target))}"
        script.append(adapt(line))
    assert "specdec up" in script[-1], "the serve block ends with `specdec up`"
    script[-1] = "exec " + script[-1]  # SIGTERM reaches `specdec up` itself
    # As a user runs it: every service exec'd, none forked from the tests' fork server.
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "SPECDEC_FORK_SERVER")}
    up = subprocess.Popen(
        ["bash", "-euc", "\n".join(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    try:
        output: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [output.put(x) for x in up.stdout], daemon=True).start()
        deadline = time.monotonic() + 300
        while not (lines and lines[-1].startswith("ready:")):
            try:
                lines.append(output.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError("no `ready:` from `specdec up`\n" + "".join(lines)) from None

        for command in commands(client):
            done = subprocess.run(
                ["bash", "-euc", adapt(command)], capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, f"{command}\n{done.stdout}{done.stderr}"
            assert done.stdout.strip(), f"{command}: no output"
            if command.startswith("curl"):
                body = json.loads(done.stdout)
                assert body["choices"][0]["finish_reason"] in ("length", "stop"), body
                assert body["specdec"]["token_ids"], body

        done = subprocess.run(
            [sys.executable, "-c", adapt(python)], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.strip()

        up.send_signal(signal.SIGTERM)
        assert up.wait(120) == 0, "".join(lines)
    finally:
        if up.poll() is None:
            up.kill()
