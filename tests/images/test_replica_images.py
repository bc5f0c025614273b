"""The drafter and verifier images (make image-test IMAGE_TEST_ROLES="gateway drafter
verifier"): CPU torch, and the whole stack from images with read-only root filesystems, the
models mounted read-only at /models, checked against transformers' generate()."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from specdec.sdk import Client
from specdec.tools.launcher import ServiceProcess
from tests.conftest import PROMPTS
from tests.images.conftest import ENABLED, SKIP_REASON

pytestmark = [pytest.mark.images, pytest.mark.skipif(not ENABLED, reason=SKIP_REASON)]

N = 24


@pytest.fixture(params=["drafter", "verifier"])
def replica_image(request):
    return request.getfixturevalue(f"{request.param}_image"), request.param


def test_replica_image_config(replica_image):
    image, role = replica_image
    assert image.config["Entrypoint"] == ["specdec", "serve", role]
    assert image.config["User"] == "10001:10001"
    env = image.env
    assert env["SPECDEC_MODEL"] == "/models"
    assert env["SPECDEC_PORT"] == {"drafter": "50061", "verifier": "50062"}[role]
    assert env["SPECDEC_DATA_PORT"] == {"drafter": "50071", "verifier": "50072"}[role]
    for cache in ("HOME", "HF_HOME", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR"):
        assert env[cache].startswith("/tmp"), cache
    assert image.healthcheck["Test"] == ["CMD", "specdec-probe"]


def test_replica_image_has_cpu_torch(replica_image):
    image, _ = replica_image
    r = image.run_read_only("python", "-c", "import torch; print(torch.__version__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("+cpu")
    r = image.run_read_only(*image.config["Entrypoint"], "--help")
    assert r.returncode == 0, r.stderr
    assert "SPECDEC_MODEL" in r.stdout and "SPECDEC_DEVICE" in r.stdout


def readable_copy(model: Path, dest: Path) -> Path:
    """The model folder as a deployment would ship it: readable by the images' uid 10001
    (the test models' weights are 0600, root's, which that uid cannot open)."""
    shutil.copytree(model, dest)
    for p in [dest, *dest.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dest


def run_replica(image, role: str, model) -> ServiceProcess:
    settings = {"SPECDEC_HOST": "127.0.0.1", "SPECDEC_PORT": "0", "SPECDEC_THREADS": "1"}
    argv = image.read_only_argv(
        *image.config["Entrypoint"], env=settings, mounts={str(model): "/models"}
    )
    return ServiceProcess(f"{role}-image", argv).start()


def test_stack_from_images_equals_generate(
    drafter_image, verifier_image, gateway_image, test_models, tokenizer, reference, tmp_path
):
    procs = []
    try:
        draft = readable_copy(test_models.draft_noisy, tmp_path / "draft")
        target = readable_copy(test_models.target, tmp_path / "target")
        d = run_replica(drafter_image, "drafter", draft)
        v = run_replica(verifier_image, "verifier", target)
        procs += [d, v]
        d.wait_healthy(timeout=300), v.wait_healthy(timeout=300)
        for image, proc in ((drafter_image, d), (verifier_image, v)):
            probe = image.run_read_only("specdec-probe", env={"SPECDEC_PORT": str(proc.port)})
            assert probe.returncode == 0 and probe.stdout.strip().endswith("SERVING"), probe
        settings = {
            "SPECDEC_DRAFTER": d.address,
            "SPECDEC_VERIFIER": v.address,
            "SPECDEC_HOST": "127.0.0.1",
            "SPECDEC_PORT": "0",
        }
        g = ServiceProcess(
            "gateway-image",
            gateway_image.read_only_argv(*gateway_image.config["Entrypoint"], env=settings),
        ).start()
        procs.append(g)
        g.wait_healthy(timeout=180)
        with Client(g.address, timeout=120) as client:
            for text in PROMPTS[:3]:
                ids = tokenizer(text).input_ids
                got = client.generate(token_ids=ids, max_new_tokens=N, k=4)
                assert list(got.tokens) == reference(ids, N), text
                assert got.stats.accepted_tokens > 0
    finally:
        for p in procs:
            p.stop()
