"""The chart boots real services: the rendered Deployments' command, args and env, run as
local processes, give a generation equal to transformers' generate().

Replaced, and only these: the model paths (tiny test models instead of the install
folder), the Redis host (a local redis-server), the pod name the downward API would give,
and the Kubernetes API the gateway discovers replicas through: FakeKubeAPI, a stand-in
server on loopback (there is no kube-apiserver here), reached through a kubeconfig instead
of the in-cluster credentials. Ports are chart values, set to free ones so the test can
run beside others. Everything else (the binary, its arguments, every SPECDEC_* and OTEL_*
variable, the k8s: discovery target) is what the chart renders, so a flag or variable the
binaries do not accept fails here.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from specdec.sdk import Client
from specdec.tools.launcher import ServiceProcess
from specdec.tools.redisproc import RedisProcess, free_port
from tests.chart.render import EXAMPLES, container, find, objects, role_name
from tests.conftest import PROMPTS
from tests.kubeapi import FakeKubeAPI

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent  # the venv's `specdec` script: the image's entrypoint


def expand(env: list[dict], pod_name: str, replace: dict[str, str]) -> dict[str, str]:
    """A container's env as the kubelet makes it: fieldRef metadata.name -> pod_name,
    $(VAR) expanded from earlier entries; values in `replace` swapped by name."""
    out: dict[str, str] = {}
    for e in env:
        if "valueFrom" in e:
            ref = e["valueFrom"].get("fieldRef", {}).get("fieldPath")
            assert ref == "metadata.name", f"{e['name']}: cannot stand in for {e['valueFrom']}"
            value = pod_name
        else:
            value = re.sub(r"\$\((\w+)\)", lambda m: out.get(m.group(1), m.group(0)), e["value"])
        out[e["name"]] = replace.get(e["name"], value)
    return out


def argv_of(c: dict) -> list[str]:
    command, args = c["command"], c.get("args", [])
    assert command == ["specdec"], command
    return [str(BIN / "specdec"), *args]


@pytest.fixture(scope="module")
def redis_server():
    with RedisProcess() as server:
        yield server


@pytest.mark.parametrize("example", ["cpu-dev"])
def test_rendered_deployments_serve_exact_generations(
    example, test_models, redis_server, tokenizer, reference, tmp_path
):
    values = yaml.safe_load(next(p for p in EXAMPLES if p.stem == example).read_text())
    ports = {role: free_port() for role in ("drafter", "verifier", "gateway")}
    for role, port in ports.items():
        values.setdefault(role, {})["port"] = port
    values["gateway"]["metricsPort"] = free_port()
    for role in ("drafter", "verifier"):
        values[role]["dataPort"] = free_port()
        values[role]["metricsPort"] = free_port()
    objs = objects(values)
    deployments = {r: find(objs, "Deployment", role_name(r)) for r in ports}
    models = {"drafter": test_models.draft_noisy, "verifier": test_models.target}

    api = FakeKubeAPI("specdec")
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    procs: list[ServiceProcess] = []
    try:
        # The models Job's command is one the CLI accepts, for models it knows.
        (job,) = [o for o in objs if o["kind"] == "Job"]
        (fetch,) = job["spec"]["template"]["spec"]["initContainers"]
        _, sub, verb, *names = fetch["command"]
        from specdec.tools.models import MODELS

        assert (sub, verb) == ("models", "install") and set(names) <= set(MODELS)
        for role in ("drafter", "verifier"):
            c = container(deployments[role], role)
            env = expand(c["env"], f"{role_name(role)}-0", {"SPECDEC_MODEL": str(models[role])})
            assert env["SPECDEC_MODEL"] == str(models[role])
            p = ServiceProcess(role, argv_of(c), env=env).start()
            procs.append(p)
        for p in procs:
            p.wait_healthy()  # grpc.health.v1 on the container port, as the probes ask
            assert p.port == ports[p.name]
            api.put(role_name(p.name), f"{role_name(p.name)}-abc", p.port, [("127.0.0.1", True)])

        c = container(deployments["gateway"], "gateway")
        chart_redis = next(e["value"] for e in c["env"] if e["name"] == "SPECDEC_REDIS")
        assert chart_redis.startswith(f"redis://{role_name('redis')}.specdec.svc:")
        env = expand(c["env"], f"{role_name('gateway')}-0", {"SPECDEC_REDIS": redis_server.url})
        env |= {"KUBECONFIG": kubeconfig, "KUBERNETES_SERVICE_HOST": ""}
        assert env["SPECDEC_DRAFTER"].startswith("k8s:specdec/")
        gateway = ServiceProcess("gateway", argv_of(c), env=env).start()
        procs.append(gateway)
        gateway.wait_healthy()
        assert gateway.port == ports["gateway"]

        with Client(gateway.address, timeout=120) as client:
            for text in PROMPTS[:2]:
                ids = tokenizer(text).input_ids
                got = client.generate(token_ids=ids, max_new_tokens=24, k=2)
                assert list(got.tokens) == reference(ids, 24), text
            # the chart's default k (SPECDEC_DEFAULT_K in the example) reached the gateway
            got = client.generate(token_ids=ids, max_new_tokens=8)
            assert got.stats.num_draft_tokens == int(env["SPECDEC_DEFAULT_K"])
        # the replicas' dataPort: the gateway connected to each pod's data port
        transports = [json.loads(line) for line in gateway.lines if '"replica transport"' in line]
        assert {(t["replica"], t["transport"]) for t in transports} == {
            (f"127.0.0.1:{ports[role]}", "dataplane") for role in ("drafter", "verifier")
        }
    finally:
        for p in reversed(procs):
            p.stop()
        api.close()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_rendered_setting_is_one_the_cli_knows():
    """Companion of the boot test for what it cannot boot here (GPU examples): every
    Deployment's args parse with the real `specdec` parser, and every SPECDEC_* variable it
    sets is the variable of one of that service's flags (the services would ignore an
    unknown variable silently)."""
    from specdec.cli import build_parser
    from specdec.common.settings import env_name

    parser = build_parser()
    serve = _subcommands(parser)["serve"]
    for path in EXAMPLES:
        objs = objects(yaml.safe_load(path.read_text()))
        for role in ("drafter", "verifier", "gateway"):
            c = container(find(objs, "Deployment", role_name(role)), role)
            parser.parse_args(c["args"])  # exits (SystemExit) on an unknown argument
            flags = _subcommands(serve)[role]._actions
            known = {env_name(a.option_strings[0]) for a in flags if a.option_strings}
            for e in c["env"]:
                if e["name"].startswith("SPECDEC_"):
                    assert e["name"] in known, f"{path.stem}: {role} has no setting {e['name']}"
