"""Start specdec services as child processes and wait until they are healthy.

Used by `specdec up` (the local stack) and by the integration tests, so both exercise the
real command line and the real gRPC health protocol. Torch-free.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence

import grpc


class ServiceFailed(RuntimeError):
    """A child service exited or did not become healthy in time."""


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

    @classmethod
    def specdec(cls, name: str, *args: str, **kw) -> ServiceProcess:
        return cls(name, [sys.executable, "-m", "specdec", *args], **kw)

    @property
    def address(self) -> str:
        if self.port is None:
            raise ServiceFailed(f"{self.name} has not reported its port")
        return f"127.0.0.1:{self.port}"

    def start(self) -> ServiceProcess:
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # Ctrl-C in a terminal reaches the parent only
            # Pin before exec, so every thread the service starts inherits the CPU set.
            preexec_fn=(lambda: os.sched_setaffinity(0, self.cpus)) if self.cpus else None,
        )
        threading.Thread(target=self._pump, daemon=True, name=f"{self.name}-log").start()
        return self

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
        if not self.alive():
            code = self.proc.returncode if self.proc else None
            raise ServiceFailed(f"{self.name} exited with code {code}:\n{self.tail()}")

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, wait, then SIGKILL. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
