"""drafter.head: a draft head pool (`specdec serve drafter --head`, docs/concepts/heads.md),
its folder on the models volume or a volume of its own, and what a head does not run with."""

from __future__ import annotations

import re

import helm_python
import pytest

from tests.chart.render import container, env_of, find, objects, role_name


def drafter_pod(values: dict) -> tuple[dict, dict, dict]:
    """The drafter container's environment, the container and the pod spec."""
    deployment = find(objects(values), "Deployment", role_name("drafter"))
    c = container(deployment, "drafter")
    return env_of(c), c, deployment["spec"]["template"]["spec"]


def test_no_head_by_default():
    env, c, pod = drafter_pod({})
    assert "SPECDEC_HEAD" not in env
    assert all(m["name"] != "head" for m in c["volumeMounts"])
    assert all(v["name"] != "head" for v in pod["volumes"])


def test_a_head_on_the_models_volume():
    values = {"models": {"source": "pvc", "pvc": {"existingClaim": "models"}},
              "drafter": {"model": {"name": "qwen-1.5b"}, "head": {"path": "heads/qwen-1.5b"}}}  # fmt: skip
    env, _, pod = drafter_pod(values)
    assert env["SPECDEC_HEAD"] == "/models/heads/qwen-1.5b"
    assert env["SPECDEC_MODEL"] == "/models/qwen-1.5b"  # the target: the head reads its tokenizer
    assert all(v["name"] != "head" for v in pod["volumes"])


def test_a_head_on_a_volume_of_its_own_is_mounted_read_only():
    volume = {"persistentVolumeClaim": {"claimName": "heads"}}
    env, c, pod = drafter_pod({"drafter": {"head": {"path": "h1", "volume": volume}}})
    assert env["SPECDEC_HEAD"] == "/head/h1"
    assert {"name": "head", "mountPath": "/head", "readOnly": True} in c["volumeMounts"]
    assert {"name": "head", **volume} in pod["volumes"]
    verifier = find(objects({"drafter": {"head": {"path": "h1", "volume": volume}}}),
                    "Deployment", role_name("verifier"))  # fmt: skip
    assert "SPECDEC_HEAD" not in env_of(container(verifier, "verifier"))


@pytest.mark.parametrize(
    ("drafter", "message"),
    [
        ({"engine": "llama.cpp"}, "drafter.head needs drafter.engine dense or paged"),
        ({"compile": True}, "drafter.head needs drafter.compile false"),
        ({"dtype": "fastest"}, "drafter.head needs a named drafter.dtype"),
        ({"head": {"path": "", "volume": {"emptyDir": {}}}}, "drafter.head.path is empty"),
        ({"head": {"path": "/abs"}}, "at '/drafter/head/path': '/abs' does not match"),
    ],
)
def test_refused(drafter, message):
    values = {"drafter": {"head": {"path": "h1"}, **drafter}}
    with pytest.raises(helm_python.HelmError, match=re.escape(message)):
        objects(values)
