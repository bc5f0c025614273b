"""The whole stack through real processes: drafter, verifier, gateways, a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import urllib.request

import pytest

from specdec.gateway.sessions import SessionIndex
from specdec.sdk import AsyncClient, Client, InvalidArgument, SpecdecError
from specdec.tools.launcher import ServiceFailed, ServiceProcess
from specdec.tools.redisproc import RedisProcess
from tests.conftest import PROMPTS

pytestmark = pytest.mark.integration

N = 32  # new tokens per exactness check


def replica(role: str, model, *flags: str, env: dict[str, str] | None = None) -> ServiceProcess:
    """A drafter or verifier on a free loopback port, one torch thread (shared by the
    integration tests)."""
    return ServiceProcess.specdec(
        role,
        "serve",
        role,
        "--model",
        str(model),
        "--port",
        "0",
        "--host",
        "127.0.0.1",
        "--threads",
        "1",
        *flags,
        env=env,
    ).start()


def gateway(
    drafters,
    verifiers,
    redis_url: str | None = None,
    *flags: str,
    env: dict[str, str] | None = None,
) -> ServiceProcess:
    """A gateway over the given replica processes on a free loopback port. Its default
    method is `model` and its default k policy `fixed` unless flags say otherwise: the
    tests built on it exercise the draft model's rounds at the k they ask for (statistics
    per k, SSD, caches); lookup drafts are tested in test_lookup.py, the adaptive policy (the
    served default) in test_adaptive.py and test_cost_model.py."""
    if "--method" not in flags:
        flags = ("--method", "model", *flags)
    if "--k-policy" not in flags:
        flags = ("--k-policy", "fixed", *flags)
    args = [
        "serve",
        "gateway",
        "--port",
        "0",
        "--host",
        "127.0.0.1",
        "--drafter",
        ",".join(p.address for p in drafters),
        "--verifier",
        ",".join(p.address for p in verifiers),
        *flags,
    ]
    if redis_url:
        args += ["--redis", redis_url]
    return ServiceProcess.specdec("gateway", *args, env=env).start()


@contextlib.contextmanager
def small_stack(
    draft_model,
    target_model,
    *drafter_flags: str,
    redis_url: str | None = None,
    gateway_flags: tuple[str, ...] = (),
    more_gateways: dict[str, tuple[str, ...]] | None = None,
    verifier_flags: tuple[str, ...] = (),
):
    """One drafter (with drafter_flags), one verifier (with verifier_flags) and a gateway over them (on Redis at
    redis_url if given, with gateway_flags), and more_gateways (name: flags) over them too,
    healthy; yields {"drafter", "verifier", "gateway", *more_gateways}, stops all after."""
    procs = []
    try:
        d = replica("drafter", draft_model, *drafter_flags)
        v = replica("verifier", target_model, *verifier_flags)
        procs += [d, v]
        d.wait_healthy(), v.wait_healthy()
        gws = {"gateway": gateway([d], [v], redis_url, *gateway_flags)}
        procs.append(gws["gateway"])
        for name, flags in (more_gateways or {}).items():
            gws[name] = gateway([d], [v], redis_url, *flags)
            procs.append(gws[name])
        for g in gws.values():
            g.wait_healthy()
        yield {"drafter": d, "verifier": v, **gws}
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def redis_server():
    with RedisProcess() as server:
        yield server


@pytest.fixture(scope="module")
def stack(test_models, redis_server):
    """One drafter, one verifier, two gateways sharing one Redis."""
    procs = []
    try:
        d = replica("drafter", test_models.draft_noisy)
        v = replica("verifier", test_models.target)
        procs += [d, v]
        d.wait_healthy(), v.wait_healthy()
        ga = gateway([d], [v], redis_server.url)
        gb = gateway([d], [v], redis_server.url)
        procs += [ga, gb]
        ga.wait_healthy(), gb.wait_healthy()
        yield {"drafter": d, "verifier": v, "a": ga, "b": gb}
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def client(stack):
    with Client(stack["a"].address, timeout=120) as c:
        yield c


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text).input_ids


@pytest.mark.parametrize("k", [0, 1, 4])
def test_greedy_equals_generate(client, tokenizer, reference, k):
    for text in PROMPTS[:4]:
        ids = ids_of(tokenizer, text)
        got = client.generate(token_ids=ids, max_new_tokens=N, k=k)
        assert list(got.tokens) == reference(ids, N), f"k={k} prompt={text!r}"
        assert got.usage.prompt_tokens == len(ids)
        assert got.usage.completion_tokens == len(got.tokens)
        s = got.stats
        assert s.num_draft_tokens == k
        assert (
            s.draft_tokens == k * s.rounds or s.draft_tokens < k * s.rounds
        )  # k shrinks at the end
        if k == 0:
            assert s.rounds == len(got.tokens) and s.draft_tokens == 0
        else:
            assert sum(s.accepted_per_position) == s.accepted_tokens
            assert s.acceptance_rate == pytest.approx(s.accepted_tokens / s.draft_tokens, rel=1e-5)
            assert s.mean_accepted_length == pytest.approx(
                (s.accepted_tokens + s.rounds) / s.rounds, rel=1e-5
            )


def test_speculation_saves_target_steps(client, tokenizer, reference):
    ids = ids_of(tokenizer, PROMPTS[0])
    plain = client.generate(token_ids=ids, max_new_tokens=N, k=0)
    spec = client.generate(token_ids=ids, max_new_tokens=N, k=4)
    assert plain.tokens == spec.tokens
    assert spec.stats.accepted_tokens > 0
    assert spec.stats.rounds < plain.stats.rounds


def test_text_prompt_and_stream_equal_unary(client):
    unary = client.generate(PROMPTS[1], max_new_tokens=N, k=4)
    chunks = list(client.stream(PROMPTS[1], max_new_tokens=N, k=4))
    final = chunks[-1].final
    assert final is not None and all(c.final is None for c in chunks[:-1])
    assert "".join(c.text for c in chunks) == unary.text == final.text
    assert tuple(t for c in chunks for t in c.tokens) == unary.tokens == final.tokens
    assert final.finish_reason == unary.finish_reason == "length"
    assert len(chunks) > 2  # it really streamed
    assert unary.timings.time_to_first_token_ms <= unary.timings.total_ms


def test_token_limit_and_stop_strings(client):
    short = client.generate(PROMPTS[2], max_new_tokens=5, k=4)
    assert len(short.tokens) == 5 and short.finish_reason == "length"
    full = client.generate(PROMPTS[2], max_new_tokens=N, k=4)
    stop = full.text[12:15]
    assert stop, full.text
    cut = full.text.index(stop)
    stopped = client.generate(PROMPTS[2], max_new_tokens=N, k=4, stop=[stop, "\x00never"])
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:cut]
    assert stopped.tokens == full.tokens[: len(stopped.tokens)]
    assert len(stopped.tokens) < len(full.tokens)
    streamed = list(client.stream(PROMPTS[2], max_new_tokens=N, k=4, stop=[stop]))
    assert "".join(c.text for c in streamed) == stopped.text  # the stop string never leaks


def test_two_turn_session_equals_one_call(client, stack, tokenizer, reference, redis_server):
    p1, p2 = ids_of(tokenizer, PROMPTS[3]), ids_of(tokenizer, " and then")
    t1 = client.generate(token_ids=p1, max_new_tokens=16, k=4, session_id="two-turn")
    t2 = client.generate(token_ids=p2, max_new_tokens=16, k=4, session_id="two-turn")
    history = [*p1, *t1.tokens, *p2]
    assert list(t2.tokens) == reference(history, 16)
    assert t2.usage.history_tokens == len(p1) + len(t1.tokens)
    assert t2.stats.cache_misses == 0  # both replicas continued from their caches
    record = asyncio.run(_get_record(redis_server.url, "two-turn"))
    assert record.tokens == [*history, *t2.tokens]
    assert record.turns == 2
    assert record.verifier == stack["verifier"].address
    assert record.verifier_cached > len(p1)
    # RESET forgets the history.
    fresh = client.generate(
        token_ids=p2, max_new_tokens=8, k=4, session_id="two-turn", reset_session=True
    )
    assert list(fresh.tokens) == reference(p2, 8) and fresh.usage.history_tokens == 0


def test_session_id_at_the_advertised_maximum(client, tokenizer, reference):
    """A session id of max_session_id_chars characters (any characters) works through
    the whole stack, speculation and its caches included, for two turns; one more is
    refused by the gateway before anything reaches a replica."""
    longest = client.server_info().max_session_id_chars
    session = ("é/" * longest)[:longest]
    p1, p2 = ids_of(tokenizer, PROMPTS[1]), ids_of(tokenizer, " again")
    t1 = client.generate(token_ids=p1, max_new_tokens=8, k=4, session_id=session)
    t2 = client.generate(token_ids=p2, max_new_tokens=8, k=4, session_id=session)
    assert list(t1.tokens) == reference(p1, 8)
    assert list(t2.tokens) == reference([*p1, *t1.tokens, *p2], 8)
    assert t2.stats.draft_tokens > 0 and t2.stats.cache_misses == 0  # it speculated
    with pytest.raises(SpecdecError) as err:
        client.generate(token_ids=p1, max_new_tokens=2, session_id=session + "x")
    assert err.value.code.name == "INVALID_ARGUMENT" and str(longest) in err.value.details


async def _get_record(url, session_id):
    index = SessionIndex(url)
    try:
        return await index.get(session_id)
    finally:
        await index.close()


def test_session_continues_on_another_gateway(stack, tokenizer, reference):
    p1, p2 = ids_of(tokenizer, PROMPTS[4]), ids_of(tokenizer, "\n# next")
    with Client(stack["a"].address) as a, Client(stack["b"].address) as b:
        t1 = a.generate(token_ids=p1, max_new_tokens=12, k=4, session_id="a-to-b")
        t2 = b.generate(token_ids=p2, max_new_tokens=12, k=4, session_id="a-to-b")
    assert list(t2.tokens) == reference([*p1, *t1.tokens, *p2], 12)
    assert t2.usage.history_tokens == len(p1) + len(t1.tokens)


def test_eight_concurrent_streams_are_exact(stack, tokenizer, reference):
    jobs = [(ids_of(tokenizer, PROMPTS[i % len(PROMPTS)]), (0, 1, 4, 3)[i % 4]) for i in range(8)]

    async def one(client, ids, k):
        chunks = [c async for c in client.stream(token_ids=ids, max_new_tokens=N, k=k)]
        return chunks[-1].final, tuple(t for c in chunks for t in c.tokens)

    async def main():
        async with AsyncClient(stack["a"].address, timeout=300) as client:
            return await asyncio.gather(*(one(client, ids, k) for ids, k in jobs))

    for (ids, k), (final, streamed) in zip(jobs, asyncio.run(main()), strict=True):
        assert list(final.tokens) == reference(ids, N), f"k={k}"
        assert streamed == final.tokens


def _request(
    prompt=None,
    token_ids=None,
    max_new_tokens=8,
    sampling=None,
    k=None,
    stop=(),
    session=None,
    ssd=None,
):
    """A GenerateRequest built by hand, so the server (not the SDK) judges it."""
    from specdec.v1 import common_pb2, gateway_pb2

    req = gateway_pb2.GenerateRequest(max_new_tokens=max_new_tokens, stop=list(stop))
    if prompt is not None:
        req.prompt = prompt
    if token_ids is not None:
        req.prompt_token_ids.ids.extend(token_ids)
    req.sampling.CopyFrom(common_pb2.SamplingParams(**(sampling or {})))
    if k is not None:
        req.speculation.num_draft_tokens = k
    if ssd is not None:
        req.speculation.ssd = ssd
    for key, value in (session or {}).items():
        setattr(req.session, key, value)
    return req


BAD_REQUESTS = [
    ({}, "prompt is empty"),
    ({"prompt": ""}, "prompt is empty"),
    ({"token_ids": []}, "prompt is empty"),
    ({"token_ids": [1, 10**6]}, "outside the vocabulary"),
    ({"prompt": "hi", "max_new_tokens": -1}, "max_new_tokens"),
    ({"prompt": "hi", "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt": "hi", "max_new_tokens": 10**6}, "max_new_tokens"),
    ({"prompt": "hi", "sampling": {"temperature": -0.5}}, "temperature"),
    ({"prompt": "hi", "sampling": {"temperature": float("nan")}}, "temperature"),
    ({"prompt": "hi", "sampling": {"temperature": 1.0, "top_p": 1.5}}, "top_p"),
    ({"prompt": "hi", "sampling": {"temperature": 1.0, "top_p": -0.1}}, "top_p"),
    ({"prompt": "hi", "sampling": {"top_k": -1}}, "top_k"),
    ({"prompt": "hi", "k": 99}, "num_draft_tokens"),
    ({"prompt": "hi", "k": -2}, "num_draft_tokens"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "session": {"mode": 1}}, "without a session id"),
    ({"prompt": "hi", "session": {"ttl_seconds": 5}}, "without a session id"),
    ({"prompt": "hi", "session": {"id": "s", "mode": 7}}, "unknown session mode 7"),
    ({"prompt": "hi", "session": {"id": "s", "ttl_seconds": 10**9}}, "ttl"),
    ({"prompt": "hi", "session": {"id": "x" * 300}}, "session id"),
    ({"prompt": "hi " * 200, "max_new_tokens": 400}, "context"),
    ({"prompt": "x" * (512 * 64 + 1)}, "characters"),
]


def test_bad_requests_are_invalid_argument(stack, client):
    import grpc

    from specdec.v1 import gateway_pb2_grpc

    with grpc.insecure_channel(stack["a"].address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for kwargs, fragment in BAD_REQUESTS:
            for call in (
                stub.Generate,
                lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout)),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call(_request(**kwargs), timeout=30)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kwargs
                assert fragment in err.value.details(), (kwargs, err.value.details())
    assert stack["a"].alive()
    assert client.generate("still serving", max_new_tokens=2).finish_reason == "length"


def test_sdk_raises_invalid_argument(client):
    with pytest.raises(InvalidArgument) as err:
        client.generate("hi", max_new_tokens=8, temperature=-1.0)
    assert "temperature" in err.value.details


def test_concurrent_turns_of_one_session_are_refused(stack, tokenizer):
    """A turn in flight on gateway A: a second turn of that session on B is ABORTED."""
    ids = ids_of(tokenizer, PROMPTS[0])
    verifier = stack["verifier"].proc
    with Client(stack["a"].address) as a, Client(stack["b"].address) as b:
        first = a.stream(token_ids=ids, max_new_tokens=400, k=0, session_id="busy")
        chunks = [next(first)]
        # Freeze the verifier: the turn's next Verify hangs, so the turn holds the session
        # for as long as the checks below take, whatever the machine's speed (a second
        # turn waits up to a second for the session before it is refused).
        verifier.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(SpecdecError) as err:
                b.generate(token_ids=[5], max_new_tokens=2, session_id="busy")
            assert err.value.code.name == "ABORTED" and "in progress" in err.value.details
            with pytest.raises(SpecdecError) as err:  # the same gateway refuses it too
                a.generate(token_ids=[5], max_new_tokens=2, session_id="busy")
            assert err.value.code.name == "ABORTED"
        finally:
            verifier.send_signal(signal.SIGCONT)
        chunks += list(first)
        assert chunks[-1].final is not None
        # The lock is gone once the turn ends: the next turn runs, on either gateway.
        nxt = b.generate(token_ids=[5], max_new_tokens=2, session_id="busy")
    assert nxt.usage.history_tokens == len(ids) + 400


def test_gateway_restart_between_turns(stack, redis_server, tokenizer, reference):
    d, v = stack["drafter"], stack["verifier"]
    p1, p2 = ids_of(tokenizer, PROMPTS[5]), ids_of(tokenizer, " ORDER BY")
    g = gateway([d], [v], redis_server.url).wait_healthy()
    try:
        with Client(g.address) as c:
            t1 = c.generate(token_ids=p1, max_new_tokens=10, k=4, session_id="restart")
    finally:
        assert g.stop() == 0
    g2 = gateway([d], [v], redis_server.url).wait_healthy()
    try:
        with Client(g2.address) as c:
            t2 = c.generate(token_ids=p2, max_new_tokens=10, k=4, session_id="restart")
    finally:
        g2.stop()
    assert list(t2.tokens) == reference([*p1, *t1.tokens, *p2], 10)
    assert t2.usage.history_tokens == len(p1) + len(t1.tokens)


def test_verifier_killed_between_turns_fails_over(test_models, redis_server, tokenizer, reference):
    procs = []
    try:
        d = replica("drafter", test_models.draft_noisy)
        v1 = replica("verifier", test_models.target)
        v2 = replica("verifier", test_models.target)
        procs += [d, v1, v2]
        for p in procs:
            p.wait_healthy()
        g = gateway([d], [v1, v2], redis_server.url)
        procs.append(g)
        g.wait_healthy()
        p1, p2 = ids_of(tokenizer, PROMPTS[0]), ids_of(tokenizer, "\n    return")
        with Client(g.address) as c:
            # Three sessions on two verifiers: two of them share one, the one killed.
            first = {
                s: c.generate(token_ids=p1, max_new_tokens=12, k=4, session_id=s)
                for s in ("failover-a", "failover-b", "failover-c")
            }
            holders = {s: asyncio.run(_get_record(redis_server.url, s)).verifier for s in first}
            holder_address = max(set(holders.values()), key=list(holders.values()).count)
            sharing = [s for s in first if holders[s] == holder_address][:2]
            holder = {v1.address: v1, v2.address: v2}[holder_address]
            holder.kill()
            # The first turn fails over from the dead verifier; the second finds it marked
            # down and continues on the survivor directly.
            second = {
                s: c.generate(token_ids=p2, max_new_tokens=12, k=4, session_id=s) for s in sharing
            }
            t3 = c.generate(token_ids=p2, max_new_tokens=12, k=4)  # the survivor serves all
        for s, t2 in second.items():
            assert list(t2.tokens) == reference([*p1, *first[s].tokens, *p2], 12)
            # The session moved with its whole history: a resend, counted either way.
            assert t2.stats.cache_misses >= 1, s
            moved = asyncio.run(_get_record(redis_server.url, s))
            assert moved.verifier != holder.address
        assert list(t3.tokens) == reference(p2, 12)
    finally:
        for p in procs:
            p.stop()


def test_redis_down_keeps_serving(stack, tokenizer, reference):
    d, v = stack["drafter"], stack["verifier"]
    server = RedisProcess().start()
    metrics_port = _free_port()
    g = gateway([d], [v], server.url, "--metrics-port", str(metrics_port)).wait_healthy()
    try:
        ids = ids_of(tokenizer, PROMPTS[1])
        server.stop()
        with Client(g.address) as c:
            plain = c.generate(token_ids=ids, max_new_tokens=10, k=4)
            sess = c.generate(token_ids=ids, max_new_tokens=10, k=4, session_id="no-redis")
        assert list(plain.tokens) == list(sess.tokens) == reference(ids, 10)
        assert g.alive()
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
        errors = [
            float(line.rsplit(" ", 1)[1])
            for line in scrape.splitlines()
            if line.startswith("specdec_gateway_session_store_errors_total")
        ]
        assert sum(errors) > 0
        assert "specdec_gateway_session_store_up 0.0" in scrape
        assert any('"severity": "WARNING"' in line for line in g.lines)
    finally:
        g.stop()
        server.stop()


@pytest.mark.parametrize("mismatch", ["vocabulary", "tokenizer"])
def test_gateway_refuses_mismatched_replicas(stack, tmp_path, test_models, mismatch):
    import json
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    other = tmp_path / "other"
    if mismatch == "vocabulary":
        config = AutoConfig.from_pretrained(test_models.draft_small)
        config.vocab_size += 16
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(other)
        for f in test_models.tokenizer.iterdir():
            shutil.copy(f, other / f.name)
    else:  # same vocabulary size, another tokenizer (it lowercases its input)
        shutil.copytree(test_models.draft_small, other)
        spec = json.loads((other / "tokenizer.json").read_text())
        spec["normalizer"] = {"type": "Lowercase"}
        (other / "tokenizer.json").write_text(json.dumps(spec))
    odd = replica("drafter", other).wait_healthy()
    g = gateway([odd], [stack["verifier"]])
    try:
        with pytest.raises(ServiceFailed) as err:
            g.wait_healthy(60)
        message = str(err.value)
        assert mismatch in message
        assert odd.address in message and stack["verifier"].address in message
    finally:
        g.stop()
        odd.stop()


def _free_port() -> int:
    from specdec.tools.redisproc import free_port

    return free_port()
