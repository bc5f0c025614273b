"""Every command that starts processes (`up`, `demo`, `bench`) stops all of them on SIGTERM
and on SIGINT, while still starting as well as once running.

Each command runs with a marker in its environment, which every process it starts inherits
(the services, anything they start), so the test finds them all in /proc, including one
started just as the signal arrived, whatever process group it is in; and the command's
descendants when the signal is sent count too (redis-server rewrites its environment
block with its process title). After the signal
every one of them must be gone within a bounded wait. `loadtest` and `distill` start no
process (they call a running gateway, or train in their own process).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

MARKER = "SPECDEC_TEST_PROCESS_TREE"


def _processes() -> dict[int, tuple[int, str, bytes]]:
    """pid -> (parent pid, start time, environment) of every live (not zombie) process.
    The start time tells a pid apart from a later process that reuses it."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            environ = (entry / "environ").read_bytes()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if fields[0] != "Z":
            out[int(entry.name)] = (int(fields[1]), fields[19], environ)
    return out


def tree(tag: str, root: int | None = None) -> set[tuple[int, str]]:
    """(pid, start time) of the live processes whose environment holds MARKER=tag, and of
    root's descendants."""
    needle = f"{MARKER}={tag}".encode()
    procs = _processes()
    found = {pid for pid, (_, _, env) in procs.items() if needle in env.split(b"\0")}
    grew = root is not None
    while grew:
        more = {pid for pid, (ppid, _, _) in procs.items() if ppid in found | {root}}
        grew = not more <= found
        found |= more
    return {(pid, procs[pid][1]) for pid in found}


def still_running(started: set[tuple[int, str]], tag: str) -> set[int]:
    procs = _processes()
    alive = {pid for pid, start in started if pid in procs and procs[pid][1] == start}
    return alive | {pid for pid, _ in tree(tag)}


class Command:
    """A `specdec` command run with the marker; its output collected line by line."""

    def __init__(self, argv: list[str], tmp_path: Path, fork: bool = True):
        self.tag = uuid.uuid4().hex
        env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
        if not fork:  # every service exec'd, as in production (tests/conftest.py forks)
            env.pop("SPECDEC_FORK_SERVER", None)
        env[MARKER] = self.tag
        env["TMPDIR"] = str(tmp_path)
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specdec", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not any(re.search(pattern, line) for line in self.lines):
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {pattern!r} in:\n{self.output()}"
            time.sleep(0.02)

    def signal_and_check(self, signum: int, children_at_least: int) -> int:
        """Send the signal; the command must exit and leave no process behind. Returns its
        exit status."""
        # The line a test waits for is printed just before the next child starts: wait
        # (bounded) for that child to show in the process tree.
        deadline = time.monotonic() + 30
        while True:
            started = {(p, s) for p, s in tree(self.tag, self.proc.pid) if p != self.proc.pid}
            if len(started) >= children_at_least or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert len(started) >= children_at_least, (started, self.output())
        self.proc.send_signal(signum)
        try:
            code = self.proc.wait(180)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"still running 180 s after {signal.Signals(signum).name}:\n{self.output()}"
            )
        deadline = time.monotonic() + 30
        while (left := still_running(started, self.tag)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"left running: {sorted(left)} (of {sorted(started)})\n{self.output()}"
        return code

    def kill_all(self) -> None:
        for pid, _ in tree(self.tag, self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def command(tmp_path):
    made: list[Command] = []

    def start(*argv: str, fork: bool = True) -> Command:
        made.append(Command(list(argv), tmp_path, fork))
        return made[-1]

    yield start
    for c in made:  # a failed test leaves nothing running either
        c.kill_all()


def _models(test_models) -> list[str]:
    return [
        "--dtype", "float32",
        "--draft-model", str(test_models.draft_noisy),
        "--target-model", str(test_models.target),
        "--draft-threads", "1", "--target-threads", "1",
    ]  # fmt: skip


# When the signal arrives: the pattern of the line printed just before, and how many
# processes the command has started by then (Redis, drafter, verifier, gateway).
UP_MOMENTS = {
    "redis": (r"^redis\s", 1),  # before the replicas load
    "loading": (r"^loading models", 3),  # while they load
    "loaded": (r"^verifier\s+127\.0\.0\.1:", 3),  # once they serve, before the gateway
    "gateway": (r"^dtype\s+verifier", 4),  # while the gateway starts
    "ready": (r"^ready:", 4),
}


@pytest.mark.parametrize(
    ("moment", "signum"),
    [
        ("redis", signal.SIGTERM),
        ("loading", signal.SIGTERM),
        ("loading", signal.SIGINT),
        ("gateway", signal.SIGTERM),
        ("ready", signal.SIGINT),
    ],
)
def test_up_stops_everything(command, test_models, moment, signum):
    up = command("up", *_models(test_models), "--port", "0")
    pattern, children = UP_MOMENTS[moment]
    up.wait_for(pattern)
    assert up.signal_and_check(signum, children) == 0
    assert "stopped" in up.output()


@pytest.mark.parametrize("moment", list(UP_MOMENTS))
def test_up_with_exec_services_stops_everything(command, test_models, moment):
    """As production runs them: every service exec'd in a session of its own (nothing but
    `up` would reap it), SIGTERM at each moment of the start; no process of the stack is
    left, none starts after the signal, and `up` exits."""
    up = command("up", *_models(test_models), "--port", "0", fork=False)
    pattern, children = UP_MOMENTS[moment]
    up.wait_for(pattern)
    assert up.signal_and_check(signal.SIGTERM, children) == 0
    output = up.output()
    assert "stopped" in output
    if moment != "ready":  # nothing announced after the signal's stop
        assert "interrupted while starting" in output and "ready:" not in output


def test_up_killed_outright_leaves_nothing(command, test_models):
    """SIGKILL, which `up` cannot handle, while the replicas load: its children (each in a
    session of its own) get SIGTERM from the kernel as it dies, and stop."""
    up = command("up", *_models(test_models), "--port", "0", fork=False)
    up.wait_for(UP_MOMENTS["loading"][0])
    assert up.signal_and_check(signal.SIGKILL, 3) == -signal.SIGKILL


def test_bench_stops_everything(command, test_models, tmp_path):
    """SIGTERM while the bench's stack loads its models (the bench once left its Redis,
    drafter, verifier and gateway running), then SIGINT while it measures, once its
    progress (--progress: on stderr, which is no terminal here) has shown the time left."""
    argv = ["bench", *_models(test_models), "--quick", "--k", "2", "--ssd-k", "2"]
    argv += ["--max-new-tokens", "4"]
    bench = command(*argv, "--out", str(tmp_path / "a"))
    bench.wait_for(r"^loading models")
    assert bench.signal_and_check(signal.SIGTERM, 3) == 128 + signal.SIGTERM
    bench = command(*argv, "--out", str(tmp_path / "b"), "--progress")
    bench.wait_for(r"^\[[#-]+\] 1/\d+ \d+:\d\d elapsed, \d+:\d\d left  prompt 1/")
    assert bench.signal_and_check(signal.SIGINT, 4) == 128 + signal.SIGINT


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_demo_stops_everything(command, test_models, signum):
    demo = command("demo", *_models(test_models), "--no-pin", "--drafter", "bf16")
    demo.wait_for(r"^loading models")
    assert demo.signal_and_check(signum, 3) == 128 + signum
