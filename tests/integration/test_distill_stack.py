"""A drafter that learns, end to end through real processes: a distilled drafter serves
beside the one it came from, the gateway splits sessions between them (--drafter-canary)
and records finished requests (--record); every output equals the target's generate(),
the recording holds what was answered and nothing of a request that refused it, and
`specdec distill --data` trains on it."""

from __future__ import annotations

import json
import urllib.request

import pytest

from specdec.cli import main as specdec
from specdec.gateway.fleet.canary import parse_canary, version_rule
from specdec.gateway.sessions import replica_session_id
from specdec.sdk import Client
from specdec.tools.distill.data import read_rows
from specdec.tools.distill.prompts import bench_prompts, build_prompts, write_prompts
from specdec.tools.redisproc import free_port
from tests.conftest import PROMPTS
from tests.integration.test_gateway import gateway, ids_of, replica

pytestmark = pytest.mark.integration

N = 24  # new tokens per request


@pytest.fixture(scope="module")
def new_drafter(test_models, tmp_path_factory):
    """draft_small distilled a little (a versioned model directory)."""
    root = tmp_path_factory.mktemp("distill-stack")
    prompts = root / "prompts.jsonl"
    write_prompts(prompts, build_prompts(16, seed=3, exclude=bench_prompts()))
    out = root / "drafter"
    argv = ["distill", "--target-model", str(test_models.target), "--draft-model",
            str(test_models.draft_small), "--prompts", str(prompts), "--out", str(out),
            "--steps", "10", "--lr", "3e-3", "--max-new-tokens", "16", "--max-length", "256",
            "--threads", "1", "--no-progress", "--version", "distill-test-v2"]  # fmt: skip
    assert specdec(argv) == 0
    return out


def session_ids(canary: str, n_each: int) -> tuple[list[str], list[str]]:
    """n_each session ids that the canary sends to the new version, n_each to the old."""
    rule = parse_canary(canary)
    new, old = [], []
    i = 0
    while len(new) < n_each or len(old) < n_each:
        sid = f"user-{i}"
        side = new if version_rule(rule, replica_session_id(sid)).canary else old
        if len(side) < n_each:
            side.append(sid)
        i += 1
    return new, old


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def test_two_versions_canary_record_and_distill(
    test_models, new_drafter, tokenizer, reference, tmp_path
):
    canary = "distill-test-v2:50"
    record_dir = tmp_path / "record"
    metrics_port = free_port()
    procs = []
    try:
        old = replica("drafter", test_models.draft_small)
        new = replica("drafter", new_drafter)
        verifier = replica("verifier", test_models.target)
        procs += [old, new, verifier]
        for p in procs:
            p.wait_healthy()
        gw = gateway([old, new], [verifier], None, "--record", str(record_dir),
                     "--record-top-logprobs", "5",
                     "--drafter-canary", canary, "--metrics-port", str(metrics_port))  # fmt: skip
        procs.append(gw)
        gw.wait_healthy()
        answered = []
        with Client(gw.address, timeout=120) as client:
            info = client.server_info()
            assert info.recording
            assert info.drafter_versions == ("", "distill-test-v2")
            assert (info.drafter_canary_version, info.drafter_canary_percent) == (
                "distill-test-v2",
                50.0,
            )
            to_new, to_old = session_ids(canary, 3)
            for i, sid in enumerate(to_new + to_old):
                prompt = PROMPTS[i % len(PROMPTS)]
                g = client.generate(prompt, max_new_tokens=N, k=3, session_id=sid)
                assert list(g.tokens) == reference(ids_of(tokenizer, prompt), N), sid
                want = "distill-test-v2" if sid in to_new else ""
                assert g.stats.drafter_version == want, sid
                assert g.stats.recorded
                answered.append((ids_of(tokenizer, prompt), list(g.tokens), g.stats))
            # A request's own logprobs keep their width beside the recording's 5
            scored_prompt = "def scale(values, factor):"  # no other request's prompt
            scored = client.generate(
                scored_prompt, max_new_tokens=N, k=3, logprobs=True, top_logprobs=2
            )
            assert list(scored.tokens) == reference(ids_of(tokenizer, scored_prompt), N)
            assert all(len(x.top) == 2 for x in scored.logprobs)
            answered.append((ids_of(tokenizer, scored_prompt), list(scored.tokens), scored.stats))
            secret = "What is the capital of France? Paris"  # refuses recording
            refused = client.generate(secret, max_new_tokens=N, k=3, record=False)
            assert list(refused.tokens) == reference(ids_of(tokenizer, secret), N)
            assert not refused.stats.recorded
        text = scrape(metrics_port)
        for version in ("", "distill-test-v2"):
            line = (
                "specdec_gateway_spec_decode_num_draft_tokens_by_drafter_total"
                f'{{drafter_version="{version}"}}'
            )
            assert line in text, version
        gw.stop()  # flushes the recorder
        procs.remove(gw)
    finally:
        for p in procs:
            p.stop()

    rows = [r for f in sorted(record_dir.glob("record-*.jsonl")) for r in read_rows(f)]
    assert len(rows) == len(answered)
    for row in rows:  # the target's scores of the output (--record-top-logprobs 5)
        assert len(row["target_top_ids"]) == len(row["output_ids"])
        assert all(len(top) == 5 for top in row["target_top_ids"])
        # greedy: each output token is the target's likeliest, and scored as such
        assert [top[0] for top in row["target_top_ids"]] == row["output_ids"]
        assert row["target_logprobs"] == [top[0] for top in row["target_top_logprobs"]]
    scored_row = next(r for r in rows if r["prompt_ids"] == ids_of(tokenizer, scored_prompt))
    assert [[t for t, _ in x.top] for x in scored.logprobs] == [
        top[:2] for top in scored_row["target_top_ids"]
    ]
    by_prompt = {(tuple(r["prompt_ids"]), tuple(r["output_ids"])): r for r in rows}
    for prompt_ids, output_ids, stats in answered:
        row = by_prompt[(tuple(prompt_ids), tuple(output_ids))]
        assert row["output_ids"] == output_ids
        assert row["history_tokens"] == 0
        assert sum(row["round_k"]) == stats.draft_tokens
        assert sum(row["round_accepted"]) == stats.accepted_tokens
        assert len(row["round_k"]) == stats.rounds
        assert row["drafter_version"] == stats.drafter_version
        assert row["target_model"] == str(test_models.target)
    secret_ids = ids_of(tokenizer, secret)
    assert all(r["prompt_ids"] != secret_ids for r in rows)
    assert all(r["output_ids"] != list(refused.tokens) for r in rows)
    raw = "".join(f.read_text() for f in record_dir.glob("*.jsonl"))
    assert json.dumps(secret_ids, separators=(",", ":"))[1:-1] not in raw

    # The recording is distill's input.
    out = tmp_path / "from-recording"
    argv = ["distill", "--target-model", str(test_models.target), "--draft-model",
            str(new_drafter), "--data", str(record_dir), "--out", str(out), "--steps", "3",
            "--batch-size", "2", "--threads", "1", "--no-progress", "--holdout", "0.34"]  # fmt: skip
    assert specdec(argv) == 0
    report = json.loads((out / "specdec_version.json").read_text())
    assert report["parent_version"] == "distill-test-v2"
    assert report["data"]["train_sequences"] + report["data"]["held_out_sequences"] == len(rows)
    # every row was recorded with the target's top-m: no batch needed the teacher forward
    assert report["data"]["train_sequences_with_recorded_top"] == report["data"]["train_sequences"]
    assert report["cost"]["batches_without_teacher_forward"] == 3
