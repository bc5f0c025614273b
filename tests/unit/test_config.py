"""Configuration is read once and a bad value fails start-up with a message naming it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specdec.cli import build_parser
from specdec.common.settings import ConfigError
from specdec.drafter.config import DrafterConfig
from specdec.verifier.config import VerifierConfig


def parse(*argv: str) -> VerifierConfig:
    args = build_parser().parse_args(["serve", "verifier", *argv])
    return VerifierConfig.from_args(args)


def test_defaults_and_flags():
    cfg = parse("--model", "/m", "--port", "0", "--max-cached-tokens", "100")
    assert (cfg.model, cfg.port, cfg.max_cached_tokens, cfg.device) == ("/m", 0, 100, "cpu")


def test_engine_setting(monkeypatch):
    cfg = parse("--model", "m")
    assert (cfg.engine, cfg.kv_engine) == ("auto", "paged")  # auto: paged on a CPU
    # ... and dense where the paged engine does not run: CUDA, compiled forwards, TP
    assert parse("--model", "m", "--device", "cuda").kv_engine == "dense"
    assert parse("--model", "m", "--compile").kv_engine == "dense"
    tp = ("--tensor-parallel", "2", "--dtype", "float32")
    assert parse("--model", "m", *tp).kv_engine == "dense"
    with pytest.raises(ConfigError, match="paged engine's pool is not sharded"):
        parse("--model", "m", *tp, "--engine", "paged")
    assert parse("--model", "m", "--engine", "dense").kv_engine == "dense"
    monkeypatch.setenv("SPECDEC_ENGINE", "paged")
    cfg = parse("--model", "m", "--kv-block-size", "32", "--compile")
    assert (cfg.engine, cfg.kv_engine, cfg.kv_block_size) == ("paged", "paged", 32)


def test_compile_setting(monkeypatch):
    assert parse("--model", "m").compile is False
    assert parse("--model", "m", "--compile").compile is True
    monkeypatch.setenv("SPECDEC_COMPILE", "true")
    assert parse("--model", "m").compile is True
    assert parse("--model", "m", "--no-compile").compile is False  # the flag wins
    drafter = DrafterConfig.from_args(
        build_parser().parse_args(["serve", "drafter", "--model", "m"])
    )
    assert drafter.compile is True


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
        (("--model", "m", "--engine", "vllm"), "--engine"),
        (("--model", "m", "--kv-block-size", "0"), "--kv-block-size"),
        (("--model", "m", "--device", "tpu"), "--device"),
        (("--model", "m", "--max-cached-tokens", "0"), "--max-cached-tokens"),
        (("--model", "m", "--max-draft-tokens", "-1"), "--max-draft-tokens"),
        (("--model", "m", "--gguf-file", "/no/such/file.gguf"), "--gguf-file"),
        (("--model", "m", "--health-port", "9000"), "--health-port"),  # without TLS
        (
            ("--model", "m", "--tls-cert", "c", "--tls-key", "k", "--health-port", "-1"),
            "--health-port",
        ),
    ],
)
def test_bad_values_name_the_setting(argv, names):
    with pytest.raises(ConfigError, match=names.replace("/", ".")):
        parse(*argv)


def test_ssd_settings():
    from specdec.gateway.config import GatewayConfig

    args = build_parser().parse_args(["serve", "drafter", "--model", "m", "--ssd-fan-out", "9"])
    cfg = DrafterConfig.from_args(args)
    assert cfg.role == "drafter" and parse("--model", "m").role == "verifier"
    assert (cfg.ssd_fan_out, cfg.ssd_max_per_outcome, cfg.ssd_acceptance_prior) == (9, 3, 0.7)
    assert cfg.ssd_outcomes == "confidence"
    args = build_parser().parse_args(
        ["serve", "drafter", "--model", "m", "--ssd-outcomes", "geometric"]
    )
    assert DrafterConfig.from_args(args).ssd_outcomes == "geometric"
    for flag, value in (
        ("--ssd-fan-out", "0"),
        ("--ssd-fan-out", "65"),
        ("--ssd-acceptance-prior", "1"),
        ("--ssd-max-per-outcome", "0"),
        ("--ssd-outcomes", "uniform"),
    ):
        args = build_parser().parse_args(["serve", "drafter", "--model", "m", flag, value])
        with pytest.raises(ConfigError, match=flag):
            DrafterConfig.from_args(args)

    def gateway(*argv):
        base = ["serve", "gateway", "--drafter", "h:1", "--verifier", "h:2"]
        return GatewayConfig.from_args(build_parser().parse_args([*base, *argv]))

    assert gateway().ssd is False and gateway("--ssd").ssd is True
    assert gateway("--ssd", "--no-ssd").ssd is False  # the last one wins
    assert gateway("--ssd-fan-out", "4").ssd_fan_out == 4
    with pytest.raises(SystemExit):  # SSD settings belong to the drafter
        build_parser().parse_args(["serve", "verifier", "--model", "m", "--ssd-fan-out", "2"])


def test_switches_take_no_value_and_their_variable_true_or_false(monkeypatch, capsys):
    """A boolean setting is --flag / --no-flag; its variable reads true/false, and a
    malformed one names the setting. The value form of older releases (--ssd true) still
    parses, with a deprecation warning."""
    from specdec.gateway.config import GatewayConfig

    def gateway(*argv):
        base = ["serve", "gateway", "--drafter", "h:1", "--verifier", "h:2"]
        return GatewayConfig.from_args(build_parser().parse_args([*base, *argv]))

    with pytest.raises(SystemExit):
        gateway("--ssd", "maybe")
    monkeypatch.setenv("SPECDEC_SSD", "maybe")
    with pytest.raises(ConfigError, match="--ssd / SPECDEC_SSD"):
        gateway()
    assert gateway("--ssd").ssd is True  # the flag wins over the variable
    monkeypatch.setenv("SPECDEC_SSD", "true")
    assert gateway().ssd is True and gateway("--no-ssd").ssd is False
    monkeypatch.delenv("SPECDEC_SSD")
    capsys.readouterr()
    assert gateway("--ssd", "true").ssd is True
    assert gateway("--ssd=false").ssd is False
    assert parse("--model", "m", "--trust-remote-code", "yes").trust_remote_code is True
    warnings = capsys.readouterr().err
    assert "`--ssd true` is deprecated" in warnings and "write `--ssd`" in warnings
    assert "write `--no-ssd`" in warnings and "write `--trust-remote-code`" in warnings
    assert parse("--model", "m").cost_probe is True
    assert parse("--model", "m", "--no-cost-probe").cost_probe is False


def test_gateway_http_settings(monkeypatch):
    from specdec.gateway.config import GatewayConfig

    def gateway(*argv):
        base = ["serve", "gateway", "--drafter", "h:1", "--verifier", "h:2"]
        return GatewayConfig.from_args(build_parser().parse_args([*base, *argv]))

    assert gateway().strict_fields is False and gateway().served_model_name == ""
    assert gateway("--strict-fields").strict_fields is True
    monkeypatch.setenv("SPECDEC_STRICT_FIELDS", "maybe")
    with pytest.raises(ConfigError, match="--strict-fields / SPECDEC_STRICT_FIELDS"):
        gateway()
    monkeypatch.setenv("SPECDEC_STRICT_FIELDS", "1")
    assert gateway().strict_fields is True
    assert gateway("--no-strict-fields").strict_fields is False  # the flag wins


def test_cli_exits_with_the_message():
    result = subprocess.run(
        [sys.executable, "-m", "specdec", "serve", "drafter", "--model", "m", "--dtype", "fp7"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "--dtype" in result.stderr and "fp7" in result.stderr


def test_replica_server_name_needs_the_replica_ca():
    from specdec.gateway.config import GatewayConfig

    base = ["serve", "gateway", "--drafter", "h:1", "--verifier", "h:2"]
    args = build_parser().parse_args([*base, "--replica-server-name", "replicas.example"])
    with pytest.raises(ConfigError, match="--replica-server-name"):
        GatewayConfig.from_args(args)
