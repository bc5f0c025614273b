"""--tensor-parallel: the setting, and the combinations a tensor-parallel replica refuses
(the runs themselves: tests/integration/test_tp.py)."""

from __future__ import annotations

import argparse

import pytest

from specdec.cli import build_parser
from specdec.common.settings import ConfigError
from specdec.drafter.config import DrafterConfig
from specdec.verifier.config import VerifierConfig


def verifier(*argv: str) -> VerifierConfig:
    return VerifierConfig.from_args(build_parser().parse_args(["serve", "verifier", *argv]))


def test_setting_and_environment(monkeypatch):
    assert verifier("--model", "m").tensor_parallel == 1
    assert verifier("--model", "m", "--tensor-parallel", "2").tensor_parallel == 2
    monkeypatch.setenv("SPECDEC_TENSOR_PARALLEL", "4")
    assert verifier("--model", "m").tensor_parallel == 4


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (("--tensor-parallel", "0"), "--tensor-parallel / SPECDEC_TENSOR_PARALLEL: must be"),
        (("--tensor-parallel", "2", "--engine", "paged"), "paged engine"),
        (("--tensor-parallel", "2", "--pack-weights", "true"), "packed weights"),
        (("--tensor-parallel", "2", "--dtype", "fastest"), "--dtype fastest"),
        (("--tensor-parallel", "2", "--device", "cuda:1"), "rank r runs on cuda:r"),
    ],
)
def test_refused_combinations(argv, why):
    with pytest.raises(ConfigError, match=why):
        verifier("--model", "m", *argv)


def subcommand(*path: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def test_the_drafter_is_not_offered_tensor_parallel(capsys):
    """Only the verifier runs tensor-parallel: the drafter has no such flag (it was offered
    and always refused)."""
    assert "--tensor-parallel" in subcommand("serve", "verifier")._option_string_actions
    assert "--tensor-parallel" not in subcommand("serve", "drafter")._option_string_actions
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "drafter", "--model", "m", "--tensor-parallel", "2"])
    assert "unrecognized arguments: --tensor-parallel 2" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "drafter", "--model", "m"])
    assert DrafterConfig.from_args(args).tensor_parallel == 1
