"""A throwaway local Prometheus server scraping given targets, with its HTTP query API.

Used by `make docs-screenshots` (the dashboard rendered from a real run). Needs Debian's
`prometheus` binary (`make system-deps`). The server listens on 127.0.0.1 only and keeps
its TSDB in a temporary directory, removed on `stop()`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from specdec.tools.redisproc import free_port

__all__ = ["PrometheusProcess"]


class PrometheusProcess:
    """`with PrometheusProcess({job: "HOST:PORT"}) as prom:` scrapes every `scrape_s` seconds."""

    def __init__(self, targets: dict[str, str], scrape_s: int = 1):
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError(
                "the prometheus binary is not installed (Debian: `make system-deps`)"
            )
        self.binary = binary
        self.targets = targets
        self.scrape_s = scrape_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._dir: Path | None = None
        self._proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> PrometheusProcess:
        """Starts the server and waits until it is ready (stopped again if it never is)."""
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="specdec-prometheus-"))
        jobs = "".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']\n"
            for job, target in self.targets.items()
        )
        config = self._dir / "prometheus.yml"
        config.write_text(
            f"global:\n  scrape_interval: {self.scrape_s}s\n"
            f"  evaluation_interval: {self.scrape_s}s\nscrape_configs:\n{jobs}"
        )
        log = open(self._dir / "prometheus.log", "w")  # noqa: SIM115 (closed with the process)
        self._proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self._dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited with {self._proc.returncode}:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus not ready after {timeout}s:\n{self.tail()}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def tail(self, lines: int = 20) -> str:
        if self._dir is None or not (self._dir / "prometheus.log").exists():
            return ""
        return "\n".join((self._dir / "prometheus.log").read_text().splitlines()[-lines:])

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path> with the query parameters; the `data` of a successful answer."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=30) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path} {params}: {body}")
        return body["data"]

    def query_range(self, promql: str, start: float, end: float, step: float) -> list[dict]:
        """The matrix of a range query: [{"metric": {...}, "values": [[t, "v"], ...]}, ...]."""
        return self.api("query_range", query=promql, start=start, end=end, step=step)["result"]

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> PrometheusProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
