"""Peer tools as tests (`make test-peers`): `specdec up` on tiny models behind a recording
proxy, and the peers' own virtualenvs under .cache/peers/<tool>.

`make test` collects these tests and skips them (the tools are not installed there);
`make test-peers` installs the pinned tools (cached) and sets SPECDEC_PEERS, and a missing
tool is then a failure, never a skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PEERS = os.environ.get("SPECDEC_PEERS", "")
SKIP_REASON = "peer tools (guidellm, aiperf): run `make test-peers`"


def tool(name: str, program: str) -> Path:
    """A peer tool's program in its virtualenv (a failure, not a skip, when missing)."""
    path = Path(PEERS) / name / "bin" / program
    assert path.exists(), f"{path} is missing: `make test-peers` installs {name}"
    return path


@dataclass
class Recorder:
    """A TCP proxy in front of the gateway's HTTP port that keeps what clients send: the
    JSON body of each request, by path (what a peer tool sends, to list its fields)."""

    upstream: tuple[str, int]
    port: int = 0
    raw: list[bytes] = field(default_factory=list)
    _sock: socket.socket | None = None

    def __enter__(self) -> Recorder:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        assert self._sock is not None
        self._sock.close()

    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            sent: list[bytes] = []
            self.raw.append(b"")
            index = len(self.raw) - 1

            def pump(src, dst, keep, index=index, sent=sent):
                try:
                    while data := src.recv(65536):
                        if keep:
                            sent.append(data)
                            self.raw[index] = b"".join(sent)
                        dst.sendall(data)
                except OSError:
                    pass
                finally:
                    for s in (src, dst):
                        with contextlib.suppress(OSError):
                            s.shutdown(socket.SHUT_RDWR)

            threading.Thread(target=pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=pump, args=(server, client, False), daemon=True).start()

    def requests(self) -> list[tuple[str, dict]]:
        """(path, JSON body) of every POST the clients sent, in order per connection."""
        out = []
        for stream in self.raw:
            rest = stream
            while rest:
                head, sep, rest = rest.partition(b"\r\n\r\n")
                if not sep:
                    break
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                body, rest = rest[:length], rest[length:]
                if method == "POST":
                    out.append((path, json.loads(body or b"{}")))
        return out


@dataclass
class Stack:
    http: str  # http://127.0.0.1:PORT of the recording proxy
    direct: str  # the gateway's own HTTP address
    model: str  # the target's path, as the tools send it (/v1/models lists its folder name)
    tokenizer: str  # the tiny tokenizer's folder
    recorder: Recorder
    logs: Path


@pytest.fixture(scope="module")
def up(test_models, tmp_path_factory) -> Iterator[Stack]:
    """`specdec up` on the tiny pair with the HTTP API, behind a Recorder."""
    from specdec.tools.redisproc import free_port

    logs = tmp_path_factory.mktemp("peer-logs")
    http_port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    # The gateway refuses fields it does not know (it ignores them by default), so that
    # `refusals` names every field a tool sends that the gateway does not serve.
    env["SPECDEC_STRICT_FIELDS"] = "true"
    argv = [
        sys.executable, "-m", "specdec", "up", "--dtype", "float32",
        "--draft-model", str(test_models.draft_noisy), "--target-model", str(test_models.target),
        "--port", "0", "--http-port", str(http_port), "--log-dir", str(logs),
        "--draft-threads", "1", "--target-threads", "1", "--default-k", "3",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: list[str] = []
    try:
        ready = False
        deadline = time.monotonic() + 300
        while not ready and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            ready = line.startswith("ready:")
        assert ready, "".join(lines)
        with Recorder(("127.0.0.1", http_port)) as recorder:
            yield Stack(
                http=f"http://127.0.0.1:{recorder.port}",
                direct=f"http://127.0.0.1:{http_port}",
                model=str(test_models.target),
                tokenizer=str(test_models.tokenizer),
                recorder=recorder,
                logs=logs,
            )
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
