"""How many functions a request's temperature passes through, from the HTTP body to the
sampling code, through real processes.

A drafter, a verifier and a gateway serving HTTP, on tiny fp32 models, each started with
a `sitecustomize` (tests/integration/tracing_site) that records every function of the
project's code called with the traced temperature among its arguments, or its immediate
holder: the HTTP body, the typed Request's `Sampling`, the resolved `SamplingParams` and
the wire's `SamplingParams` message. A function that passes the request on in a larger
object (the Job, a round's calls) does not handle the temperature and is not counted.
One chat completion at that temperature, then the records.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest

import specdec.gateway
from tests.integration.test_gateway import replica
from tests.integration.test_http import free_port, http_gateway

pytestmark = pytest.mark.integration

TEMPERATURE = 0.734375  # 47/64: the same in float32 (the wire) and float64; nothing else holds it
# The design's bar. Measured on 2026-11-29: 11 functions, 7 in the gateway (the chat door,
# the body's parse, the typed Request's build, Sampling.resolve into SamplingParams, its
# own checks, greedy, the wire's to_proto) and 4 in the verifier (from_proto into
# SamplingParams, its checks, greedy, warp); it was 30 when the gateway and the verifier
# each went through resolve, check and the controls' checks as separate calls.
MAX_STOPS = 12
SITE = Path(__file__).parent / "tracing_site"
ROOT = Path(specdec.gateway.__file__).resolve().parents[4]  # the checkout


def _traced(out: Path) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {
        "PYTHONPATH": os.pathsep.join(p for p in (str(SITE), path) if p),
        "SPECDEC_TRACE_TEMPERATURE": repr(TEMPERATURE),
        "SPECDEC_TRACE_OUT": str(out),
        "SPECDEC_TRACE_ROOTS": os.pathsep.join(str(ROOT / part) for part in ("services", "sdk")),
    }


def _stops(out: Path) -> list[str]:
    return out.read_text().split() if out.exists() else []


def test_temperature_from_the_http_body_to_the_sampling_code(test_models, tmp_path):
    files = {role: tmp_path / f"{role}.trace" for role in ("drafter", "verifier", "gateway")}
    procs = []
    try:
        d = replica("drafter", test_models.draft_noisy, env=_traced(files["drafter"]))
        procs.append(d)
        v = replica("verifier", test_models.target, env=_traced(files["verifier"]))
        procs.append(v)
        d.wait_healthy(), v.wait_healthy()
        port = free_port()
        g = http_gateway(d.address, v.address, port, env=_traced(files["gateway"]))
        procs.append(g)
        g.wait_healthy()
        body = {
            "model": "target",
            "messages": [{"role": "user", "content": "Count to ten."}],
            "max_tokens": 6,
            "temperature": TEMPERATURE,
            "seed": 7,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert answer["choices"][0]["message"]["content"]
    finally:
        for p in reversed(procs):
            p.stop()
    gateway, verifier = _stops(files["gateway"]), _stops(files["verifier"])
    report = "\n".join(
        [f"gateway ({len(gateway)}):", *gateway, f"verifier ({len(verifier)}):", *verifier]
    )
    print(report)
    # The trace runs from the door to the sampling code: the HTTP body's parser first ...
    assert any("front.http" in s for s in gateway), report
    # ... the verifier's warp of the logits last.
    assert "specdec.replica.sampling:warp" in verifier, report
    # One conversion to the wire's message, in the gateway; one back, in the verifier.
    assert [s for s in gateway if "proto" in s] == ["specdec.sdk.request:Sampling.to_proto"], report
    assert [s for s in verifier if s.endswith("to_proto")] == [], report
    assert len(gateway) + len(verifier) <= MAX_STOPS, report
