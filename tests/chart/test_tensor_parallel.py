"""verifier.tensorParallel: one verifier pod of N ranks (specdec.replica.tp), one GPU a rank."""

from __future__ import annotations

import re

import helm_python
import pytest

from tests.chart.render import container, env_of, find, objects, role_name


def verifier_pod(values: dict) -> tuple[dict, dict]:
    """The verifier container's environment and resources."""
    deployment = find(objects(values), "Deployment", role_name("verifier"))
    c = container(deployment, "verifier")
    return env_of(c), c["resources"]


def test_default_is_one_rank_and_one_gpu():
    env, resources = verifier_pod({})
    assert "SPECDEC_TENSOR_PARALLEL" not in env
    assert resources["limits"]["nvidia.com/gpu"] == 1


def test_n_ranks_request_n_gpus_of_one_pod():
    env, resources = verifier_pod({"verifier": {"tensorParallel": 4}})
    assert env["SPECDEC_TENSOR_PARALLEL"] == "4"
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 4
    env, resources = verifier_pod({"verifier": {"tensorParallel": 2, "gpus": 2}})
    assert resources["limits"]["nvidia.com/gpu"] == 2


def test_on_cpu_the_ranks_need_no_gpu():
    values = {
        "verifier": {"tensorParallel": 2, "device": "cpu", "gpus": 0, "dtype": "float32"},
    }
    env, resources = verifier_pod(values)
    assert env["SPECDEC_TENSOR_PARALLEL"] == "2"
    assert "nvidia.com/gpu" not in resources.get("limits", {})


@pytest.mark.parametrize(
    ("verifier", "message"),
    [
        (
            {"tensorParallel": 2, "engine": "paged"},
            "verifier.tensorParallel 2 needs verifier.engine dense",
        ),
        ({"tensorParallel": 2, "dtype": "fastest"}, "needs a named verifier.dtype"),
        ({"tensorParallel": 4, "gpus": 2}, "verifier.gpus is 2 but verifier.tensorParallel is 4"),
        ({"tensorParallel": 0}, "tensorParallel"),
    ],
)
def test_refused(verifier, message):
    with pytest.raises(helm_python.HelmError, match=re.escape(message)):
        objects({"verifier": verifier})


def test_the_drafter_has_no_such_setting():
    with pytest.raises(helm_python.HelmError, match="tensorParallel"):
        objects({"drafter": {"tensorParallel": 2}})
