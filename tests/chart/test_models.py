"""Where the replicas' models come from: by default each pod downloads its hub model into a
volume of its own; with `models.storage: claim` a Job fills one claim that every replica
mounts read-only.

The commands the chart renders run here: the hub download (huggingface_hub, offline, from a
folder laid out as the hub's cache), `specdec models install`'s parser, and the replicas'
wait script against a marker file.
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

DRAFT, TARGET = "Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct"
PAIR = {"drafter": "qwen2.5-coder-0.5b-instruct", "verifier": "qwen2.5-coder-1.5b-instruct"}
INSTALL = {role: {"model": {"name": name}} for role, name in PAIR.items()}


def _job(objs: list[dict]) -> dict:
    (job,) = [o for o in objs if o["kind"] == "Job"]
    assert job["metadata"]["name"].startswith(role_name("models") + "-")
    return job


def _marker(job: dict) -> str:
    (done,) = job["spec"]["template"]["spec"]["containers"]
    assert done["command"][0] == "touch"
    return done["command"][1]


def _pod(objs: list[dict], role: str) -> dict:
    return find(objs, "Deployment", role_name(role))["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    ("models", "extra", "model_env"),
    [
        ({}, {}, {"drafter": f"/models/{DRAFT}", "verifier": f"/models/{TARGET}"}),
        ({"source": "install"}, INSTALL, {r: f"/models/{n}/model" for r, n in PAIR.items()}),
        ({"storage": "claim"}, {}, {"drafter": f"/models/{DRAFT}", "verifier": f"/models/{TARGET}"}),
        (
            {"source": "install", "storage": "claim"},
            INSTALL,
            {r: f"/models/{n}/model" for r, n in PAIR.items()},
        ),
        ({"source": "pvc", "pvc": {"existingClaim": "filled"}}, INSTALL,
         {r: f"/models/{n}" for r, n in PAIR.items()}),
        ({"source": "hostPath"}, INSTALL, {r: f"/models/{n}" for r, n in PAIR.items()}),
    ],
)  # fmt: skip
def test_replicas_read_their_model_read_only(models, extra, model_env):
    objs = objects({"models": models, **extra})
    source, storage = models.get("source", "hub"), models.get("storage", "pod")
    per_pod = source in ("hub", "install") and storage == "pod"
    filled = source in ("hub", "install") and storage == "claim"
    claims = [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    jobs = [o for o in objs if o["kind"] == "Job"]
    assert len(jobs) == len(claims) == filled
    for role in ("drafter", "verifier"):
        spec = _pod(objs, role)
        c = container(find(objs, "Deployment", role_name(role)), role)
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["SPECDEC_MODEL"] == model_env[role]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "models"]
        assert mount["readOnly"] is True
        (volume,) = [v for v in spec["volumes"] if v["name"] == "models"]
        if source == "hostPath":
            assert volume["hostPath"]["path"] == "/var/lib/specdec/models"
            continue
        if per_pod:  # its own volume, filled by its own init container
            assert volume["emptyDir"] == {"sizeLimit": "40Gi"}
            (fetch,) = spec["initContainers"]
            assert fetch["name"] == "fetch-model"
            (fmount,) = [m for m in fetch["volumeMounts"] if m["name"] == "models"]
            assert not fmount.get("readOnly") and fmount["mountPath"] == "/models"
            if source == "hub":
                assert fetch["command"][:2] == ["python3", "-c"]
                assert fetch["command"][-1] == env["SPECDEC_MODEL"]  # what it links
            else:
                assert fetch["command"][:4] == ["specdec", "models", "install", PAIR[role]]
            continue
        claim = volume["persistentVolumeClaim"]
        assert claim["readOnly"] is True
        if source == "pvc":
            assert claim["claimName"] == "filled" and "initContainers" not in spec
            continue
        # storage claim: the chart's claim, which the Job fills; the pod waits for its marker
        assert claim["claimName"] == claims[0]["metadata"]["name"]
        job = _job(objs)
        (job_volume,) = [
            v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"
        ]
        assert job_volume["persistentVolumeClaim"]["claimName"] == claim["claimName"]
        (wait,) = spec["initContainers"]
        assert wait["command"][3] == _marker(job)
        assert wait["command"][5] == job["metadata"]["name"]
        assert all(m.get("readOnly") for m in wait["volumeMounts"])


def test_default_models_need_no_claim_and_no_rwx():
    """The default install: hub ids, each pod's own volume, no models claim or Job, and
    nothing anywhere that asks for ReadWriteMany."""
    objs = objects()
    assert not [o for o in objs if o["kind"] in ("Job", "PersistentVolumeClaim")]
    modes = [
        mode
        for o in objs
        if o["kind"] == "StatefulSet"
        for t in o["spec"].get("volumeClaimTemplates", [])
        for mode in t["spec"]["accessModes"]
    ]
    assert modes and "ReadWriteMany" not in modes
    for role, repo in (("drafter", DRAFT), ("verifier", TARGET)):
        (fetch,) = _pod(objs, role)["initContainers"]
        assert fetch["command"][3] == repo  # the hub id, organisation and all
    # the claim a Job fills (opt-in) is ReadWriteOnce unless asked otherwise
    claim = next(
        o for o in objects({"models": {"storage": "claim"}}) if o["kind"] == "PersistentVolumeClaim"
    )
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_ephemeral_volume_is_a_readwriteonce_claim_per_pod():
    objs = objects(
        {"models": {"pod": {"volume": "ephemeral", "size": "30Gi", "storageClassName": "ssd"}}}
    )
    for role in ("drafter", "verifier"):
        (volume,) = [v for v in _pod(objs, role)["volumes"] if v["name"] == "models"]
        spec = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
        assert spec == {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "ssd",
            "resources": {"requests": {"storage": "30Gi"}},
        }


@pytest.mark.parametrize("storage", ["pod", "claim"])
def test_hub_token_reaches_the_download_only(storage):
    values = {
        "models": {"storage": storage, "hub": {"tokenSecret": {"name": "hub-token", "key": "hf"}}}
    }
    objs = objects(values)
    if storage == "pod":
        fetches = [_pod(objs, role)["initContainers"][0] for role in ("drafter", "verifier")]
    else:
        fetches = _job(objs)["spec"]["template"]["spec"]["initContainers"]
    assert len(fetches) == 2
    for f in fetches:
        (token,) = [e for e in f["env"] if e["name"] == "HF_TOKEN"]
        assert token["valueFrom"]["secretKeyRef"] == {"name": "hub-token", "key": "hf"}
    for role in ("drafter", "verifier"):  # the serving containers never hold the token
        c = container(find(objs, "Deployment", role_name(role)), role)
        assert "HF_TOKEN" not in [e["name"] for e in c["env"]]
    gone = objects({"models": {"storage": storage}})
    assert "HF_TOKEN" not in str(gone)


def test_install_job_runs_the_cli_once_for_both_models():
    from specdec.cli import build_parser
    from specdec.tools.models import MODELS

    values = {"models": {"source": "install", "storage": "claim"}, **INSTALL}
    values["models"]["install"] = {"extraArgs": ["--no-index"]}
    objs = objects(values)
    job = _job(objs)
    spec = job["spec"]["template"]["spec"]
    (fetch,) = spec["initContainers"]
    assert fetch["command"][0] == "specdec"
    args = build_parser().parse_args(fetch["command"][1:])  # the CLI accepts it as rendered
    assert sorted(args.names) == sorted(PAIR.values()) and not args.index
    assert set(args.names) <= set(MODELS)
    env = {e["name"]: e.get("value") for e in fetch["env"]}
    assert env["SPECDEC_MODELS_DIR"] == "/models" and "HF_TOKEN" not in env
    assert spec["restartPolicy"] == "Never"
    # its pod takes no connections
    policy = find(objs, "NetworkPolicy", role_name("models"))
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"] and "ingress" not in policy["spec"]


def test_the_job_and_marker_follow_what_is_fetched():
    claim = {"models": {"storage": "claim"}}
    base = _job(objects(claim))
    other_model = _job(objects({**claim, "drafter": {"model": {"name": "org/other"}}}))
    other_revision = _job(objects({**claim, "drafter": {"model": {"revision": "v2"}}}))
    other_image = _job(objects({**claim, "images": {"tag": "9.9.9"}}))
    for other in (other_model, other_revision):
        assert _marker(other) != _marker(base)  # the pods wait for the new fill
        assert other["metadata"]["name"] != base["metadata"]["name"]
    assert _marker(other_image) == _marker(base)  # same models: nothing to wait for
    assert other_image["metadata"]["name"] != base["metadata"]["name"]  # a new Job all the same
    assert _job(objects(claim))["metadata"]["name"] == base["metadata"]["name"]  # stable


def test_pvc_source_needs_an_existing_claim():
    with pytest.raises(helm_python.HelmError, match=r"models\.pvc\.existingClaim"):
        objects({"models": {"source": "pvc"}})


def _wait_command(values: dict, marker: Path) -> list[str]:
    (wait,) = _pod(objects(values), "drafter")["initContainers"]
    assert wait["name"] == "wait-for-models" and wait["command"][:2] == ["sh", "-c"]
    return [*wait["command"][:3], str(marker), *wait["command"][4:]]


def test_wait_script_waits_for_the_marker(tmp_path):
    marker = tmp_path / ".specdec-ready"
    command = _wait_command({"models": {"storage": "claim"}}, marker)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        assert proc.poll() is None, "returned before the marker existed"
        marker.touch()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert "waiting for the models Job" in proc.stdout.read()


def test_wait_script_gives_up_naming_the_job_and_the_claims_phase(tmp_path):
    values = {"models": {"storage": "claim", "job": {"waitSeconds": 1}}}
    command = _wait_command(values, tmp_path / ".specdec-ready")
    job = _job(objects(values))["metadata"]["name"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    (line,) = proc.stderr.splitlines()  # one line
    assert line.startswith("models: not ready after 1 s: claim sd-specdec-models is Bound")
    assert f"the models Job {job} has not written" in line
    assert f"kubectl -n specdec describe job {job}" in line


def _run_fetch(fetch: dict, mount: Path, hub_offline: bool = True) -> subprocess.CompletedProcess:
    """A fetch-model container's command as the pod runs it, here: python3 is this venv's
    Python, the volume is `mount`, the hub is out of reach (HF_HUB_OFFLINE=1)."""
    argv = [sys.executable, *fetch["command"][1:]]
    env = {**os.environ, "HF_HOME": str(mount.parent / "hf-home")}
    env |= {e["name"]: e["value"] for e in fetch["env"] if "value" in e and e["name"] != "HOME"}
    env["HF_HOME"] = str(mount.parent / "hf-home")
    if hub_offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)


def test_hub_download_resolves_a_hub_shaped_folder_offline(test_models, tmp_path):
    """The init container's download, run here on a volume whose hub cache holds the model
    (laid out as huggingface_hub leaves a download): it links the folder SPECDEC_MODEL names
    to the snapshot, and transformers loads the model from there."""
    from transformers import AutoConfig

    from specdec.tools.models import to_hub_cache

    mount = tmp_path / "models"
    objs = objects(
        {"models": {"mountPath": str(mount)}, "drafter": {"model": {"name": "org/tiny"}}}
    )
    snapshot = to_hub_cache(test_models.draft_noisy, "org/tiny", mount / "hub")
    (fetch,) = _pod(objs, "drafter")["initContainers"]
    c = container(find(objs, "Deployment", role_name("drafter")), "drafter")
    model = Path(next(e["value"] for e in c["env"] if e["name"] == "SPECDEC_MODEL"))
    assert model == mount / "org" / "tiny"
    done = _run_fetch(fetch, mount)
    assert done.returncode == 0, done.stderr
    assert model.resolve() == snapshot.resolve()
    assert f"org/tiny@main is {snapshot}" in done.stdout
    assert AutoConfig.from_pretrained(model).vocab_size == test_models.vocab_size
    again = _run_fetch(fetch, mount)  # a restarted init container: the same link
    assert again.returncode == 0 and model.resolve() == snapshot.resolve()


def test_hub_download_failure_is_one_line(tmp_path):
    mount = tmp_path / "models"
    objs = objects(
        {"models": {"mountPath": str(mount)}, "drafter": {"model": {"name": "org/none"}}}
    )
    (fetch,) = _pod(objs, "drafter")["initContainers"]
    done = _run_fetch(fetch, mount)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"models: cannot download org/none@main into {mount}/hub: ")
    assert not (mount / "org" / "none").exists()
