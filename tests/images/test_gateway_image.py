"""The gateway image (make image-test): its entrypoint, no torch, and a real gateway run from
it with a read-only root filesystem against a drafter and a verifier on this host."""

from __future__ import annotations

import pytest

from specdec.sdk import Client
from specdec.tools.launcher import ServiceProcess
from tests.conftest import PROMPTS
from tests.images.conftest import ENABLED, SKIP_REASON

pytestmark = [pytest.mark.images, pytest.mark.skipif(not ENABLED, reason=SKIP_REASON)]

N = 24  # new tokens per comparison
UID = "10001"


def test_image_config(gateway_image):
    cfg = gateway_image.config
    assert cfg["Entrypoint"] == ["specdec", "serve", "gateway"]
    assert cfg["User"] == f"{UID}:{UID}"
    env = gateway_image.env
    assert env["HOME"].startswith("/tmp")
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert gateway_image.healthcheck["Test"] == ["CMD", "specdec-probe"]


def test_entrypoint_answers_help(gateway_image):
    r = gateway_image.buildah_run(*gateway_image.config["Entrypoint"], "--help")
    assert r.returncode == 0, r.stderr
    for setting in ("SPECDEC_DRAFTER", "SPECDEC_VERIFIER", "SPECDEC_PORT", "SPECDEC_REDIS"):
        assert setting in r.stdout


def test_no_torch_in_the_gateway_image(gateway_image):
    r = gateway_image.buildah_run("python", "-c", "import torch")
    assert r.returncode != 0
    assert "No module named 'torch'" in r.stderr
    r = gateway_image.buildah_run(
        "python", "-c", "import specdec.gateway.front.server, transformers"
    )
    assert "No module named 'transformers'" in r.stderr
    r = gateway_image.buildah_run("python", "-c", "import specdec.gateway.front.server, tokenizers")
    assert r.returncode == 0, r.stderr


def test_root_filesystem_is_read_only_but_tmp(gateway_image):
    script = "id -u; touch /tmp/x && echo tmp-ok; touch /opt/specdec/x 2>&1; touch /x 2>&1; true"
    r = gateway_image.run_read_only("/bin/sh", "-c", script)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == UID
    assert lines[1] == "tmp-ok"
    assert "Read-only file system" in lines[2] and "Read-only file system" in lines[3], lines


def replica(role: str, model) -> ServiceProcess:
    return ServiceProcess.specdec(
        role, "serve", role, "--model", str(model), "--port", "0",
        "--host", "127.0.0.1", "--threads", "1",
    ).start()  # fmt: skip


@pytest.fixture(scope="module")
def stack(gateway_image, test_models):
    """Drafter and verifier on this host; one gateway from the image (read-only root, every
    setting from SPECDEC_* variables) and one from this checkout, both on those replicas."""
    procs = []
    try:
        d = replica("drafter", test_models.draft_noisy)
        v = replica("verifier", test_models.target)
        procs += [d, v]
        d.wait_healthy(), v.wait_healthy()
        settings = {
            "SPECDEC_DRAFTER": d.address,
            "SPECDEC_VERIFIER": v.address,
            "SPECDEC_HOST": "127.0.0.1",
            "SPECDEC_PORT": "0",
        }
        image_gw = ServiceProcess(
            "gateway-image",
            gateway_image.read_only_argv(*gateway_image.config["Entrypoint"], env=settings),
        ).start()
        procs.append(image_gw)
        local_gw = ServiceProcess.specdec(
            "gateway-local", "serve", "gateway", "--port", "0", "--host", "127.0.0.1",
            "--drafter", d.address, "--verifier", v.address,
        ).start()  # fmt: skip
        procs.append(local_gw)
        image_gw.wait_healthy(timeout=180), local_gw.wait_healthy()
        yield {"image": image_gw, "local": local_gw}
    finally:
        for p in procs:
            p.stop()


def test_healthcheck_probe_reports_serving(gateway_image, stack):
    port = str(stack["image"].port)
    test = gateway_image.healthcheck["Test"]
    assert test[0] == "CMD"
    r = gateway_image.run_read_only(*test[1:], env={"SPECDEC_PORT": port})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"127.0.0.1:{port}: SERVING"
    r = gateway_image.run_read_only(*test[1:], env={"SPECDEC_PORT": "1"})  # nothing there
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr


def test_generation_equals_generate_and_the_local_gateway(stack, tokenizer, reference):
    with (
        Client(stack["image"].address, timeout=120) as image,
        Client(stack["local"].address, timeout=120) as local,
    ):
        for text in PROMPTS[:3]:
            ids = tokenizer(text).input_ids
            # The fixed policy: the image's gateway is under test, and the adaptive one may
            # leave the tiny drafter out where its cost curve says drafting does not pay.
            got = image.generate(token_ids=ids, max_new_tokens=N, k=4, k_policy="fixed")
            assert list(got.tokens) == reference(ids, N), text
            assert got.stats.accepted_tokens > 0
            from_image = image.generate(text, max_new_tokens=N, k=2)
            from_local = local.generate(text, max_new_tokens=N, k=2)
            assert from_image.text == from_local.text
            assert list(from_image.tokens) == list(from_local.tokens)
    assert stack["image"].alive(), stack["image"].tail()
