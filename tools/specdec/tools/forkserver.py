"""A fork server for replica processes: torch and transformers imported once, a service
forked from that process per start.

A drafter or verifier spends most of its start-up importing torch and transformers (3-4 s
of CPU on the 2-core test machines), far more than loading a tiny model. The integration
tests start a few hundred replicas, so with ``SPECDEC_FORK_SERVER=1`` in the environment
(tests/conftest.py sets it) `specdec.tools.launcher.ServiceProcess` asks this server for
``specdec serve drafter|verifier ...`` instead of exec'ing a new interpreter. The server
(``python -m specdec.tools.forkserver``, one per process that starts services, started on
first use) imports what a replica imports, starts no thread, then for each request forks a
child that becomes the service: its own session (as ``start_new_session``), the requested
CPUs, environment and working directory, stdout and stderr on the caller's pipe, fresh
random seeds, and then the same ``specdec.cli.main`` the ``specdec`` command runs. The
child is a real process running the real command line; only the interpreter's start is
shared. Its exit status comes back over a socket of its own (`ForkedProcess`, which acts
as the `subprocess.Popen` the launcher uses).

Not used for the gateway (torch-free, it starts fast) nor where the requested environment
differs from the server's in a variable that a library may read at import time (anything
but ``SPECDEC_*``, ``OTEL_*`` and ``PYTHONUNBUFFERED``): those start by exec as before.
Production never uses it: `specdec up` and the images exec each service. A forked
service's numpy runs its BLAS on one thread (the server sets OPENBLAS_NUM_THREADS=1 before
importing it, so that no thread exists when it forks); the services do not use numpy's BLAS.

The protocol (a Unix socket pair): the caller sends one JSON request per child with two
file descriptors (the write end of the child's output pipe and one end of a socket pair
for its status); the server answers the child's pid on that status socket, then its
``waitpid`` status when it has reaped it.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading

ENV = "SPECDEC_FORK_SERVER"
# Variables a child may set differently from the server: read by specdec at run time, never
# by a library at import time.
FREE_PREFIXES = ("SPECDEC_", "OTEL_", "PYTHONUNBUFFERED")
ROLES = ("drafter", "verifier")
MAX_REQUEST = 1 << 20
# Imported by the server before it forks: the service's modules and what loading a model
# imports lazily (from_pretrained pulls in accelerate, torch.distributed, dynamo, sympy).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "sympy",
    "accelerate",
    "safetensors.torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.generation",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "specdec.cli",
    "specdec.serve",
    "specdec.drafter.server",
    "specdec.verifier.server",
)


def wanted() -> bool:
    return os.environ.get(ENV, "") == "1"


def forkable(args: list[str], env: dict[str, str]) -> bool:
    """Whether `specdec <args>` under `env` may be forked from a server started in this
    process's environment."""
    if len(args) < 2 or args[0] != "serve" or args[1] not in ROLES:
        return False
    keys = set(env) | set(os.environ)
    return all(env.get(k) == os.environ.get(k) for k in keys if not k.startswith(FREE_PREFIXES))


# ---- the caller's side (torch-free) -------------------------------------------------------


class ForkedProcess:
    """A service forked by the server, with the part of `subprocess.Popen`'s interface the
    launcher and the tests use: pid, stdout, poll, wait, send_signal, terminate, kill,
    returncode. Exit statuses follow Popen's: -N for a child killed by signal N."""

    def __init__(self, pid: int, stdout, status: socket.socket, argv: list[str]):
        self.pid = pid
        self.stdout = stdout
        self.args = argv
        self.returncode: int | None = None
        self._status = status
        self._lock = threading.Lock()

    def _collect(self, timeout: float | None) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            ready, _, _ = select.select([self._status], [], [], timeout)
            if not ready:
                return
            data = self._status.recv(4)
            self._status.close()
            if len(data) == 4:
                self.returncode = _returncode(struct.unpack("!i", data)[0])
            else:  # the server died before it reaped the child: wait for the pid to go
                while _exists(self.pid):
                    select.select([], [], [], 0.05)
                self.returncode = -signal.SIGKILL

    def poll(self) -> int | None:
        self._collect(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._collect(timeout)
        if self.returncode is None:
            assert timeout is not None  # without one, _collect waits for the exit
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _returncode(status: int) -> int:
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


class Client:
    """This process's fork server, started on first use."""

    _lock = threading.Lock()
    _sock: socket.socket | None = None
    _server: subprocess.Popen | None = None

    @classmethod
    def spawn(cls, args: list[str], env: dict[str, str], cpus: set[int] | None) -> ForkedProcess:
        read_end, write_end = os.pipe()
        mine, theirs = socket.socketpair()
        request = {"args": args, "env": env, "cwd": os.getcwd(), "cpus": sorted(cpus or ())}
        try:
            with cls._lock:
                sock = cls._connect()
                payload = json.dumps(request).encode()
                sock.sendmsg(
                    [struct.pack("!I", len(payload)), payload],
                    [
                        (
                            socket.SOL_SOCKET,
                            socket.SCM_RIGHTS,
                            array.array("i", [write_end, theirs.fileno()]),
                        )
                    ],
                )
            data = b""
            while len(data) < 4:
                chunk = mine.recv(4 - len(data))
                if not chunk:
                    raise RuntimeError("the fork server closed without starting the service")
                data += chunk
        finally:
            os.close(write_end)
            theirs.close()
        pid = struct.unpack("!i", data)[0]
        stdout = os.fdopen(read_end, "r", encoding="utf-8", errors="replace")
        return ForkedProcess(pid, stdout, mine, [sys.executable, "-m", "specdec", *args])

    @classmethod
    def _connect(cls) -> socket.socket:
        if cls._sock is not None and cls._server is not None and cls._server.poll() is None:
            return cls._sock
        mine, theirs = socket.socketpair()
        cls._server = subprocess.Popen(
            [sys.executable, "-m", "specdec.tools.forkserver", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            start_new_session=True,  # a Ctrl-C meant for the caller does not reach it
        )
        theirs.close()
        ready = mine.recv(5)
        if ready != b"ready":
            raise RuntimeError(f"the fork server did not start (exit {cls._server.wait()})")
        cls._sock = mine
        return mine


# ---- the server ---------------------------------------------------------------------------


def _recv_request(sock: socket.socket) -> tuple[dict, list[int]] | None:
    fds = array.array("i")
    msg, ancdata, _, _ = sock.recvmsg(4, socket.CMSG_LEN(2 * fds.itemsize))
    if not msg:
        return None
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    (size,) = struct.unpack("!I", msg)
    if size > MAX_REQUEST:
        raise ValueError(f"request of {size} bytes")
    payload = b""
    while len(payload) < size:
        chunk = sock.recv(size - len(payload))
        if not chunk:
            return None
        payload += chunk
    return json.loads(payload), list(fds)


def _become_service(request: dict, out_fd: int) -> int:
    """In the forked child: set up the process as `Popen(start_new_session=True,
    preexec_fn=affinity)` would have, then run the specdec command."""
    os.setsid()
    if request["cpus"]:
        os.sched_setaffinity(0, set(request["cpus"]))
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    import random

    import torch

    random.seed()
    torch.seed()  # the server's generator state is every child's otherwise
    sys.argv = [sys.argv[0], *request["args"]]
    from specdec.cli import main

    try:
        code = main(request["args"])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # what the interpreter would print for an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code or 0


def serve(sock: socket.socket) -> None:
    # What a replica imports, from_pretrained's lazy imports included: every fork then
    # starts with it in memory.
    import importlib

    # numpy's OpenBLAS starts a pool of threads at import unless told to use one; the
    # services do not use it (torch has its own BLAS), and one thread keeps the fork safe.
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        raise RuntimeError("an import started a thread: forking would copy a half-held lock")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock.sendall(b"ready")
    children: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([sock], [], [], 0.05)
        _reap(children)
        if not ready:
            continue
        got = _recv_request(sock)
        if got is None:  # the caller is gone
            return
        request, (out_fd, status_fd) = got
        status = socket.socket(fileno=status_fd)
        pid = os.fork()
        if pid == 0:
            sock.close()
            status.close()
            for other in children.values():
                other.close()
            code = 1
            try:
                code = _become_service(request, out_fd)
            finally:
                os._exit(code)
        os.close(out_fd)
        with contextlib.suppress(OSError):
            status.sendall(struct.pack("!i", pid))
        children[pid] = status


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock = children.pop(pid, None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.sendall(struct.pack("!i", status))
            sock.close()


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
