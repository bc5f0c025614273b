"""Batching across sessions through real processes on the tiny fp32 models, with each KV
engine (--engine dense and paged): eight concurrent sessions of different prompt lengths
are exactly generate() (greedy, k 0 and 3, with and without SSD, and with token trees)
while the replicas' metrics show forwards of several sessions, and a session whose caches were dropped misses
and resends its second turn without disturbing the others."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.common.prefix import prefix_hash
from specdec.gateway.sessions import replica_session_id
from specdec.sdk import AsyncClient
from specdec.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.conftest import PROMPTS
from tests.integration.test_gateway import _free_port, gateway, replica

pytestmark = pytest.mark.integration

N = 24  # new tokens per session


@pytest.fixture(scope="module", params=["dense", "paged"])
def batch_stack(test_models, request):
    """A drafter and a verifier batching up to 8 sessions, with /metrics, on one KV engine;
    one gateway."""
    procs = []
    try:
        ports = {"drafter": _free_port(), "verifier": _free_port()}
        engine = ("--engine", request.param)
        d = replica("drafter", test_models.draft_noisy, "--metrics-port", str(ports["drafter"]),
                    "--max-batch-size", "8", *engine)  # fmt: skip
        v = replica("verifier", test_models.target, "--metrics-port", str(ports["verifier"]),
                    "--max-batch-size", "8", *engine)  # fmt: skip
        procs += [d, v]
        d.wait_healthy(), v.wait_healthy()
        g = gateway([d], [v])
        procs.append(g)
        g.wait_healthy()
        yield {"gateway": g, "drafter": d, "verifier": v, "ports": ports, "engine": request.param}
    finally:
        for p in procs:
            p.stop()


def prompts(tokenizer) -> list[list[int]]:
    """Eight prompts of different lengths (5 to 54 tokens)."""
    ids = tokenizer(" ".join(PROMPTS * 3)).input_ids
    return [ids[3 * i : 3 * i + 5 + 7 * i] for i in range(8)]


def scrape(port: int) -> dict[str, float]:
    """The replica's samples by name and labels, e.g. 'x_bucket{le="1.0"}'."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def batched_forwards(before: dict, after: dict, role: str) -> tuple[float, float]:
    """(forwards, forwards of more than one session) between two scrapes."""
    name = f"specdec_{role}_model_forward_sessions"
    total = after[f"{name}_count"] - before.get(f"{name}_count", 0)
    single = after[f'{name}_bucket{{le="1.0"}}'] - before.get(f'{name}_bucket{{le="1.0"}}', 0)
    return total, total - single


async def _generate_all(address, jobs, **kw):
    async with AsyncClient(address, timeout=300) as client:
        return await asyncio.gather(
            *(
                client.generate(token_ids=ids, max_new_tokens=N, **kw, **extra)
                for ids, extra in jobs
            )
        )


@pytest.mark.parametrize("k,ssd", [(0, False), (3, False), (3, True), (0, True)])
def test_eight_concurrent_sessions_are_exact_and_batched(batch_stack, tokenizer, reference, k, ssd):
    ports = batch_stack["ports"]
    before = {role: scrape(port) for role, port in ports.items()}
    jobs = [(ids, {}) for ids in prompts(tokenizer)]
    results = asyncio.run(_generate_all(batch_stack["gateway"].address, jobs, k=k, ssd=ssd))
    for (ids, _), result in zip(jobs, results, strict=True):
        assert list(result.tokens) == reference(ids, N), f"prompt of {len(ids)} tokens"
    after = {role: scrape(port) for role, port in ports.items()}
    total, several = batched_forwards(before["verifier"], after["verifier"], "verifier")
    assert several > 0, f"no Verify forward of more than one session in {total}"
    if k:
        total, several = batched_forwards(before["drafter"], after["drafter"], "drafter")
        assert several > 0, f"no Draft forward of more than one session in {total}"


def test_info_names_the_engine(batch_stack):
    for role, stub_type in (
        ("drafter", drafter_pb2_grpc.DrafterServiceStub),
        ("verifier", verifier_pb2_grpc.VerifierServiceStub),
    ):
        with grpc.insecure_channel(batch_stack[role].address) as channel:
            info = stub_type(channel).Info(common_pb2.InfoRequest(), timeout=30)
        assert info.engine == batch_stack["engine"], role


def _release(address: str, stub_type, session_id: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        return (
            stub_type(channel)
            .Release(common_pb2.ReleaseRequest(session_id=session_id), timeout=30)
            .released
        )


def test_a_cache_miss_in_a_batch_leaves_the_others_exact(batch_stack, tokenizer, reference):
    """Eight sessions take a first turn; four lose their caches on both replicas; all eight
    take a second turn at once: the four miss and resend, every output is exact."""
    first = prompts(tokenizer)
    second = [tokenizer(p).input_ids[:4] for p in (PROMPTS * 2)[:8]]
    sessions = [f"batch-miss-{i}" for i in range(8)]
    turn1 = asyncio.run(
        _generate_all(
            batch_stack["gateway"].address,
            [(ids, {"session_id": s}) for ids, s in zip(first, sessions, strict=True)],
            k=3,
        )
    )
    for s in sessions[::2]:
        assert _release(
            batch_stack["verifier"].address,
            verifier_pb2_grpc.VerifierServiceStub,
            replica_session_id(s),
        )
        assert _release(
            batch_stack["drafter"].address,
            drafter_pb2_grpc.DrafterServiceStub,
            replica_session_id(s),
        )
    misses = scrape(batch_stack["ports"]["verifier"]).get("specdec_verifier_cache_misses_total", 0)
    turn2 = asyncio.run(
        _generate_all(
            batch_stack["gateway"].address,
            [(ids, {"session_id": s}) for ids, s in zip(second, sessions, strict=True)],
            k=3,
        )
    )
    after = scrape(batch_stack["ports"]["verifier"])
    assert after["specdec_verifier_cache_misses_total"] - misses >= 4
    for ids1, r1, ids2, r2 in zip(first, turn1, second, turn2, strict=True):
        assert list(r1.tokens) == reference(ids1, N)
        assert list(r2.tokens) == reference([*ids1, *r1.tokens, *ids2], N)


def test_token_trees_batched_on_each_engine(batch_stack, tokenizer, reference):
    """Eight concurrent sessions verifying the drafter's token trees (tree width 3) on each
    engine: tree rows join batched forwards with the other sessions' rows, and every output
    is exactly generate()'s; a Verify of a tree answers its accepted path."""
    ports = batch_stack["ports"]
    before = scrape(ports["verifier"])
    jobs = [(ids, {}) for ids in prompts(tokenizer)]
    results = asyncio.run(
        _generate_all(
            batch_stack["gateway"].address, jobs, k=3, tree_width=3, k_policy="fixed",
            method="model",
        )
    )  # fmt: skip
    for (ids, _), result in zip(jobs, results, strict=True):
        assert list(result.tokens) == reference(ids, N), f"prompt of {len(ids)} tokens"
    assert sum(r.stats.tree_rounds for r in results) > 0
    total, several = batched_forwards(before, scrape(ports["verifier"]), "verifier")
    assert several > 0, f"no Verify forward of more than one session in {total}"
    ids = prompts(tokenizer)[2]
    request = verifier_pb2.VerifyRequest(
        session_id="tree-on-" + batch_stack["engine"],
        prefix=common_pb2.CachedPrefix(length=0, hash=prefix_hash([])),
        new_tokens=ids,
        draft_tokens=[ids[0], ids[1], ids[2]],
        draft_parents=[-1, -1, 0],  # two children of the last new token, one grandchild
    )
    with grpc.insecure_channel(batch_stack["verifier"].address) as channel:
        answer = verifier_pb2_grpc.VerifierServiceStub(channel).Verify(request, timeout=60)
    assert len(answer.accepted_path) == answer.accepted_count <= 2
