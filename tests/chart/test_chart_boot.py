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
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from specdec.sdk import Client
from specdec.tools.launcher import ServiceProcess
from specdec.tools.redisproc import RedisProcess, free_port
from tests.chart.render import EXAMPLES, container, env_of, find, objects, role_name
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


def free_ports(values: dict) -> dict[str, int]:
    """Set every port of the chart's services to a free one (the test runs beside others)."""
    ports = {role: free_port() for role in ("drafter", "verifier", "gateway")}
    for role, port in ports.items():
        values.setdefault(role, {})["port"] = port
    values["gateway"]["metricsPort"] = free_port()
    for role in ("drafter", "verifier"):
        values[role]["dataPort"] = free_port()
        values[role]["metricsPort"] = free_port()
    return ports


def start_stack(
    objs: list[dict], tmp_path: Path, redis_url: str, models: dict[str, str] | None = None
) -> tuple[list[ServiceProcess], FakeKubeAPI]:
    """The rendered drafter, verifier and gateway Deployments as local processes (gateway
    last); `models` replaces SPECDEC_MODEL by role. Stop the processes and the API after."""
    deployments = {r: find(objs, "Deployment", role_name(r)) for r in ("drafter", "verifier")}
    api = FakeKubeAPI("specdec")
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    procs: list[ServiceProcess] = []
    try:
        for role in ("drafter", "verifier"):
            c = container(deployments[role], role)
            replace = {"SPECDEC_MODEL": models[role]} if models else {}
            env = expand(c["env"], f"{role_name(role)}-0", replace)
            procs.append(ServiceProcess(role, argv_of(c), env=env).start())
        for p in procs:
            p.wait_healthy()  # grpc.health.v1 on the container port, as the probes ask
            api.put(role_name(p.name), f"{role_name(p.name)}-abc", p.port, [("127.0.0.1", True)])
        c = container(find(objs, "Deployment", role_name("gateway")), "gateway")
        env = expand(c["env"], f"{role_name('gateway')}-0", {"SPECDEC_REDIS": redis_url})
        env |= {"KUBECONFIG": kubeconfig, "KUBERNETES_SERVICE_HOST": ""}
        assert env["SPECDEC_DRAFTER"].startswith("k8s:specdec/")
        gateway = ServiceProcess("gateway", argv_of(c), env=env).start()
        procs.append(gateway)
        gateway.wait_healthy()
    except BaseException:
        for p in reversed(procs):
            p.stop()
        api.close()
        raise
    return procs, api


@pytest.mark.parametrize("example", ["cpu-dev"])
def test_rendered_deployments_serve_exact_generations(
    example, test_models, redis_server, tokenizer, reference, tmp_path
):
    values = yaml.safe_load(next(p for p in EXAMPLES if p.stem == example).read_text())
    ports = free_ports(values)
    objs = objects(values)
    models = {"drafter": str(test_models.draft_noisy), "verifier": str(test_models.target)}
    # The models Job's command is one the CLI accepts, for models it knows.
    (job,) = [o for o in objs if o["kind"] == "Job"]
    (fetch,) = job["spec"]["template"]["spec"]["initContainers"]
    _, sub, verb, *names = fetch["command"]
    from specdec.tools.models import MODELS

    assert (sub, verb) == ("models", "install") and set(names) <= set(MODELS)
    c = container(find(objs, "Deployment", role_name("gateway")), "gateway")
    chart_redis = next(e["value"] for e in c["env"] if e["name"] == "SPECDEC_REDIS")
    assert chart_redis.startswith(f"redis://{role_name('redis')}.specdec.svc:")
    procs, api = start_stack(objs, tmp_path, redis_server.url, models)
    try:
        gateway = procs[-1]
        for p in procs:
            assert p.port == ports[p.name]
        env = env_of(container(find(objs, "Deployment", role_name("gateway")), "gateway"))
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


def test_hub_models_install_from_a_hub_shaped_folder_and_serve_under_the_hub_id(
    test_models, redis_server, tokenizer, reference, tmp_path
):
    """The default models path end to end, offline: each replica's init container resolves
    its hub id from a folder laid out as the hub's cache (what a download leaves), the
    replica loads what the init container linked, and the OpenAI API serves the target
    under its hub id, organisation kept."""
    from specdec.tools.models import to_hub_cache

    mount = tmp_path / "models"
    values: dict = {
        "models": {"mountPath": str(mount)},
        "drafter": {"model": {"name": "tiny-org/tiny-draft"}},
        "verifier": {"model": {"name": "tiny-org/tiny-target"}},
    }
    for role in ("drafter", "verifier"):
        values[role] |= {"device": "cpu", "gpus": 0, "dtype": "float32"}
        values[role]["image"] = {"torchVariant": "cpu"}
    ports = free_ports(values)
    values["gateway"]["httpPort"] = http = free_port()
    objs = objects(values)
    to_hub_cache(test_models.draft_noisy, "tiny-org/tiny-draft", mount / "hub")
    to_hub_cache(test_models.target, "tiny-org/tiny-target", mount / "hub")
    for role in ("drafter", "verifier"):
        (fetch,) = find(objs, "Deployment", role_name(role))["spec"]["template"]["spec"][
            "initContainers"
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
        env |= {e["name"]: e["value"] for e in fetch["env"] if e["name"] == "SPECDEC_MODELS_DIR"}
        done = subprocess.run(
            [sys.executable, *fetch["command"][1:]], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
    procs, api = start_stack(objs, tmp_path, redis_server.url)  # SPECDEC_MODEL as rendered
    try:
        assert procs[-1].port == ports["gateway"]
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=60) as r:
            listed = [m["id"] for m in json.load(r)["data"]]
        assert listed == ["tiny-org/tiny-target"]
        ids = tokenizer(PROMPTS[0]).input_ids
        with Client(procs[-1].address, timeout=120) as client:
            got = client.generate(token_ids=ids, max_new_tokens=16, k=2)
        assert list(got.tokens) == reference(ids, 16)
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
