"""Peer benchmark clients against `specdec up` on tiny models (`make test-peers`): each
finishes its requests with 0 errors, and every request field it sent is one the gateway
serves (the recording proxy keeps their bodies)."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request

import pytest

from tests.peers.conftest import PEERS, SKIP_REASON, Stack, tool

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not PEERS, reason=SKIP_REASON)]

REQUESTS = 16  # per tool: enough to reach every code path of its client, quick on tiny models
PROMPT_TOKENS = 48
OUTPUT_TOKENS = 24


def sent_fields(stack: Stack, since: int) -> dict[str, set[str]]:
    """The body fields of the POSTs recorded after the first `since`, by path."""
    out: dict[str, set[str]] = {}
    for path, body in stack.recorder.requests()[since:]:
        out.setdefault(path, set()).update(body)
    return out


def refusals(stack: Stack, since: int) -> list[str]:
    """Replays the POSTs recorded after the first `since` (the gateway's answers are
    deterministic) and returns the gateway's message for each one it refuses, with the
    body's fields: what a peer tool sent that the gateway does not serve."""
    out = []
    for path, body in stack.recorder.requests()[since:]:
        req = urllib.request.Request(
            stack.direct + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                r.read()
        except urllib.error.HTTPError as e:
            message = json.loads(e.read())["error"]["message"]
            out.append(f"{e.code} {message} (fields: {sorted(body)})")
    return sorted(set(out))


def run(argv: list[str], timeout: int) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{argv[0]} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


def test_guidellm_synthetic_chat_has_no_errors(up: Stack, tmp_path):
    before = len(up.recorder.requests())
    report = tmp_path / "guidellm.json"
    scenario = {
        "backend": {
            "kind": "openai_http",
            "target": up.http,
            "model": up.model,
            "request_format": "/v1/chat/completions",
            "timeout": 300,
        },
        "profile": {"kind": "concurrent", "streams": 2},
        "tokenizer": {"kind": "huggingface_auto", "model": up.tokenizer},
        "data": [
            {
                "kind": "synthetic_text",
                "prompt_tokens": PROMPT_TOKENS,
                "output_tokens": OUTPUT_TOKENS,
            }
        ],
        "constraints": [{"kind": "max_requests", "count": REQUESTS}],
        "outputs": [{"kind": "json", "path": str(report)}],
    }
    config = tmp_path / "scenario.json"
    config.write_text(json.dumps({"spec": scenario}))
    done = run(
        [str(tool("guidellm", "guidellm")), "run", "--scenario", str(config), "--disable-progress"],
        timeout=900,
    )
    totals = guidellm_totals(json.loads(report.read_text()))
    if totals["errored"] or totals["incomplete"]:
        pytest.fail(f"guidellm: {totals}; refused: {refusals(up, before)}\n{done.stdout[-2000:]}")
    assert totals["successful"] == REQUESTS, totals
    fields = sent_fields(up, before)
    assert set(fields) == {"/v1/chat/completions"}, fields
    print("guidellm sent:", sorted(fields["/v1/chat/completions"]))


def guidellm_totals(report: dict) -> dict[str, int]:
    """Request counts by status over the report's benchmarks."""
    totals = {"successful": 0, "errored": 0, "incomplete": 0}
    for bench in report["benchmarks"]:
        counts = bench["metrics"]["request_totals"]
        for key in totals:
            totals[key] += int(counts[key])
    return totals


def test_aiperf_synthetic_completions_has_no_errors(up: Stack, tmp_path):
    before = len(up.recorder.requests())
    artifacts = tmp_path / "aiperf"
    argv = [
        str(tool("aiperf", "aiperf")), "profile",
        "--model", up.model, "--tokenizer", up.tokenizer,
        "--url", up.http, "--endpoint-type", "completions", "--streaming",
        "--synthetic-input-tokens-mean", str(PROMPT_TOKENS),
        "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-stddev", "0",
        "--request-count", str(REQUESTS), "--concurrency", "2", "--random-seed", "7",
        "--artifact-dir", str(artifacts), "--ui-type", "none",
    ]  # fmt: skip
    done = run(argv, timeout=900)
    sent = up.recorder.requests()[before:]
    fields = sent_fields(up, before)
    failed = refusals(up, before)
    assert not failed, f"aiperf: refused {failed}\n{done.stdout[-2000:]}"
    assert set(fields) == {"/v1/completions"}, fields
    assert len(sent) >= REQUESTS, len(sent)
    exports = list(artifacts.rglob("profile_export_aiperf.json"))
    assert exports, f"no aiperf report under {artifacts}:\n{done.stdout[-2000:]}"
    report = json.loads(exports[0].read_text())
    assert report["error_summary"] == [], report["error_summary"]
    assert report["request_count"]["avg"] == REQUESTS and not report["was_cancelled"], report
    print("aiperf sent:", sorted(fields["/v1/completions"]))
