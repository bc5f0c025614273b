"""The installs split by need: the SDK and the gateway never import torch, and the SDK's
wheel carries only the client."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from importlib.metadata import requires
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _fresh_modules(code: str) -> set[str]:
    """Top-level module names imported by `code` in a fresh interpreter."""
    probe = code + "\nimport sys\nprint(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_sdk_imports_neither_torch_nor_transformers():
    mods = _fresh_modules(
        "import specdec.sdk, specdec.sdk.client, specdec.sdk.cli_generate, specdec.v1.gateway_pb2\n"
        "import specdec.sdk.loadtest.cli, specdec.sdk.loadtest.runner, "
        "specdec.sdk.loadtest.summary, specdec.sdk.loadtest.report"
    )
    assert "specdec" in mods
    # matplotlib only when the loadtest draws its PNG (the optional extra [loadtest]).
    assert not {"torch", "transformers", "tokenizers", "redis", "matplotlib", "numpy"} & mods


def test_gateway_and_cli_import_no_torch():
    mods = _fresh_modules(
        "import specdec.gateway.server, specdec.gateway.turn, specdec.gateway.loop, "
        "specdec.gateway.sessions, specdec.gateway.replicas, specdec.tools.launcher, "
        "specdec.gateway.http.app\n"
        "from specdec.cli import build_parser\n"
        "build_parser().parse_args(['serve', 'gateway', '--drafter', 'h:1', '--verifier', 'h:2'])"
    )
    assert "specdec" in mods and "grpc" in mods and "uvicorn" in mods
    assert "torch" not in mods and "transformers" not in mods


def test_control_torch_is_seen_when_imported():
    """The probe above can fail: importing a replica's runtime does pull torch in."""
    assert "torch" in _fresh_modules("import specdec.replica.runtime")


def _names(reqs: list[str] | None) -> set[str]:
    return {re.split(r"[\s<>=;\[!~]", r, maxsplit=1)[0].lower() for r in reqs or []}


def test_distribution_dependencies():
    sdk = requires("specdec-sdk") or []
    assert _names([r for r in sdk if "extra ==" not in r]) == {"grpcio", "protobuf"}
    assert _names([r for r in sdk if 'extra == "loadtest"' in r]) == {"matplotlib", "httpx"}
    server = requires("specdec-server") or []
    gateway = [r for r in server if 'extra == "gateway"' in r]
    replica = [r for r in server if 'extra == "replica"' in r]
    assert "torch" not in _names(gateway) and "transformers" not in _names(gateway)
    assert {"torch", "transformers"} <= _names(replica)


@pytest.fixture(scope="module")
def sdk_wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(ROOT / "sdk")],
        check=True,
    )  # fmt: skip
    (wheel,) = out.glob("specdec_sdk-*.whl")
    return wheel


def test_sdk_wheel_carries_only_the_client(sdk_wheel):
    names = zipfile.ZipFile(sdk_wheel).namelist()
    code = [n for n in names if n.endswith((".py", ".pyi", ".jsonl"))]
    assert "specdec/sdk/client.py" in code and "specdec/v1/gateway_pb2.py" in code
    assert "specdec/cli.py" in code
    # `specdec loadtest` and its prompt set (which `specdec bench` reads too).
    assert {"specdec/sdk/loadtest/cli.py", "specdec/sdk/loadtest/prompts.jsonl"} <= set(code)
    assert not [n for n in code if not n.startswith(("specdec/sdk/", "specdec/v1/"))
                and n not in ("specdec/cli.py", "specdec/__main__.py")]  # fmt: skip
    assert not any(part in n for n in names for part in ("bench", "demo", "tools/", "gateway/"))
    assert "specdec/__init__.py" not in names  # a namespace shared with specdec-server


def test_server_wheel_carries_no_tooling(tmp_path):
    """The images install specdec-server: the local stack, demo, bench and model
    installer (specdec-tools) are not in it, nor its commands."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(ROOT)],
        check=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("specdec_server-*.whl")
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    assert "specdec/gateway/loop.py" in names and "specdec/serve/__init__.py" in names
    assert not [n for n in names if n.startswith("specdec/tools/")]
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    commands = archive.read(entry_points).decode()
    assert "serve" in commands and not {"up =", "bench =", "demo =", "models ="} & {
        line.split("=")[0].strip() + " =" for line in commands.splitlines() if "=" in line
    }
