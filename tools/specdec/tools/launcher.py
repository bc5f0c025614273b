"""Start specdec services as child processes, wait until they are healthy, and stop every
one of them however the command that started them ends.

Used by `specdec up` (the local stack), `demo`, `bench` and the integration tests, so all
exercise the real command line and the real gRPC health protocol. Torch-free.

A command that starts processes runs under `stops_children()`: SIGTERM then interrupts it
as Ctrl-C (SIGINT) does, so every `with` and `finally` on the way out stops what it
started, and whatever is still running at the end (a child started while the signal
arrived, a stop cut short) is terminated there, its process group with it. Every child is
recorded as it starts (`register`) in a section that a signal cannot split (`guarded`), so
none escapes the record. A second signal while stopping kills the children at once.

Once told to stop, the command starts nothing more: every start and every wait for a
child's health raises Interrupted again (`check_interrupted`), so a stop holds even where
the first Interrupted was swallowed on its way out (an exception raised in a finalizer or a
C callback is only printed). And every child is asked to die with the command: it gets
SIGTERM from the kernel when this process ends, however it ends (SIGKILL included), since
each runs in its own session and nothing else would reap it (`die_with_parent`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import grpc

from specdec.tools import forkserver


class ServiceFailed(RuntimeError):
    """A child service exited or did not become healthy in time."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; `signum` says which (the exit status is 128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Children:
    """The child processes this command started and has not reaped yet, and the signal
    state of `stops_children`."""

    def __init__(self) -> None:
        self.procs: dict[int, tuple[subprocess.Popen, bool]] = {}  # pid -> (proc, own group)
        self.guarded = 0  # depth of `guarded` sections: a signal waits for their end
        self.pending: int | None = None  # a signal that arrived in a guarded section
        self.stopping = False  # the command was interrupted (or is cleaning up)
        self.interrupted: int | None = None  # the signal that told it to stop
        self.active = False  # inside stops_children: signals interrupt

    def alive(self) -> list[tuple[subprocess.Popen, bool]]:
        return [(p, group) for p, group in self.procs.values() if p.poll() is None]


CHILDREN = _Children()


def register(proc: subprocess.Popen, own_group: bool = False) -> subprocess.Popen:
    """Record a child so that `stops_children` stops it if nothing else does; own_group: it
    leads a process group of its own (start_new_session), signalled as a whole."""
    CHILDREN.procs[proc.pid] = (proc, own_group)
    return proc


def forget(proc: subprocess.Popen) -> None:
    """A child that has been reaped."""
    CHILDREN.procs.pop(proc.pid, None)


def check_interrupted() -> None:
    """Raise Interrupted again when the command has been told to stop: nothing starts, and
    no wait goes on, after that (called before every start and in every wait)."""
    if CHILDREN.active and CHILDREN.interrupted is not None:
        raise Interrupted(CHILDREN.interrupted)


def die_with_parent(cpus: set[int] | None = None) -> list[str]:
    """The argv prefix that makes a child get SIGTERM when this process ends (util-linux's
    `setpriv --pdeathsig`, Linux; asked only from the main thread, which lives as long as
    the process: the kernel signals the child when the thread that started it ends) and run
    on `cpus` when given (`taskset`), both before the child's own program starts, so every
    thread it starts inherits the CPUs.

    Not a Popen preexec_fn: Python code between fork and exec in a process with threads
    can deadlock the child (a lock another thread held at the fork), and the tests' and
    `specdec up`'s processes have threads: a gateway's start hung there in a test run."""
    prefix: list[str] = []
    main = threading.current_thread() is threading.main_thread()
    if sys.platform == "linux" and main and shutil.which("setpriv"):
        prefix += ["setpriv", "--pdeathsig", "TERM", "--"]
    if cpus:
        prefix += ["taskset", "--cpu-list", ",".join(str(c) for c in sorted(cpus))]
    return prefix


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """A section a signal does not split: start a child and register it, stop one. The
    signal is raised (as Interrupted) when the outermost section ends."""
    CHILDREN.guarded += 1
    try:
        yield
    finally:
        CHILDREN.guarded -= 1
        if not CHILDREN.guarded and CHILDREN.pending is not None and not CHILDREN.stopping:
            signum, CHILDREN.pending = CHILDREN.pending, None
            CHILDREN.stopping = True
            raise Interrupted(signum)


def _on_signal(signum: int, frame) -> None:
    if not CHILDREN.active:
        return
    if CHILDREN.stopping:  # a second signal while stopping: no more waiting
        _signal_all(signal.SIGKILL)
        return
    CHILDREN.interrupted = signum  # from now on nothing starts (check_interrupted)
    if CHILDREN.guarded:
        CHILDREN.pending = signum
        return
    CHILDREN.stopping = True
    raise Interrupted(signum)


def _signal_all(signum: int) -> None:
    for proc, own_group in CHILDREN.alive():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if own_group:
                os.killpg(proc.pid, signum)
            else:
                proc.send_signal(signum)


def stop_all(timeout: float = 20.0) -> None:
    """Terminate every recorded child still running (SIGTERM to it or its group), wait up
    to `timeout` seconds in all, then SIGKILL what is left; reap them."""
    if not CHILDREN.alive():
        return
    _signal_all(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while CHILDREN.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal_all(signal.SIGKILL)
    for proc, own_group in list(CHILDREN.procs.values()):
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        if own_group:  # what the child left in its group (its own children)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        forget(proc)


@contextlib.contextmanager
def stops_children() -> Iterator[None]:
    """The scope of a command that starts processes: SIGINT and SIGTERM raise Interrupted
    in it, and every child it recorded is stopped when it ends, however it ends."""
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    CHILDREN.active, CHILDREN.stopping, CHILDREN.pending = True, False, None
    CHILDREN.interrupted = None
    try:
        yield
    finally:
        CHILDREN.stopping = True  # a signal now hurries the stop instead of cutting it
        try:
            stop_all()
        finally:
            CHILDREN.active = False
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def stopping_children(command: Callable[..., int]) -> Callable[..., int]:
    """A command function run under `stops_children`."""

    @functools.wraps(command)
    def run(*args, **kw) -> int:
        with stops_children():
            return command(*args, **kw)

    return run


class ServiceProcess:
    """One `specdec serve ...` child. Listens on --port 0; the port is read from its log."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        log_path: str | None = None,
        cpus: Sequence[int] | None = None,
    ):
        self.name = name
        self.cpus = set(cpus) if cpus else None
        self.argv = list(argv)
        self.env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.log_path = log_path
        self.port: int | None = None
        self.lines: deque[str] = deque(maxlen=400)
        self._port_seen = threading.Event()
        self.proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None  # reads its output into `lines`

    @classmethod
    def specdec(cls, name: str, *args: str, **kw) -> ServiceProcess:
        return cls(name, [sys.executable, "-m", "specdec", *args], **kw)

    @property
    def address(self) -> str:
        if self.port is None:
            raise ServiceFailed(f"{self.name} has not reported its port")
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The started process's id."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} has not started")
        return self.proc.pid

    def start(self) -> ServiceProcess:
        check_interrupted()
        prefix = [sys.executable, "-m", "specdec"]
        args = self.argv[len(prefix) :]
        if (
            forkserver.wanted()
            and self.argv[: len(prefix)] == prefix
            and forkserver.forkable(args, self.env)
        ):
            with guarded():
                self.proc = register(
                    forkserver.Client.spawn(args, self.env, self.cpus),  # type: ignore[arg-type]
                    own_group=True,
                )
            self._read_output()
            return self
        with guarded():  # recorded as soon as it exists
            self.proc = register(
                subprocess.Popen(
                    [*die_with_parent(self.cpus), *self.argv],
                    env=self.env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,  # Ctrl-C in a terminal reaches the parent only
                    # Pinned before its program starts, and ends with this process,
                    # however it ends (die_with_parent's argv prefix).
                ),
                own_group=True,
            )
        self._read_output()
        return self

    def _read_output(self) -> None:
        self._reader = threading.Thread(target=self._pump, daemon=True, name=f"{self.name}-log")
        self._reader.start()

    def _pump(self) -> None:
        sink = open(self.log_path, "a") if self.log_path else None  # noqa: SIM115
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if sink:
                sink.write(line)
                sink.flush()
            if self.port is None and '"listening"' in line:
                try:
                    self.port = int(json.loads(line)["port"])
                    self._port_seen.set()
                except (ValueError, KeyError):
                    pass
        if sink:
            sink.close()

    def tail(self, n: int = 40) -> str:
        return "\n".join(list(self.lines)[-n:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(
        self,
        timeout: float = 120.0,
        credentials: grpc.ChannelCredentials | None = None,
        options: tuple = (),
    ) -> ServiceProcess:
        """Block until grpc.health.v1 answers SERVING (raises ServiceFailed otherwise);
        credentials: for a service that serves TLS; options: channel options (such as the
        name to check in its certificate)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        while not self._port_seen.wait(0.1):
            self._check_running()
            if time.monotonic() > deadline:
                raise ServiceFailed(f"{self.name} never reported its port:\n{self.tail()}")
        channel = (
            grpc.insecure_channel(self.address, options=options)
            if credentials is None
            else grpc.secure_channel(self.address, credentials, options=options)
        )
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                self._check_running()
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise ServiceFailed(f"{self.name} not SERVING after {timeout}s:\n{self.tail()}")
                time.sleep(0.2)

    def _check_running(self) -> None:
        check_interrupted()
        if not self.alive():
            code = self.proc.returncode if self.proc else None
            raise ServiceFailed(f"{self.name} exited with code {code}: {self.why()}")

    def why(self) -> str:
        """Why the service exited: its one-line error (`specdec: ...`, a refused setting
        or model, a failed start), else the end of its output."""
        if self._reader is not None:
            self._reader.join(2)  # its last words reach `lines` once its output closes
        said = [line for line in self.lines if line.startswith("specdec: ")]
        return said[-1] if said else "\n" + self.tail()

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM to its process group, wait, then SIGKILL. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        forget(self.proc)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._signal(signal.SIGKILL)
            self.proc.wait()
        if self.proc is not None:
            forget(self.proc)

    def _signal(self, signum: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signum)  # its group: the service and what it started
