"""Replica discovery through DNS and through the Kubernetes API, with real processes.

Four replicas run on loopback: a drafter and a verifier on 127.0.0.2 and again on
127.0.0.3 (each role on one port number, so an address record alone names a replica, as
with a headless Service). A gateway finds them through

* a real DNS server (dnslib) on 127.0.0.1 whose A records the test changes, and
* a stand-in Kubernetes API server (see FakeKubeAPI) read by the real `kubernetes` client.

In both, a session's replicas leave between two turns and the next turn is still equal to
transformers' generate(): the session moves with a full-context resend.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import threading
import time
import urllib.parse
import urllib.request

import pytest
from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from specdec.gateway.sessions import SessionIndex
from specdec.sdk import Client
from specdec.tools.launcher import ServiceProcess
from specdec.tools.redisproc import RedisProcess, free_port
from tests.conftest import PROMPTS
from tests.kubeapi import FakeKubeAPI

pytestmark = pytest.mark.integration

HOSTS = ("127.0.0.2", "127.0.0.3")
ODD_HOST = "127.0.0.4"  # a replica with another tokenizer
N = 16


class Hosted(ServiceProcess):
    """A service bound to one loopback address other than 127.0.0.1."""

    host = "127.0.0.1"

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError(f"{self.name} has not reported its port")
        return f"{self.host}:{self.port}"


def port_free_on_all(hosts) -> int:
    for _ in range(50):
        port = free_port()
        try:
            for h in hosts:
                with socket.socket() as s:
                    s.bind((h, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every loopback address")


def start_replica(role: str, model, host: str, port: int) -> Hosted:
    p = Hosted.specdec(
        f"{role}@{host}",
        "serve",
        role,
        "--model",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--threads",
        "1",
    )
    p.host = host
    return p.start()


@pytest.fixture(scope="module")
def redis_server():
    with RedisProcess() as server:
        yield server


@pytest.fixture(scope="module")
def pools(test_models):
    """{role: (port, {host: process})}: a drafter and a verifier on each of HOSTS."""
    ports = {"drafter": port_free_on_all((*HOSTS, ODD_HOST)), "verifier": port_free_on_all(HOSTS)}
    models = {"drafter": test_models.draft_noisy, "verifier": test_models.target}
    procs = {
        role: {h: start_replica(role, models[role], h, ports[role]) for h in HOSTS}
        for role in ports
    }
    try:
        for by_host in procs.values():
            for p in by_host.values():
                p.wait_healthy()
        yield {role: (ports[role], procs[role]) for role in ports}
    finally:
        for by_host in procs.values():
            for p in by_host.values():
                p.stop()


def start_gateway(drafter: str, verifier: str, redis_url: str, *flags, env=None):
    """A gateway over the discovered pools, on the fixed policy: discovery is under test,
    and every round of a turn then calls a drafter (the adaptive policy may price the tiny
    drafter out and never place one)."""
    metrics_port = free_port()
    g = ServiceProcess.specdec(
        "gateway",
        "serve",
        "gateway",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--drafter",
        drafter,
        "--verifier",
        verifier,
        "--redis",
        redis_url,
        "--metrics-port",
        str(metrics_port),
        "--k-policy",
        "fixed",
        *flags,
        env=env,
    ).start()
    g.metrics_port = metrics_port
    return g


def replica_counts(gateway) -> dict[tuple[str, str], float]:
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{gateway.metrics_port}/metrics", timeout=5)
        .read()
        .decode()
    )
    found = re.findall(
        r'^specdec_gateway_replicas\{role="(\w+)",state="(\w+)"\} ([0-9.]+)$', text, re.M
    )
    return {(role, state): float(v) for role, state, v in found}


def wait_for_replicas(gateway, drafters: int, verifiers: int, drafters_out: int = 0) -> None:
    """Until the gateway serves from exactly this many replicas and knows no others
    (but `drafters_out` drafters it keeps out)."""
    want = {
        ("drafter", "up"): drafters,
        ("drafter", "down"): drafters_out,
        ("verifier", "up"): verifiers,
        ("verifier", "down"): 0,
    }
    seen = None
    for _ in range(600):  # polls, not a time limit: replicas are admitted by a 2 s probe
        gateway._check_running()
        seen = replica_counts(gateway)
        if all(seen.get(k) == v for k, v in want.items()):
            return
        time.sleep(0.2)
    raise AssertionError(f"gateway replicas {seen}, wanted {want}\n{gateway.tail()}")


def session_record(url: str, session_id: str):
    async def get():
        index = SessionIndex(url)
        try:
            return await index.get(session_id)
        finally:
            await index.close()

    return asyncio.run(get())


def run_turns(client, tokenizer, reference, session_id, redis_url):
    """Turn helper: returns (send(prompt) -> response, history list)."""
    history: list[int] = []

    def send(text: str):
        ids = tokenizer(text).input_ids
        got = client.generate(token_ids=ids, max_new_tokens=N, k=3, session_id=session_id)
        context = [*history, *ids]
        assert list(got.tokens) == reference(context, N), f"turn after {len(history)} tokens"
        assert got.usage.history_tokens == len(history)
        history[:] = [*context, *got.tokens]
        record = session_record(redis_url, session_id)
        return got, record

    return send


# -- DNS ------------------------------------------------------------------------------------


class Zone(BaseResolver):
    """A records the test edits while the DNS server answers (NXDOMAIN for others)."""

    def __init__(self):
        self.records: dict[str, list[str]] = {}
        self.lock = threading.Lock()

    def set(self, name: str, addresses: list[str] | None) -> None:
        with self.lock:
            if addresses is None:
                self.records.pop(name, None)
            else:
                self.records[name] = list(addresses)

    def resolve(self, request, handler):
        reply = request.reply()
        name = str(request.q.qname).rstrip(".")
        with self.lock:
            addresses = self.records.get(name)
        if addresses is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype == QTYPE.A:
            for a in addresses:
                reply.add_answer(RR(name, QTYPE.A, rdata=A(a), ttl=1))
        return reply


@pytest.fixture
def dns_server():
    zone = Zone()
    server = DNSServer(
        zone, port=0, address="127.0.0.1", logger=DNSLogger("-request,-reply,-truncated")
    )
    server.start_thread()
    try:
        yield zone, server.server.server_address[1]
    finally:
        server.stop()


@pytest.fixture
def other_tokenizer(test_models, tmp_path):
    """The small draft model with another tokenizer of the same size (it lowercases)."""
    other = tmp_path / "other"
    shutil.copytree(test_models.draft_small, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Lowercase"}
    (other / "tokenizer.json").write_text(json.dumps(spec))
    return other


def test_dns_discovery_follows_records(
    pools, dns_server, redis_server, tokenizer, reference, other_tokenizer
):
    zone, dns_port = dns_server
    (d_port, drafters), (v_port, verifiers) = pools["drafter"], pools["verifier"]
    zone.set("drafters.specdec.test", [HOSTS[0]])
    zone.set("verifiers.specdec.test", [HOSTS[0]])
    server = f"dns://127.0.0.1:{dns_port}/"
    g = start_gateway(
        f"{server}drafters.specdec.test:{d_port}",
        f"{server}verifiers.specdec.test:{v_port}",
        redis_server.url,
        "--dns-interval",
        "0.3",
    )
    try:
        g.wait_healthy()
        wait_for_replicas(g, 1, 1)
        with Client(g.address, timeout=120) as client:
            send = run_turns(client, tokenizer, reference, "dns-session", redis_server.url)
            _, record = send(PROMPTS[0])
            assert (record.drafter, record.verifier) == (
                drafters[HOSTS[0]].address,
                verifiers[HOSTS[0]].address,
            )
            # A second replica of each role appears, then the session's replicas leave
            # the records (their processes keep running: only discovery says they left).
            zone.set("drafters.specdec.test", list(HOSTS))
            zone.set("verifiers.specdec.test", list(HOSTS))
            wait_for_replicas(g, 2, 2)
            zone.set("drafters.specdec.test", [HOSTS[1]])
            zone.set("verifiers.specdec.test", [HOSTS[1]])
            wait_for_replicas(g, 1, 1)
            _, record = send(" and then")
            assert (record.drafter, record.verifier) == (
                drafters[HOSTS[1]].address,
                verifiers[HOSTS[1]].address,
            )
            # The name goes away: no drafter, so the turn runs at k = 0, exactly; it comes
            # back: speculation resumes.
            zone.set("drafters.specdec.test", None)
            wait_for_replicas(g, 0, 1)
            got, _ = send(" meanwhile")
            assert got.stats.draft_tokens == 0 and got.stats.rounds == len(got.tokens)
            zone.set("drafters.specdec.test", [HOSTS[0]])
            wait_for_replicas(g, 1, 1)
            got, _ = send(" finally")
            assert got.stats.draft_tokens > 0
            # A drafter with another tokenizer appears: known, kept out, never served.
            odd = start_replica("drafter", other_tokenizer, ODD_HOST, d_port).wait_healthy()
            try:
                zone.set("drafters.specdec.test", [HOSTS[0], ODD_HOST])
                wait_for_replicas(g, 1, 1, drafters_out=1)
                for _ in range(100):
                    if any("kept out" in line and ODD_HOST in line for line in g.lines):
                        break
                    time.sleep(0.2)
                else:
                    raise AssertionError(f"no refusal logged:\n{g.tail()}")
                _, record = send(" again")
                assert record.drafter == drafters[HOSTS[0]].address
            finally:
                odd.stop()
    finally:
        g.stop()


# -- Kubernetes API -------------------------------------------------------------------------


@pytest.fixture
def kube_api(tmp_path):
    api = FakeKubeAPI("specdec")
    try:
        yield api, api.write_kubeconfig(tmp_path / "kubeconfig")
    finally:
        api.close()


def test_k8s_discovery_follows_endpointslices(pools, kube_api, redis_server, tokenizer, reference):
    """The real `kubernetes` client in the gateway against FakeKubeAPI, a stand-in API
    server on loopback: there is no kube-apiserver binary on this machine."""
    api, kubeconfig = kube_api
    (d_port, drafters), (v_port, verifiers) = pools["drafter"], pools["verifier"]
    first, second = HOSTS
    api.put("drafters", "drafters-a", d_port, [(first, True)])
    api.put("verifiers", "verifiers-a", v_port, [(first, True)])
    g = start_gateway(
        f"k8s:specdec/drafters:{d_port}",  # the endpoint port by number
        "k8s:specdec/verifiers:grpc",  # ... and by name
        redis_server.url,
        env={"KUBECONFIG": kubeconfig, "KUBERNETES_SERVICE_HOST": ""},
    )
    try:
        g.wait_healthy()
        wait_for_replicas(g, 1, 1)
        with Client(g.address, timeout=120) as client:
            send = run_turns(client, tokenizer, reference, "k8s-session", redis_server.url)
            _, record = send(PROMPTS[2])
            assert (record.drafter, record.verifier) == (
                drafters[first].address,
                verifiers[first].address,
            )
            # Added: a second slice for the drafters, a second endpoint for the verifiers;
            # one not ready yet, which does not count.
            api.put("drafters", "drafters-b", d_port, [(second, False)])
            api.put("verifiers", "verifiers-a", v_port, [(first, True), (second, True)])
            wait_for_replicas(g, 1, 2)
            api.put("drafters", "drafters-b", d_port, [(second, True)])
            wait_for_replicas(g, 2, 2)
            # The session's drafter turns not ready, its verifier's endpoint is removed
            # (the processes keep running; only the API says they left).
            api.put("drafters", "drafters-a", d_port, [(first, False)])
            api.put("verifiers", "verifiers-a", v_port, [(second, True)])
            wait_for_replicas(g, 1, 1)
            _, record = send(" and then")
            assert (record.drafter, record.verifier) == (
                drafters[second].address,
                verifiers[second].address,
            )
            # A deleted slice takes its endpoints with it.
            api.put("drafters", "drafters-a", d_port, [(first, True)])
            wait_for_replicas(g, 2, 1)
            api.delete("drafters-b")
            wait_for_replicas(g, 1, 1)
            # Changes without watch events, then the watch expires (410 Gone): only the
            # relist that follows can show them.
            lists = dict(api.lists)
            api.put("drafters", "drafters-b", d_port, [(second, True)], emit=False)
            api.put("verifiers", "verifiers-b", v_port, [(first, True)], emit=False)
            api.expire()
            wait_for_replicas(g, 2, 2)
            assert api.lists["drafters"] > lists["drafters"]
            assert api.lists["verifiers"] > lists["verifiers"]
            send(" finally")
    finally:
        g.stop()
