"""The images built with buildah (`make image-test`), and ways to run them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENABLED = os.environ.get("SPECDEC_IMAGE_TEST") == "1"
SKIP_REASON = "container image test: needs images built with buildah; run `make image-test`"
# The images this run built and tests (make image-test IMAGE_TEST_ROLES="gateway drafter ...").
ROLES = os.environ.get("SPECDEC_IMAGE_ROLES", "gateway").split()

# Mount the image's root filesystem read-only in a private mount namespace, give it /dev,
# /proc, a tmpfs /tmp and read-only bind mounts (SRC:DST in $3, space-separated), then run the
# command as the image's user with only the image's environment (plus NAME=VALUE overrides):
# what `docker run --read-only --tmpfs /tmp -v SRC:DST:ro` does.
READ_ONLY_RUNNER = r"""
set -e
root=$1; user=$2; mounts=$3; shift 3
mount --bind "$root" "$root"
mount --rbind /dev "$root/dev"
mount --rbind /proc "$root/proc"
mount -t tmpfs -o mode=1777,size=256m tmpfs "$root/tmp"
for m in $mounts; do
    mkdir -p "$root${m#*:}"
    mount --bind "${m%%:*}" "$root${m#*:}"
    mount -o remount,bind,ro "$root${m#*:}"
done
mount -o remount,bind,ro "$root"
exec chroot --userspec="$user" "$root" /usr/bin/env -i "$@"
"""


def pytest_configure(config):
    config.addinivalue_line("markers", "images: builds or runs container images (make image-test)")


def buildah(*args: str, **kw) -> subprocess.CompletedProcess:
    store = Path(os.environ.get("BUILDAH_ROOT", ROOT / "build/containers"))
    cmd = ["buildah", "--root", f"{store}/storage", "--runroot", f"{store}/run"]
    cmd += ["--storage-driver", "vfs", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


@dataclass
class Image:
    name: str
    config: dict  # OCI config: User, Env, Entrypoint, WorkingDir
    healthcheck: dict  # Docker config Healthcheck: Test, Interval, ...
    container: str  # a buildah working container from the image
    rootfs: str  # its root filesystem, mounted

    @property
    def env(self) -> dict[str, str]:
        return dict(e.split("=", 1) for e in self.config.get("Env", []))

    def buildah_run(self, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """`buildah run --isolation chroot` (writable root, host network)."""
        return buildah("run", "--isolation", "chroot", self.container, "--", *cmd)

    def read_only_argv(
        self, *cmd: str, env: dict[str, str] | None = None, mounts: dict[str, str] | None = None
    ) -> list[str]:
        """argv that runs cmd in the image with a read-only root filesystem (root only);
        mounts: {host path: path in the image}, bound read-only."""
        assignments = [f"{k}={v}" for k, v in {**self.env, **(env or {})}.items()]
        binds = " ".join(f"{src}:{dst}" for src, dst in (mounts or {}).items())
        assert all(" " not in b and b.count(":") == 1 for b in binds.split()), binds
        return [
            "unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", READ_ONLY_RUNNER,
            "runner", self.rootfs, self.config["User"], binds, *assignments, *cmd,
        ]  # fmt: skip

    def run_read_only(self, *cmd: str, env=None, mounts=None, timeout: float = 120):
        argv = self.read_only_argv(*cmd, env=env, mounts=mounts)
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def open_image(role: str) -> Iterator[Image]:
    """The image of `role` from buildah's storage, as a mounted working container."""
    if not ENABLED:
        pytest.skip(SKIP_REASON)
    if role not in ROLES:
        pytest.skip(f"the {role} image is not tested by this run (SPECDEC_IMAGE_ROLES={ROLES}); "
                    f'make image-test IMAGE_TEST_ROLES="gateway drafter verifier" tests all')  # fmt: skip
    if shutil.which("buildah") is None:
        pytest.fail("buildah is not installed (apt-get install -y buildah)")
    if os.geteuid() != 0:
        pytest.fail("the read-only run needs root (mount namespaces, chroot)")
    # the image's reference as `make images` tags it (IMAGE_PREFIX, IMAGE_TAG, TORCH_VARIANT)
    name = subprocess.run(
        [str(ROOT / "docker" / "images.sh"), "name", role],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    inspect = buildah("inspect", "--type", "image", name)
    if inspect.returncode != 0:
        pytest.fail(f"no image {name} in buildah's storage (make image-test builds it):\n"
                    f"{inspect.stderr}")  # fmt: skip
    data = json.loads(inspect.stdout)
    ctr = buildah("from", "--quiet", name)
    assert ctr.returncode == 0, ctr.stderr
    container = ctr.stdout.strip()
    try:
        mount = buildah("mount", container)
        assert mount.returncode == 0, mount.stderr
        yield Image(
            name=name,
            config=data["OCIv1"]["config"],
            healthcheck=data["Docker"]["config"].get("Healthcheck") or {},
            container=container,
            rootfs=mount.stdout.strip(),
        )
    finally:
        buildah("umount", container)
        buildah("rm", container)


@pytest.fixture(scope="session")
def gateway_image() -> Iterator[Image]:
    yield from open_image("gateway")


@pytest.fixture(scope="session")
def drafter_image() -> Iterator[Image]:
    yield from open_image("drafter")


@pytest.fixture(scope="session")
def verifier_image() -> Iterator[Image]:
    yield from open_image("verifier")
