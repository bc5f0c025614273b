"""A real Prometheus server scrapes the gateway, the drafter and the verifier on loopback;
its query API must return the counters and gauges that match the requests just made.

Needs the `prometheus` binary (Debian: `apt-get install -y prometheus`); the test fails
with that message when it is missing, it does not skip.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest

from specdec.sdk import Client
from specdec.tools.launcher import ServiceProcess
from specdec.tools.redisproc import free_port
from specdec.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2_grpc
from tests.conftest import PROMPTS

pytestmark = pytest.mark.integration

MAX_CACHED = 4096


def serve(role: str, *flags: str) -> ServiceProcess:
    return ServiceProcess.specdec(
        role, "serve", role, "--port", "0", "--host", "127.0.0.1", *flags
    ).start()


class Prometheus:
    """A real `prometheus` server scraping `targets` ({job: HOST:PORT}) every second."""

    def __init__(self, workdir: Path, targets: dict[str, str]):
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail(
                "the prometheus binary is not installed; install it with "
                "`apt-get install -y prometheus` (Debian) to run this test"
            )
        config = workdir / "prometheus.yml"
        jobs = "\n".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']"
            for job, target in targets.items()
        )
        config.write_text(
            f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n{jobs}\n"
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / "prometheus.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("prometheus not ready")

    def query(self, promql: str) -> float | None:
        """An instant query's single value (None when it returns no series)."""
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        result = body["data"]["result"]
        if not result:
            return None
        assert len(result) == 1, f"{promql}: {len(result)} series"
        return float(result[0]["value"][1])

    def wait_for(self, expected: dict[str, float], timeout: float = 90) -> dict[str, float | None]:
        """Poll until every query returns its expected value; returns the last values."""
        deadline = time.monotonic() + timeout
        while True:
            got = {q: self.query(q) for q in expected}
            if all(got[q] is not None and got[q] == pytest.approx(v) for q, v in expected.items()):
                return got
            if time.monotonic() > deadline:
                return got
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def scraped(test_models, tmp_path_factory):
    ports = {role: free_port() for role in ("gateway", "drafter", "verifier")}
    procs = []
    prom = None
    try:
        common = ("--threads", "1", "--max-cached-tokens", str(MAX_CACHED))
        d = serve("drafter", "--model", str(test_models.draft_noisy), *common,
                  "--metrics-port", str(ports["drafter"]))  # fmt: skip
        v = serve("verifier", "--model", str(test_models.target), *common,
                  "--metrics-port", str(ports["verifier"]))  # fmt: skip
        procs += [d, v]
        d.wait_healthy(), v.wait_healthy()
        g = serve("gateway", "--drafter", d.address, "--verifier", v.address,
                  "--metrics-port", str(ports["gateway"]), "--k-policy", "fixed")  # fmt: skip
        procs.append(g)
        g.wait_healthy()
        prom = Prometheus(
            tmp_path_factory.mktemp("prometheus"),
            {role: f"127.0.0.1:{port}" for role, port in ports.items()},
        )
        prom.wait_ready()
        yield {"prometheus": prom, "drafter": d, "verifier": v, "gateway": g}
    finally:
        if prom:
            prom.stop()
        for p in procs:
            p.stop()


def _info(address: str, stub_type) -> common_pb2.ModelInfo:
    with grpc.insecure_channel(address) as channel:
        return stub_type(channel).Info(common_pb2.InfoRequest(), timeout=30)


def test_prometheus_scrapes_every_service(scraped, tokenizer):
    prom = scraped["prometheus"]
    gens = []
    with Client(scraped["gateway"].address, timeout=120) as client:
        ids = tokenizer(PROMPTS[0]).input_ids
        gens.append(client.generate(token_ids=ids, max_new_tokens=32, k=4, ssd=True))
        gens.append(client.generate(PROMPTS[1], max_new_tokens=24, k=2, ssd=False))
        # Sampling with SSD: every hit is a Draft answered from a prepared branch.
        session = client.generate(
            PROMPTS[2], max_new_tokens=32, k=3, ssd=True, temperature=1.0, seed=7,
            session_id="prom",
        )  # fmt: skip
        gens.append(session)

    def total(field: str) -> int:
        return sum(getattr(g.stats, field) for g in gens)

    assert total("ssd_hits") > 0 and session.stats.ssd_hits > 0
    # One-off requests release their caches in the background: wait until only the
    # session's remain, as the replicas themselves report in Info.
    deadline = time.monotonic() + 30
    while True:
        d_info = _info(scraped["drafter"].address, drafter_pb2_grpc.DrafterServiceStub)
        v_info = _info(scraped["verifier"].address, verifier_pb2_grpc.VerifierServiceStub)
        if d_info.cached_sessions == v_info.cached_sessions == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert d_info.cached_sessions == v_info.cached_sessions == 1
    # The verifier holds the session's context and accepted drafts: everything but the
    # last token, which was generated and never fed back.
    session_tokens = session.usage.prompt_tokens + session.usage.completion_tokens
    assert v_info.cached_tokens == session_tokens - 1

    expected = {
        # the gateway's spec-decode counters = the responses' statistics
        "specdec_gateway_spec_decode_num_drafts_total": total("rounds"),  # k > 0 throughout
        "specdec_gateway_spec_decode_num_draft_tokens_total": total("draft_tokens"),
        "specdec_gateway_spec_decode_num_accepted_tokens_total": total("accepted_tokens"),
        "specdec_gateway_generation_tokens_total": sum(g.usage.completion_tokens for g in gens),
        "specdec_gateway_ssd_hits_total": total("ssd_hits"),
        "specdec_gateway_ssd_misses_total": total("ssd_misses"),
        "specdec_gateway_ssd_branches_total": total("ssd_branches"),
        "specdec_gateway_replica_cache_misses_total": 0,
        # the k each round used (fixed policy here: the request's k but near the end)
        'sum(specdec_gateway_spec_decode_rounds_by_k_total{k_policy="fixed"})': total("rounds"),
        'specdec_gateway_spec_decode_rounds_by_k_total{k_policy="fixed",k="4"}': sum(
            g.stats.rounds_by_k[4] for g in gens if len(g.stats.rounds_by_k) > 4
        ),
        "specdec_gateway_adaptive_k0_rounds_total": 0,
        "specdec_gateway_ssd_speculates_total": total("ssd_speculates"),
        "sum(specdec_gateway_round_seconds_count)": total("rounds"),
        "sum(specdec_gateway_requests_total)": len(gens),
        # the verifier saw every round once
        "specdec_verifier_spec_decode_num_draft_tokens_total": total("draft_tokens"),
        "specdec_verifier_spec_decode_num_accepted_tokens_total": total("accepted_tokens"),
        'specdec_verifier_requests_total{method="Verify",code="OK"}': total("rounds"),
        "sum(specdec_verifier_model_forward_seconds_count)": total("rounds"),
        'specdec_verifier_model_forward_seconds_count{kind="prefill"}': len(gens),
        "specdec_verifier_cache_misses_total": 0,
        # queues and KV memory, idle now
        "specdec_verifier_num_requests_waiting": 0,
        "specdec_verifier_num_requests_running": 0,
        "specdec_drafter_num_requests_waiting": 0,
        "specdec_drafter_num_requests_running": 0,
        "specdec_verifier_cached_sessions": 1,
        "specdec_drafter_cached_sessions": 1,
        "specdec_verifier_cached_tokens": v_info.cached_tokens,
        "specdec_drafter_cached_tokens": d_info.cached_tokens,
        "specdec_verifier_max_cached_tokens": MAX_CACHED,
        "specdec_drafter_max_cached_tokens": MAX_CACHED,
        "specdec_verifier_kv_cache_usage_perc": v_info.cached_tokens / MAX_CACHED,
        "specdec_drafter_kv_cache_usage_perc": d_info.cached_tokens / MAX_CACHED,
    }
    got = prom.wait_for(expected)
    wrong = {q: (got[q], v) for q, v in expected.items() if got[q] != pytest.approx(v)}
    assert not wrong, f"query: (prometheus, expected): {wrong}"
    # Every SSD round sent one Speculate. One that answered before its verdict is a hit or
    # a miss there; one still running at its verdict (`late`, counted by the gateway) is
    # cancelled, and the next round's Draft settles it as a hit or a miss. The drafter
    # answers OK the ones that finished, so its count is within `late` of the rounds the
    # responses settled; it prepared the responses' branches, and a late one it finished
    # anyway added up to one fan-out more.
    late = prom.query("specdec_gateway_ssd_speculate_late_total") or 0
    speculated = total("ssd_hits") + total("ssd_misses")
    speculates = prom.query('specdec_drafter_requests_total{method="Speculate",code="OK"}') or 0
    assert speculated - late <= speculates <= speculated + late
    prepared = prom.query("specdec_drafter_ssd_branches_prepared_total")
    fan_out = 6  # the drafter's default --ssd-fan-out
    assert total("ssd_branches") <= prepared <= total("ssd_branches") + fan_out * late
    # A hit is served by the next round's Draft; a hit on the last round that leaves room
    # for no further draft is never asked for (at most one per request).
    served = prom.query("specdec_drafter_ssd_branches_served_total")
    # Greedy requests take a hit's draft from the Speculate answer itself, unless that
    # answer came late and the next Draft was served from the drafter's branches.
    assert session.stats.ssd_hits - 1 <= served <= total("ssd_hits")
    # Every target was scraped successfully.
    for job in ("gateway", "drafter", "verifier"):
        assert prom.query(f'up{{job="{job}"}}') == 1


DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "specdec" / "dashboards" / "specdec.json"


def test_dashboard_queries_run_on_real_prometheus(scraped):
    """Every query of the shipped Grafana dashboard parses in Prometheus and, after
    traffic, returns data: the metric names it uses are the ones the services export."""
    prom = scraped["prometheus"]
    with Client(scraped["gateway"].address, timeout=120) as client:
        for i in range(3):
            client.generate(PROMPTS[i], max_new_tokens=16, k=3, ssd=True)
        # the adaptive policy's panels (the stack runs --k-policy fixed)
        client.generate(PROMPTS[0], max_new_tokens=16, k=3, k_policy="adaptive")
    dashboard = json.loads(DASHBOARD.read_text())
    queries = {
        t["expr"].replace("$__rate_interval", "5m"): panel["title"]
        for panel in dashboard["panels"]
        for t in panel.get("targets", [])
    }
    assert len(queries) >= 20
    # Metrics that only move on failures, under memory pressure or under concurrent load
    # (the goodput guard measures from 2 sessions) have no data here, nor the guard's roles,
    # which exist where the gateway's replicas share it through Redis (this stack has none;
    # the screenshots' run does: tests/integration/test_screenshots.py).
    quiet = ("request_errors", "failovers", "evictions", "cache_misses", "guard_goodput",
             "guard_role")  # fmt: skip
    time.sleep(3)  # a scrape after the requests
    empty = []
    for expr, title in queries.items():
        url = prom.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", (title, expr, body)
        if not body["data"]["result"] and not any(q in expr for q in quiet):
            empty.append((title, expr))
    assert not empty, f"queries with no data: {empty}"
