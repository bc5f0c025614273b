"""Configuration is read once and a bad value fails start-up with a message naming it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specdec.cli import build_parser
from specdec.common.config import ConfigError, ReplicaConfig


def parse(*argv: str) -> ReplicaConfig:
    args = build_parser().parse_args(["serve", "verifier", *argv])
    return ReplicaConfig.from_args("verifier", args)


def test_defaults_and_flags():
    cfg = parse("--model", "/m", "--port", "0", "--max-cached-tokens", "100")
    assert (cfg.model, cfg.port, cfg.max_cached_tokens, cfg.device) == ("/m", 0, 100, "cpu")


def test_environment_variables(monkeypatch):
    monkeypatch.setenv("SPECDEC_MODEL", "/env-model")
    monkeypatch.setenv("SPECDEC_MAX_DRAFT_TOKENS", "7")
    cfg = parse()
    assert cfg.model == "/env-model" and cfg.max_draft_tokens == 7
    assert parse("--max-draft-tokens", "3").max_draft_tokens == 3  # the flag wins


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        ((), "--model / SPECDEC_MODEL"),
        (("--model", "m", "--port", "70000"), "--port"),
        (("--model", "m", "--port", "x"), "--port"),
        (("--model", "m", "--dtype", "int3"), "--dtype"),
        (("--model", "m", "--device", "tpu"), "--device"),
        (("--model", "m", "--max-cached-tokens", "0"), "--max-cached-tokens"),
        (("--model", "m", "--max-draft-tokens", "-1"), "--max-draft-tokens"),
        (("--model", "m", "--gguf-file", "/no/such/file.gguf"), "--gguf-file"),
    ],
)
def test_bad_values_name_the_setting(argv, names):
    with pytest.raises(ConfigError, match=names.replace("/", ".")):
        parse(*argv)


def test_cli_exits_with_the_message():
    result = subprocess.run(
        [sys.executable, "-m", "specdec", "serve", "drafter", "--model", "m", "--dtype", "fp7"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "--dtype" in result.stderr and "fp7" in result.stderr


def test_cli_import_is_torch_free():
    code = "import sys, specdec.cli, specdec.launcher; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
