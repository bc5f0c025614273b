"""The Helm chart, rendered by real Helm: lint, schema, Kubernetes validation, placement."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess

import helm_python
import kubernetes_validate
import pytest
import yaml

from tests.chart.render import (
    CHART,
    CRD_KINDS,
    EXAMPLES,
    KUBE_VERSION,
    container,
    env_of,
    find,
    objects,
    render,
    role_name,
    values_sets,
)

SETS = values_sets()


def test_four_examples_ship():
    assert {p.stem for p in EXAMPLES} >= {"cpu-dev", "gpu-pools", "external-redis", "tracing"}


@pytest.mark.parametrize("set_name", sorted(SETS))
def test_helm_lint_strict(set_name):
    report = helm_python.lint(
        str(CHART), SETS[set_name], strict=True, kube_version=f"v{KUBE_VERSION}"
    )
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert problems == []


@pytest.mark.parametrize("set_name", sorted(SETS))
def test_every_object_validates(set_name):
    objs = objects(SETS[set_name])
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "NetworkPolicy"} <= kinds
    for obj in objs:
        where = f"{set_name}: {obj['kind']}/{obj['metadata']['name']}"
        assert obj["metadata"]["namespace"] == "specdec", where
        if obj["kind"] in CRD_KINDS:
            # No schema ships for CRDs; the rendered object must still be one
            # kubernetes-validate recognises as unknown, not a typo of a core kind.
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_crd_objects_point_at_rendered_objects():
    objs = objects(SETS["gpu-pools"])
    for role in ("drafter", "verifier"):
        so = find(objs, "ScaledObject", role_name(role))
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        target = so["spec"]["scaleTargetRef"]
        assert find(objs, target["kind"], target["name"])
        assert "replicas" not in find(objs, "Deployment", role_name(role))["spec"]
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metadata"]["query"]
    route = find(objs, "GRPCRoute", role_name("gateway"))
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    svc = find(objs, "Service", backend["name"])
    assert backend["port"] in [p["port"] for p in svc["spec"]["ports"]]


def test_gpu_pools_place_drafter_and_verifier_apart():
    values = SETS["gpu-pools"]
    objs = objects(values)
    pods = {
        role: find(objs, "Deployment", role_name(role))["spec"]["template"]["spec"]
        for role in ("drafter", "verifier")
    }
    d, v = pods["drafter"], pods["verifier"]
    assert d["nodeSelector"] and v["nodeSelector"]
    assert d["nodeSelector"] != v["nodeSelector"]
    assert d["nodeSelector"] == values["drafter"]["nodeSelector"]
    assert v["nodeSelector"] == values["verifier"]["nodeSelector"]
    # each tolerates its own pool's taint and not the other's
    pool_key = next(iter(d["nodeSelector"]))
    d_pools = {t.get("value") for t in d["tolerations"] if t["key"] == pool_key}
    v_pools = {t.get("value") for t in v["tolerations"] if t["key"] == pool_key}
    assert d_pools == {d["nodeSelector"][pool_key]}
    assert v_pools == {v["nodeSelector"][pool_key]}
    gpu = values["gpuResource"]
    for role, spec in pods.items():
        res = container({"spec": {"template": {"spec": spec}}}, role)["resources"]
        want = values[role]["gpus"]
        assert want >= 1
        assert res["limits"][gpu] == want and res["requests"][gpu] == want, role
        assert spec["runtimeClassName"] == "nvidia"
        selector = find(objs, "Deployment", role_name(role))["spec"]["selector"]
        (spread,) = spec["topologySpreadConstraints"]
        assert spread["labelSelector"] == selector  # filled in with this role's pods


@pytest.mark.parametrize("gpu", ["amd.com/gpu", "nvidia.com/mig-1g.10gb"])
def test_gpu_resource_name_and_count_are_values(gpu):
    objs = objects({"gpuResource": gpu, "drafter": {"gpus": 2}, "verifier": {"gpus": 1}})
    for role, n in (("drafter", 2), ("verifier", 1)):
        res = container(find(objs, "Deployment", role_name(role)), role)["resources"]
        assert res["limits"][gpu] == n and res["requests"][gpu] == n
        assert "nvidia.com/gpu" not in res["limits"]


def test_cpu_dev_requests_no_gpu():
    objs = objects(SETS["cpu-dev"])
    for role in ("drafter", "verifier"):
        c = container(find(objs, "Deployment", role_name(role)), role)
        assert not [k for k in c["resources"]["limits"] if "gpu" in k]
        assert env_of(c)["SPECDEC_DEVICE"] == "cpu"


@pytest.mark.parametrize("set_name", sorted(SETS))
def test_pods_are_locked_down(set_name):
    for obj in objects(SETS[set_name]):
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = obj["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["runAsUser"] >= 10000
            assert c["resources"]["limits"] and c["resources"]["requests"]


@pytest.mark.parametrize("role", ["drafter", "verifier", "gateway"])
def test_probes_shm_and_termination_window(role):
    objs = objects()
    dep = find(objs, "Deployment", role_name(role))
    spec = dep["spec"]["template"]["spec"]
    c = container(dep, role)
    port = c["ports"][0]["containerPort"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": port}, probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model loading
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
    grace = float(env_of(c)["SPECDEC_GRACE_SECONDS"])
    assert spec["terminationGracePeriodSeconds"] > grace


def test_services_headless_for_replicas():
    objs = objects()
    for role in ("drafter", "verifier"):
        svc = find(objs, "Service", role_name(role))
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["publishNotReadyAddresses"] is False
    gw = find(objs, "Service", role_name("gateway"))
    assert gw["spec"].get("clusterIP") != "None"
    assert find(objs, "HorizontalPodAutoscaler", role_name("gateway"))
    for role in ("drafter", "verifier", "gateway"):
        assert find(objs, "PodDisruptionBudget", role_name(role))


def test_only_the_gateway_reaches_replicas_and_redis():
    objs = objects()
    gateway_labels = find(objs, "Deployment", role_name("gateway"))["spec"]["selector"][
        "matchLabels"
    ]
    for role in ("drafter", "verifier", "redis"):
        pol = find(objs, "NetworkPolicy", role_name(role))
        assert pol["spec"]["policyTypes"] == ["Ingress"]
        rule, *others = pol["spec"]["ingress"]
        assert rule["from"] == [{"podSelector": {"matchLabels": gateway_labels}}]
        # anything else reaches the metrics port only (networkPolicy.metricsFrom)
        metrics = [] if role == "redis" else [{"port": 9090, "protocol": "TCP"}]
        assert [r["ports"] for r in others] == ([metrics] if metrics else [])


def test_discovery_rbac_and_token_only_for_k8s_mode():
    objs = objects()
    role = find(objs, "Role", role_name("gateway"))
    (rule,) = role["rules"]
    assert rule == {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    }
    binding = find(objs, "RoleBinding", role_name("gateway"))
    sa = find(objs, "ServiceAccount", binding["subjects"][0]["name"])
    gw = find(objs, "Deployment", role_name("gateway"))
    assert gw["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    env = env_of(container(gw, "gateway"))
    assert env["SPECDEC_DRAFTER"] == f"k8s:specdec/{role_name('drafter')}:50061"
    assert env["SPECDEC_VERIFIER"] == f"k8s:specdec/{role_name('verifier')}:50062"
    mounts = container(gw, "gateway")["volumeMounts"]
    assert any(m["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount" for m in mounts)

    dns = objects({"discovery": {"mode": "dns"}})
    assert not [o for o in dns if o["kind"] in ("Role", "RoleBinding")]
    gw = find(dns, "Deployment", role_name("gateway"))
    env = env_of(container(gw, "gateway"))
    assert env["SPECDEC_DRAFTER"] == (f"dns:{role_name('drafter')}.specdec.svc.cluster.local:50061")
    assert all(
        "serviceaccount" not in m["mountPath"] for m in container(gw, "gateway")["volumeMounts"]
    )


def test_external_redis_url_comes_from_the_secret():
    objs = objects(SETS["external-redis"])
    assert not [o for o in objs if o["metadata"]["name"] == role_name("redis")]
    gw = container(find(objs, "Deployment", role_name("gateway")), "gateway")
    (redis,) = [e for e in gw["env"] if e["name"] == "SPECDEC_REDIS"]
    assert redis["valueFrom"]["secretKeyRef"] == {"name": "specdec-redis", "key": "url"}


def test_builtin_redis_is_persistent():
    objs = objects()
    sts = find(objs, "StatefulSet", role_name("redis"))
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert "--appendonly" in container(sts, "redis")["args"]
    gw = container(find(objs, "Deployment", role_name("gateway")), "gateway")
    assert env_of(gw)["SPECDEC_REDIS"] == f"redis://{role_name('redis')}.specdec.svc:6379/0"


def test_tracing_sets_otel_env_and_jaeger():
    objs = objects(SETS["tracing"])
    endpoint = f"http://{role_name('jaeger')}.specdec.svc:4317"
    for role in ("drafter", "verifier", "gateway"):
        env = env_of(container(find(objs, "Deployment", role_name(role)), role))
        assert env["OTEL_SDK_DISABLED"] == "false"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint
        assert float(env["OTEL_TRACES_SAMPLER_ARG"]) == 1.0
        assert env["OTEL_SERVICE_NAME"] == f"specdec-{role}"
    assert find(objs, "Deployment", role_name("jaeger"))
    assert find(objs, "Service", role_name("jaeger"))
    off = env_of(container(find(objects(), "Deployment", role_name("gateway")), "gateway"))
    assert off["OTEL_SDK_DISABLED"] == "true" and "OTEL_EXPORTER_OTLP_ENDPOINT" not in off


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"discovery": {"mode": "consul"}}, "/discovery/mode"),
        ({"drafter": {"replicas": -1}}, "/drafter/replicas"),
        ({"verifier": {"settings": {"MAX_CONTEXT": "4"}}}, "SPECDEC_"),
        ({"gateway": {"tpyo": 1}}, "tpyo"),
        ({"tracing": {"enabled": True}}, "tracing.otlpEndpoint"),
        ({"gateway": {"graceSeconds": 30}}, "gateway.terminationGracePeriodSeconds"),
        ({"redis": {"enabled": False}}, "redis.external.secretName"),
        ({"discovery": {"mode": "static"}}, "discovery.staticDrafters"),
        ({"gateway": {"grpcRoute": {"enabled": True}}}, "gateway.grpcRoute.parentRefs"),
        ({"tls": {"replicas": {"secretName": "r"}}}, "tls.replicas.serverName"),
        ({"tls": {"healthPort": 0}}, "/tls/healthPort"),
        ({"verifier": {"image": {"torchVariant": "cpu"}}}, "verifier.image.torchVariant is cpu"),
    ],
)
def test_bad_values_fail_naming_the_setting(values, message):
    with pytest.raises(helm_python.HelmError, match=re.escape(message)):
        render(values)


def test_every_value_is_documented_and_in_the_schema():
    lines = (CHART / "values.yaml").read_text().splitlines()
    schema = helm_python.Chart.load(str(CHART)).schema
    undocumented = []
    stack: list[tuple[int, str]] = []
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z][\w.-]*):(.*)$", line)
        if not m:
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3).strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = [k for _, k in stack] + [key]
        node = schema
        for k in path:
            props = node.get("properties")
            if props is None:  # a free-form map (resources, nodeSelector, ...)
                break
            assert k in props, f"values.yaml {'.'.join(path)} is not in values.schema.json"
            node = props[k]
        else:
            if rest != "" or node.get("type") != "object" or "properties" not in node:
                # a leaf: the comment block above it must hold a `# --` line
                j = i - 1
                while j >= 0 and lines[j].strip().startswith("#") and "# --" not in lines[j]:
                    j -= 1
                if j < 0 or "# --" not in lines[j]:
                    undocumented.append(".".join(path))
        if rest == "":
            stack.append((indent, key))
    assert undocumented == []


def test_notes_say_how_to_call_the_gateway():
    notes = render()["specdec/templates/NOTES.txt"]
    assert f"{role_name('gateway')}.specdec.svc:50051" in notes
    assert "port-forward" in notes
    (line,) = [x.strip() for x in notes.splitlines() if "specdec generate" in x]
    from specdec.cli import build_parser

    args = build_parser().parse_args(shlex.split(line)[1:])  # the command as printed parses
    assert args.gateway == "127.0.0.1:50051" and args.prompt


def test_notes_show_a_curl_of_the_openai_api():
    """NOTES give the OpenAI base URL and curl commands that ask for the served model's
    name and a chat completion through a port-forward, on the default values."""
    notes = render()["specdec/templates/NOTES.txt"]
    assert f"http://{role_name('gateway')}.specdec.svc:8000/v1" in notes
    assert f"port-forward svc/{role_name('gateway')} 8000:8000" in notes
    (models,) = [x.strip() for x in notes.splitlines() if x.strip().startswith("MODEL=$(curl")]
    assert "http://127.0.0.1:8000/v1/models" in models
    (chat,) = [x.strip() for x in notes.splitlines() if x.strip().startswith("curl ")]
    words = shlex.split(chat)
    assert words[1] == "http://127.0.0.1:8000/v1/chat/completions"
    body = json.loads(words[words.index("-d") + 1].replace("$MODEL", "m"))
    assert body == {"model": "m", "messages": [{"role": "user", "content": "Hello"}]}
    off = render({"gateway": {"httpPort": 0}})["specdec/templates/NOTES.txt"]
    assert "OpenAI" not in off and "8000" not in off


def test_schema_engines_and_dtypes_are_the_clis():
    """values.schema.json takes exactly the engines and dtypes `specdec serve` takes (one
    list: specdec.replica.config), so `engine: auto`, the services' default, renders."""
    from specdec.replica.config import DTYPES, ENGINES

    schema = json.loads((CHART / "values.schema.json").read_text())
    for role in ("drafter", "verifier"):
        props = schema["properties"][role]["properties"]
        assert props["engine"]["enum"] == list(ENGINES), role
        assert props["dtype"]["enum"] == list(DTYPES), role
        c = container(
            find(objects({role: {"engine": "auto"}}), "Deployment", role_name(role)), role
        )
        assert env_of(c)["SPECDEC_ENGINE"] == "auto"


def test_examples_are_valid_yaml_objects():
    for path in EXAMPLES:
        assert isinstance(yaml.safe_load(path.read_text()), dict), path.name


@pytest.mark.parametrize("values, port", [({}, 8000), ({"gateway": {"httpPort": 8080}}, 8080)])
def test_gateway_http_port_is_exposed(values, port):
    """gateway.httpPort (8000 by default, as vLLM's): the container port, --http-port, the
    Service, the NetworkPolicy; 0 turns the HTTP API off."""
    gw = role_name("gateway")
    objs = objects(values)
    c = container(find(objs, "Deployment", gw), "gateway")
    assert {"name": "http", "containerPort": port, "protocol": "TCP"} in c["ports"]
    assert env_of(c)["SPECDEC_HTTP_PORT"] == str(port)
    ports = {p["name"]: p for p in find(objs, "Service", gw)["spec"]["ports"]}
    assert ports["http"]["port"] == port and ports["http"]["targetPort"] == "http"
    ingress = find(objs, "NetworkPolicy", gw)["spec"]["ingress"]
    assert {"port": port, "protocol": "TCP"} in ingress[0]["ports"]
    off = objects({"gateway": {"httpPort": 0}})
    c = container(find(off, "Deployment", gw), "gateway")
    assert env_of(c)["SPECDEC_HTTP_PORT"] == "0"
    assert "http" not in [p["name"] for p in c["ports"]]
    assert "http" not in [p["name"] for p in find(off, "Service", gw)["spec"]["ports"]]


TRUST = {
    "tls": {
        "gateway": {"secretName": "gw-tls", "requireClientCert": True},
        "replicas": {"secretName": "replica-tls", "serverName": "replicas.specdec.svc"},
        "healthPort": 8181,
    },
    "auth": {"tokensSecretName": "gw-tokens", "tokensSecretKey": "tokens.txt"},
}


def _mounted(dep: dict, c: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at `path` in container c of Deployment dep."""
    mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    assert mount["readOnly"] is True, path
    volume = next(
        v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    )
    secret = volume["secret"]
    assert secret["defaultMode"] == 0o440, path  # the pod's group (fsGroup) only
    name = path.removeprefix(mount["mountPath"] + "/")
    for item in secret.get("items", []):
        if item["path"] == name:
            return secret["secretName"], item["key"]
    return secret["secretName"], name


def test_tls_and_tokens_are_mounted_from_secrets():
    objs = objects(TRUST)
    for obj in objs:  # what the cluster would accept
        if obj["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    gw = find(objs, "Deployment", role_name("gateway"))
    c = container(gw, "gateway")
    env = env_of(c)
    files = {
        "SPECDEC_TLS_CERT": ("gw-tls", "tls.crt"),
        "SPECDEC_TLS_KEY": ("gw-tls", "tls.key"),
        "SPECDEC_TLS_CLIENT_CA": ("gw-tls", "ca.crt"),
        "SPECDEC_REPLICA_CA": ("replica-tls", "ca.crt"),
        "SPECDEC_REPLICA_CERT": ("replica-tls", "tls.crt"),
        "SPECDEC_REPLICA_KEY": ("replica-tls", "tls.key"),
        "SPECDEC_AUTH_TOKENS_FILE": ("gw-tokens", "tokens.txt"),
    }
    for name, where in files.items():
        assert _mounted(gw, c, env[name]) == where, name
    assert env["SPECDEC_REPLICA_SERVER_NAME"] == "replicas.specdec.svc"
    for role in ("drafter", "verifier"):
        dep = find(objs, "Deployment", role_name(role))
        rc = container(dep, role)
        renv = env_of(rc)
        for name, key in (("SPECDEC_TLS_CERT", "tls.crt"), ("SPECDEC_TLS_KEY", "tls.key"),
                          ("SPECDEC_TLS_CLIENT_CA", "ca.crt")):  # fmt: skip
            assert _mounted(dep, rc, renv[name]) == ("replica-tls", key), (role, name)
        client_side = {"SPECDEC_REPLICA_CA", "SPECDEC_REPLICA_CERT", "SPECDEC_AUTH_TOKENS_FILE"}
        assert not client_side & set(renv), role
    # The kubelet's gRPC probes cannot speak TLS: every TLS port has a plaintext health port.
    for role in ("drafter", "verifier", "gateway"):
        dep = find(objs, "Deployment", role_name(role))
        rc = container(dep, role)
        assert env_of(rc)["SPECDEC_HEALTH_PORT"] == "8181", role
        assert {"name": "health", "containerPort": 8181, "protocol": "TCP"} in rc["ports"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert rc[probe]["grpc"] == {"port": 8181}, (role, probe)
    # Nothing secret is written into the manifests themselves.
    rendered = render(TRUST)
    notes = rendered.pop("specdec/templates/NOTES.txt")
    text = "\n".join(rendered.values())
    assert "BEGIN" not in text and "Bearer" not in text
    # NOTES' curl commands name the token only as a variable the reader sets.
    assert "BEGIN" not in notes
    assert {m for m in re.findall(r"Bearer (\S+)", notes)} == {'$TOKEN"'}


def test_no_trust_settings_by_default():
    for dep in (o for o in objects() if o["kind"] == "Deployment"):
        for c in dep["spec"]["template"]["spec"]["containers"]:
            env = env_of(c)
            assert not {k for k in env if "TLS" in k or "REPLICA_C" in k or "AUTH" in k}, c["name"]
            assert "SPECDEC_HEALTH_PORT" not in env


@pytest.mark.parametrize(("cpu", "threads"), [("2", "2"), ("500m", "1"), ("3500m", "3"), (6, "6")])
def test_replica_threads_follow_the_cpu_request(cpu, threads):
    values = {role: {"resources": {"requests": {"cpu": cpu}}} for role in ("drafter", "verifier")}
    objs = objects(values)
    for role in ("drafter", "verifier"):
        c = container(find(objs, "Deployment", role_name(role)), role)
        assert env_of(c)["SPECDEC_THREADS"] == threads, role
    # An explicit setting wins, once.
    values["drafter"]["settings"] = {"SPECDEC_THREADS": "5"}
    c = container(find(objects(values), "Deployment", role_name("drafter")), "drafter")
    assert [e["value"] for e in c["env"] if e["name"] == "SPECDEC_THREADS"] == ["5"]


def test_replica_data_ports_are_exposed_to_the_gateways_only():
    """drafter/verifier.dataPort: the container port `data`, --data-port, the headless
    Service, and the NetworkPolicy's gateway rule; 0 turns the data plane off."""
    objs = objects()
    for role, port in (("drafter", 50071), ("verifier", 50072)):
        name = role_name(role)
        c = container(find(objs, "Deployment", name), role)
        assert {"name": "data", "containerPort": port, "protocol": "TCP"} in c["ports"]
        assert env_of(c)["SPECDEC_DATA_PORT"] == str(port)
        ports = {p["name"]: p for p in find(objs, "Service", name)["spec"]["ports"]}
        assert ports["data"]["port"] == port and ports["data"]["targetPort"] == "data"
        rule = find(objs, "NetworkPolicy", name)["spec"]["ingress"][0]  # the gateways'
        assert {"port": port, "protocol": "TCP"} in rule["ports"]
    off = objects({"drafter": {"dataPort": 0}})
    c = container(find(off, "Deployment", role_name("drafter")), "drafter")
    assert env_of(c)["SPECDEC_DATA_PORT"] == "-1"
    assert "data" not in [p["name"] for p in c["ports"]]
    service = find(off, "Service", role_name("drafter"))
    assert "data" not in [p["name"] for p in service["spec"]["ports"]]


@pytest.mark.parametrize(
    ("build", "chart_defaults"),
    [
        # the release workflow's prefix (.github/workflows/release.yml): the chart's default
        ({"IMAGE_PREFIX": "ghcr.io/specdec/specdec"}, True),
        ({}, False),  # `make images` with its defaults (localhost/specdec)
        ({"IMAGE_PREFIX": "registry.example.com/team/specdec", "IMAGE_TAG": "1.2.3"}, False),
        ({"IMAGE_PREFIX": "registry.example.com/specdec", "TORCH_VARIANT": "cpu"}, False),
    ],
)
def test_images_are_what_make_images_tags(build, chart_defaults):
    """The chart's image references equal `docker/images.sh name ROLE` (what `make images`
    and the release workflow tag) for the same prefix, tag and torch build; with no values
    set, the images the release workflow pushes."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("IMAGE_PREFIX", "IMAGE_TAG", "TORCH_VARIANT")
    }
    values: dict = {"images": {}}
    if not chart_defaults:
        values["images"]["prefix"] = build.get("IMAGE_PREFIX", "localhost/specdec")
    if "IMAGE_TAG" in build:
        values["images"]["tag"] = build["IMAGE_TAG"]
    if "TORCH_VARIANT" in build:
        for role in ("drafter", "verifier"):
            values[role] = {"image": {"torchVariant": build["TORCH_VARIANT"]}, "device": "cpu"}
    objs = objects(values)
    for role in ("drafter", "verifier", "gateway"):
        made = subprocess.run(
            [str(CHART.parents[1] / "docker" / "images.sh"), "name", role],
            env={**env, **build},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert container(find(objs, "Deployment", role_name(role)), role)["image"] == made


def test_local_images_with_pull_policy_always_are_refused():
    """A `localhost/` image (built here, in no registry) with Always cannot be pulled: the
    chart refuses it, naming the value to set; IfNotPresent (the default) renders."""
    local = {"images": {"prefix": "localhost/specdec"}}
    for role in ("drafter", "verifier", "gateway"):
        values = {**local, role: {"image": {"pullPolicy": "Always"}}}
        with pytest.raises(helm_python.HelmError) as err:
            render(values)
        message = str(err.value)
        assert f"{role}.image.pullPolicy is Always" in message
        assert "IfNotPresent" in message and "images.prefix" in message
    objs = objects(local)
    for role in ("drafter", "verifier", "gateway"):
        c = container(find(objs, "Deployment", role_name(role)), role)
        assert c["image"].startswith("localhost/") and c["imagePullPolicy"] == "IfNotPresent"
    # a registry's images may move with Always
    objs = objects({"gateway": {"image": {"pullPolicy": "Always"}}})
    assert (
        container(find(objs, "Deployment", role_name("gateway")), "gateway")["imagePullPolicy"]
        == "Always"
    )


def test_default_replica_images_carry_a_torch_for_the_default_device():
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    for role in ("drafter", "verifier"):
        assert defaults[role]["device"] == "cuda" and defaults[role]["gpus"] >= 1
        assert defaults[role]["image"]["torchVariant"].startswith("cu")
        image = container(find(objects(), "Deployment", role_name(role)), role)["image"]
        assert image.endswith("-" + defaults[role]["image"]["torchVariant"])
    dev = values_sets()["cpu-dev"]
    for role in ("drafter", "verifier"):
        assert dev[role]["device"] == "cpu" and dev[role]["image"]["torchVariant"] == "cpu"
