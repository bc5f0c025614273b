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
        "import specdec.gateway.front.server, specdec.gateway.front.turn, specdec.gateway.round.loop, "
        "specdec.gateway.sessions, specdec.gateway.fleet.replicas, specdec.tools.launcher, "
        "specdec.gateway.front.http.app\n"
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
    for torch_free in ("specdec-common", "specdec-gateway"):
        names = _names(requires(torch_free))
        assert not {"torch", "transformers", "specdec-replica"} & names, torch_free
    assert "specdec-common" in _names(requires("specdec-gateway"))
    assert {"torch", "transformers", "specdec-common"} <= _names(requires("specdec-replica"))
    for replica in ("specdec-drafter", "specdec-verifier"):
        assert _names(requires(replica)) == {"specdec-replica"}
    assert {"specdec-gateway", "specdec-drafter", "specdec-verifier"} <= _names(
        requires("specdec-server")
    )


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
    assert "specdec/__init__.py" not in names  # a namespace shared with the services


def _wheel(folder: Path, out: Path) -> zipfile.ZipFile:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(folder)],
        check=True,
    )  # fmt: skip
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def _entry_points(archive: zipfile.ZipFile) -> str:
    (entry_points,) = [n for n in archive.namelist() if n.endswith("entry_points.txt")]
    return archive.read(entry_points).decode()


def test_each_service_wheel_carries_its_own_code_and_no_tooling(tmp_path):
    """The images install the services' distributions: each carries its own package and
    registers itself for `specdec serve`; none carries the local stack, demo, bench and
    model installer (specdec-tools) or their commands."""
    for part in ("common", "gateway", "replica", "drafter", "verifier"):
        out = tmp_path / part
        out.mkdir()
        archive = _wheel(ROOT / "services" / part, out)
        names = archive.namelist()
        code = {n.split("/")[1] for n in names if n.startswith("specdec/") and n.endswith(".py")}
        assert code == ({"common", "serve"} if part == "common" else {part}), (part, code)
        assert "specdec/__init__.py" not in names
        if part in ("gateway", "drafter", "verifier"):
            assert f"{part} = specdec.{part}.cli:SERVICE" in _entry_points(archive)
    common = _entry_points(zipfile.ZipFile(next((tmp_path / "common").glob("*.whl"))))
    assert "serve = specdec.serve:add_serve_parser" in common
    assert not {"up =", "bench =", "demo =", "models ="} & {
        line.split("=")[0].strip() + " =" for line in common.splitlines() if "=" in line
    }
