"""The docs' screenshots from a real local run, taken in headless Chromium (Debian's package).

    python -m specdec.tools.docs.screenshots [--out docs/images] [--seconds 60] [--keep DIR]

`make docs-screenshots` runs this. It builds the tiny test models, starts the local stack
(`specdec up`: Redis, drafter, verifier, gateway) with every metrics port on and its traces
exported to an in-process OTLP receiver, has a real Prometheus scrape the three services
every second, and sends requests through the SDK for `--seconds` (two clients; draft model,
n-gram, suffix and hybrid drafts, SSD, sampling, a conversation per client). Then:

- `dashboard.png`: the chart's Grafana dashboard (`helm/specdec/dashboards/specdec.json`)
  drawn from Prometheus's answers to its own queries over the run (specdec.tools.docs.dashboard);
- `trace.png`: one more request's trace, every span the gateway, drafter and verifier
  exported, as a Jaeger-style timeline (specdec.tools.docs.traceview).

Each page is a local file (no server, no network) shot in a fresh empty Chromium profile.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.tools.docs import dashboard, traceview
from specdec.tools.otlpsink import OtlpReceiver, ReceivedSpan
from specdec.tools.promproc import PrometheusProcess

PROMPTS = (
    "def fibonacci(n):",
    "The quick brown fox",
    "What is the capital of France?",
    "Once upon a time there was a little server",
    "class Counter:\n    def __init__(self, start: int = 0) -> None:\n",
)
SCRAPE_S = 1


@dataclass
class Shots:
    """What a run drew: the images, the dashboard's panels as reported, the trace's summary."""

    dashboard: Path
    trace: Path
    panels: list[dict]  # dashboard.Panel.report() of every panel
    trace_summary: dict  # traceview.summary()
    requests: int
    pages: dict[str, Path] = field(default_factory=dict)  # the HTML pages shot


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    raise RuntimeError("chromium is not installed (Debian: `make system-deps`)")


def shoot(browser: str, page: Path, out: Path, width: int, height: int) -> None:
    """A screenshot of the local page `page` at width x height CSS pixels."""
    with tempfile.TemporaryDirectory(prefix="specdec-chromium-") as profile:
        subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--hide-scrollbars",
                "--force-device-scale-factor=1",
                f"--user-data-dir={profile}",
                f"--screenshot={out.resolve()}",
                f"--window-size={width},{height}",
                page.resolve().as_uri(),
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    if not out.exists() or out.stat().st_size == 0:
        raise RuntimeError(f"chromium wrote no screenshot to {out}")


def traffic(address: str, seconds: float, clients: int = 2) -> int:
    """Requests from `clients` threads for `seconds`, through every kind of draft."""
    from specdec.sdk import Client

    mixes: tuple[dict[str, Any], ...] = (
        {"method": "model", "k": 4, "ssd": True},
        {"method": "ngram", "k": 3},
        {"method": "suffix", "k": 4},
        {"method": "hybrid", "k": 4, "ssd": True, "temperature": 0.8},
        {"method": "model", "k": 2},  # a turn of this client's conversation
    )
    deadline = time.monotonic() + seconds

    def worker(w: int) -> int:
        done = 0
        with Client(address, timeout=120) as client:
            while time.monotonic() < deadline:
                i = w + done * clients
                mix = dict(mixes[i % len(mixes)])
                if i % len(mixes) == len(mixes) - 1:  # six turns a conversation: < 512 tokens
                    mix["session_id"] = f"docs-{w}-{i // (6 * len(mixes))}"
                if "temperature" in mix:
                    mix["seed"] = i
                client.generate(PROMPTS[i % len(PROMPTS)], max_new_tokens=24, **mix)
                done += 1
        return done

    with ThreadPoolExecutor(clients) as pool:  # an error in a client raises here
        return sum(pool.map(worker, range(clients)))


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Variables set for the children started inside (restored after)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _stack_args(models, endpoint: str, ports: dict[str, int]) -> argparse.Namespace:
    from specdec.tools.stack import add_up_parser

    parser = argparse.ArgumentParser()
    add_up_parser(parser.add_subparsers())
    argv = ["up", "--draft-model", str(models.draft_noisy), "--target-model",
            str(models.target), "--port", "0", "--dtype", "float32", "--draft-threads", "1",
            "--target-threads", "1", "--otlp-endpoint", endpoint, "--ssd"]  # fmt: skip
    for role, port in ports.items():
        argv.append(f"--{role}-arg=--metrics-port={port}")
    return parser.parse_args(argv)


def _fixed_port() -> int:
    """A free port below Linux's ephemeral range (32768 and up), so that no service binding
    port 0 in the meantime takes it before the service it is meant for starts."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


def _one_trace(receiver: OtlpReceiver, trace_id: str, timeout: float = 30) -> list[ReceivedSpan]:
    """The trace's spans once the gateway's request span is in and no more come for 1 s."""
    deadline = time.monotonic() + timeout
    count, since = -1, time.monotonic()
    while True:
        spans = receiver.spans(trace_id)
        root = any(s.kind == "SERVER" and s.service == "specdec-gateway" for s in spans)
        if len(spans) != count:
            count, since = len(spans), time.monotonic()
        elif root and time.monotonic() - since >= 1.0:
            return spans
        if time.monotonic() > deadline:
            raise TimeoutError(f"trace {trace_id}: {len(spans)} spans, no gateway request span")
        time.sleep(0.1)


def run(out_dir: Path, seconds: float = 60, work_dir: Path | None = None, models=None) -> Shots:
    """The local run, both pages and both screenshots; `models`: tiny models already built."""
    from specdec.sdk import Client
    from specdec.tools.stack import LocalStack

    browser = chromium()
    out_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if work_dir is None:
            work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="shots-")))
        work_dir.mkdir(parents=True, exist_ok=True)
        if models is None:
            from specdec.tools.tinymodels import build_test_models

            models = build_test_models(work_dir / "models")
        receiver = stack.enter_context(OtlpReceiver())
        ports = {role: _fixed_port() for role in ("drafter", "verifier", "gateway")}
        with _env(OTEL_BSP_SCHEDULE_DELAY="200"):
            local = stack.enter_context(
                LocalStack(_stack_args(models, receiver.endpoint, ports), announce=print)
            )
        prom = stack.enter_context(
            PrometheusProcess({r: f"127.0.0.1:{p}" for r, p in ports.items()}, SCRAPE_S)
        )
        _wait_up(prom, list(ports))
        start = time.time()
        requests = traffic(local.gateway.address, seconds)
        time.sleep(3 * SCRAPE_S)  # the last requests' samples
        end = time.time()
        print(f"{requests} requests in {end - start:.0f} s; tracing one more ...", flush=True)
        with Client(local.gateway.address, timeout=120) as client:
            gen = client.generate(
                PROMPTS[0], max_new_tokens=12, k=4, ssd=True, method="model", session_id="trace"
            )
        spans = _one_trace(receiver, gen.trace_id)

        step = max(SCRAPE_S, round((end - start) / 240))
        board = dashboard.load()
        panels = dashboard.query_panels(board, prom.query_range, start, end, step, SCRAPE_S)
        note = f"Prometheus, {requests} requests from a local run on the tiny test models"
        pages = {"dashboard": work_dir / "dashboard.html", "trace": work_dir / "trace.html"}
        pages["dashboard"].write_text(dashboard.render(board, panels, start, end, note))
        rounds = [s for s in spans if s.name == "speculation round"]
        expand = min(rounds, key=lambda s: s.start_ns).span_id if rounds else ""
        pages["trace"].write_text(traceview.render(spans, expand))
        images = {"dashboard": out_dir / "dashboard.png", "trace": out_dir / "trace.png"}
        shoot(browser, pages["dashboard"], images["dashboard"], dashboard.WIDTH,
              dashboard.page_height(panels))  # fmt: skip
        shoot(browser, pages["trace"], images["trace"], traceview.WIDTH,
              traceview.page_height(spans, expand))  # fmt: skip
        return Shots(
            dashboard=images["dashboard"],
            trace=images["trace"],
            panels=dashboard.report(panels),
            trace_summary=traceview.summary(spans),
            requests=requests,
            pages=pages,
        )


def _wait_up(prom: PrometheusProcess, jobs: list[str], timeout: float = 30) -> None:
    """Until Prometheus has scraped every job successfully."""
    deadline = time.monotonic() + timeout
    while True:
        up = {r["metric"]["job"]: r["value"][1] for r in prom.api("query", query="up")["result"]}
        if all(up.get(job) == "1" for job in jobs):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"prometheus could not scrape every service: up = {up}")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.tools.docs.screenshots")
    p.add_argument("--out", default="docs/images", help="where dashboard.png and trace.png go")
    p.add_argument("--seconds", type=float, default=60, help="how long to send requests")
    p.add_argument("--keep", help="keep the HTML pages and the models in this folder")
    args = p.parse_args(argv)
    shots = run(Path(args.out), args.seconds, Path(args.keep) if args.keep else None)
    empty = [p["title"] for p in shots.panels if not p["points"]]
    print(f"wrote {shots.dashboard}: {len(shots.panels)} panels, "
          f"{sum(p['points'] for p in shots.panels)} points" +
          (f"; no data in: {', '.join(empty)}" if empty else ""))  # fmt: skip
    t = shots.trace_summary
    print(f"wrote {shots.trace}: {t['spans']} spans from {', '.join(t['services'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
