"""The models cache: a claim filled once by a Job, mounted read-only by every replica.

The Job's commands are checked against the real CLIs they run (`specdec models install`'s
parser and the `hf` command, offline), and the replicas' wait script runs here against a
marker file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import helm_python
import pytest

from tests.chart.render import container, find, objects, role_name

DRAFT, TARGET = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"


def _job(objs: list[dict]) -> dict:
    (job,) = [o for o in objs if o["kind"] == "Job"]
    assert job["metadata"]["name"].startswith(role_name("models") + "-")
    return job


def _marker(job: dict) -> str:
    (done,) = job["spec"]["template"]["spec"]["containers"]
    assert done["command"][0] == "touch"
    return done["command"][1]


@pytest.mark.parametrize(
    ("source", "model_env"),
    [
        ("install", f"/models/{DRAFT}/model"),
        ("hub", f"/models/{DRAFT}"),
        ("pvc", f"/models/{DRAFT}"),
        ("hostPath", f"/models/{DRAFT}"),
    ],
)
def test_replicas_read_the_models_read_only(source, model_env):
    values = {"models": {"source": source}}
    if source == "pvc":
        values["models"]["pvc"] = {"existingClaim": "filled"}
    objs = objects(values)
    claims = [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    jobs = [o for o in objs if o["kind"] == "Job"]
    assert len(jobs) == len(claims) == (source in ("install", "hub"))
    for role in ("drafter", "verifier"):
        dep = find(objs, "Deployment", role_name(role))
        spec = dep["spec"]["template"]["spec"]
        c = container(dep, role)
        assert {
            "SPECDEC_MODEL": model_env.replace(DRAFT, DRAFT if role == "drafter" else TARGET)
        }.items() <= {e["name"]: e.get("value") for e in c["env"]}.items()
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "models"]
        assert mount["readOnly"] is True
        (volume,) = [v for v in spec["volumes"] if v["name"] == "models"]
        if source == "hostPath":
            assert volume["hostPath"]["path"] == "/var/lib/specdec/models"
            continue
        claim = volume["persistentVolumeClaim"]
        assert claim["readOnly"] is True
        if source == "pvc":
            assert claim["claimName"] == "filled" and "initContainers" not in spec
            continue
        # install, hub: the chart's claim, which the Job fills; the pod waits for its marker
        assert claim["claimName"] == claims[0]["metadata"]["name"]
        job = _job(objs)
        (job_volume,) = [
            v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"
        ]
        assert job_volume["persistentVolumeClaim"]["claimName"] == claim["claimName"]
        (wait,) = spec["initContainers"]
        assert wait["command"][-1] == _marker(job)
        assert all(m.get("readOnly") for m in wait["volumeMounts"])


def test_install_job_runs_the_cli_once_for_both_models():
    from specdec.cli import build_parser
    from specdec.tools.models import MODELS

    job = _job(objects({"models": {"install": {"extraArgs": ["--no-index"]}}}))
    spec = job["spec"]["template"]["spec"]
    (fetch,) = spec["initContainers"]
    assert fetch["command"][0] == "specdec"
    args = build_parser().parse_args(fetch["command"][1:])  # the CLI accepts it as rendered
    assert sorted(args.names) == sorted([DRAFT, TARGET]) and not args.index
    assert set(args.names) <= set(MODELS)
    env = {e["name"]: e.get("value") for e in fetch["env"]}
    assert env["SPECDEC_MODELS_DIR"] == "/models" and "HF_TOKEN" not in env
    assert spec["restartPolicy"] == "Never"
    # its pod takes no connections
    policy = find(objects(), "NetworkPolicy", role_name("models"))
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"] and "ingress" not in policy["spec"]
    claim = next(o for o in objects() if o["kind"] == "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_hub_job_downloads_each_model_with_the_token_from_a_secret(tmp_path):
    values = {
        "models": {"source": "hub", "hub": {"tokenSecret": {"name": "hub-token", "key": "hf"}}},
        "drafter": {"model": {"name": "org/draft-GGUF", "ggufFile": "draft.Q8_0.gguf"}},
        "verifier": {"model": {"name": "org/target"}},
    }
    objs = objects(values)
    job = _job(objs)
    fetches = job["spec"]["template"]["spec"]["initContainers"]
    assert [f["command"] for f in fetches] == [
        [
            "hf",
            "download",
            "org/draft-GGUF",
            "draft.Q8_0.gguf",
            "--local-dir",
            "/models/org/draft-GGUF",
        ],
        ["hf", "download", "org/target", "--local-dir", "/models/org/target"],
    ]
    for f in fetches:
        (token,) = [e for e in f["env"] if e["name"] == "HF_TOKEN"]
        assert token["valueFrom"]["secretKeyRef"] == {"name": "hub-token", "key": "hf"}
    for role in ("drafter", "verifier"):  # the replicas never hold the token
        c = container(find(objs, "Deployment", role_name(role)), role)
        assert "HF_TOKEN" not in [e["name"] for e in c["env"]]
    drafter = container(find(objs, "Deployment", role_name("drafter")), "drafter")
    env = {e["name"]: e.get("value") for e in drafter["env"]}
    assert env["SPECDEC_MODEL"] == "/models/org/draft-GGUF"
    assert env["SPECDEC_GGUF_FILE"] == "draft.Q8_0.gguf"
    # The real `hf` CLI accepts each command: offline it fails for want of the hub (exit 1),
    # where an argument it does not know would be a usage error (exit 2).
    hf = Path(sys.executable).with_name("hf")
    for i, f in enumerate(fetches):
        argv = [str(hf), *f["command"][1:]]
        argv[argv.index("--local-dir") + 1] = str(tmp_path / f"models-{i}")  # none there yet
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 1, proc.stderr
        assert "offline" in proc.stderr.lower()


def test_the_job_and_marker_follow_what_is_fetched():
    base = _job(objects())
    other_model = _job(objects({"drafter": {"model": {"name": "qwen2.5-coder-1.5b-instruct"}}}))
    other_image = _job(objects({"images": {"tag": "9.9.9"}}))
    assert _marker(other_model) != _marker(base)  # the pods wait for the new fill
    assert other_model["metadata"]["name"] != base["metadata"]["name"]
    assert _marker(other_image) == _marker(base)  # same models: nothing to wait for
    assert other_image["metadata"]["name"] != base["metadata"]["name"]  # a new Job all the same
    assert _job(objects())["metadata"]["name"] == base["metadata"]["name"]  # stable


def test_pvc_source_needs_an_existing_claim():
    with pytest.raises(helm_python.HelmError, match=r"models\.pvc\.existingClaim"):
        objects({"models": {"source": "pvc"}})


def test_wait_script_waits_for_the_marker(tmp_path):
    (wait,) = next(
        o
        for o in objects()
        if o["kind"] == "Deployment" and o["metadata"]["name"] == role_name("drafter")
    )["spec"]["template"]["spec"]["initContainers"]
    assert wait["command"][:2] == ["sh", "-c"]
    marker = tmp_path / ".specdec-ready"
    proc = subprocess.Popen([*wait["command"][:3], str(marker)], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        assert proc.poll() is None, "returned before the marker existed"
        marker.touch()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert "waiting for the models Job" in proc.stdout.read()
