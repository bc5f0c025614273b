"""The generated stubs in sdk/specdec/v1 (made by the SDK's build, sdk/setup.py, and by
`make proto`; not tracked) are what protoc makes from protos/ now, and buf lint passes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOS = sorted((ROOT / "protos" / "specdec" / "v1").glob("*.proto"))


def test_generated_stubs_are_fresh(tmp_path):
    assert PROTOS, "no .proto files found"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'protos'}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            *map(str, PROTOS),
        ],
        check=True,
    )
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "specdec" / "v1").iterdir()}
    generated = {
        p.name: p.read_bytes()
        for p in (ROOT / "sdk" / "specdec" / "v1").iterdir()
        if "_pb2" in p.name
    }
    assert set(fresh) == set(generated), "stub files differ: run `make proto`"
    stale = [name for name in fresh if fresh[name] != generated[name]]
    assert not stale, f"stale generated stubs {stale}: run `make proto`"


def test_buf_lint():
    buf = shutil.which("buf", path=str(Path(sys.executable).parent)) or shutil.which("buf")
    if buf is None:
        pytest.fail("buf not installed (the buf-bin package is part of the dev extra)")
    result = subprocess.run([buf, "lint"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
